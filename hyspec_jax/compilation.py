"""Compilation bookkeeping: JAX's persistent compilation cache, an on-disk program cache and a process-wide
compile counter.

- `enable_compilation_cache()` points JAX at an on-disk cache ($HYSPEC_JAX_CACHE, else
  `$HYSPEC_CACHE/xla`, else ~/.cache/hyspec_jax/xla) with no minimum compile time or entry size, so that every
  program — the small ones included — is stored and a second run of the same buckets skips XLA.
- `compile_count()` counts XLA compilations of this process (every jit cache miss, whether XLA compiles or
  the program comes from the persistent cache) through the `jax.monitoring` backend-compile event
  (`/jax/core/compile/backend_compile_duration`, recorded around `compiler.compile_or_get_cached`).
  `CompileWatch` counts from a mark: engines mark it at the end of their start-up compile (`warmup`), so
  `compilations_after_startup` is the number of recompiles while serving (it should stay 0).
- `DiskCachedJit`: a jit whose traced + lowered program is also kept on disk (`jax.export`), keyed by its static
  arguments, argument tree, shapes, dtypes, backend and `source_digest()`; used where `program_cache()` turns
  it on (`hyspec generate`, CPU): a second process skips Python tracing and lowering, ~1-1.5 s per large
  program on a 2-core CPU (the persistent compilation cache only skips XLA's compile).
- `precompile(calls, workers)`: a start-up compile's programs compiled side by side on threads (XLA's compile
  releases the GIL) into each jit's own cache; `compile_workers()` how many ($HYSPEC_COMPILE_WORKERS; 1 on a GPU,
  whose autotuner times kernels on the device).
- `tune_cpu_codegen()`: before JAX starts on a host without a GPU plugin, LLVM optimisation level 1 for the code
  XLA generates (`CPU_BACKEND_OPT_LEVEL`): a cold CPU server starts 20% sooner, decoding as fast.
- `split_for_jit(module)` = (`static_graphdef`, `pure_params`): what the jitted entry points take, cheap to pass
  on every call (a decode step / speculative round): a GraphDef whose hash is computed once, and the
  parameters as a plain nested dict of arrays (`nnx.merge` accepts it) that jit flattens in C++ instead of
  through nnx's Python Variable flattening (~1.3 ms per call for the 108 arrays of the embedded model).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_ENV = "HYSPEC_JAX_CACHE"

# XLA's LLVM optimisation level for CPU code. On a 2-core CPU, level 1 against XLA's default (2): the tree-ready
# server's cold start 75.4 / 73.4 s against 96.1 / 90.8 s, warm 7.1 / 6.7 against 6.5 / 7.1 s; decoding tokens/s at
# batch 1 within the runs' spread, plain 156 / 155 against 158 / 154, tree-ready 100 / 100 against 104 / 101
# (bench/results/profile/cpu_codegen_level.md).
CPU_BACKEND_OPT_LEVEL = 1
_OPT_FLAG = "--xla_backend_optimization_level"

_lock = threading.Lock()
_count = 0
_installed = False
_callbacks: list[Callable[[str], None]] = []


def _gpu_plugin_installed() -> bool:
    """Whether a PJRT GPU plugin (jax-cuda*-plugin, jax-rocm*-plugin) is installed: then JAX may run on a GPU, whose
    code the CPU setting must not touch."""
    import importlib.metadata
    import importlib.util
    import pkgutil
    if importlib.metadata.entry_points(group="jax_plugins"):       # plugins registered by entry point
        return True
    if importlib.util.find_spec("jax_plugins") is None:            # or in the jax_plugins namespace package
        return False
    import jax_plugins
    return any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


def tune_cpu_codegen() -> bool:
    """Set XLA's LLVM optimisation level for CPU code to `CPU_BACKEND_OPT_LEVEL` (through XLA_FLAGS, which XLA reads
    when its backend starts: call this first) where JAX will run on the CPU — JAX_PLATFORMS is "cpu", or no GPU
    plugin is installed. Leaves a level the user set alone. Returns whether it set it."""
    flags = os.environ.get("XLA_FLAGS", "")
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    on_cpu = platforms == "cpu" or (not platforms and not _gpu_plugin_installed())
    if _OPT_FLAG in flags or not on_cpu:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {_OPT_FLAG}={CPU_BACKEND_OPT_LEVEL}".strip()
    return True


def compilation_cache_dir() -> Path:
    """Where the persistent compilation cache lives: $HYSPEC_JAX_CACHE, else <hyspec cache>/xla."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from hyspec_jax.paths import cache_dir
    return cache_dir() / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Enable JAX's persistent compilation cache at `path` (default `compilation_cache_dir()`); every program
    is cached (no minimum compile time or size). Takes effect even after earlier compiles. Returns the path."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    target = Path(path).expanduser() if path is not None else compilation_cache_dir()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if jax.config.jax_compilation_cache_dir != str(target):
        jax.config.update("jax_compilation_cache_dir", str(target))
        cc.reset_cache()   # JAX decides once per process whether the cache is used: decide again
    return target


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _count
    if event != BACKEND_COMPILE_EVENT:
        return
    with _lock:
        _count += 1
        callbacks = list(_callbacks)
    name = str(kwargs.get("fun_name", "?"))
    for cb in callbacks:
        cb(name)


