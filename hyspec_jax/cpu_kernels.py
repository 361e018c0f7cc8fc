"""Native CPU kernel for the weight products of a few rows (`cpu_kernels.cc`), built on first use.

Speculative rounds multiply a handful of rows — the verified nodes (N = 2..32), the γ draft slots — by every
weight matrix. XLA:CPU streams the weights for one row (a decode step), but for 2 ≤ M runs a packed GEMM that
first repacks each weight matrix: on a 2-core host a verify of 2..8 nodes cost 2.1-2.4x a decode step, so
no speculative mode could beat plain decoding. `cpu_kernels.cc` streams each weight row once against up to 8
rows of x (fp32 FMA), splitting the output rows over XLA's intra-op threads.

`dense(x, w)` = `x · wᵀ` (w in the HF [out, in] layout) is the entry point; the library reaches it only through
`hyspec_jax.kernels.dense` (every Linear and LM head goes there, via `models.layers.dense`), which calls it where
`eligible`. The kernel runs when all of these hold, else XLA's dot (`reference`, which the kernel must equal to fp32 rounding):
- the default backend is the CPU and the program is lowered for it (`jax.lax.platform_dependent`: GPU
  programs never contain the call, GPU hosts never build it);
- x and w are float32, w is 2-D, and x has 2..MAX_ROWS rows (leading axes flattened; 1 row is XLA's
  matrix-vector product already);
- the host is x86-64 Linux with AVX2 and FMA, a C++ compiler (`$CXX`, else `c++`) built the library
  (once per source/JAX version, cached under `<hyspec cache>/kernels`), and $HYSPEC_CPU_KERNELS is not 0.
Any failure falls back to XLA with one warning. Autodiff works (custom JVP: the tangents use the reference);
under `vmap` the call is mapped sequentially.

`single_thread_lapack()` (called once by the first `eligible` check of a CPU-backend process, also off with
$HYSPEC_CPU_KERNELS=0): XLA:CPU's LAPACK custom calls — the triangular solves of the chunked prefill
(`gdn.chunked_prefill`, method "solve") — run in scipy's OpenBLAS, whose worker threads spin against XLA's own
threads: on a 2-core host one [8, 32, 32] solve took ~60 ms instead of well under 1 ms, so a 32-token
prefill took 380 ms instead of 34 ms. One OpenBLAS thread gives bitwise the same results. Only scipy's
OpenBLAS (the one XLA's LAPACK kernels call) is pinned, not numpy's.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from hyspec_jax.paths import cache_dir

F32 = jnp.float32
ENV = "HYSPEC_CPU_KERNELS"          # "0" / "false" / "off": never use the native kernel
TARGET = "hyspec_dense_f32_v1"      # XLA custom-call target (versioned: cached executables name it)
MAX_ROWS = 32                       # beyond this XLA's GEMM is as fast (it amortises its packing)
SOURCE = Path(__file__).with_name("cpu_kernels.cc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_status: dict = {}


def reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] · w [O, I]ᵀ -> [..., O] with fp32 accumulation (XLA's dot)."""
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=F32)


def _cpu_flags() -> set[str]:
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def library_path() -> Path:
    """Where the built library lives (keyed by source, compiler, flags and JAX version)."""
    cxx = os.environ.get("CXX", "c++")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cxx, *FLAGS, jax.__version__]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"hyspec_cpu_kernels-{key}.so"


def _build() -> Path:
    out = library_path()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [os.environ.get("CXX", "c++"), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:1])} failed: {proc.stderr.strip()[-400:]}")
        os.replace(tmp, out)      # atomic: concurrent builders race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> tuple[bool, str]:
    if _disabled():
        return False, f"disabled by ${ENV}"
    if not {"avx2", "fma"} <= _cpu_flags():
        return False, "needs an x86-64 Linux CPU with AVX2 and FMA"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.hyspec_dense_f32), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any build / load problem: XLA's dot is always correct
        msg = f"{type(e).__name__}: {e}"
        warnings.warn(f"hyspec: native CPU kernel unavailable, using XLA's dot ({msg}); "
                      f"set {ENV}=0 to silence", RuntimeWarning, stacklevel=3)
        return False, msg
    _status["lib"] = lib
    return True, ""


def _disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def lapack_threads(n: int) -> bool:
    """Set the thread count of scipy's OpenBLAS (the one XLA:CPU's LAPACK kernels call); True when done.
    Never raises."""
    try:
        import scipy.linalg  # noqa: F401 - loads that OpenBLAS
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "scipy.libs" in line and "openblas" in line.lower()}
        done = False
        for path in libs:
            fn = getattr(ctypes.CDLL(path), "scipy_openblas_set_num_threads", None)
            if fn is not None:
                fn(int(n))
                done = True
        return done
    except Exception:  # noqa: BLE001 - a speed setting only
        return False


def single_thread_lapack() -> bool:
    """`lapack_threads(1)` (see the module docstring)."""
    return lapack_threads(1)


def _tune_once() -> None:
    """Pin LAPACK's threads once per process. OpenBLAS must not change its thread count while another thread is
    inside it: the first call comes from the first eligibility check (a trace, before the process has run any
    program with these kernels); a process that may have run LAPACK work before that calls this first
    (tests/conftest.py)."""
    with _lock:
        if "tuned" in _status:
            return
        _status["tuned"] = True
    if not _disabled() and jax.default_backend() == "cpu":
        single_thread_lapack()


def available() -> bool:
    """Whether the native kernel is usable in this process (builds / loads it on the first call; never raises)."""
    with _lock:
        if "ok" not in _status:
            _status["ok"], _status["reason"] = _load()
        return _status["ok"]


def status() -> str:
    """'native' or why not (after `available()`)."""
    available()
    return "native" if _status["ok"] else _status["reason"]


def eligible(x: jax.Array, w: jax.Array) -> bool:
    """Whether `dense` would use the native kernel on a CPU for these operands (static: shapes and dtypes)."""
    _tune_once()
    rows = math.prod(x.shape[:-1])
    return (x.dtype == F32 and w.dtype == F32 and w.ndim == 2 and x.shape[-1] == w.shape[1]
            and 2 <= rows <= MAX_ROWS and jax.default_backend() == "cpu" and available())


def _native(x: jax.Array, w: jax.Array) -> jax.Array:
    lead = x.shape[:-1]
    m = math.prod(lead)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, w.shape[0]), F32), vmap_method="sequential")
    return call(x.reshape(m, x.shape[-1]), w).reshape(*lead, w.shape[0])


@jax.custom_jvp
def _dense_cpu(x: jax.Array, w: jax.Array) -> jax.Array:
    return jax.lax.platform_dependent(x, w, cpu=_native, default=reference)


@_dense_cpu.defjvp
def _dense_cpu_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return _dense_cpu(x, w), reference(dx, w) + reference(x, dw)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., I] · w [O, I]ᵀ -> [..., O] float32: the native kernel where `eligible`, else `reference`."""
    return _dense_cpu(x, w) if eligible(x, w) else reference(x, w)


__all__ = ["dense", "reference", "eligible", "available", "status", "library_path", "lapack_threads",
           "single_thread_lapack", "MAX_ROWS", "ENV", "TARGET"]
