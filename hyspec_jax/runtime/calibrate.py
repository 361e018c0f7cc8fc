"""Bole's offline calibration (Algorithm 3, steps 1–5): the verification budget of every bucket, and the round
times of every verify width the engine chooses between.

    hyspec calibrate [--model DIR] [--batch 1,4,8] [--kv-len 1024] [--nodes 1,2,4,8,16,32,64]
                     [--depth 8] [--eps 0.1] [--repeats 20] [--out FILE] [--json]
                     [--drafter DIR] [--spec-mode M] [speculative options of `hyspec generate`]
    python -m hyspec_jax.runtime.calibrate ...          (same options)

For each bucket (batch slots B, KV length S) it measures
  T_dec(B, S)      one-token decode of every slot (`TargetModel.extend`, T = 1, state donated and fed back),
  T_ver(N | B, S)  the complete target verify forward over a [B, N] forest (`TargetModel.verify`, logits and
                   commit factors, with the kernels of --kernels; tree template: a seeded random tree of depth
                   min(d, N−1), the same for every row), for every node capacity N,
each as the median of `repeats` timed calls after a warm-up call (block_until_ready; the prefix holds S/2
committed tokens), and stores B_ver = max{N : T_ver(N) ≤ (1+ε)·T_dec} in a JSON table keyed by device kind,
model and bucket (`hyspec_jax.spec.budget.BudgetTable`; existing entries of other buckets are kept).
`hyspec generate --budget-table FILE` then verifies B_ver nodes per slot.

With a drafter — the speculative engine `hyspec generate` builds from the same options (the embedded model: its
drafter and recommended settings) — it also times the engine's own round program (draft, select, verify with the
kernels it runs, accept, commit) at every width bucket w of `hyspec_jax.runtime.width` (w = 1: plain decoding) for
every slot; each timed call is one round's dispatch and host read, after a prefill of the slots with half the KV
length (a power of two), as the median of `repeats` rounds after a warm-up round, the widths interleaved. They go
to the entry's `t_round_ms` under the round's signature (mode, draft shape, kernels, deferred commit); the engine
then chooses the width of every round from them (`SpecConfig.adaptive_width`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return sorted(set(out))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="target model directory (default: as `hyspec generate`)")
    p.add_argument("--batch", type=_ints, default=[1, 4, 8], metavar="B,..", help="batch-slot buckets (default 1,4,8)")
    p.add_argument("--kv-len", type=_ints, default=[1024], metavar="S,..", help="KV-length buckets (default 1024)")
    p.add_argument("--nodes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], metavar="N,..",
                   help="compiled node capacities per slot, anchor included (default 1,2,4,8,16,32,64)")
    p.add_argument("--depth", type=int, default=8, metavar="D", help="tree depth template (default 8)")
    p.add_argument("--eps", type=float, default=0.1, metavar="E", help="admitted latency overhead ε (default 0.1)")
    p.add_argument("--repeats", type=int, default=20, metavar="R", help="timed calls per measurement (default 20)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="parameter dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--out", metavar="FILE", help="budget table to create or update (default: DIR/budget.json)")
    p.add_argument("--json", action="store_true", help="print the new entries as JSON")
    from hyspec_jax.spec.options import add_spec_arguments
    add_spec_arguments(p)


# ------------------------------------------------------------------------------------------------
# Timing (shared with bench/verify_scale.py: one home for how T_dec and T_ver are measured)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall times of one program: the median of the timed calls, every timed call, and the first call.

    `first_s` is the first warm-up call: trace + compile + run for a plain jitted function, just a run (plus
    one-time autotuning / module load) for a program compiled ahead of time."""
    median_s: float
    times_s: tuple[float, ...]
    first_s: float

    @property
    def spread(self) -> float:
        """(max − min) / median of the timed calls: how much to trust a difference between two medians."""
        return (max(self.times_s) - min(self.times_s)) / self.median_s if self.median_s > 0 else float("nan")


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                before: Callable[[], Any] | None = None) -> tuple[Timing, Any]:
    """Time `fn()`: `warmup` untimed calls (compiles and first-touch costs stay out of the timing), then `repeats`
    calls each timed with block_until_ready (JAX dispatches asynchronously: without it the clock stops at
    dispatch). `before()` runs untimed ahead of every call (e.g. restoring a donated state); it is
    waited for before the clock starts. Returns (Timing, the last call's output)."""
    import jax

    if repeats < 1 or warmup < 1:
        raise ValueError(f"repeats and warmup must be ≥ 1, got repeats={repeats}, warmup={warmup}")
    first, times, out = 0.0, [], None
    for i in range(warmup + repeats):
        if before is not None:
            jax.block_until_ready(before())
        out = None                                   # drop the previous output before the next call
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        dt = time.perf_counter() - t0
        if i == 0:
            first = dt
        elif i >= warmup:
            times.append(dt)
    return Timing(statistics.median(times), tuple(times), first), out


