"""The user documents point at files that exist, and no Markdown file reads like a work log."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# The documents a user reads: every path they name must resolve.
USER_DOCS = [ROOT / "README.md", RESULTS / "README.md", ROOT / "checkpoints" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]

# Wording that speaks of the people who wrote the project rather than of the project.
WORK_LOG = [r"\bthis stop\b", r"\blast stop\b", r"\bprevious stop\b", r"\bnext stop\b", r"\bearlier stops?\b",
            r"\bstop[ -]\d+\b", r"\bthis session\b", r"\blast session\b", r"\bprevious session\b",
            r"\bearlier sessions?\b"]

SKIP_DIRS = {"node_modules", "build", "dist", "__pycache__"}


def _markdown_files():
    for path in sorted(ROOT.rglob("*.md")):
        parts = path.relative_to(ROOT).parts
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        yield path


def _exists(base: Path, ref: str) -> bool:
    ref = ref.split("#", 1)[0]
    if not ref:
        return True
    if any(c in ref for c in "*?["):
        return any(base.glob(ref))
    return (base / ref).exists()


def _result_paths(text: str):
    """Every `bench/results/...` path in a text (globs allowed), trailing punctuation stripped."""
    for m in re.finditer(r"bench/results/[A-Za-z0-9_./*?\-]*", text):
        yield m.group(0).rstrip(".,;:")


def _links(text: str):
    """Relative Markdown link targets: [text](target)."""
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if not re.match(r"[a-z]+:|#", target):
            yield target


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_result_paths_and_links_exist(doc):
    assert doc.exists(), doc
    text = doc.read_text()
    missing = [p for p in _result_paths(text) if not _exists(ROOT, p)]
    missing += [t for t in _links(text) if not _exists(doc.parent, t)]
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_results_index_names_existing_files():
    """bench/results/README.md names its files relative to bench/results/ (or from the repository root)."""
    text = (RESULTS / "README.md").read_text()
    names = [n for n in re.findall(r"`([^`\s]+)`", text)
             if re.search(r"\.(md|json|png|log|sh|py)$", n) and not n.startswith(("-", "$", "."))]
    assert len(names) > 40
    missing = [n for n in names if not (_exists(RESULTS, n) or _exists(ROOT, n))]
    assert not missing, f"bench/results/README.md names files that do not exist: {missing}"


def test_every_current_result_is_indexed():
    """Each result table outside archive/ is named in the index (raw JSON runs are cited by their tables)."""
    text = (RESULTS / "README.md").read_text()
    tables = [p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*.md")
              if p.name != "README.md" and p.relative_to(RESULTS).parts[0] != "archive"]
    assert tables
    missing = [t for t in tables if t not in text]
    assert not missing, f"not in bench/results/README.md: {missing}"


def test_no_work_log_wording_in_markdown():
    pattern = re.compile("|".join(WORK_LOG), re.I)
    hits = []
    for path in _markdown_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = pattern.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not hits, "work-log wording in Markdown files:\n" + "\n".join(hits)


def test_no_commit_hashes_in_user_docs():
    """The user's documents speak of the project as it is: no commit hashes (result files keep their provenance)."""
    hexword = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
    hits = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "design.md", RESULTS / "README.md", ROOT / "serve" / "README.md"):
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            hits += [f"{doc.relative_to(ROOT)}:{n}: {m}" for m in hexword.findall(line)]
    assert not hits, "commit hashes in user docs:\n" + "\n".join(hits)
