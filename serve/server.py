"""`hyspec serve`: load the model, compile every bucket, serve the OpenAI API on uvicorn until SIGTERM (then drain).

The launch flags follow `vllm serve` where they mean the same here (`MODEL` positional, `--speculative-config`,
`--tensor-parallel-size`, `--data-parallel-size`, `--max-model-len`, `--gpu-memory-utilization`, `--dtype`, `--seed`,
`--max-num-seqs`, `--served-model-name`, `--api-key`, `--allowed-origins`, `--disable-log-requests`,
`--max-logprobs`).
Light at import (argparse only) so that `hyspec --help` stays fast; JAX is imported by `run`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("hyspec.serve")

from hyspec_jax.spec.options import MODES, TREE_MODES, add_spec_arguments  # noqa: E402

API_KEY_ENV = ("HYSPEC_API_KEY", "VLLM_API_KEY")
STARTUP_CALIBRATION_ROUNDS = 10   # rounds per width and decoding bucket a GPU server times at start-up
DEFAULT_MAX_MODEL_LEN = 2048      # a model config without max_position_embeddings
MAX_DEFAULT_MODEL_LEN = 4096      # every slot holds a whole context's KV cache: a default longer than this is asked for


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="Hugging Face model directory (as `vllm serve "
                   "MODEL`; default: checkpoints/default, or the labelled random-weight demo model)")
    p.add_argument("--model", metavar="DIR", help="the same as MODEL")
    p.add_argument("--served-model-name", metavar="NAME", help="model id clients send (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    add_spec_arguments(p)
    p.add_argument("--speculative-config", metavar="JSON",
                   help='vLLM form of the speculative options: {"method": one of ' + ", ".join(MODES)
                        + ', "model": drafter directory, "num_speculative_tokens": drafts per chain (chain, ready) '
                          'or tree levels (tree, tree-ready)}; an option also given as a flag must agree')
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=32, metavar="B",
                   help="batch slots: requests decoded together (default 32)")
    p.add_argument("--decode-buckets", default="auto", metavar="R,R,...",
                   help="row counts below --max-batch that a decoding step (or speculative round) is also compiled "
                        "for: a step over few requests runs on the smallest that holds them, at that many rows' cost "
                        "(as vLLM's CUDA-graph batch sizes); 'auto' (default): 1 and the powers of 4 below "
                        "--max-batch for a speculative mode, and for plain decoding on a CPU (on a GPU a plain step "
                        "over few rows measured slower than over all slots); 'none': every step runs over all slots")
    p.add_argument("--startup-calibration", type=int, metavar="R",
                   help="speculative modes with no budget-table entry for this server's bucket: time every verify "
                        "width's round at start-up, R rounds each per decoding bucket (about a second), and choose "
                        "the width of every round from those times; 0: every round verifies --verify-nodes nodes "
                        "(default: 10 on one GPU, 0 on a CPU or over several devices). The times are kept in "
                        "width_times.json of the hyspec cache ($HYSPEC_CACHE, else ~/.cache/hyspec_jax): a later "
                        "start of the same server, code and device chooses from them without timing again")
    p.add_argument("--recalibrate", action="store_true",
                   help="with --startup-calibration: time the widths again even where an earlier start kept times "
                        "for this server, and keep the new ones")
    p.add_argument("--max-queue", type=int, default=256, metavar="Q",
                   help="requests waiting for a slot before new ones get 429 (default 256)")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="context length per request, prompt + completion tokens (default: the model config's "
                        f"max_position_embeddings, at most {MAX_DEFAULT_MODEL_LEN}, else {DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="T",
                   help="prompt tokens per prefill call, a power of two >= 16 (default 256): longer prompts are "
                        "prefilled in chunks between decoding steps; shorter ones are packed together")
    p.add_argument("--dtype", choices=("auto", "float32", "float", "bfloat16"), default="auto",
                   help="parameter dtype (auto: bfloat16 on GPU, float32 on CPU; float = float32)")
    p.add_argument("--seed", type=int, metavar="S",
                   help="seed of the requests that send none (default: a random seed per request)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="devices the model is sharded over (tensor parallel: heads, MLP, experts; default 1)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="D",
                   help="replicas of the (sharded) model, each decoding its share of the slots: D x N devices; "
                        "--max-batch must be a multiple of D (default 1)")
    from hyspec_jax.launch import add_distributed_arguments
    add_distributed_arguments(p)      # process 0 serves HTTP and schedules; the others run the same device calls
    p.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                   help="fraction of GPU memory JAX preallocates (XLA_PYTHON_CLIENT_MEM_FRACTION; default JAX's)")
    p.add_argument("--max-logprobs", type=int, default=20, metavar="K",
                   help="most top_logprobs a request may ask for (default 20; 0 = no logprobs or echo scoring)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                   f"${API_KEY_ENV[0]}, else ${API_KEY_ENV[1]}, else no key)")
    p.add_argument("--allowed-origins", metavar="JSON", default=None,
                   help='CORS: origins allowed to call the API, a JSON list as vLLM (e.g. \'["*"]\') or comma '
                        "separated (default: none, no CORS headers)")
    p.add_argument("--disable-log-requests", action="store_true", help="no access-log line per request")
    p.add_argument("--max-connections", type=int, default=1024, metavar="C",
                   help="open connections (and requests) at once; more are answered 503 (default 1024)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                   help="close an idle keep-alive connection after S seconds (default 5)")
    p.add_argument("--request-read-timeout", type=float, default=30.0, metavar="S",
                   help="close a connection whose request (head and body) has not arrived S seconds after its "
                        "first byte (default 30)")
    p.add_argument("--max-header-bytes", type=int, default=64 * 1024, metavar="N",
                   help="largest request head (default 64 KiB)")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, metavar="N",
                   help="largest request body; larger ones get 413 (default 32 MiB)")
    p.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="on SIGTERM, seconds to let in-flight requests finish (default 60)")
    p.add_argument("--no-compilation-cache", action="store_true",
                   help="do not use JAX's persistent compile cache (nor, on a CPU, the traced programs kept on disk)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def apply_speculative_config(args) -> None:
    """--speculative-config onto the speculative flags (a flag given too must agree)."""
    if not args.speculative_config:
        return
    try:
        cfg = json.loads(args.speculative_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = set(cfg) - {"method", "model", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"--speculative-config: unsupported keys {sorted(unknown)} (known: method, model, "
                         "num_speculative_tokens)")
    method = cfg.get("method")
    if method is not None and method not in MODES:
        raise ValueError(f"--speculative-config: method {method!r} is not one of {', '.join(MODES)}")
    mode = method or args.spec_mode
    k = cfg.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"--speculative-config: num_speculative_tokens must be a positive integer, got {k!r}")
    depth_flag = "tree_depth" if mode in TREE_MODES else "chain_length"
    for key, dest, value in (("method", "spec_mode", method), ("model", "drafter", cfg.get("model")),
                             ("num_speculative_tokens", depth_flag, k)):
        if value is None:
            continue
        have = getattr(args, dest)
        if have is not None and have != value:
            raise ValueError(f"--speculative-config {key}={value!r} disagrees with --{dest.replace('_', '-')} {have}")
        setattr(args, dest, value)
    if k is not None and mode in (None, "ar"):
        raise ValueError("--speculative-config: num_speculative_tokens needs a speculative method")


def model_max_len(model_dir: Path) -> int:
    """The default --max-model-len: the config's max_position_embeddings (top level or text_config), capped."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raw = {}
    n = raw.get("max_position_embeddings") or (raw.get("text_config") or {}).get("max_position_embeddings")
    return min(int(n), MAX_DEFAULT_MODEL_LEN) if isinstance(n, int) and n > 1 else DEFAULT_MAX_MODEL_LEN


