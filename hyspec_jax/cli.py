"""`hyspec` console script: one entry point, subcommands.

Errors the user can fix (bad paths, bad configs, bad arguments) end with one line on stderr and exit 2;
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hyspec_jax.compilation import enable_compilation_cache, tune_cpu_codegen
from hyspec_jax.config import ConfigError
from hyspec_jax.launch import (UsageError, add_distributed_arguments, check_parallel, engine_from_args, plain_engine,
                               resolve_model_dir, shard_target)


def _fail(msg: str) -> "NoReturn":  # noqa: F821
    print(f"hyspec: error: {msg}", file=sys.stderr)
    sys.exit(2)


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------
def _read_prompts(args) -> list[str]:
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise UsageError(f"--prompts-file {path}: no such file")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path}:{n}: invalid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise UsageError(f"{path}:{n}: a JSON line needs a string field \"prompt\"")
                prompts.append(obj["prompt"])
            else:
                prompts.append(line)
        if args.prompt is not None:
            prompts.insert(0, args.prompt)
        if not prompts:
            raise UsageError(f"--prompts-file {path}: no prompts in it")
        return prompts
    if args.prompt is None:
        raise UsageError("give a PROMPT or --prompts-file")
    return [args.prompt]


def batch_stats(engine, results, seconds: float) -> dict:
    """Acceptance statistics of one `hyspec generate` batch (`--stats`): the engine's `last_stats`."""
    new = sum(len(r.token_ids) for r in results)
    st = {"prompts": len(results), "new_tokens": new, "seconds": round(seconds, 4),
          "tokens_per_second": round(new / seconds, 2) if seconds > 0 else 0.0,
          "prefill_seconds": round(max((r.prefill_seconds for r in results), default=0.0), 4),
          "decode_steps_per_second": round(results[0].decode_steps_per_second, 2) if results else 0.0}
    s = engine.last_stats
    from hyspec_jax.spec.stats import rounded
    st.update(mode=s.mode, rounds=s.rounds, tau=round(s.tau, 4),
              accepted_per_position=[round(x, 4) for x in s.accepted_per_position],
              prefix_survival=rounded(s.prefix_survival),
              verify_nodes=s.verify_nodes, compilations_after_startup=s.compilations_after_startup)
    return st


def request_stats(engine, res) -> dict:
    """The speculative part of a request's `stats` (`hyspec generate --json`; plain decoding: a step is a round)."""
    from hyspec_jax.spec.stats import rounded
    return {"mode": engine.spec.mode, "rounds": res.rounds, "tau": round(res.tau, 4),
            "accepted_per_position": [round(x, 4) for x in res.accepted_per_position(engine.depth)],
            "prefix_survival": rounded(res.prefix_survival(engine.depth)),
            "verify_nodes": engine.verify_nodes}


def _warm_rate(mode: str, steps_per_second: float, tau: float, prompts: int) -> str:
    """Decode speed after the first (compiling) step or round; for one prompt also as tokens/s."""
    if mode == "ar":
        return f"{steps_per_second:.1f} decode steps/s warm"
    one = f" = {steps_per_second * tau:.1f} tok/s warm" if prompts == 1 else ""
    return f"{steps_per_second:.1f} rounds/s warm x tau {tau:.2f}{one}"


def format_stats(st: dict) -> str:
    """`batch_stats` as the human-readable block `hyspec generate --stats` prints to stderr."""
    lines = [f"mode {st['mode']}: {st['rounds']} rounds, tau {st['tau']:.2f} tokens per request-round "
             f"(bonus included)" + (f", {st['verify_nodes']} verified nodes per request" if st["mode"] != "ar"
                                    else "")]
    if st["accepted_per_position"]:
        lines.append("accepted per position (fraction of request-rounds accepting >= k drafts): "
                     + "  ".join(f"{k}: {a:.2f}" for k, a in enumerate(st["accepted_per_position"], 1)))
    if st.get("prefix_survival"):
        lines.append("prefix survival (ReaDy: P(>= k drafts accepted), last round of each request censored): "
                     + "  ".join(f"{k}: " + ("n/a" if a is None else f"{a:.2f}")
                                 for k, a in enumerate(st["prefix_survival"], 1)))
    lines.append(f"{st['new_tokens']} new tokens for {st['prompts']} prompt(s) in {st['seconds']:.2f}s: "
                 f"{st['tokens_per_second']:.1f} tok/s incl. compile (prefill {st['prefill_seconds']:.2f}s, "
                 f"{_warm_rate(st['mode'], st['decode_steps_per_second'], st['tau'], st['prompts'])})")
    lines.append(f"compilations after start-up: {st['compilations_after_startup']} (generate does not warm up: "
                 f"each program compiles on first use)")
    return "\n".join(f"[hyspec] {line}" for line in lines)


