"""The names the code's docstrings and comments (and the user docs) cite exist: every backticked Class.attr of a
class defined in the library is an attribute of that class (or of a base defined in the library), and every
backticked hyspec_jax.module.name (or spec.module.name, runtime..., the package left out) resolves to a module and
a name defined at its top level.

Read statically (ast), so nothing is imported. A renamed or removed attribute leaves no stale pointer behind, as
Engine.phase_times did in spec/round.py's docstrings after it moved to hyspec_jax.bench.phases."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# installed name → folder (pyproject's package-dir)
PACKAGES = {"hyspec_jax": ROOT / "hyspec_jax", "hyspec_jax.train": ROOT / "train", "hyspec_jax.serve": ROOT / "serve",
            "hyspec_jax.bench": ROOT / "bench", "hyspec_jax.checkpoints": ROOT / "checkpoints",
            "hyspec_jax.pallas_kernels": ROOT / "pallas_kernels", "pallas_kernels": ROOT / "pallas_kernels"}
SOURCES = sorted(p for d in ("hyspec_jax", "train", "serve", "bench", "pallas_kernels")
                 for p in (ROOT / d).rglob("*.py"))
TEXTS = SOURCES + sorted((ROOT / "tests").glob("*.py")) + [ROOT / "README.md", ROOT / "serve" / "README.md",
                                                           *sorted((ROOT / "docs").glob("*.md"))]

CLASS_ATTR = re.compile(r"`([A-Z][A-Za-z0-9_]*)\.([a-z_][A-Za-z0-9_]*)")
DOTTED = re.compile(r"`((?:hyspec_jax|pallas_kernels|spec|runtime|serve|bench|train|io|models)"
                    r"(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _classes() -> dict[str, list[tuple[set[str], list[str]]]]:
    """class name → [(member names, base names)] over every class the library defines."""
    out: dict[str, list[tuple[set[str], list[str]]]] = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            members: set[str] = set()
            for b in node.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(b.name)
                elif isinstance(b, ast.Assign):
                    members |= {t.id for t in b.targets if isinstance(t, ast.Name)}
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                    members.add(b.target.id)
            members |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                        and isinstance(n.value, ast.Name) and n.value.id == "self"}
            bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases]
            out.setdefault(node.name, []).append((members, bases))
    return out


CLASSES = _classes()


def _has(cls: str, attr: str, seen: tuple[str, ...] = ()) -> bool | None:
    """Whether the library's class `cls` has `attr`; None where that cannot be told (not the library's class, or a
    base from outside the library)."""
    if cls not in CLASSES:
        return None
    for members, bases in CLASSES[cls]:
        if attr in members:
            return True
        for base in bases:
            if base in seen or base == cls:
                continue
            found = _has(base, attr, seen + (cls,))
            if found is None or found:
                return found
    return False


def _module_file(name: str) -> Path | None:
    pkg = max((p for p in PACKAGES if name == p or name.startswith(p + ".")), key=len, default=None)
    if pkg is None:
        return None
    folder = PACKAGES[pkg].joinpath(*name[len(pkg):].split(".")[1:])
    if folder.with_suffix(".py").is_file():
        return folder.with_suffix(".py")
    if (folder / "__init__.py").is_file() or (name == pkg and folder.is_dir()):
        return folder / "__init__.py"
    return None


@functools.cache
def _top_level(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _resolves(dotted: str) -> bool:
    if re.search(r"\.(py|md|json|toml|sh|txt|npz)$", dotted):      # a file name (`serve.py`), not a module path
        return True
    parts = dotted.split(".")
    if parts[0] not in ("hyspec_jax", "pallas_kernels"):
        parts = ["hyspec_jax", *parts]
    for k in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:k]))
        if path is not None:
            rest = parts[k:]
            if not rest:
                return True
            if rest[0] not in _top_level(path):
                return False
            return len(rest) < 2 or _has(rest[0], rest[1]) is not False
    return False


def test_the_checker_catches_a_removed_attribute():
    assert _has("Engine", "generate") and _has("RoundShape", "gain_widths")
    assert _has("Engine", "phase_times") is False and _has("Engine", "round_kernels") is False
    assert _resolves("hyspec_jax.bench.phases.phase_times") and _resolves("spec.round.round_draft_jit")
    assert not _resolves("hyspec_jax.spec.round.phase_times") and not _resolves("spec.no_such_module")


def test_cited_attributes_and_names_exist():
    stale = []
    for path in TEXTS:
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            stale += [f"{where}: {m.group(1)}.{m.group(2)}" for m in CLASS_ATTR.finditer(line)
                      if _has(m.group(1), m.group(2)) is False]
            stale += [f"{where}: {m.group(1)}" for m in DOTTED.finditer(line) if not _resolves(m.group(1))]
    assert not stale, "references to names that do not exist:\n" + "\n".join(stale)