def parse_origins(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    if value.lstrip().startswith("["):
        try:
            origins = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--allowed-origins is not a valid JSON list: {e}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError("--allowed-origins must be a JSON list of strings")
        return tuple(origins)
    return tuple(o.strip() for o in value.split(",") if o.strip())


def check_args(args) -> None:
    """Checks that need no model (before anything loads)."""
    if args.model_pos and args.model and Path(args.model_pos) != Path(args.model):
        raise ValueError(f"MODEL {args.model_pos} and --model {args.model} disagree")
    args.model = args.model or args.model_pos
    apply_speculative_config(args)
    if args.max_batch < 1:
        raise ValueError("--max-batch / --max-num-seqs must be >= 1")
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if args.recalibrate and args.startup_calibration == 0:
        raise ValueError("--recalibrate times the widths at start-up: it needs --startup-calibration R > 0")
    if args.startup_calibration is not None and args.startup_calibration < 0:
        raise ValueError("--startup-calibration must be >= 0")
    decode_buckets(args)                      # a bad value: its one-line error now
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError("--max-model-len must be >= 2")
    if args.max_logprobs < 0:
        raise ValueError("--max-logprobs must be >= 0")
    if args.tensor_parallel_size < 1:
        raise ValueError("--tensor-parallel-size must be >= 1")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    for name in ("max_connections", "max_header_bytes", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("timeout_keep_alive", "request_read_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.dtype == "float":
        args.dtype = "float32"
    args.allowed_origins = parse_origins(args.allowed_origins)
    if args.api_key is None:
        args.api_key = next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


def check_devices(args) -> None:
    """The parallel sizes against the visible devices and the slots (`launch.check_parallel`), before loading."""
    from hyspec_jax.launch import check_parallel
    check_parallel(args.tensor_parallel_size, args.data_parallel_size, args.max_batch, "--max-batch")


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


def build_backend(args, target, model_dir: Path, max_model_len: int):
    """The request loop's backend for the server's options: the engine exactly as `hyspec generate` builds it from
    the same options (`launch.engine_from_args`, which also picks the embedded drafter's measured best mode when
    none is given), or plain decoding (`launch.plain_engine`), with the server's slots as its bucket and a KV length
    of max_model_len + the engine's `overshoot`; its programs compute --max-logprobs top alternatives beside each
    emitted token's logprob (`SlotLayout.logprobs`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.launch import engine_from_args, plain_engine
    from hyspec_jax.runtime.backend import prefill_shapes
    shapes = prefill_shapes(args.prefill_chunk, args.max_batch)
    leaves = jax.tree.leaves(nnx.state(target))
    dtype = leaves[0].dtype if leaves else jnp.float32
    ns = argparse.Namespace(**vars(args))
    ns.slots = args.max_batch
    if ns.startup_calibration is None:        # one GPU: its own round times; a CPU's are the shipped table's
        single = (args.tensor_parallel_size == 1 and args.data_parallel_size == 1 and jax.process_count() == 1)
        ns.startup_calibration = STARTUP_CALIBRATION_ROUNDS if single and jax.default_backend() != "cpu" else 0
    engine = engine_from_args(ns, target, model_dir, dtype, server=True)
    if engine is None:
        if args.drafter and args.spec_mode == "ar":
            raise ValueError("--drafter is only used with a speculative --spec-mode (chain, ready, tree, tree-ready)")
        engine = plain_engine(ns, target)
    return engine.backend(args.max_batch, max_model_len + engine.overshoot, shapes,
                          decode_buckets(args, plain=engine.spec.mode == "ar"), logprobs=args.max_logprobs)


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (the model, the programs, the imported modules) out of the garbage
    collector's view (`gc.freeze`, as vLLM does after its warm-up), so that a full collection while serving scans
    only what requests allocate; and log a collection that still stops the server for over 50 ms."""
    import gc
    gc.collect()
    gc.freeze()
    started: list[float] = []

    def timing(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and (dt := time.perf_counter() - started[0]) > 0.05:
            logging.getLogger("hyspec.serve").warning("garbage collection (generation %s) took %.0f ms",
                                                      info.get("generation"), 1e3 * dt)
    gc.callbacks.append(timing)


def decode_buckets(args, plain: bool = False) -> tuple[int, ...]:
    """--decode-buckets: "auto", "none", or a comma-separated list of row counts. auto: `default_decode_buckets`
    for a speculative mode; for plain decoding (plain=True) only on a CPU — on a GPU a plain step over few rows
    measured slower than over every slot (the gather and write-back cost more launches than the rows save:
    bench/results/budget/decode_buckets_h100.md), where a speculative round's cost follows its rows."""
    from hyspec_jax.runtime.backend import default_decode_buckets
    v = (args.decode_buckets or "auto").strip().lower()
    if v == "auto":
        if plain:
            import jax
            if jax.default_backend() != "cpu":
                return ()
        return default_decode_buckets(args.max_batch)
    if v == "none":
        return ()
    try:
        out = tuple(int(x) for x in v.split(","))
        if any(r < 1 for r in out):
            raise ValueError
    except ValueError:
        raise ValueError(f"--decode-buckets must be 'auto', 'none' or row counts >= 1 separated by commas, got "
                         f"{args.decode_buckets!r}") from None
    return out


def run(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="[hyspec serve] %(message)s")
    check_args(args)
    if args.gpu_memory_utilization is not None:
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{args.gpu_memory_utilization:g}"
    from hyspec_jax.compilation import tune_cpu_codegen
    tune_cpu_codegen()          # before JAX starts, as the memory fraction
    from hyspec_jax.launch import init_distributed
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)   # before JAX starts
    check_devices(args)
    import jax
    from hyspec_jax.compilation import program_cache
    # One process on one device (on a CPU: `enable_program_cache`): the programs' traced and lowered forms are kept on
    # disk too, so a warm start skips Python tracing and lowering as well as XLA. Not over several devices or
    # processes, whose sharded inputs the program cache does not store.
    single = jax.process_count() == 1 and args.tensor_parallel_size == 1 and args.data_parallel_size == 1
    with program_cache(single and not args.no_compilation_cache):
        return _start(args)


def _start(args) -> int:
    """`run` once the devices are known: load, build the backend, compile, then serve (or follow process 0)."""
    import jax
    from hyspec_jax.compilation import enable_compilation_cache
    from hyspec_jax.config import TargetConfig, resolve_dtype
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.launch import resolve_model_dir, shard_target
    from hyspec_jax.runtime.scoring import Scorer, compile_server
    from hyspec_jax.tokenizer import load_tokenizer

    model_dir, label = resolve_model_dir(args.model)
    if label:
        _progress(f"using a {label}")
    if not args.no_compilation_cache:
        enable_compilation_cache()
    TargetConfig.from_pretrained(model_dir)
    max_model_len = args.max_model_len or model_max_len(model_dir)
    tokenizer = load_tokenizer(model_dir)
    dtype = resolve_dtype(args.dtype)
    counter = CompileCounter()
    t0 = time.perf_counter()
    cfg, target = load_pretrained(model_dir, dtype=dtype)
    shard_target(target, args.tensor_parallel_size, args.data_parallel_size)   # the loop's buffers, the scorer follow
    backend = build_backend(args, target, model_dir, max_model_len)
    _progress(f"loaded {model_dir} ({cfg.model_type}, {cfg.num_hidden_layers} layers) in "
              f"{time.perf_counter() - t0:.1f}s; mode {backend.mode}, {backend.slots} slots, context "
              f"{max_model_len}, prefill shapes {backend.shapes}, decoding buckets "
              f"{list(backend.decode_buckets) or 'none'}; compiling")
    t0 = time.perf_counter()
    scorer = Scorer(backend.graphdef, backend.params, max_model_len, args.max_logprobs) if args.max_logprobs > 0 \
        else None
    compile_server(backend, scorer, lambda s: _progress(f"  compiled {s}"))
    for rows, seconds in (getattr(backend, "calibrated", None) or {}).items():     # the start-up calibration
        times = ", ".join(f"{w}: {1e3 * t:.2f}" for w, t in sorted(seconds.items()))
        _progress(f"  round ms over {rows} rows by width: {times}; kept {list(backend.chooser.kept(rows))}")
    if getattr(backend, "calibration_saved", None):
        _progress(f"  round times kept in {backend.calibration_saved} for the next start (--recalibrate: time "
                  "them again)")
    elif getattr(backend, "times_origin", None):
        _progress(f"  round times from {backend.times_origin}")
    _progress(f"warm-up done in {time.perf_counter() - t0:.1f}s ({counter.count} programs)")
    freeze_startup_objects()
    channel = None
    if jax.process_count() > 1:
        # multi-host (runtime/multihost.py): process 0 serves and schedules, sending each device call to the
        # others, which run it on their copy of the same backend; every program above compiled on every process
        from hyspec_jax.runtime.multihost import BroadcastBackend, BroadcastScorer, Channel, follow
        channel = Channel()
        if jax.process_index() != 0:
            _progress(f"process {jax.process_index()} of {jax.process_count()}: following process 0")
            follow(backend, channel, scorer)
            _progress("stopped")
            return 0
        backend = BroadcastBackend(backend, channel)
        scorer = None if scorer is None else BroadcastScorer(scorer, channel)

    try:
        return _lead(args, backend, scorer, cfg, model_dir, tokenizer, counter, max_model_len)
    finally:
        if channel is not None:
            channel.close()     # the followers return (after the scheduler's last call), also when this failed


def _lead(args, backend, scorer, cfg, model_dir: Path, tokenizer, counter: CompileCounter, max_model_len: int) -> int:
    """The request loop on its thread behind the OpenAI API, until SIGTERM (across hosts: on process 0 only)."""
    from hyspec_jax.runtime.scheduler import Scheduler
    from hyspec_jax.serve.app import FrontOptions, OpenAIServer, ServedModel, build_app
    from hyspec_jax.serve.chat import ChatTemplate
    from hyspec_jax.serve.metrics import ServerMetrics
    from hyspec_jax.tokenizer import special_token_ids

    chat = ChatTemplate(model_dir, tokenizer)
    name = args.served_model_name or model_dir.name
    metrics = ServerMetrics(name, spec_depth=backend.depth)
    metrics.compilations_startup.set(counter.count)
    counter.after_start = metrics.compilations_after_startup
    eos = frozenset(cfg.eos_token_id) | frozenset(special_token_ids(model_dir))
    if chat.eos_token_id is not None:
        eos |= {chat.eos_token_id}
    scheduler = Scheduler(backend, metrics, max_queue=args.max_queue)
    model = ServedModel(name=name, root=str(model_dir), max_model_len=max_model_len, vocab_size=cfg.vocab_size,
                        eos_token_ids=frozenset(eos), mode=backend.mode, created=int(time.time()))
    options = FrontOptions(api_key=args.api_key, allowed_origins=args.allowed_origins,
                           max_body_bytes=args.max_body_bytes, log_requests=not args.disable_log_requests,
                           max_logprobs=args.max_logprobs)
    server = OpenAIServer(scheduler=scheduler, tokenizer=tokenizer, chat=chat, model=model, metrics=metrics,
                          options=options, scorer=scorer, version=_version(), seed=args.seed)
    scheduler.start()
    return _serve(args, server, build_app(server), chat)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("hyspec-jax")
    except PackageNotFoundError:
        return "unknown"


def _serve(args, server, app, chat) -> int:
    import uvicorn

    from hyspec_jax.serve.transport import read_deadline_protocol
    scheduler = server.scheduler
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="auto",
                            http=read_deadline_protocol(args.request_read_timeout),
                            limit_concurrency=args.max_connections, timeout_keep_alive=args.timeout_keep_alive,
                            h11_max_incomplete_event_size=args.max_header_bytes,
                            timeout_graceful_shutdown=args.drain_timeout, access_log=False, server_header=False,
                            log_level=args.log_level, lifespan="off")
    try:
        sock = config.bind_socket()
    except SystemExit:       # uvicorn logs the OSError and exits
        scheduler.stop()
        raise ValueError(f"cannot listen on {args.host}:{args.port}") from None
    # listening now, so a client that connects as soon as the address below is printed waits in the backlog
    # instead of being refused (uvicorn's bind_socket only binds; its start-up listens a moment later)
    sock.listen(config.backlog)
    port = sock.getsockname()[1]
    signals = {"n": 0}

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Our handlers: the first SIGTERM/SIGINT drains (no new requests; in-flight ones finish within
            # --drain-timeout, uvicorn's graceful shutdown), a second stops now. Exit 0, no re-raised signal.
            def on_signal(sig, frame):
                signals["n"] += 1
                signame = signal.Signals(sig).name
                if signals["n"] == 1:
                    _progress(f"{signame}: draining (no new requests; in-flight ones finish, at most "
                              f"{args.drain_timeout:g}s)")
                    server.draining = True
                    scheduler.drain()
                    self.should_exit = True
                else:
                    _progress(f"{signame} again: stopping now")
                    scheduler.stop()
                    self.force_exit = True
            old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    userver = Server(config)
    scheduler.on_failure = _stop_on_engine_failure(server, userver)
    _progress(f"chat prompts: {chat.kind}")
    _progress(f"serving model '{server.model.name}' on http://{args.host}:{port} (OpenAI API under /v1"
              f"{'; API key required' if args.api_key else ''})")
    try:
        userver.run(sockets=[sock])        # uvloop where installed (loop="auto")
    finally:
        if scheduler.busy:
            _progress("drain timeout: aborting the remaining requests")
        scheduler.stop()
        scheduler.join(10.0)
    _progress("stopped")
    if scheduler.failed is not None:
        from hyspec_jax.serve.app import engine_error
        print(f"hyspec serve: error: the engine failed: {engine_error(scheduler.failed)}", file=sys.stderr)
        return 1
    return 0


def _stop_on_engine_failure(server, userver) -> Callable[[BaseException], None]:
    """The request loop's `on_failure`: a failed engine stops the server (as vLLM's does), so that a supervisor
    restarts it instead of a live process answering 503 forever. Its requests have already failed; new ones get
    503 with the error until the listener closes; the exit code is 1."""
    from hyspec_jax.serve.app import engine_error

    def stop(e: BaseException) -> None:
        _progress(f"the engine failed ({engine_error(e)}): stopping")
        server.draining = True
        userver.should_exit = True        # read by uvicorn's main loop, which then shuts down gracefully
    return stop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyspec serve", description="OpenAI-compatible server.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from hyspec_jax.config import ConfigError
    from hyspec_jax.io.hf import CheckpointError
    from hyspec_jax.launch import UsageError
    try:
        return run(args)
    except (UsageError, ConfigError, CheckpointError, FileNotFoundError, ValueError, OSError) as e:
        print(f"hyspec serve: error: {e}", file=sys.stderr)
        return 2
