"""`hyspec serve`: load the model, compile every bucket, serve the OpenAI API until SIGTERM (then drain).

Light at import (argparse only) so that `hyspec --help` stays fast; JAX is imported by `run`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("hyspec.serve")

from hyspec_jax.spec.options import add_spec_arguments  # noqa: E402


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="Hugging Face model directory (default: checkpoints/default, or "
                   "the labelled random-weight demo model when none is shipped — as `hyspec generate`)")
    p.add_argument("--served-model-name", metavar="NAME", help="model id clients send (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    add_spec_arguments(p, default_mode="ar")
    p.add_argument("--max-batch", type=int, default=32, metavar="B", help="batch slots (default 32)")
    p.add_argument("--max-queue", type=int, default=256, metavar="Q",
                   help="requests waiting for a slot before new ones get 429 (default 256)")
    p.add_argument("--max-model-len", type=int, default=2048, metavar="N",
                   help="context length per request: prompt + completion tokens (default 2048)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="T",
                   help="prompt tokens per prefill call, a power of two >= 16 (default 256): longer prompts are "
                        "prefilled in chunks between decoding steps; shorter ones are packed together")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="parameter dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="on SIGTERM, seconds to let in-flight requests finish (default 60)")
    p.add_argument("--no-compilation-cache", action="store_true", help="do not use JAX's persistent compile cache")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


class CompileCounter:
    """XLA compilations (= jit cache misses) of this process, from `hyspec_jax.compilation` (the same counter
    as the engines' `compilations_after_startup`): `count` during start-up, then each one increments the
    metric counter `after_start` (set once serving starts) and logs a warning."""

    def __init__(self):
        from hyspec_jax.compilation import CompileWatch, on_compile
        self.watch = CompileWatch()
        self.after_start = None     # metric counter, set once serving starts
        on_compile(self._on_compile)

    @property
    def count(self) -> int:
        return self.watch.since

    def _on_compile(self, fun_name: str) -> None:
        if self.after_start is not None:
            self.after_start.inc()
            log.warning("compilation while serving: %s", fun_name)


def _progress(msg: str) -> None:
    print(f"[hyspec serve] {msg}", file=sys.stderr, flush=True)


def build_backend(args, target, model_dir: Path):
    """The request loop's backend for the server's options: `ar`, or the engine exactly as `hyspec generate` builds
    it from the same options (`launch.engine_from_args`) with the server's slots as its bucket."""
    import argparse

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.launch import engine_from_args
    from hyspec_jax.generate import Generator
    from hyspec_jax.runtime.backend import prefill_shapes
    shapes = prefill_shapes(args.prefill_chunk, args.max_batch)
    if args.spec_mode == "ar":
        if args.drafter:
            raise ValueError("--drafter is only used with a speculative --spec-mode (chain, ready, tree, tree-ready)")
        return Generator.from_model(target).backend(args.max_batch, args.max_model_len, shapes)
    leaves = jax.tree.leaves(nnx.state(target))
    dtype = leaves[0].dtype if leaves else jnp.float32
    ns = argparse.Namespace(**vars(args))
    ns.slots = args.max_batch
    engine = engine_from_args(ns, target, model_dir, dtype)
    return engine.backend(args.max_batch, args.max_model_len + engine.overshoot, shapes)


def _embedded_drafter(args) -> bool:
    """Serving the embedded model (no --model) whose drafter ships beside it: a speculative mode uses that
    drafter (as `hyspec generate`), with its recommended settings for options left unset."""
    from hyspec_jax.embedded import default_drafter_dir
    return args.model is None and default_drafter_dir() is not None


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="[hyspec serve] %(message)s")
    if args.max_batch < 1:
        raise ValueError("--max-batch must be >= 1")
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if args.max_model_len < 2:
        raise ValueError("--max-model-len must be >= 2")
    if args.spec_mode != "ar" and not args.drafter and not _embedded_drafter(args):
        raise ValueError(f"--spec-mode {args.spec_mode} needs --drafter DIR")
    from hyspec_jax.compilation import enable_compilation_cache
    from hyspec_jax.launch import resolve_model_dir
    model_dir, label = resolve_model_dir(args.model)
    if label:
        _progress(f"using a {label}")


    if not args.no_compilation_cache:
        enable_compilation_cache()
    from hyspec_jax.config import TargetConfig
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.serve.app import OpenAIApp, ServedModel
    from hyspec_jax.serve.chat import ChatTemplate
    from hyspec_jax.serve.metrics import ServerMetrics
    from hyspec_jax.runtime.scheduler import Scheduler
    from hyspec_jax.tokenizer import load_tokenizer, special_token_ids

    TargetConfig.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    from hyspec_jax.config import resolve_dtype
    dtype = resolve_dtype(args.dtype)
    counter = CompileCounter()
    t0 = time.perf_counter()
    cfg, target = load_pretrained(model_dir, dtype=dtype)
    backend = build_backend(args, target, model_dir)
    _progress(f"loaded {model_dir} ({cfg.model_type}, {cfg.num_hidden_layers} layers) in "
              f"{time.perf_counter() - t0:.1f}s; mode {backend.mode}, {backend.slots} slots, context "
              f"{backend.max_context}, prefill shapes {backend.shapes}; compiling")
    t0 = time.perf_counter()
    backend.compile(lambda s: _progress(f"  compiled {s}"))
    _progress(f"warm-up done in {time.perf_counter() - t0:.1f}s ({counter.count} programs)")

    chat = ChatTemplate(model_dir, tokenizer)
    name = args.served_model_name or model_dir.name
    metrics = ServerMetrics(name, spec_depth=backend.depth)
    metrics.compilations_startup.set(counter.count)
    counter.after_start = metrics.compilations_after_startup
    eos = frozenset(cfg.eos_token_id) | frozenset(special_token_ids(model_dir))
    if chat.eos_token_id is not None:
        eos |= {chat.eos_token_id}
    scheduler = Scheduler(backend, metrics, max_queue=args.max_queue)
    model = ServedModel(name=name, root=str(model_dir), max_model_len=args.max_model_len,
                        vocab_size=cfg.vocab_size, eos_token_ids=frozenset(eos), mode=backend.mode,
                        created=int(time.time()))
    app = OpenAIApp(scheduler=scheduler, tokenizer=tokenizer, chat=chat, model=model, metrics=metrics)
    scheduler.start()
    return asyncio.run(_serve(args, app, scheduler, chat))


