"""Where a speculative round's time goes: the round split into its phases, and kernel counts by named scope.

- `phase_times(engine, prompts, params)` times one round — `round_draft` (draft, build, select), `round_verify`
  (the target's verify forward), `round_commit` (accept + commit of target and drafter), each jitted on its own —
  against the fused round (`spec_round_jit`, as `generate` runs it); `hyspec generate --phase-times` prints it
  (`format_phase_times`).
- `round_kernels(engine, prompts, params)` counts the kernels of the compiled fused round by named scope.

Both start from the engine state after the prefill of `prompts` (the first `slots` of them, admitted at once as
`generate` admits them; the same bucket).
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hyspec_jax.compilation import kernel_count, kernel_count_by_scope
from hyspec_jax.runtime.backend import bucket
from hyspec_jax.runtime.programs import ar_step_jit, spec_round_io_jit
from hyspec_jax.sampling import SamplingParams, SlotSampling
from hyspec_jax.runtime.engine import Engine, validate_prompts
from hyspec_jax.spec.round import (ROUND_SCOPES, SlotState, StepInputs, round_commit_jit, round_draft_jit,
                                   round_verify_jit, spec_round_jit)


def round_inputs(engine: Engine, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams], what: str) -> dict:
    """The inputs of one round after the prefill of `prompts` (the first `slots` of them, admitted at once; the
    bucket `generate` would use): backend, shape, admit, k, state, dstate, anchor, active, sampling, steps,
    capacity."""
    if engine.spec.mode == "ar":
        raise ValueError(f"{what} need a speculative mode (ar has no draft / verify / commit)")
    if not prompts:
        raise ValueError(f"{what} need at least one prompt")
    plist = validate_prompts(prompts, params, engine.config.vocab_size)
    B, S = engine.bucket_for(prompts, plist)
    k = min(len(prompts), B)
    T = bucket(max(len(p) for p in prompts[:k]))
    be = engine.backend(B, S, shapes=[(B, T)])
    slots = np.where(np.arange(B) < k, np.arange(B), B).astype(np.int32)
    toks, val = np.zeros((B, T), np.int32), np.zeros((B, T), bool)
    for b in range(k):
        toks[b, :len(prompts[b])], val[b, :len(prompts[b])] = prompts[b], True
    sampling = SlotSampling.from_params(list(plist[:k]) + [SamplingParams()] * (B - k), B)
    np.asarray(be.prefill(slots, toks, val, np.arange(B) < k, sampling))     # done before any phase is timed
    admit = np.arange(B) < k
    shape = be.round_shapes[any(p.temperature > 0 for p in plist[:k])]
    host = StepInputs.pack(admit, admit.astype(np.int32), be.capacity)
    return dict(backend=be, B=B, S=S, N=be.verify_nodes, shape=shape, admit=admit, k=k,
                slots=SlotState(be.state, be.dstate), anchor=be.anchor, sampling=sampling,
                inputs=StepInputs(jnp.asarray(host), sampling), capacity=be.capacity)


def _step_inputs(x: dict) -> StepInputs:
    """A plain decoding step's inputs over the admitted slots (step 0), for its kernel count."""
    return StepInputs(StepInputs.pack(x["admit"], np.zeros(x["B"], np.int32)), x["sampling"])