def time_decode(decode: Callable, params, state, tokens, *, repeats: int, warmup: int = 1):
    """T_dec: one-token decode of every slot, `decode(params, state, tokens [B,1], valid [B,1]) -> (logits,
    state)` with the state DONATED and fed back (`target.extend` / `sharding.jit_extend`). Every call starts
    from the same committed lengths (restored untimed before each call, in the lengths' own sharding).
    Consumes `state`; returns (Timing, last logits, last state)."""
    import jax
    import jax.numpy as jnp

    # Commit every input to where it already is: the outputs fed back are committed, and a jitted function
    # recompiles when an argument changes from uncommitted to committed (it would in the timed calls).
    commit = lambda x: jax.device_put(x, x.sharding)
    state = jax.tree.map(commit, state)
    tokens = commit(jnp.asarray(tokens))
    valid = jax.device_put(jnp.ones(tokens.shape, bool), tokens.sharding)
    lengths = np.asarray(state.lengths)
    sharding = state.lengths.sharding
    box = {"s": state}

    def before():
        box["s"] = box["s"].replace(lengths=jax.device_put(lengths, sharding))
        return box["s"].lengths

    def call():
        logits, box["s"] = decode(params, box["s"], tokens, valid)
        return logits

    timing, logits = median_time(call, repeats, warmup, before=before)
    return timing, logits, box["s"]


def time_verify(verify: Callable, params, state, tree, tokens, *, repeats: int, warmup: int = 1):
    """T_ver: the complete target verify forward, `verify(params, state, tree, tokens [B,N]) -> (logits,
    cache)` (`target.verify` / `sharding.jit_verify`; the committed state is read, never written).
    Returns (Timing, last (logits, cache))."""
    return median_time(lambda: verify(params, state, tree, tokens), repeats, warmup)


def template_tree(rng: np.random.Generator, nodes: int, depth: int, batch: int):
    """The verify tree of a capacity: a seeded random tree of `nodes` nodes (anchor included) and depth
    exactly min(depth, nodes − 1), the same for every one of `batch` rows."""
    from hyspec_jax import tree as tree_lib

    d = min(depth, nodes - 1)
    par = tree_lib.random_parents(rng, nodes, max_depth=d, min_depth=d)
    return tree_lib.pack_forest([par] * batch, tree_lib.TreeShape(nodes, d))


@dataclasses.dataclass(frozen=True)
class CalibrationSweep:
    """What `hyspec calibrate` measures: every bucket (batch slots × KV length), T_ver at every node capacity over
    a template tree `depth` deep, B_ver within (1 + eps)·T_dec, each time the median of `repeats` calls; kernel_impl:
    the verify's kernels (`hyspec_jax.kernels`; `hyspec calibrate` passes --kernels, auto by default, as the
    engine runs)."""
    batches: tuple[int, ...]
    kv_lens: tuple[int, ...]
    nodes: tuple[int, ...]
    depth: int
    eps: float
    repeats: int
    kernel_impl: str = "reference"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CalibrationSweep":
        """The sweep of `hyspec calibrate`'s options (`add_arguments`)."""
        return cls(batches=tuple(args.batch), kv_lens=tuple(args.kv_len), nodes=tuple(args.nodes), depth=args.depth,
                   eps=args.eps, repeats=args.repeats, kernel_impl=args.kernels)