async def _serve(args, app, scheduler, chat) -> int:
    from hyspec_jax.serve.http import HTTPServer
    http = HTTPServer(app.handle)
    try:
        port = await http.start(args.host, args.port)
    except OSError as e:
        scheduler.stop()
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = {"n": 0}

    def on_signal(signame: str) -> None:
        signals["n"] += 1
        if signals["n"] == 1:
            _progress(f"{signame}: draining (no new requests; in-flight ones finish, at most "
                      f"{args.drain_timeout:g}s)")
            app.draining = True
            http.stop_accepting()
            scheduler.drain()
            stop.set()
        else:
            _progress(f"{signame} again: stopping now")
            scheduler.stop()

    for sig, signame in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
        loop.add_signal_handler(sig, on_signal, signame)
    _progress(f"chat prompts: {chat.kind}")
    _progress(f"serving model '{app.model.name}' on http://{args.host}:{port} (OpenAI API under /v1)")
    await stop.wait()
    deadline = time.monotonic() + args.drain_timeout
    while time.monotonic() < deadline and (scheduler.busy or http.in_flight > 0):
        await asyncio.sleep(0.05)
    if scheduler.busy:
        _progress("drain timeout: aborting the remaining requests")
        scheduler.stop()
        for _ in range(100):
            if http.in_flight == 0:
                break
            await asyncio.sleep(0.05)
    scheduler.drain()
    await loop.run_in_executor(None, scheduler.join, 10.0)
    await http.close_idle()
    _progress("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyspec serve", description="OpenAI-compatible server.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from hyspec_jax.launch import UsageError
    from hyspec_jax.config import ConfigError
    from hyspec_jax.io.hf import CheckpointError
    try:
        return run(args)
    except (UsageError, ConfigError, CheckpointError, FileNotFoundError, ValueError, OSError) as e:
        print(f"hyspec serve: error: {e}", file=sys.stderr)
        return 2
