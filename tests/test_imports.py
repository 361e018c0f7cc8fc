"""The import graph: no cycle among the library's modules and the kernels, and `hyspec_jax.pallas_kernels` a leaf
that imports from the rest of `hyspec_jax` only the math its kernels must equal.

Every module's source is parsed (ast), never imported, and every import counts: top level and inside functions.
`hyspec_jax.serve`, `.train`, `.bench` and `.pallas_kernels` map to the serve/, train/, bench/ and pallas_kernels/
folders, as pyproject.toml's package-dir has them.

Parsed the same way: no function or method in spec/ or runtime/ takes more than 8 parameters ([house-2]).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package → folder (pyproject.toml [tool.setuptools] package-dir)
PACKAGES = {"hyspec_jax": ROOT / "hyspec_jax", "hyspec_jax.serve": ROOT / "serve", "hyspec_jax.train": ROOT / "train",
            "hyspec_jax.bench": ROOT / "bench", "hyspec_jax.pallas_kernels": ROOT / "pallas_kernels"}
KERNELS = "hyspec_jax.pallas_kernels"
# what pallas_kernels may import from hyspec_jax: the math its kernels must equal
KERNEL_MATH = {"hyspec_jax", "hyspec_jax.gdn", "hyspec_jax.tree", "hyspec_jax.attention"}
# the application layers on top of the library (entry points and tools): the library never imports them
APPLICATION = ("hyspec_jax.serve", "hyspec_jax.train", "hyspec_jax.bench", "hyspec_jax.cli")


def modules() -> dict[str, Path]:
    """Every module name → its file, from the package folders (the folders nested in another package's folder,
    e.g. none today, are named by their own package)."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p in ("results", "recipes", "data") for p in parts[:-1]):
                continue
            name = ".".join([pkg, *parts])
            out.setdefault(name, path)
    return out