def install() -> None:
    """Register the counting listener (once per process)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    from jax import monitoring
    monitoring.register_event_duration_secs_listener(_on_event)


_KERNEL_OPS = ("fusion", "custom-call", "dot", "convolution", "sort", "scatter", "gather", "reduce", "copy",
               "all-reduce", "all-gather", "reduce-scatter")


def kernel_count(lowered) -> int:
    """Launch-level work items of a lowered program once compiled: the instructions that run as kernels or library
    calls (fusions, custom calls, dots, sorts, scatters, copies, ...), not parameters, tuples or bitcasts; a
    loop's body counts once per iteration (XLA's known trip count; once where unknown), a conditional its
    smallest branch. On a GPU each is about one kernel launch — what a latency-bound round scales with."""
    return sum(kernel_count_by_scope(lowered, ()).values())


def hlo_computations(text: str) -> dict[str, list[str]]:
    """The computations of a compiled HLO module's text (`compiled.as_text()`): {name: its instruction lines};
    the entry computation under "ENTRY"."""
    import re
    comps: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps


def kernel_count_by_scope(lowered, scopes: Sequence[str]) -> dict[str, int]:
    """`kernel_count` split by `jax.named_scope`: each kernel counts under the longest of `scopes` (paths such as
    "draft/tree_build") that its HLO op name, less the jit / vmap / control-flow parts, starts with; kernels under
    none of them (or with no op name: XLA's own copies, some library calls) count under "(other)". A
    conditional's own launch counts under "(control)". With no scopes, everything counts under "". lowered may
    also be a compiled program's HLO text (`compiled.as_text()`)."""
    import re
    comps = hlo_computations(lowered if isinstance(lowered, str) else lowered.compile().as_text())
    wanted = sorted((tuple(sc.split("/")) for sc in scopes), key=len, reverse=True)

    def scope(line: str) -> str:
        if not wanted:
            return ""
        m = re.search(r'op_name="([^"]*)"', line)
        if m:
            path = tuple(p for p in m.group(1).split("/") if p and "(" not in p)
            for w in wanted:
                if path[:len(w)] == w:
                    return "/".join(w)
        return "(other)"

    def count(comp: str, seen: tuple = ()) -> dict[str, int]:
        out: dict[str, int] = {}
        if comp not in comps or comp in seen:
            return out

        def add(d: dict[str, int], mult: int = 1) -> None:
            for k, v in d.items():
                out[k] = out.get(k, 0) + mult * v

        for line in comps[comp]:
            m = re.match(r"^\s*(?:ROOT )?%?\S+ = .*? ([a-z\-]+)\(", line)
            if not m:
                continue
            op = m.group(1)
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                mult = int(trip.group(1)) if trip else 1
                add(count(body, seen + (comp,)), mult)
                add(count(cond, seen + (comp,)), mult)
            elif op == "conditional":
                branches = re.findall(r"(?:branch_computations=\{|true_computation=|false_computation=|, )%([\w.\-]+)",
                                      line)
                counted = [count(b, seen + (comp,)) for b in branches if b in comps]
                add({"(control)" if wanted else "": 1})
                if counted:
                    add(min(counted, key=lambda d: sum(d.values())))
            elif op == "call":
                callee = re.search(r"to_apply=%?([\w.\-]+)", line)
                if callee:
                    add(count(callee.group(1), seen + (comp,)))
            elif op in _KERNEL_OPS:
                add({scope(line): 1})
        return out
    return count("ENTRY")


def compile_count() -> int:
    """XLA compilations in this process since `install()` (called by every `CompileWatch`)."""
    install()
    with _lock:
        return _count


def on_compile(callback: Callable[[str], None]) -> Callable[[], None]:
    """Call `callback(fun_name)` after every compilation; returns a function that removes it."""
    install()
    with _lock:
        _callbacks.append(callback)

    def remove() -> None:
        with _lock:
            if callback in _callbacks:
                _callbacks.remove(callback)
    return remove


COMPILE_WORKERS_ENV = "HYSPEC_COMPILE_WORKERS"


def compile_workers() -> int:
    """Threads a start-up compile uses (`precompile`): $HYSPEC_COMPILE_WORKERS, else on the CPU the host's cores up
    to 8, on a GPU 1 (one program after another). Why not side by side on a GPU: XLA autotunes a program's kernels by
    timing them on the device, and threads compiling at once time their candidates over one another — the autotuner
    then warns that its timer is inaccurate ("Delay kernel timed out", seen in a 64-slot server's start-up on an
    H100; openxla/xla pull request 38882) and may keep slower kernels for the server's whole life. Kernel choice
    weighs more than start-up (without autotuning the 27B decode step ran 2x slower, `bench/results/scale/`)."""
    env = os.environ.get(COMPILE_WORKERS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"{COMPILE_WORKERS_ENV} must be an integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"{COMPILE_WORKERS_ENV} must be >= 1, got {n}")
        return n
    import jax
    if jax.default_backend() != "cpu":
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def precompile(calls: Sequence[tuple[Callable, tuple, dict]], workers: int,
               done: Callable[[int, float | None], None] | None = None) -> None:
    """Compile jitted calls `(fn, args, kwargs)` side by side on `workers` threads without running them
    (`fn.trace(*args, **kwargs).lower().compile()`): XLA's compile releases the GIL, and the compiled program lands
    in the jit's own cache, so the call itself then only runs. `done(i, seconds)` after call i compiled, with the
    seconds its thread spent on it (None: it failed). A call that fails here is left to its real call, which raises
    the real error.
    A `DiskCachedJit` compiles the program it will run (`DiskCachedJit.compile_ahead`: with the program cache on,
    the stored or exported one)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    def one(call) -> float:
        t0 = time.perf_counter()
        fn, args, kwargs = call
        if isinstance(fn, DiskCachedJit):
            fn.compile_ahead(*args, **kwargs)
        else:
            fn.trace(*args, **kwargs).lower().compile()
        return time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="hyspec-compile") as pool:
        futures = {pool.submit(one, c): i for i, c in enumerate(calls)}
        for f in as_completed(futures):
            if f.exception() is not None:
                import logging
                logging.getLogger("hyspec").debug("precompile of call %d failed: %r", futures[f], f.exception())
            if done is not None:
                done(futures[f], None if f.exception() is not None else f.result())


def split_for_jit(module):
    """`nnx.split(module)` in the form jitted entry points take: (`static_graphdef`, `pure_params`)."""
    from flax import nnx
    graphdef, params = nnx.split(module)
    return static_graphdef(graphdef), pure_params(params)


def pure_params(params):
    """An `nnx.State` as a plain nested dict of arrays (anything else unchanged); `nnx.merge` takes either."""
    from flax import nnx
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def static_graphdef(graphdef):
    """`graphdef` (an `nnx.GraphDef`) as an equal GraphDef whose hash is computed once and whose equality
    short-cuts on identity; interchangeable with it everywhere (`nnx.merge`, static jit arguments).

    `jit` hashes its static arguments on every call, and compares them on a cache hit; a plain GraphDef
    recomputes both over every node of the model: ~3.5 ms per call for the 8-layer embedded model on a 2-core
    host, a third of a CPU decode step, paid by every decode step and speculative round."""
    from flax.nnx import graphlib
    if isinstance(graphdef, _static_graphdef_class()) or not isinstance(graphdef, graphlib.GraphDef):
        return graphdef
    return _static_graphdef_class()(graphdef)


_STATIC_GRAPHDEF: list = []


def _static_graphdef_class():
    if _STATIC_GRAPHDEF:
        return _STATIC_GRAPHDEF[0]
    import jax
    from flax.nnx import graphlib

    class StaticGraphDef(graphlib.GraphDef):
        __slots__ = ("_hash",)

        def __init__(self, graphdef):
            super().__init__(nodes=graphdef.nodes, attributes=graphdef.attributes, num_leaves=graphdef.num_leaves)
            object.__setattr__(self, "_hash", graphlib.GraphDef.__hash__(self))

        def __hash__(self) -> int:
            return self._hash

        def __eq__(self, other) -> bool:
            if self is other:
                return True
            if not isinstance(other, graphlib.GraphDef):
                return NotImplemented
            return (hash(self) == hash(other) and self.num_leaves == other.num_leaves
                    and self.nodes == other.nodes and self.attributes == other.attributes)

        def __ne__(self, other) -> bool:
            eq = self.__eq__(other)
            return eq if eq is NotImplemented else not eq

        def __reduce__(self):
            return (_rebuild_static_graphdef, (graphlib.GraphDef(self.nodes, self.attributes, self.num_leaves),))

    jax.tree_util.register_static(StaticGraphDef)
    _STATIC_GRAPHDEF.append(StaticGraphDef)
    return StaticGraphDef


def _rebuild_static_graphdef(graphdef):
    return static_graphdef(graphdef)


# ------------------------------------------------------------------------------------------------
# Program cache: traced + lowered programs on disk (jax.export), so a new process skips Python tracing
# ------------------------------------------------------------------------------------------------
PROGRAM_CACHE_ENV = "HYSPEC_PROGRAM_CACHE"     # "0" / "off": never use it, even where a command enables it
# epoch: bumped by every `enable_program_cache`, which may point at another directory ($HYSPEC_JAX_CACHE): the
# programs a `DiskCachedJit` holds in memory are then forgotten, so it loads or stores them there
_program_cache = {"on": False, "epoch": 0}


def enable_program_cache(on: bool = True) -> bool:
    """Let `DiskCachedJit` functions use the on-disk program cache in this process (`hyspec generate` turns it
    on; libraries and tests leave it off). Returns whether it is now on: only on a CPU backend, and
    $HYSPEC_PROGRAM_CACHE=0 keeps it off, as does a missing `flatbuffers` (`jax.export` serialization)."""
    import jax
    ok = on and os.environ.get(PROGRAM_CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    # CPU only: each call pays ~0.2 ms of Python (flatten + key) — ~1.5% of a CPU decode step, but ~15% of an
    # H200 one, where tracing is also a small part of the start-up (XLA's compile dominates there)
    ok = ok and jax.default_backend() == "cpu"
    if ok:
        try:
            import flatbuffers  # noqa: F401 - jax.export's serializer needs it
        except ImportError:
            ok = False
    _program_cache["on"] = ok
    _program_cache["epoch"] += 1
    return ok


@contextlib.contextmanager
def program_cache(on: bool = True):
    """`enable_program_cache(on)` for the duration of a `with` block (then as before)."""
    before = _program_cache["on"]
    try:
        yield enable_program_cache(on)
    finally:
        _program_cache["on"] = before


def program_cache_dir() -> Path:
    """Where exported programs live: next to the compilation cache (`<that>/../programs`)."""
    return compilation_cache_dir().parent / "programs"


_SOURCE_DIGEST: list[str] = []


def source_digest() -> str:
    """sha256 of this package's and the kernels' (`hyspec_jax.pallas_kernels`) sources (*.py, *.cc) and the JAX /
    jaxlib / flax versions:
    part of every program key,
    so a changed line anywhere re-traces (a stale program is never run)."""
    if not _SOURCE_DIGEST:
        import hashlib

        import jax
        import jaxlib
        import flax
        h = hashlib.sha256(f"{jax.__version__} {jaxlib.__version__} {flax.__version__}".encode())
        root = Path(__file__).resolve().parent
        kernels = root.parent / "pallas_kernels"    # in a checkout the kernels' folder sits beside this one (a wheel
        for pkg in (root, kernels) if kernels.is_dir() else (root,):              # has it inside)
            for f in sorted(list(pkg.rglob("*.py")) + list(pkg.rglob("*.cc"))):
                h.update(str(f.relative_to(root.parent)).encode())
                h.update(f.read_bytes())
        _SOURCE_DIGEST.append(h.hexdigest())
    return _SOURCE_DIGEST[0]


class DiskCachedJit:
    """`jax.jit(fn, static_argnames=..., donate_argnames=...)` whose traced and lowered program is kept on disk.

    JAX's persistent compilation cache skips XLA's compile in a new process, but not tracing and lowering,
    which for the speculative round and the prefill cost ~1-1.5 s each on a 2-core CPU — most of a short
    `hyspec generate`. With the program cache on (`enable_program_cache`) the first call for a new (static
    arguments, argument tree, shapes, dtypes) exports the program (`jax.export`, lowered for this backend
    only) to `program_cache_dir()` keyed by all of these, `source_digest()` and the backend; later processes
    deserialize it and run `jax.jit(exported.call)` (the same StableHLO, donation kept), whose compile
    comes from the persistent cache. Off, or on any failure (a custom call export refuses, a sharded input,
    an unreadable file: one warning), it is the plain jit. Outputs are bitwise those of the plain jit.
    """

    def __init__(self, fn: Callable, *, name: str, static_argnames: tuple[str, ...] = (),
                 donate_argnames: tuple[str, ...] = ()):
        import inspect

        import jax
        self.fn, self.name = fn, name
        self.static_argnames, self.donate_argnames = tuple(static_argnames), tuple(donate_argnames)
        self.signature = inspect.signature(fn)
        self.jit = jax.jit(fn, static_argnames=self.static_argnames, donate_argnames=self.donate_argnames)
        self._programs: dict = {}
        self._epoch = _program_cache["epoch"]
        self._warned = False

    def __getattr__(self, item):          # lower / trace / _cache_size ...: the plain jit's
        return getattr(self.jit, item)

    def __call__(self, *args, **kwargs):
        if not _program_cache["on"]:
            return self.jit(*args, **kwargs)
        import jax
        key, leaves, first = self._resolve(args, kwargs)
        prog = self._programs[key]
        if prog is not False:
            call, out_tree = prog
            try:
                return jax.tree.unflatten(out_tree, call(*leaves))
            except Exception as e:  # noqa: BLE001
                # the first call compiles it: a stored program this jaxlib cannot run falls back, unless it ran
                # and consumed donated buffers (nothing left to fall back with); later failures are real
                if not first or any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
                    raise
                self._programs[key] = self._fail(e)
        return self.jit(*args, **kwargs)

    def compile_ahead(self, *args, **kwargs) -> None:
        """Compile this call's program without running it (`precompile`): with the program cache on, its stored or
        newly exported program into that program's jit (XLA's compile, or the persistent cache's read), so that the
        call then only runs; else the plain jit's trace, lower and compile. A program that fails to compile here
        is not run: the call takes the plain jit (one warning)."""
        if not _program_cache["on"]:
            self.jit.trace(*args, **kwargs).lower().compile()
            return
        key, leaves, _ = self._resolve(args, kwargs)
        prog = self._programs[key]
        if prog is False:
            self.jit.trace(*args, **kwargs).lower().compile()
            return
        try:
            prog[0].trace(*leaves).lower().compile()
        except Exception as e:  # noqa: BLE001 - the plain jit is always right
            self._programs[key] = self._fail(e)
            self.jit.trace(*args, **kwargs).lower().compile()

    def _resolve(self, args, kwargs) -> tuple[tuple, list, bool]:
        """(key, leaves, first): this call's key in `_programs`, where its program (or False: the plain jit) now is
        (loaded or exported if it was not), its arguments' leaves, and whether this call put it there."""
        if self._epoch != _program_cache["epoch"]:
            self._programs, self._epoch = {}, _program_cache["epoch"]
        import jax
        import numpy as np
        bound = self.signature.bind(*args, **kwargs)
        static = tuple((k, v) for k, v in bound.arguments.items() if k in self.static_argnames)
        names = tuple(k for k in bound.arguments if k not in self.static_argnames)
        leaves, treedef = jax.tree.flatten([bound.arguments[k] for k in names])
        try:            # arrays (jax / numpy): attribute reads, ~50 µs for the ~150 leaves of a round
            avals = tuple((x.shape, x.dtype) for x in leaves)
        except AttributeError:
            avals = tuple((np.shape(x), _dtype(x)) for x in leaves)
        # whether any input spans several devices (such a call is never stored) is part of the key, so a sharded
        # call does not decide for a single-device one with the same shapes (one process can run both)
        sharded = any(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 for x in leaves)
        key = (static, names, treedef, avals, sharded)
        first = key not in self._programs
        if first:
            self._programs[key] = self._program(static, names, treedef, leaves)
        return key, leaves, first

    def _program(self, static, names, treedef, leaves):
        try:
            return self._load_or_export(static, names, treedef, leaves)
        except Exception as e:  # noqa: BLE001 - the plain jit is always right
            return self._fail(e)

    def _fail(self, e: Exception) -> bool:
        if not self._warned:
            import warnings
            self._warned = True
            warnings.warn(f"hyspec: program cache unused for {self.name} ({type(e).__name__}: "
                          f"{str(e)[:200]}); tracing it instead", RuntimeWarning, stacklevel=4)
        return False

    def _load_or_export(self, static, names, treedef, leaves):
        import hashlib
        import pickle

        import jax
        import numpy as np
        from jax import export

        from hyspec_jax import cpu_kernels
        if any(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 for x in leaves):
            raise ValueError("sharded inputs")
        platform = jax.default_backend()
        avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in leaves]
        ident = repr((self.name, static, names, str(treedef), [(a.shape, str(a.dtype)) for a in avals],
                      platform, source_digest()))
        path = program_cache_dir() / f"{self.name}-{hashlib.sha256(ident.encode()).hexdigest()[:24]}"
        donated = [i for i, k in enumerate(_leaf_owners(names, treedef)) if k in self.donate_argnames]
        if path.with_suffix(".bin").is_file() and path.with_suffix(".tree").is_file():
            exp = export.deserialize(bytearray(path.with_suffix(".bin").read_bytes()))
            out_tree = pickle.loads(path.with_suffix(".tree").read_bytes())
        else:
            box = {}
            kw_static = dict(static)

            def flat(*xs):
                dyn = jax.tree.unflatten(treedef, xs)
                out = self.fn(**kw_static, **dict(zip(names, dyn)))
                out_leaves, box["tree"] = jax.tree.flatten(out)
                return out_leaves

            exp = export.export(jax.jit(flat), platforms=[platform],
                                disabled_checks=[export.DisabledSafetyCheck.custom_call(cpu_kernels.TARGET)])(*avals)
            out_tree = box["tree"]
            path.parent.mkdir(parents=True, exist_ok=True)
            for suffix, blob in ((".bin", exp.serialize()), (".tree", pickle.dumps(out_tree))):
                tmp = path.with_suffix(f"{suffix}.{os.getpid()}.tmp")
                tmp.write_bytes(blob)
                os.replace(tmp, path.with_suffix(suffix))     # atomic: concurrent writers race harmlessly
        if platform == "cpu":
            cpu_kernels.available()       # the native kernel's FFI target must be registered before it runs
        return jax.jit(exp.call, donate_argnums=tuple(donated)), out_tree


def _dtype(x):
    import numpy as np
    d = getattr(x, "dtype", None)
    return np.dtype(d) if d is not None else np.result_type(x)


def _leaf_owners(names, treedef) -> list[str]:
    """For every leaf of the flattened list of arguments, the name of the argument it belongs to."""
    import jax
    owners = []
    for k, sub in zip(names, jax.tree.unflatten(treedef, range(treedef.num_leaves))):
        owners += [k] * len(jax.tree.leaves(sub))
    return owners


class CompileWatch:
    """Counts this process's compilations since `mark()` (initially: since construction)."""

    def __init__(self):
        self.start = compile_count()

    def mark(self) -> int:
        """Start counting from now; returns the total so far."""
        self.start = compile_count()
        return self.start

    @property
    def since(self) -> int:
        return compile_count() - self.start


__all__ = ["BACKEND_COMPILE_EVENT", "CACHE_ENV", "compilation_cache_dir", "enable_compilation_cache", "install",
           "compile_count", "on_compile", "CompileWatch", "split_for_jit", "static_graphdef",
           "pure_params", "DiskCachedJit", "enable_program_cache", "program_cache", "program_cache_dir", "source_digest",
           "PROGRAM_CACHE_ENV", "COMPILE_WORKERS_ENV", "compile_workers", "precompile"]
