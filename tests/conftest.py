"""Test configuration: CPU-friendly defaults, fake host devices for mesh code, hypothesis profile."""

import os

# Fake devices for mesh tests on CPU (must be set before jax initialises its backends).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("USE_HUB_KERNELS", "NO")  # keep transformers' torch reference path as the oracle
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models and shapes: XLA's optimisation passes and LLVM's cost more time than they save (a CPU compile takes
# about half as long without them), in the workers and in every process a test starts (servers, CLIs, multi-host
# runs inherit it). The math is the same; tests that compare two programs compile both this way.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache from the start, where `hyspec generate` / `serve` keep it ($HYSPEC_JAX_CACHE,
# else ~/.cache/hyspec_jax/xla): a program an earlier run, the other worker or a test's subprocess compiled is read
# back instead of compiled again. It used to come on only at a worker's first start-up compile or CLI call
# (`use_compilation_cache`), so whether a module's programs were cached depended on which modules ran before it.
# Compile counts (`CompileWatch`) count programs read from the cache too.
from hyspec_jax.compilation import enable_compilation_cache  # noqa: E402

enable_compilation_cache()

# Pin scipy's OpenBLAS to one thread now, before any test computes (cpu_kernels does it at its first eligibility
# check, i.e. while tracing, which in a library process precedes its first LAPACK call; in a test worker
# earlier tests may still be running XLA's LAPACK kernels asynchronously then, and OpenBLAS must not change
# its thread count while a call is in flight).
from hyspec_jax import cpu_kernels  # noqa: E402

cpu_kernels._tune_once()

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ------------------------------------------------------------------------------------------------
# The xdist schedule: slow modules first
# ------------------------------------------------------------------------------------------------
# bin/test hands whole files to the workers (--dist loadfile) in collection order (--no-loadscope-reorder). xdist's
# own order, most tests first, put the few-test modules that run for minutes (multi-process runs, servers, start-up
# compiles) last, and each worker queues its next file before it finishes the current one: one worker was still
# in a multi-host module long after the other had run out of files. A module marked `slow_module` is collected
# first (registered in pytest_configure below), then the rest most tests first (xdist's order), so the files left for the
# end are short ones.
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):          # only where xdist schedules whole files
        return
    files = [item.nodeid.split("::", 1)[0] for item in items]
    count = {f: files.count(f) for f in set(files)}
    first = {f: files.index(f) for f in set(files)}
    slow = {f for f, item in zip(files, items) if item.get_closest_marker("slow_module")}
    order = sorted(range(len(items)), key=lambda i: (files[i] not in slow, -count[files[i]], first[files[i]], i))
    items[:] = [items[i] for i in order]


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


# ------------------------------------------------------------------------------------------------
# Native crashes in xdist workers: where and why, at the end of the report
# ------------------------------------------------------------------------------------------------
# A worker killed by a fatal signal (a segfault or abort in native code) only shows up as "worker gwN crashed";
# faulthandler's dump goes to the inherited stderr, interleaved with the progress output and far above the
# summary. Each worker writes its dump to its own file instead, and the controller prints the head of it
# (the signal and the crashing thread's innermost frames) in the terminal summary.
import faulthandler  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

_FAULT_KEY = "hyspec_fault_dir"
_crash_reports: list[tuple[str, str]] = []


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin pointed it at stderr
def pytest_configure(config):
    config.addinivalue_line("markers", "slow_module: a module that runs for a minute or more; bin/test's xdist "
                                       "schedule starts it first (see pytest_collection_modifyitems)")
    workerinput = getattr(config, "workerinput", None)
    if workerinput and workerinput.get(_FAULT_KEY):
        f = open(Path(workerinput[_FAULT_KEY]) / f"{workerinput['workerid']}.log", "w")  # noqa: SIM115
        faulthandler.enable(file=f, all_threads=True)
        config._hyspec_fault_file = f  # keep the file object alive for the worker's lifetime
    elif workerinput is None:
        config._hyspec_fault_dir = tempfile.mkdtemp(prefix="hyspec-faults-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput[_FAULT_KEY] = node.config._hyspec_fault_dir


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    if not error:
        return
    wid = node.workerinput["workerid"]
    try:
        text = (Path(node.config._hyspec_fault_dir) / f"{wid}.log").read_text(errors="replace")
    except OSError:
        text = ""
    _crash_reports.append((wid, _crash_head(text) or "(no faulthandler dump: the worker was killed without a "
                                                       "fatal-signal handler running, e.g. by the OOM killer)"))


def _crash_head(text: str, frames: int = 16) -> str:
    """The signal line and the crashing ("Current") thread's innermost frames of a faulthandler dump."""
    lines = text.splitlines()
    head = [ln for ln in lines[:2] if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Current thread")), None)
    if start is None:
        return "\n".join(ln for ln in lines[:frames] if not ln.startswith("Extension modules"))
    block = []
    for ln in lines[start:]:
        if not ln.strip():
            break
        block.append(ln)
    return "\n".join(head + block[:frames])


def pytest_terminal_summary(terminalreporter):
    for wid, text in _crash_reports:
        terminalreporter.section(f"native crash in worker {wid} (faulthandler)")
        terminalreporter.write_line(text)


def pytest_unconfigure(config):
    fault_dir = getattr(config, "_hyspec_fault_dir", None)
    if fault_dir:
        import shutil
        shutil.rmtree(fault_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Memory maps of a long-lived worker
# ------------------------------------------------------------------------------------------------
# Every XLA:CPU executable keeps its JIT-compiled code in its own memory mappings (a small program ~10, a model
# round hundreds), and the jit caches keep every executable a test module compiled alive. One xdist worker
# runs a few dozen modules, and crossed Linux's per-process limit (vm.max_map_count, 65,530 by default): the
# next mmap failed and the worker died with a segfault inside a compile or a compilation-cache read (measured:
# a worker at 65,418 maps, then "Fatal Python error: Segmentation fault" in compilation_cache.py). After a
# module whose worker holds more than a quarter of the limit, the caches are dropped; the persistent
# compilation cache makes the recompiles of later modules cheap. Measured (HYSPEC_TEST_MAPS_LOG, 2-core host):
# the largest module adds ~12,000 maps, the peak is ~25,000, and the suite takes as long as before (7 min).
import gc  # noqa: E402


def _map_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


_MAP_BUDGET = _max_map_count() // 4


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps(request):
    yield
    before = _map_count()
    if before > _MAP_BUDGET:
        jax.clear_caches()
        gc.collect()
    log = os.environ.get("HYSPEC_TEST_MAPS_LOG")   # "pid module maps-before maps-after" per module, to size this
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {request.module.__name__} {before} {_map_count()}\n")