def _resolve(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` (a module or a name inside one) is or lives in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The known modules `module` imports anywhere in its source (top level, in functions, under `if`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                                       # relative: from the module's package
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names = [f"{prefix}.{a.name}" for a in node.names] + [prefix]
        else:
            continue
        for n in names:
            target = _resolve(n, known)
            if target is not None and target != module:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `g` (as the list of modules around it), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(g, WHITE)
    stack: list[str] = []

    def visit(m):
        color[m] = GREY
        stack.append(m)
        for n in sorted(g[m]):
            if n not in g:
                continue
            if color[n] == GREY:
                return stack[stack.index(n):] + [n]
            if color[n] == WHITE and (c := visit(n)):
                return c
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(g):
        if color[m] == WHITE and (c := visit(m)):
            return c
    return None


def _library(name: str) -> bool:
    return not any(name == a or name.startswith(a + ".") for a in APPLICATION)


def test_the_parse_sees_every_package():
    g = graph()
    for pkg in ("hyspec_jax.io.hf", "hyspec_jax.models.target", "hyspec_jax.spec.select", "hyspec_jax.kernels",
                "hyspec_jax.pallas_kernels.gdn_tree_solve", "hyspec_jax.serve", "hyspec_jax.train", "hyspec_jax.bench.kernels"):
        assert pkg in g, pkg
    assert f"{KERNELS}.gdn_tree_solve" in g["hyspec_jax.kernels"]       # imports are resolved to modules
    assert "hyspec_jax.gdn" in g[f"{KERNELS}.gdn_tree_solve"]


def test_no_import_cycle_in_the_library_and_kernels():
    """hyspec_jax's library modules and pallas_kernels, counting imports inside functions: no cycle (the
    application layers — serve, train, bench, the CLI — import the library, never the other way round)."""
    g = graph()
    lib = {m: {n for n in deps if _library(n)} for m, deps in g.items() if _library(m)}
    assert find_cycle(lib) is None, " -> ".join(find_cycle(lib))
    for m, deps in lib.items():                       # the library never reaches up into the application layers
        up = sorted(n for n in g[m] if not _library(n))
        assert not up, f"{m} imports {up}"


def test_no_import_cycle_anywhere():
    """The whole tree — library, kernels, CLI, server, trainers, benchmarks — counting imports inside functions."""
    g = graph()
    assert find_cycle(g) is None, " -> ".join(find_cycle(g))


def test_pallas_kernels_import_only_the_math_from_hyspec_jax():
    g = graph()
    for m, deps in g.items():
        if not (m == KERNELS or m.startswith(KERNELS + ".")):
            continue
        lib = sorted(n for n in deps if n.split(".")[0] == "hyspec_jax" and n not in KERNEL_MATH
                     and not (n == KERNELS or n.startswith(KERNELS + ".")))
        assert not lib, f"{m} imports {lib} (pallas_kernels may import only {sorted(KERNEL_MATH - {'hyspec_jax'})})"


def spec_runtime_imports(g: dict[str, set[str]]) -> dict[str, list[str]]:
    """{spec module: the runtime modules it imports}, for every spec module that imports one."""
    out = {}
    for m, deps in g.items():
        if m == "hyspec_jax.spec" or m.startswith("hyspec_jax.spec."):
            up = sorted(n for n in deps if n == "hyspec_jax.runtime" or n.startswith("hyspec_jax.runtime."))
            if up:
                out[m] = up
    return out


def test_spec_never_imports_runtime():
    """spec/ holds the pure jitted round and never imports runtime/, which holds every host-side piece (backends,
    the width choice, the scheduler, multi-host) and imports spec/ — one direction only."""
    found = spec_runtime_imports(graph())
    assert not found, found
    assert spec_runtime_imports({"hyspec_jax.spec.round": {"hyspec_jax.runtime.programs", "hyspec_jax.tree"}}) == {
        "hyspec_jax.spec.round": ["hyspec_jax.runtime.programs"]}          # the check sees such an import


def test_the_checks_can_fail(tmp_path):
    """A cycle closed only by an import inside a function is found, and so is a kernel module importing the library
    (the graph as it stood before the dispatcher moved into hyspec_jax)."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n    return x\n")
    known = {"a", "b"}
    g = {m: imports_of(m, tmp_path / f"{m}.py", known) for m in known}
    assert g == {"a": {"b"}, "b": {"a"}}
    assert find_cycle(g) == ["a", "b", "a"]
    old = {f"{KERNELS}.dispatch": {"hyspec_jax.models.layers", "hyspec_jax.gdn"},
           "hyspec_jax.models.layers": {"hyspec_jax.cpu_kernels"}, "hyspec_jax.cpu_kernels": {"hyspec_jax.demo"},
           "hyspec_jax.demo": {"hyspec_jax.io.hf"}, "hyspec_jax.io.hf": {"hyspec_jax.models.target"},
           "hyspec_jax.models.target": {f"{KERNELS}.dispatch"}, "hyspec_jax.gdn": set()}
    assert find_cycle(old) is not None
    assert "hyspec_jax.models.layers" not in KERNEL_MATH


MAX_PARAMS = 8          # [house-2]: a longer list is a named struct or a frozen config waiting to be written


def wide_functions(path: Path, limit: int = MAX_PARAMS, root: Path = ROOT) -> list[str]:
    """'file:line name (n)' for every function, method and lambda in `path` taking more than `limit` parameters,
    counted from the source: positional, keyword-only, *args and **kwargs alike; a method's self / cls not."""
    tree = ast.parse(path.read_text(), filename=str(path))
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body
               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
               and not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in f.decorator_list)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        a = node.args
        n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
        n -= id(node) in methods
        if n > limit:
            out.append(f"{path.relative_to(root)}:{node.lineno} {getattr(node, 'name', 'lambda')} ({n})")
    return out


def test_no_function_in_spec_or_runtime_takes_more_than_8_parameters():
    folders = [ROOT / "hyspec_jax" / "spec", ROOT / "hyspec_jax" / "runtime"]
    files = [p for f in folders for p in sorted(f.rglob("*.py"))]
    assert len(files) > 10
    wide = [w for p in files for w in wide_functions(p)]
    assert not wide, "more than 8 parameters (group them in a named struct or a frozen config): " + ", ".join(wide)


def test_the_parameter_count_sees_every_kind(tmp_path):
    """Keyword-only parameters, *args and **kwargs count; self and cls do not, a static method's first one does."""
    src = ("def f(a, b, /, c, *args, d, **kw): pass\n"       # 6
           "def ok(a, b, c, d, e): pass\n"                   # 5
           "class C:\n"
           "    def m(self, a, b, c, d, e): pass\n"          # 5
           "    @classmethod\n"
           "    def k(cls, a, b, c, d, *, e): pass\n"        # 5
           "    @staticmethod\n"
           "    def s(a, b, c, d, e, f): pass\n"             # 6
           "g = lambda a, b, c, d, e, f: 0\n")               # 6
    (tmp_path / "m.py").write_text(src)
    assert sorted(wide_functions(tmp_path / "m.py", limit=5, root=tmp_path)) == [
        "m.py:1 f (6)", "m.py:8 s (6)", "m.py:9 lambda (6)"]
