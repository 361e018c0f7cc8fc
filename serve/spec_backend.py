"""Speculative backend: rounds are `hyspec_jax.spec.engine.spec_round_io_jit` (draft → select → verify → accept →
commit, one jitted call per bucket); prefill is chunked here so that it can interleave with rounds.

Per slot the device holds the target state, the drafter's context K/V and (host-side, `Scheduler.last`) the
anchor. A prefill chunk runs the target over the chunk with the drafter's tap layers and appends those
features to the slot's drafter context — chunk by chunk, the same as the engine's one-shot `prefill`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.models.drafter import Drafter, DrafterState, init_drafter_state
from hyspec_jax.models.target import TargetModel
from hyspec_jax.serve.backend import (I32, Backend, StepResult, _gather_target, _rows, _scatter_target,
                                     sample_rows)
from hyspec_jax.spec.engine import SpecEngine, pack_round_inputs, spec_round_io_jit, unpack_round_outputs


def _spec_prefill(tgraph, tparams, dgraph, dparams, state, dstate, slots, tokens, valid, reset, sampling, *,
                  tap_layers):
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter = nnx.merge(dgraph, dparams)
    sub = _gather_target(state, slots, reset)
    idx = jnp.minimum(slots, dstate.batch - 1)
    dsub = DrafterState(keys=_rows(dstate.keys, idx, 1), values=_rows(dstate.values, idx, 1),
                        lengths=jnp.where(reset, 0, _rows(dstate.lengths, idx, 0)))
    logits, taps, sub = target.extend(sub, tokens, valid, last_only=True, tap_layers=tap_layers)
    dsub = drafter.append_context(dsub, taps, jnp.sum(valid, axis=1, dtype=I32))
    first = sample_rows(logits[:, 0], sampling, jnp.zeros(slots.shape, I32))
    put = lambda full, part: full.at[:, slots].set(part.astype(full.dtype), mode="drop")  # noqa: E731
    dstate = DrafterState(keys=put(dstate.keys, dsub.keys), values=put(dstate.values, dsub.values),
                          lengths=dstate.lengths.at[slots].set(dsub.lengths, mode="drop"))
    return first, _scatter_target(state, slots, sub), dstate


_spec_prefill_jit = jax.jit(_spec_prefill, static_argnames=("tgraph", "dgraph", "tap_layers"),
                            donate_argnames=("state", "dstate"))


class SpecBackend(Backend):
    def __init__(self, engine: SpecEngine, target: TargetModel, *, slots: int, max_len: int, prefill_chunk: int):
        self.engine = eng = engine
        self.mode = eng.spec.mode
        self.gamma = eng.round_shape(False).gamma
        # the bucket's verify width: --verify-nodes, else Bole's calibrated B_ver for (slots, KV length), else default
        eng.verify_nodes = eng.nodes_for(slots, max_len + self.gamma + 2)
        self.depth = eng.depth
        super().__init__(target, slots=slots, max_len=max_len, prefill_chunk=prefill_chunk)
        self.tgraph, self.tparams, self.dgraph, self.dparams = eng.tgraph, eng.tparams, eng.dgraph, eng.dparams
        self.graphdef, self.params = self.tgraph, self.tparams
        self.dstate = init_drafter_state(eng.drafter.config, slots, self.kv_len, self.dtype)
        self.shapes_by_flag = {s: eng.round_shape(s) for s in (False, True)}
        self.tap_layers = self.shapes_by_flag[False].tap_layers
        self.capacity = int(eng.spec.capacity or slots * eng.verify_nodes)
        self.drafted = eng.verify_nodes - 1

    @property
    def kv_len(self) -> int:
        return self.max_len + self.gamma + 2     # a round commits at most depth + 1 ≤ γ + 1 tokens past the limit

    def prefill(self, slots, tokens, valid, reset, sampling) -> np.ndarray:
        first, self.state, self.dstate = _spec_prefill_jit(
            self.tgraph, self.tparams, self.dgraph, self.dparams, self.state, self.dstate, np.array(slots, np.int32),
            np.array(tokens, np.int32), np.array(valid, bool), np.array(reset, bool), sampling,
            tap_layers=self.tap_layers)
        return np.asarray(first)

    def step(self, active, last, sampling, steps, stochastic) -> StepResult:
        self.state, self.dstate, _, host_out = spec_round_io_jit(
            self.tgraph, self.tparams, self.dgraph, self.dparams, self.state, self.dstate, np.array(last, np.int32),
            sampling, pack_round_inputs(np.asarray(active, bool), steps, self.capacity, None),
            shape=self.shapes_by_flag[bool(stochastic)])
        toks, count, acc = unpack_round_outputs(np.asarray(host_out))     # one transfer each way
        return StepResult(tokens=toks, count=count, accepted=acc, drafted=self.drafted)

    def _warm_steps(self, progress) -> None:
        B = self.slots
        for stochastic in (False, True):
            t0 = time.perf_counter()
            samp = self.sampling(np.full(B, 1.0 if stochastic else 0.0, np.float32), np.ones(B, np.float32),
                                 np.zeros(B, np.int32), np.zeros(B, np.uint32))
            self.step(np.zeros(B, bool), np.zeros(B, np.int32), samp, np.zeros(B, np.int32), stochastic)
            progress(f"{self.mode} round [{B}, N={self.engine.verify_nodes}, "
                     f"{'sampling' if stochastic else 'greedy'}] {time.perf_counter() - t0:.1f}s")


def build_spec_backend(args, target: TargetModel, model_dir) -> SpecBackend:
    """The engine exactly as `hyspec generate` builds it from the same options (`engine_from_args`), with the
    server's slots as its bucket."""
    import argparse

    from hyspec_jax.spec.engine import engine_from_args
    leaves = jax.tree.leaves(nnx.state(target))
    dtype = leaves[0].dtype if leaves else jnp.float32
    ns = argparse.Namespace(**vars(args))
    ns.slots = args.max_batch
    engine = engine_from_args(ns, target, model_dir, dtype)
    return SpecBackend(engine, target, slots=args.max_batch, max_len=args.max_model_len,
                       prefill_chunk=args.prefill_chunk)