def calibrate(model, sweep: CalibrationSweep, *, model_name: str, log=print) -> list[dict]:
    """Measure every bucket of the sweep; returns table entries (see module docstring)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.models import target as target_lib
    from hyspec_jax.spec.budget import b_ver
    from hyspec_jax.state import init_state

    cfg = model.config
    graphdef, params = nnx.split(model)
    dtype = jax.tree.leaves(params)[0].dtype
    device_kind = jax.devices()[0].device_kind
    decode = functools.partial(target_lib.extend_jit, graphdef)              # state donated
    verify = jax.jit(lambda p, st, tree, toks: nnx.merge(graphdef, p).verify(st, tree, toks,
                                                                             kernel_impl=sweep.kernel_impl)[::2])
    rng = np.random.default_rng(0)
    entries = []
    depth, eps, repeats = sweep.depth, sweep.eps, sweep.repeats
    for B in sweep.batches:
        for S in sweep.kv_lens:
            if S <= max(sweep.nodes) + 1:
                raise ValueError(f"kv_len {S} too short for node capacity {max(sweep.nodes)}")
            base = init_state(cfg, B, S, dtype)
            base = base.replace(lengths=jnp.full((B,), S // 2, jnp.int32))
            tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
            t_dec = time_decode(decode, params, jax.tree.map(jnp.copy, base), tok, repeats=repeats)[0].median_s
            t_ver = {}
            for N in sweep.nodes:
                tree = template_tree(rng, N, depth, B)
                toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, N)), jnp.int32)
                t_ver[N] = time_verify(verify, params, base, tree, toks, repeats=repeats)[0].median_s
                log(f"[calibrate] B={B} S={S} N={N:<4d} T_ver={1e3 * t_ver[N]:8.3f} ms  "
                    f"({t_ver[N] / t_dec:5.2f}× T_dec={1e3 * t_dec:.3f} ms)")
            n, within = b_ver(t_ver, t_dec, eps)
            entries.append(dict(device_kind=device_kind, model=model_name, batch=B, kv_len=S, max_depth=depth,
                                eps=eps, t_dec_ms=round(1e3 * t_dec, 4),
                                t_ver_ms={str(k): round(1e3 * v, 4) for k, v in t_ver.items()},
                                b_ver=n, within_tolerance=within, dtype=str(jnp.dtype(dtype)),
                                jax_version=jax.__version__, repeats=repeats))
            log(f"[calibrate] B={B} S={S}: B_ver = {n}" + ("" if within else " (no capacity within ε)"))
    return entries


def calibrate_rounds(engine, sweep: CalibrationSweep, *,
                     log=print) -> dict[tuple[int, int], tuple[str, dict[str, float]]]:
    """The engine's round time at every width bucket of the sweep's buckets (see the module docstring): {(B, S):
    (round signature, {width: ms})}, timed by `runtime.width.time_widths` (the widths interleaved, `sweep.repeats`
    rounds each), each repeat after a fresh prefill of the slots (untimed)."""
    from hyspec_jax.runtime.width import round_signature, time_widths

    out = {}
    for B in sweep.batches:
        for S in sweep.kv_lens:
            T = 1 << max(0, (S // 2).bit_length() - 1)            # the prefix: the power of two ≤ S / 2
            be = engine.width_backend(B, S, None, shapes=[(B, T)])
            widths = sorted(be.widths)
            if T > engine.max_prompt_len(S) or S - be.overshoot - T - len(widths) * (be.depth + 1) < 0:
                raise ValueError(f"kv_len {S} too short for a {T}-token prefix and {len(widths)} rounds of "
                                 f"{be.depth + 1} tokens")
            sig = round_signature(engine.spec.mode, be.widths[widths[-1]][False], engine.spec.deferred_rows)
            rng = np.random.default_rng(B * 7919 + S)
            z = np.zeros(B, np.float32)
            samp = be.sampling(z, np.ones(B, np.float32), z.astype(np.int32), z.astype(np.uint32))
            t0 = time.perf_counter()
            # every width's round compiled first by the backend's start-up compile: side by side where
            # $HYSPEC_COMPILE_WORKERS allows (the CPU default; one after another on a GPU, see compile_workers)
            be.compile(stochastic=(False,), prompt_lengths=[T])
            log(f"[calibrate] B={B} S={S}: compiled {len(widths)} rounds in {time.perf_counter() - t0:.1f} s")

            def prefill() -> None:       # the slots afresh with a T-token prefix, waited for: not in a round's time
                prompt = rng.integers(0, engine.config.vocab_size, (B, T))
                np.asarray(be.prefill(np.arange(B, dtype=np.int32), prompt, np.ones((B, T), bool), np.ones(B, bool),
                                      samp))
            seconds = time_widths(be, np.ones(B, bool), sweep.repeats, before_repeat=prefill)
            ms = {str(w): round(1e3 * seconds[w], 4) for w in widths}
            for w in widths:
                log(f"[calibrate] B={B} S={S} {sig} width {w:<4d} round {ms[str(w)]:8.3f} ms")
            out[(B, S)] = (sig, ms)
    return out


def run(args) -> int:
    """`hyspec calibrate`."""
    from hyspec_jax.launch import UsageError, resolve_model_dir

    if not 0 <= args.eps <= 10:
        raise UsageError(f"--eps must be in [0, 10], got {args.eps}")
    if args.repeats < 1 or args.depth < 0:
        raise UsageError("--repeats must be >= 1 and --depth >= 0")
    model_dir, label = resolve_model_dir(args.model)
    if label:
        print(f"[hyspec] using a {label}", file=sys.stderr)

    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.spec.budget import BudgetTable, model_id

    from hyspec_jax.config import resolve_dtype
    dtype = resolve_dtype(args.dtype)
    cfg, model = load_pretrained(model_dir, dtype=dtype)
    out = Path(args.out) if args.out else Path(model_dir) / "budget.json"
    table = BudgetTable.load(out) if out.is_file() else BudgetTable()
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    sweep = CalibrationSweep.from_args(args)
    entries = calibrate(model, sweep, model_name=model_id(cfg, Path(model_dir).name), log=log)
    from hyspec_jax.launch import engine_from_args
    engine = engine_from_args(args, model, model_dir, dtype)
    if engine is None:
        log("[calibrate] plain decoding (no drafter): no round times")
    else:
        rounds = calibrate_rounds(engine, sweep, log=log)
        for e in entries:
            sig, ms = rounds[(e["batch"], e["kv_len"])]
            e["t_round_ms"] = {sig: ms}
    for e in entries:
        table.add(e)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.save(out)
    print(f"[calibrate] wrote {len(entries)} bucket(s) to {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(entries))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hyspec calibrate", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