def phase_times(engine: Engine, prompts: Sequence[Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams], repeats: int = 5, warmup: int = 1) -> dict:
    """Median of `repeats` calls after `warmup` of each phase jitted alone and of the fused round, each with
    block_until_ready; donated inputs (fused round, commit) are restored untimed before each call.

    Returns {"draft_ms", "verify_ms", "commit_ms", "kernels" (`compilation.kernel_count` of each phase, the
    fused round and one plain decoding step of the same bucket), "sum_ms", "round_ms", "sum_over_round",
    "identical" (the split round's committed tokens, counts, accepted and anchors equal the fused round's),
    "state_identical" (its new target and drafter states too, bit for bit: XLA may fuse across the phase
    boundaries differently), "mode", "batch", "kv_len", "verify_nodes", "active", "repeats"}. The split pieces are
    extra programs: they count in the engine's `compilations_after_startup`."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    x = round_inputs(engine, prompts, params, "phase times")
    shape, slots, anchor, inputs = x["shape"], x["slots"], x["anchor"], x["inputs"]
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731
    tg, tp, dg, dp = engine.tgraph, engine.tparams, engine.dgraph, engine.dparams
    box = {}

    def timed(fn, before=None) -> tuple[float, object]:
        times, out = [], None
        for i in range(warmup + repeats):
            if before is not None:
                jax.block_until_ready(before())
            out = None
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn())
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(times)), out

    def restore():
        box["s"] = copy(slots)
        return box["s"]

    t_draft, draft = timed(lambda: round_draft_jit(tg, tp, dg, dp, slots, anchor, inputs, shape=shape))
    t_verify, verified = timed(lambda: round_verify_jit(tg, tp, slots.target, draft, shape=shape))
    t_commit, split = timed(lambda: round_commit_jit(dg, dp, box["s"], anchor, inputs, draft, verified, shape=shape),
                            before=restore)
    t_round, fused = timed(lambda: spec_round_jit(tg, tp, dg, dp, box["s"], anchor, inputs, shape=shape),
                           before=restore)
    same = lambda xs, ys: all(bool(np.array_equal(np.asarray(a), np.asarray(b)))  # noqa: E731
                              for a, b in zip(jax.tree.leaves(xs), jax.tree.leaves(ys)))
    identical = same(split[1:], fused[1:])            # anchor, and the round's output: tokens, count, accepted
    state_identical = same(split[0], fused[0])        # target and drafter states, bit for bit
    total = t_draft + t_verify + t_commit
    B = x["B"]
    kernels = dict(
        draft=kernel_count(round_draft_jit.lower(tg, tp, dg, dp, slots, anchor, inputs, shape=shape)),
        verify=kernel_count(round_verify_jit.lower(tg, tp, slots.target, draft, shape=shape)),
        commit=kernel_count(round_commit_jit.lower(dg, dp, slots, anchor, inputs, draft, verified, shape=shape)),
        round=kernel_count(spec_round_jit.lower(tg, tp, dg, dp, slots, anchor, inputs, shape=shape)),
        ar_step=kernel_count(ar_step_jit.lower(tg, tp, SlotState(slots.target), anchor, _step_inputs(x),
                                               stochastic=shape.stochastic)))
    return dict(draft_ms=round(t_draft, 4), verify_ms=round(t_verify, 4), commit_ms=round(t_commit, 4),
                kernels=kernels, sum_ms=round(total, 4), round_ms=round(t_round, 4),
                sum_over_round=round(total / t_round, 4) if t_round > 0 else float("nan"),
                identical=identical, state_identical=state_identical, mode=engine.spec.mode, batch=B,
                kv_len=x["S"], verify_nodes=x["N"], active=x["k"], repeats=repeats)


def round_kernels(engine: Engine, prompts: Sequence[Sequence[int]],
                  params: SamplingParams | Sequence[SamplingParams], hlo_path: str | None = None) -> dict:
    """Kernels of the compiled fused round (`spec_round_io_jit`, the program `generate` runs for these prompts'
    bucket) by named scope (`compilation.kernel_count_by_scope`: draft/drafter_forward, draft/tree_build, verify,
    commit, ...), and of one plain decoding step of the same bucket: {"round": {scope: n}, "round_total",
    "ar_step"}. Compiles on this backend; runs nothing but the prefill. hlo_path: also write the compiled round's
    HLO text there."""
    x = round_inputs(engine, prompts, params, "round kernels")
    shape = x["shape"]
    text = spec_round_io_jit.lower(engine.tgraph, engine.tparams, engine.dgraph, engine.dparams, x["slots"],
                                   x["anchor"], x["inputs"], shape=shape).compile().as_text()
    if hlo_path is not None:
        with open(hlo_path, "w") as f:
            f.write(text)
    scopes = kernel_count_by_scope(text, ROUND_SCOPES)
    ar = kernel_count(ar_step_jit.lower(engine.tgraph, engine.tparams, SlotState(x["slots"].target), x["anchor"],
                                        _step_inputs(x), stochastic=shape.stochastic))
    return {"round": dict(sorted(scopes.items(), key=lambda kv: -kv[1])), "round_total": sum(scopes.values()),
            "ar_step": ar}


def format_phase_times(pt: dict) -> str:
    """`phase_times` as the lines `hyspec generate --phase-times` prints to stderr."""
    head = (f"[hyspec] round phases ({pt['mode']}, {pt['active']} request(s) in {pt['batch']} slot(s), "
            f"KV {pt['kv_len']}, N={pt['verify_nodes']}; median of {pt['repeats']}, each phase jitted alone):")
    lines = [head] + [f"[hyspec]   {name:<7} {pt[key]:10.3f} ms" for name, key in
                      (("draft", "draft_ms"), ("verify", "verify_ms"), ("commit", "commit_ms"))]
    lines.append(f"[hyspec]   sum     {pt['sum_ms']:10.3f} ms  vs fused round {pt['round_ms']:.3f} ms "
                 f"(sum/fused {pt['sum_over_round']:.2f}; split outputs "
                 f"{'identical' if pt['identical'] else 'DIFFER'}, states "
                 f"{'bit-identical' if pt['state_identical'] else 'differ in rounding'})")
    if pt.get("kernels"):
        k = pt["kernels"]
        lines.append(f"[hyspec]   kernels (compiled; loops per iteration): draft {k['draft']}, verify {k['verify']}, "
                     f"commit {k['commit']}, fused round {k['round']}; one plain decoding step {k['ar_step']}")
    return "\n".join(lines)