def cmd_generate(args) -> int:
    from hyspec_jax.launch import init_distributed
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    import jax
    if jax.process_index() != 0:      # every process runs the same loop; one prints it
        sys.stdout = open(os.devnull, "w")
    from hyspec_jax.compilation import program_cache
    with program_cache():      # traced programs on disk too: a second `generate` skips tracing its programs
        return _generate(args)


def _generate(args) -> int:
    from hyspec_jax.sampling import SamplingParams

    prompts = _read_prompts(args)
    try:
        base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_parallel(args.tensor_parallel_size, args.data_parallel_size, args.slots)   # before anything loads
    model_dir, label = resolve_model_dir(args.model)
    if label:
        print(f"[hyspec] using a {label}", file=sys.stderr)


    enable_compilation_cache()
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.tokenizer import StreamDecoder, load_tokenizer, special_token_ids

    from hyspec_jax.config import TargetConfig
    TargetConfig.from_pretrained(model_dir)  # config errors first: they say what the directory is missing
    tokenizer = load_tokenizer(model_dir)
    from hyspec_jax.config import resolve_dtype
    dtype = resolve_dtype(args.dtype)
    cfg, model = load_pretrained(model_dir, dtype=dtype)
    shard_target(model, args.tensor_parallel_size, args.data_parallel_size)
    stops = tuple(sorted(set(cfg.eos_token_id) | set(special_token_ids(model_dir))))
    engine = engine_from_args(args, model, model_dir, dtype, batch=len(prompts),   # None: plain decoding
                              new_tokens=args.max_tokens * len(prompts),
                              note=lambda why: print(f"[hyspec] mode ar (default: {why}; --spec-mode to choose)",
                                                     file=sys.stderr)) or plain_engine(args, model)
    encoded = [tokenizer.encode(p).ids for p in prompts]
    params = [SamplingParams(max_tokens=base.max_tokens, temperature=base.temperature, top_p=base.top_p,
                             top_k=base.top_k, seed=base.seed + i, stop_token_ids=stops)
              for i in range(len(prompts))]

    stream = not args.json and len(prompts) == 1
    decoder = StreamDecoder(tokenizer)

    def on_tokens(i: int, ids: list[int]) -> None:
        delta = decoder.push([t for t in ids if t not in stops])
        if delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    if stream:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    t0 = time.perf_counter()
    results = engine.generate(encoded, params, on_tokens=on_tokens if stream else None)
    seconds = time.perf_counter() - t0
    for prompt, res in zip(prompts, results):
        text = tokenizer.decode([t for t in res.token_ids if t not in stops], skip_special_tokens=True)
        stats = {"new_tokens": len(res.token_ids), "seconds": round(seconds, 4),
                 "tokens_per_second": round(len(res.token_ids) / seconds, 2) if seconds > 0 else 0.0,
                 "prefill_seconds": round(res.prefill_seconds, 4),
                 "decode_steps_per_second": round(res.decode_steps_per_second, 2)}
        stats.update(request_stats(engine, res))
        if args.json:
            print(json.dumps({"prompt": prompt, "prompt_token_ids": res.prompt_token_ids,
                              "token_ids": res.token_ids, "text": text, "finish_reason": res.finish_reason,
                              "stats": stats}))
        elif not stream:
            print(f"=== {prompt}\n{prompt}{text}\n")
    if stream:
        print()
    if args.stats:
        print(format_stats(batch_stats(engine, results, seconds)), file=sys.stderr)
    elif not args.json:
        total = sum(len(r.token_ids) for r in results)
        rate = results[0].decode_steps_per_second
        print(f"[hyspec] {total} tokens for {len(results)} prompt(s) in {seconds:.2f}s "
              f"({total / seconds:.1f} tok/s incl. compile; "
              f"{_warm_rate(engine.spec.mode, rate, engine.last_stats.tau, len(results))})",
              file=sys.stderr)
    if getattr(args, "phase_times", False):
        from hyspec_jax.bench.phases import format_phase_times, phase_times
        if engine.spec.mode == "ar":
            print("[hyspec] --phase-times: plain autoregressive decoding has no draft / verify / commit phases",
                  file=sys.stderr)
        else:
            print(format_phase_times(phase_times(engine, encoded, params)), file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    from hyspec_jax.runtime.calibrate import run

    enable_compilation_cache()
    return run(args)


def cmd_serve(args) -> int:
    from hyspec_jax.serve.server import run

    return run(args)


def cmd_bench(args) -> int:
    import importlib

    module = importlib.import_module(f"hyspec_jax.bench.{args.which.replace('-', '_')}")
    return module.main(args.rest)


# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyspec", description="Speculative decoding for hybrid GDN LLMs in JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text with a target model (autoregressive)",
                       description="Generate text. Without --model: the shipped default model, or a labelled "
                                   "random-weight demo model when none is shipped.")
    g.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt text")
    g.add_argument("--model", metavar="DIR", help="Hugging Face model directory (config.json, safetensors, tokenizer.json)")
    g.add_argument("--prompts-file", metavar="F", help="one prompt per line, or JSON lines with a \"prompt\" field; generated as one batch")
    g.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1 = off)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0 = off)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (prompt i uses S+i)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="parameter dtype (auto: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the target over N devices (heads, MLP, experts; default 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="D",
                   help="D replicas of the (sharded) target, each decoding its share of the slots; uses D x N "
                        "devices, and --slots must be a multiple of D (default 1)")
    add_distributed_arguments(g)
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming text")
    g.add_argument("--stats", action="store_true", help="after generating, print acceptance statistics to stderr "
                   "(mode, rounds, tau, accepted per position, prefix survival, tokens/s, compilations after "
                   "start-up)")
    g.add_argument("--phase-times", action="store_true",
                   help="speculative modes: after generating, time one round of the same prompts split into its "
                        "phases — draft (+ select), verify, accept + commit, each jitted alone — against the "
                        "fused round, one line each on stderr (compiles the split programs)")
    sp = g.add_argument_group("speculative decoding")
    from hyspec_jax.spec.options import add_spec_arguments
    add_spec_arguments(sp)
    sp.add_argument("--slots", type=int, metavar="B", help="batch slots: more prompts are admitted as slots free up")
    g.set_defaults(func=cmd_generate)

    from hyspec_jax.runtime.calibrate import add_arguments as add_calibrate_arguments
    c = sub.add_parser("calibrate", help="measure verify vs decode latency per bucket: Bole's budget table",
                       description="Bole Algorithm 3: T_ver(N) per node capacity and T_dec per bucket; writes "
                                   "B_ver = max{N : T_ver(N) <= (1+eps) T_dec} to a JSON table.")
    add_calibrate_arguments(c)
    c.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="benchmarks and memory reports (JSON + a readable table)",
                       description="Benchmarks. `hyspec bench WHICH --help` for each one's options.")
    b.add_argument("which", choices=("memory", "kernels", "verify-scale", "e2e", "round-profile", "topk",
                                     "profile-scale", "serve-compile", "round-scale", "serve-compare", "gdn-layer"),
                   help="e2e: Spec-Bench-style tokens/s, tau and prefix survival per domain and mode vs ar; round-profile: wall vs GPU busy time and GPU launches per round, per mode (profiler trace); topk: the tree build's per-level top-k kernel tilings vs XLA (GPU); memory: transient verify memory, "
                   "Bole's factorized design vs per-node snapshots; kernels: GDN tree kernels vs baselines (GPU); "
                   "verify-scale: T_ver(N)/T_dec and B_ver of the Qwen3.8-27B geometry, 1 or D GPUs; "
                   "profile-scale: T_dec and T_ver split into dense, GDN, attention, norms, logits and the rest, "
                   "each against its floor (profiler trace); "
                   "serve-compile: hyspec serve's whole start-up program set at a geometry (default 27B), compiled "
                   "cold and from the persistent cache; "
                   "round-scale: the engine's round of each drafting mode (chain, ready, tree, tree-ready with a "
                   "published-geometry DSpark drafter; mtp, mtp-tree with the target's MTP head in Qwen's layout) "
                   "vs a decoding step at the 27B geometry (random weights), and the projected speed-up; "
                   "gdn-layer: one GDN layer's verify tree solve and decoding step at the model's own inputs, their "
                   "alternatives, XLA and SGLang's kernels (GPU); "
                   "serve-compare: modes against a baseline from serve_load passes, the ratio taken within each pass "
                   "(median and range), with the widths the server chose")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")
    b.set_defaults(func=cmd_bench)

    from hyspec_jax.serve.server import add_arguments as add_serve_arguments
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, SSE, /metrics)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
                                   "Without --model: the same default as `generate`. SIGTERM drains and exits.")
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)
    from hyspec_jax.train.cli_train import add_train_commands
    add_train_commands(sub)  # build-corpus, train-target, train-drafter
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    tune_cpu_codegen()          # before JAX starts its backend
    from hyspec_jax.io.hf import CheckpointError
    try:
        return args.func(args)
    except (UsageError, ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted")


if __name__ == "__main__":
    sys.exit(main())
