"""Compilation bookkeeping: JAX's persistent compilation cache and a process-wide compile counter.

- `enable_compilation_cache()` points JAX at an on-disk cache ($HYSPEC_JAX_CACHE, else
  `$HYSPEC_CACHE/xla`, else ~/.cache/hyspec_jax/xla) with no minimum compile time or entry size, so that every
  program — the small ones included — is stored and a second run of the same buckets skips XLA.
- `compile_count()` counts XLA compilations of this process (every jit cache miss, whether XLA compiles or
  the program comes from the persistent cache) through the `jax.monitoring` backend-compile event
  (`/jax/core/compile/backend_compile_duration`, recorded around `compiler.compile_or_get_cached`).
  `CompileWatch` counts from a mark: engines mark it at the end of their start-up compile (`warmup`), so
  `compilations_after_startup` is the number of recompiles while serving (it should stay 0).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_ENV = "HYSPEC_JAX_CACHE"

_lock = threading.Lock()
_count = 0
_installed = False
_callbacks: list[Callable[[str], None]] = []


def compilation_cache_dir() -> Path:
    """Where the persistent compilation cache lives: $HYSPEC_JAX_CACHE, else <hyspec cache>/xla."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from hyspec_jax.demo import cache_dir
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
           "compile_count", "on_compile", "CompileWatch"]
