"""The speculative engine: one jitted draft → select → verify → accept → commit round per bucket (DESIGN §2, §7).

Per slot the device holds the target's committed state (`TargetState`), the drafter's context K/V
(`DrafterState`, same committed length) and the anchor — the last token the target chose, not processed yet.
One round (`spec_round`, compiled once per bucket: batch slots B, verify width N, KV length S; state donated):

  draft    one DSpark block from the context K/V + anchor (`ready` modes: the reader reads TargetState.ssm)
  build    chain [anchor, x₀..x_{γ−1}] (optionally cut by DSpark's confidence) or a beam tree (`spec.select`)
  select   Bole's batch-shared budget: anchor + root child of every active slot, then the batch-wide best
           scores, ≤ N per row, ≤ C in all (`spec.budget.select_nodes`); compacted to a [B, N] forest
  verify   one target forward over the forest from the committed state, with the drafter's tap layers
  accept   greedy matching or lossless recursive rejection sampling (`spec.accept`)
  commit   target: factorized commit of the root-to-accepted path (`spec.commit.commit`); drafter: context
           K/V of the path's target taps (anchor + accepted drafts) appended; next anchor = the bonus token.

The host loop (`SpecEngine.generate`) only admits requests into free slots (one jitted prefill that also fills
the drafter context), runs rounds, streams the committed tokens and finishes requests (stop token inside the
accepted path, or max_tokens — both exact). It is pipelined: the next round is dispatched before the host
reads the one in flight, except where a request could reach max_tokens in that round or hints are given (a
stop token costs one discarded round of its slot). Modes: `ar` (plain decoding, `generate.Generator`), `chain`
(DSpark), `ready` (DSpark + ReaDy reader), `tree` (DSpark tree, Bole verification), `tree-ready`.

Start-up: `SpecEngine.warmup()` / `compile_buckets(buckets)` compile every configured bucket (the round,
greedy and sampling, and the prefill of every prompt bucket) through JAX's persistent compilation cache;
`compilations_after_startup` (also in `SpecStats`) counts the XLA compilations since — 0 while every request
fits a compiled bucket.

Statistics (`SpecStats` of the last `generate`, `hyspec generate --stats` / `--json`): rounds, τ, accepted
drafts per position, ReaDy's censored prefix survival (`prefix_survival`: the last round of each request
censored), times. Where a round's time goes: `SpecEngine.phase_times` times the round's three phases —
`round_draft` (draft, build, select), `round_verify`, `round_commit` (accept + commit), the functions
`spec_round` composes — each jitted alone, against the fused round (`hyspec generate --phase-times`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax import tree as tree_lib
from hyspec_jax.compilation import CompileWatch, DiskCachedJit, split_for_jit
from hyspec_jax.generate import (Generator, bucket, compile_progress, prompt_buckets, start_host_copy,
                                 use_compilation_cache, validate_prompts)
from hyspec_jax.models.drafter import DraftBlock, Drafter, DrafterState, init_drafter_state, target_heads
from hyspec_jax.models.target import TargetModel
from hyspec_jax.sampling import SamplingParams, SlotSampling, sample
from hyspec_jax.spec.accept import accept
from hyspec_jax.spec.budget import BudgetTable, confident_length, model_id, root_floor, select_nodes
from hyspec_jax.spec.commit import commit
from hyspec_jax.spec.propose import chain_from_block
from hyspec_jax.spec.select import TreeSpec, chain_candidates, tree_candidates
from hyspec_jax.spec.stats import prefix_survival, rounded
from hyspec_jax.state import TargetState, init_state

I32 = jnp.int32
F32 = jnp.float32
from hyspec_jax.spec.options import KERNEL_IMPLS, MODES  # noqa: E402  (one home for the option values)
HINT_BIAS = 1.0e3   # added to the drafter's base logits at hinted tokens (see `spec_round`)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """User-level speculation settings (the engine derives the static round shape from them)."""
    mode: str = "chain"
    chain_length: int | None = None          # drafts per chain (default γ of the drafter)
    tree: TreeSpec | None = None             # tree modes (default: depth min(γ, 4), top-k 2, beam 4)
    verify_nodes: int | None = None          # N: verify width per slot, anchor included (e.g. Bole's B_ver)
    capacity: int | None = None              # C: batch-wide node budget (default B·N)
    confidence_threshold: float | None = None  # chain: DSpark confidence-scheduled length
    method: str = "squaring"                 # tree-solve inverse method
    kernels: str = "auto"                # Pallas top-k, tree solve, tree attention, commit where supported (GPU)

    def __post_init__(self):
        if self.kernels not in KERNEL_IMPLS:
            raise ValueError(f"kernels must be one of {KERNEL_IMPLS}, got {self.kernels!r}")
        if self.mode not in MODES:
            raise ValueError(f"spec mode must be one of {MODES}, got {self.mode!r}")
        if self.chain_length is not None and self.chain_length < 1:
            raise ValueError("chain_length must be >= 1")
        if self.verify_nodes is not None and self.verify_nodes < 1:
            raise ValueError("verify_nodes must be >= 1")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError("capacity must be >= 1")
        if self.confidence_threshold is not None and not 0.0 <= self.confidence_threshold <= 1.0:
            raise ValueError("confidence_threshold must be in [0, 1]")

    @property
    def is_tree(self) -> bool:
        return self.mode in ("tree", "tree-ready")

    @property
    def uses_reader(self) -> bool:
        return self.mode in ("ready", "tree-ready")


@dataclasses.dataclass(frozen=True)
class RoundShape:
    """Static part of a compiled round (hashable)."""
    tree: TreeSpec | None       # None = chain
    gamma: int                  # chain drafts
    verify_nodes: int           # N
    reader: bool
    stochastic: bool            # False: every slot greedy (no draft distributions are kept)
    confidence_threshold: float | None
    method: str
    tap_layers: tuple[int, ...]
    kernel_impl: str = "reference"

    @property
    def depth(self) -> int:
        d = self.tree.depth if self.tree is not None else self.gamma
        return max(0, min(d, self.verify_nodes - 1))

    @property
    def max_children(self) -> int:
        return self.tree.top_k if self.tree is not None else 1


def _slot_keys(seed: jax.Array, steps: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seed, steps)


def _fold(keys: jax.Array, i: int) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, M, ...] at idx [B, N] -> [B, N, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def round_draft(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                state: TargetState, dstate: DrafterState, anchor: jax.Array, active: jax.Array,
                sampling: SlotSampling, steps: jax.Array, capacity: jax.Array, hint: jax.Array | None = None, *,
                shape: RoundShape):
    """Round phase 1 — draft, build, select (see `spec_round`): (tokens [B, N], tree, child_q [B, N, …] or
    None) — the [B, N] forest the target verifies and, when sampling, the draft distribution of each node."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter = nnx.merge(dgraph, dparams)
    heads = target_heads(target)
    N, D = shape.verify_nodes, shape.depth
    samp = sampling if shape.stochastic else None
    dkeys = _fold(_slot_keys(sampling.seed, steps), 0)

    with jax.named_scope("drafter_forward"):
        block = drafter.draft(dstate, anchor, heads, state.ssm if shape.reader else None,
                              num_slots=shape.gamma)   # the slots a chain / tree reads (no unused LM heads)
    if hint is not None:
        G, V = block.logits.shape[1], block.logits.shape[2]
        h = hint[:, :G]
        bonus_logits = jnp.where((jnp.arange(V)[None, None] == h[..., None]) & (h[..., None] >= 0), HINT_BIAS, 0.0)
        block = DraftBlock(hidden=block.hidden, logits=block.logits + bonus_logits)
    if shape.tree is None:
        G = shape.gamma
        block = DraftBlock(hidden=block.hidden[:, :G], logits=block.logits[:, :G])
        prop = chain_from_block(drafter, block, anchor, samp, dkeys if samp is not None else None)
        length = (None if shape.confidence_threshold is None
                  else confident_length(prop.confidence, shape.confidence_threshold))
        cand = chain_candidates(prop, anchor, length, samp)
    else:
        with jax.named_scope("tree_build"):
            cand = tree_candidates(drafter, block, anchor, shape.tree, samp, dkeys if samp is not None else None,
                                   kernel_impl=shape.kernel_impl)
    valid = cand.valid & active[:, None]
    forced = root_floor(cand.score, cand.parent, valid, active)
    sel = select_nodes(cand.score, cand.parent, cand.depth, valid, forced, N, capacity)
    tokens = jnp.where(sel.valid, jnp.take_along_axis(cand.token, sel.index, axis=1), 0)
    tree = tree_lib.Tree(parent=sel.parent, valid=sel.valid, depth=sel.depth,
                         envelope=tree_lib.TreeShape(N, D))
    child_q = None if samp is None else _gather(cand.child_q, sel.index)
    return tokens, tree, child_q


def round_verify(tgraph: nnx.GraphDef, tparams: nnx.State, state: TargetState, tree: tree_lib.Tree,
                 tokens: jax.Array, *, shape: RoundShape):
    """Round phase 2 — the target's verify forward over the forest: (logits, taps, TreeCache)."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    return target.verify(state, tree, tokens, method=shape.method, tap_layers=shape.tap_layers,
                         kernel_impl=shape.kernel_impl)


def round_commit(dgraph: nnx.GraphDef, dparams: nnx.State, state: TargetState, dstate: DrafterState,
                 anchor: jax.Array, active: jax.Array, sampling: SlotSampling, steps: jax.Array,
                 tokens: jax.Array, tree: tree_lib.Tree, child_q: jax.Array | None, logits: jax.Array,
                 taps: jax.Array, cache, *, shape: RoundShape):
    """Round phase 3 — accept, then commit target and drafter: `spec_round`'s return value."""
    drafter: Drafter = nnx.merge(dgraph, dparams)
    B = anchor.shape[0]
    D = shape.depth
    samp = sampling if shape.stochastic else None
    akeys = _fold(_slot_keys(sampling.seed, steps), 1)
    acc = accept(logits, tokens, tree.parent, tree.valid, child_q, samp, akeys if samp is not None else None,
                 max_depth=D, max_children=shape.max_children)

    node = jnp.where(active, acc.node, -1)
    new_state = commit(state, cache, tree, node, shape.kernel_impl)
    path, length = tree_lib.path_to(tree, node)                                   # [B, D+1], [B]
    src = jnp.maximum(path, 0)
    path_taps = jnp.take_along_axis(taps, src[None, :, :, None], axis=2)          # [L, B, D+1, H]
    new_dstate = drafter.append_context(dstate, path_taps, length)

    m = acc.num_accepted
    path_tokens = jnp.take_along_axis(tokens, src, axis=1)                        # anchor, accepted drafts
    out = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), I32)], axis=1)
    out = jnp.where(jnp.arange(D + 1)[None] == m[:, None], acc.bonus[:, None], out)
    count = jnp.where(active, m + 1, 0)
    return new_state, new_dstate, jnp.where(active, acc.bonus, anchor), out, count, m


def spec_round(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
               state: TargetState, dstate: DrafterState, anchor: jax.Array, active: jax.Array,
               sampling: SlotSampling, steps: jax.Array, capacity: jax.Array, hint: jax.Array | None = None, *,
               shape: RoundShape):
    """One speculative round for every slot. Returns (state, dstate, anchor, tokens [B, D+1], count [B],
    accepted [B]): slot b committed tokens[b, :count[b]] (its accepted drafts, then the bonus token, which is
    also the new anchor). Inactive slots are untouched (count 0).

    steps [B]: per-slot round counters (PRNG: a slot's randomness never depends on its neighbours);
    capacity: batch-wide node budget (runtime scalar); hint [B, γ] int (−1 = none): optional token hints
    added to the drafter's base logits at each block slot (an oracle / prompt-lookup hook; drafts stay
    drafts — acceptance is unchanged and still lossless, because the hinted q is the q drawn from).

    The three phases are `round_draft` → `round_verify` → `round_commit` (composed here into one program;
    `SpecEngine.phase_times` jits and times them one by one).
    """
    # named scopes: each phase's kernels carry its name in profiles and in the compiled HLO's op names
    with jax.named_scope("draft"):
        tokens, tree, child_q = round_draft(tgraph, tparams, dgraph, dparams, state, dstate, anchor, active,
                                            sampling, steps, capacity, hint, shape=shape)
    with jax.named_scope("verify"):
        logits, taps, cache = round_verify(tgraph, tparams, state, tree, tokens, shape=shape)
    with jax.named_scope("commit"):
        return round_commit(dgraph, dparams, state, dstate, anchor, active, sampling, steps, tokens, tree, child_q,
                            logits, taps, cache, shape=shape)


def spec_round_io(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
                  state: TargetState, dstate: DrafterState, anchor: jax.Array, sampling: SlotSampling,
                  host_in: jax.Array, *, shape: RoundShape):
    """`spec_round` with its per-round host inputs packed in one int32 array and its host outputs in another, so
    a round moves one array each way (each transfer costs tens of µs of host time beside a GPU: a visible part
    of a launch-bound batch-1 round). host_in [B, 3 + g]: active (0/1), steps, capacity (read from row 0),
    then g hint columns (g = 0: no hints). Returns (state, dstate, anchor, host_out [B, D + 3]: the committed
    tokens [D + 1], count, accepted)."""
    hint = host_in[:, 3:] if host_in.shape[1] > 3 else None
    state, dstate, anchor, toks, count, acc = spec_round(
        tgraph, tparams, dgraph, dparams, state, dstate, anchor, host_in[:, 0] > 0, sampling, host_in[:, 1],
        host_in[0, 2], hint, shape=shape)
    host_out = jnp.concatenate([toks.astype(I32), count.astype(I32)[:, None], acc.astype(I32)[:, None]], axis=1)
    return state, dstate, anchor, host_out


def pack_round_inputs(active: np.ndarray, steps: np.ndarray, capacity: int, hint: np.ndarray | None) -> np.ndarray:
    """`spec_round_io`'s host_in [B, 3 + g] int32 (hint [B, g] or None)."""
    B = len(active)
    g = 0 if hint is None else hint.shape[1]
    host = np.empty((B, 3 + g), np.int32)
    host[:, 0], host[:, 1], host[:, 2] = active, steps, capacity
    if g:
        host[:, 3:] = hint
    return host


def unpack_round_outputs(host_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [B, D + 1], count [B], accepted [B]) from `spec_round_io`'s host_out."""
    return host_out[:, :-2], host_out[:, -2], host_out[:, -1]


# the named scopes of `spec_round` (`SpecEngine.round_kernels` counts kernels by them)
ROUND_SCOPES = ("draft/drafter_forward", "draft/tree_build", "draft", "verify", "commit")

spec_round_jit = DiskCachedJit(spec_round, name="spec_round", static_argnames=("tgraph", "dgraph", "shape"),
                               donate_argnames=("state", "dstate"))
spec_round_io_jit = DiskCachedJit(spec_round_io, name="spec_round_io", static_argnames=("tgraph", "dgraph", "shape"),
                                  donate_argnames=("state", "dstate"))
# the phases jitted alone (`SpecEngine.phase_times`); the commit donates the states as the fused round does
round_draft_jit = jax.jit(round_draft, static_argnames=("tgraph", "dgraph", "shape"))
round_verify_jit = jax.jit(round_verify, static_argnames=("tgraph", "shape"))
round_commit_jit = jax.jit(round_commit, static_argnames=("dgraph", "shape"), donate_argnames=("state", "dstate"))


def prefill(tgraph: nnx.GraphDef, tparams: nnx.State, dgraph: nnx.GraphDef, dparams: nnx.State,
            state: TargetState, dstate: DrafterState, anchor: jax.Array, tokens: jax.Array, valid: jax.Array,
            admit: jax.Array, sampling: SlotSampling, *, tap_layers: tuple[int, ...], stochastic: bool):
    """Admit new requests into slots `admit` [B]: reset their state, run the target over their prompts
    (tokens/valid [B, T]) tapping the drafter's layers, fill the drafter context with the prompt's features
    and sample the first token (the anchor; step 0, as `generate.Generator` does). Other slots are untouched."""
    target: TargetModel = nnx.merge(tgraph, tparams)
    drafter: Drafter = nnx.merge(dgraph, dparams)
    z = lambda x: jnp.where(admit.reshape((1, -1) + (1,) * (x.ndim - 2)), jnp.zeros_like(x), x)  # noqa: E731
    state = TargetState(ssm=z(state.ssm), conv=z(state.conv), keys=state.keys, values=state.values,
                        lengths=jnp.where(admit, 0, state.lengths))
    dstate = DrafterState(keys=dstate.keys, values=dstate.values, lengths=jnp.where(admit, 0, dstate.lengths))
    valid = valid & admit[:, None]
    logits, taps, state = target.extend(state, tokens, valid, last_only=True, tap_layers=tap_layers)
    dstate = drafter.append_context(dstate, taps, jnp.sum(valid, axis=1, dtype=I32))
    first = sample(logits[:, 0], sampling, jnp.zeros((), I32), stochastic)
    return state, dstate, jnp.where(admit, first, anchor)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "batch", "max_len", "dtype"))
def _new_buffers(tcfg, dcfg, batch: int, max_len: int, dtype):
    """Empty target state, drafter context and anchors of a generation: one dispatch (see `init_state`)."""
    return (init_state(tcfg, batch, max_len, dtype), init_drafter_state(dcfg, batch, max_len, dtype),
            jnp.zeros((batch,), I32))


prefill_jit = DiskCachedJit(prefill, name="spec_prefill",
                            static_argnames=("tgraph", "dgraph", "tap_layers", "stochastic"),
                            donate_argnames=("state", "dstate"))


# ------------------------------------------------------------------------------------------------
# Host loop
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SpecResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str                       # "stop" | "length"
    rounds: int = 0                          # rounds this request took part in
    committed: list[int] = dataclasses.field(default_factory=list)   # tokens committed per round (bonus incl.)
    accepted: list[int] = dataclasses.field(default_factory=list)    # drafts accepted per round
    prefill_seconds: float = 0.0             # (as generate.GenerationResult) batch totals
    decode_steps_per_second: float = 0.0     # rounds per second of the batch after its first (compiling) round

    @property
    def tau(self) -> float:
        return float(np.mean(self.committed)) if self.committed else 0.0

    def accepted_per_position(self, depth: int) -> list[float]:
        a = np.asarray(self.accepted)
        return [float(np.mean(a > k)) if len(a) else 0.0 for k in range(depth)]

    def prefix_survival(self, depth: int) -> list[float]:
        """`prefix_survival` of this request alone (its last round censored)."""
        return prefix_survival([self.accepted], depth)


@dataclasses.dataclass
class SpecStats:
    mode: str
    rounds: int                  # batch rounds (device calls of the round)
    tau: float                   # mean tokens committed per request-round, bonus included
    accepted_per_position: list[float]   # k-th entry: fraction of request-rounds accepting ≥ k+1 drafts
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0
    verify_nodes: int = 0
    capacity: int = 0
    compilations_after_startup: int = 0   # XLA compilations since the engine's start-up compile (warmup)
    # ReaDy's censored prefix survival over the requests of the call (`prefix_survival`; NaN: no round counts)
    prefix_survival: list[float] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tau"] = round(self.tau, 4)
        d["accepted_per_position"] = [round(x, 4) for x in self.accepted_per_position]
        d["prefix_survival"] = rounded(self.prefix_survival)
        for k in ("seconds", "prefill_seconds", "round_seconds"):
            d[k] = round(d[k], 4)
        return d


HintFn = Callable[[int, list[int]], Sequence[int]]


class SpecEngine:
    """Batched speculative generation with continuous admission between rounds."""

    def __init__(self, target: TargetModel, drafter: Drafter | None, spec: SpecConfig, *, slots: int | None = None,
                 kv_len: int | None = None, budget_table: BudgetTable | None = None, model_name: str = ""):
        """slots / kv_len fix the bucket (default: powers of two from the request batch); budget_table: Bole's
        calibrated B_ver per bucket sets the verify width N when spec.verify_nodes is not given."""
        self.spec = spec
        self.budget_table, self.model_name = budget_table, model_name
        self.config = target.config
        self.tgraph, self.tparams = split_for_jit(target)      # cheap to pass every round (compilation.py)
        leaves = jax.tree.leaves(self.tparams)
        self.dtype = leaves[0].dtype if leaves else F32
        self.slots, self.kv_len = slots, kv_len
        self.last_stats: SpecStats | None = None
        self.watch = CompileWatch()
        if spec.mode == "ar":
            self.drafter = None
            self._ar = Generator(self.config, self.tgraph, self.tparams)
            return
        if drafter is None:
            raise ValueError(f"spec mode {spec.mode!r} needs a drafter")
        if spec.uses_reader and drafter.reader is None:
            raise ValueError(f"spec mode {spec.mode!r} needs a drafter with a ReaDy reader")
        dcfg = drafter.config
        if dcfg.vocab_size != self.config.vocab_size:
            raise ValueError(f"drafter vocab {dcfg.vocab_size} != target vocab {self.config.vocab_size}")
        if dcfg.num_target_layers != self.config.num_hidden_layers:
            raise ValueError(f"drafter was built for a {dcfg.num_target_layers}-layer target, this target has "
                             f"{self.config.num_hidden_layers}")
        if drafter.reader is not None and not spec.uses_reader:
            drafter = _without_reader(drafter)
        self.drafter = drafter
        self.dgraph, self.dparams = split_for_jit(drafter)
        gamma = dcfg.num_draft_tokens
        if spec.is_tree:
            tspec = spec.tree or TreeSpec(depth=min(gamma, 4), top_k=2, beam=4)
            if tspec.depth > gamma:
                raise ValueError(f"tree depth {tspec.depth} exceeds the drafter's {gamma} draft slots")
            if tspec.top_k > self.config.vocab_size:
                raise ValueError(f"tree top-k {tspec.top_k} exceeds the vocabulary")
            self._max_nodes = tspec.num_candidates
            self._tree, self._gamma = tspec, tspec.depth
            self.verify_nodes = self._default_nodes = spec.verify_nodes or min(tspec.num_candidates, 16)
        else:
            g = spec.chain_length or gamma
            if g > gamma:
                raise ValueError(f"chain length {g} exceeds the drafter's {gamma} draft slots")
            self._max_nodes = g + 1
            self._tree, self._gamma = None, g
            self.verify_nodes = self._default_nodes = spec.verify_nodes or g + 1

    @property
    def depth(self) -> int:
        return 0 if self.spec.mode == "ar" else max(0, min(self._gamma, self.verify_nodes - 1))

    @property
    def compilations_after_startup(self) -> int:
        """XLA compilations since the end of `warmup` / `compile_buckets` (never warmed up: since construction).
        Process-wide: anything else compiling meanwhile counts too."""
        return self.watch.since

    def nodes_for(self, batch: int, kv_len: int) -> int:
        """Verify width N of a bucket: spec.verify_nodes, else the calibrated B_ver, else the default."""
        if self.spec.verify_nodes is None and self.budget_table is not None:
            e = self.budget_table.lookup(jax.devices()[0].device_kind, self.model_name, batch, kv_len,
                                         self._gamma)
            if e is not None:
                return max(1, min(int(e["b_ver"]), self._max_nodes))
        return self._default_nodes

    def round_shape(self, stochastic: bool) -> RoundShape:
        return RoundShape(tree=self._tree, gamma=self._gamma, verify_nodes=self.verify_nodes,
                          reader=self.spec.uses_reader, stochastic=stochastic,
                          confidence_threshold=None if self._tree is not None else self.spec.confidence_threshold,
                          method=self.spec.method, tap_layers=tuple(self.drafter.config.target_layer_ids),
                          kernel_impl=self.spec.kernels)

    # --------------------------------------------------------------------------------------------
    # Device calls: `generate` and `compile_buckets` share them, so start-up compiles exactly what generate runs
    def _buffers(self, B: int, S: int):
        return _new_buffers(self.config, self.drafter.config, B, S, self.dtype)

    def _prefill_call(self, state, dstate, anchor, toks: np.ndarray, val: np.ndarray, admit: np.ndarray,
                      sampling: SlotSampling, shape: RoundShape):
        return prefill_jit(self.tgraph, self.tparams, self.dgraph, self.dparams, state, dstate, anchor,
                           np.asarray(toks), np.asarray(val), np.array(admit), sampling,
                           tap_layers=shape.tap_layers, stochastic=shape.stochastic)

    def _round_call(self, state, dstate, anchor, active: np.ndarray, sampling: SlotSampling, steps: np.ndarray,
                    capacity: int, hint: np.ndarray | None, shape: RoundShape):
        state, dstate, anchor, host_out = spec_round_io_jit(
            self.tgraph, self.tparams, self.dgraph, self.dparams, state, dstate, anchor, sampling,
            pack_round_inputs(active, steps, capacity, hint), shape=shape)
        start_host_copy(host_out)     # the host reads it: start its copy now (see generate.Generator)
        return state, dstate, anchor, host_out

    def _bucket_for(self, prompts, plist) -> tuple[int, int, int, RoundShape]:
        """The bucket a request batch runs in: (slots B, KV length S, verified nodes N, round shape); sets
        `verify_nodes`. One rule for `generate` and `phase_times`."""
        B = self.slots or bucket(len(prompts), 1)
        need = max(len(p) for p in prompts) + max(p.max_tokens for p in plist) + self._gamma + 2
        S = self.kv_len or bucket(need, 128)
        if need > S:
            raise ValueError(f"kv_len {S} is too short: prompts + max_tokens + draft depth need {need}")
        self.verify_nodes = N = self.nodes_for(B, S)
        return B, S, N, self.round_shape(any(p.temperature > 0 for p in plist))

    def max_prompt_len(self, kv_len: int) -> int:
        """Longest prompt a KV length holds (with one new token and the round's overshoot)."""
        return kv_len - 1 - (0 if self.spec.mode == "ar" else self._gamma + 2)

    def compile_buckets(self, buckets: Sequence[tuple[int, int]], prompt_lengths: Sequence[int] | None = None,
                        stochastic: Sequence[bool] = (False, True), progress: bool = True, cache: bool = True) -> int:
        """Start-up compile: for every (batch slots, KV length) bucket, the prefill of every prompt bucket
        (prompt_lengths rounded up to powers of two ≥ 16; default: every one the KV length holds) and the round (greedy and/or sampling);
        then mark start-up (`compilations_after_startup` counts from here). A `generate` call runs in
        (self.slots or bucket(#prompts, 1), self.kv_len or bucket(prompt + max_tokens + γ + 2, 128)).
        cache: use JAX's persistent compilation cache. Returns the number of programs compiled."""
        if cache:
            use_compilation_cache()
        if self.spec.mode == "ar":
            n = self._ar.compile_buckets(buckets, prompt_lengths, progress=progress, cache=False,
                                         stochastic=stochastic)
            self.watch.mark()
            return n
        jobs = []
        for B, S in buckets:
            ts = (sorted({bucket(n) for n in prompt_lengths}) if prompt_lengths
                  else prompt_buckets(self.max_prompt_len(S)))
            jobs += [(B, S, "prefill", t) for t in ts] + [(B, S, "round", bool(s)) for s in stochastic]
        watch = CompileWatch()
        bar = compile_progress(len(jobs), progress)
        for B, S, kind, arg in jobs:
            self.verify_nodes = self.nodes_for(B, S)
            bar.set_postfix_str(f"slots {B}, kv {S}, " + (f"prefill {arg}" if kind == "prefill" else
                                f"{self.spec.mode} round N={self.verify_nodes} {'sampling' if arg else 'greedy'}"))
            state, dstate, anchor = self._buffers(B, S)
            sampling = SlotSampling.from_params([], B)
            shape = self.round_shape(arg if kind == "round" else False)
            if kind == "prefill":
                out = self._prefill_call(state, dstate, anchor, np.zeros((B, arg), np.int32),
                                         np.zeros((B, arg), bool), np.zeros(B, bool), sampling, shape)
            else:
                state, dstate, anchor = self._prefill_call(state, dstate, anchor, np.zeros((B, bucket(1)), np.int32),
                                                           np.zeros((B, bucket(1)), bool), np.zeros(B, bool),
                                                           sampling, shape)
                out = self._round_call(state, dstate, anchor, np.zeros(B, bool), sampling, np.zeros(B, np.int32),
                                       self.spec.capacity or B * self.verify_nodes, None, shape)
            jax.block_until_ready(out)
            bar.update(1)
        bar.close()
        self.watch.mark()
        return watch.since

    def warmup(self, progress: bool = True, cache: bool = True, **kw) -> int:
        """Start-up compile of the configured bucket (slots, kv_len; unset: 1 slot, KV 128); see compile_buckets."""
        return self.compile_buckets([(self.slots or 1, self.kv_len or 128)], progress=progress, cache=cache, **kw)

    # --------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 hint: HintFn | None = None) -> list[SpecResult]:
        """Generate for ragged prompts; `on_tokens(request_index, new_ids)` streams tokens as rounds commit
        them. hint(request_index, generated_so_far) -> token hints for the next drafts (tests / lookup)."""
        if not prompts:
            return []
        n = len(prompts)
        plist = validate_prompts(prompts, params, self.config.vocab_size)
        if self.spec.mode == "ar":
            return self._generate_ar(prompts, plist, on_tokens)
        t0 = time.perf_counter()
        B, S, N, shape = self._bucket_for(prompts, plist)
        D = self.depth
        capacity = self.spec.capacity or B * N
        state, dstate, anchor = self._buffers(B, S)
        G = self.drafter.config.num_draft_tokens
        sampling = SlotSampling.from_params([], B)

        pending = deque(range(n))
        slot_req = [-1] * B
        out: list[list[int]] = [[] for _ in range(n)]
        finish = [""] * n
        results_rounds = [0] * n
        committed: list[list[int]] = [[] for _ in range(n)]
        accepted: list[list[int]] = [[] for _ in range(n)]
        accepted_all: list[int] = []
        slot_params = [SamplingParams()] * B
        steps = np.zeros(B, np.int32)
        stops = [set(p.stop_token_ids) for p in plist]
        t_prefill = 0.0
        rounds = 0

        def emit(i: int, toks: list[int]) -> bool:
            """Append tokens to request i up to a stop token or max_tokens; True when it finished."""
            new = []
            done = False
            for t in toks:
                new.append(t)
                out[i].append(t)
                if t in stops[i]:
                    finish[i], done = "stop", True
                    break
                if len(out[i]) >= plist[i].max_tokens:
                    finish[i], done = "length", True
                    break
            if on_tokens is not None and new:
                on_tokens(i, new)
            return done

        # Rounds are pipelined: the next round is dispatched before the host reads the one in flight, so the
        # host's work (dispatch, streaming, bookkeeping) overlaps the device's. A slot's round outputs are used
        # only while the request that owned the slot at dispatch still runs: a request that stops in the round
        # in flight costs one discarded round of its slot. A round is not dispatched ahead when a request could
        # reach max_tokens in the round in flight (known on the host: no discarded round at the end of a
        # generation) or with hints (they read the tokens of the round before).
        inflight = None                              # (device outputs, slot owners at dispatch)
        t_first_done = t_last_done = None

        def dispatch():
            nonlocal state, dstate, anchor
            active = np.array([r >= 0 for r in slot_req])
            # no hint columns without hints (the round then has no hint ops; hinted runs compile their own round)
            hint_arr = None if hint is None else np.full((B, G), -1, np.int32)
            if hint is not None:
                for b in range(B):
                    if slot_req[b] >= 0:
                        h = list(hint(slot_req[b], list(out[slot_req[b]])))[:G]
                        hint_arr[b, :len(h)] = h
            steps[active] += 1
            state, dstate, anchor, host_out = self._round_call(
                state, dstate, anchor, active, sampling, steps, capacity, hint_arr, shape)
            return host_out, list(slot_req)

        def finish_round(flight) -> None:
            nonlocal rounds, t_first_done, t_last_done
            outs, owners = flight
            toks_out, count, acc = unpack_round_outputs(np.asarray(outs))   # one transfer, waits for the round
            t_done = time.perf_counter()
            rounds += 1
            t_first_done = t_first_done or t_done
            t_last_done = t_done
            for b in range(B):
                i = owners[b]
                if i < 0 or slot_req[b] != i:
                    continue                             # the request finished in the round before
                results_rounds[i] += 1
                committed[i].append(int(count[b]))
                accepted[i].append(int(acc[b]))
                accepted_all.append(int(acc[b]))
                if emit(i, [int(t) for t in toks_out[b, :count[b]]]):
                    slot_req[b] = -1

        while pending or any(r >= 0 for r in slot_req) or inflight is not None:
            free = [b for b in range(B) if slot_req[b] < 0]
            if pending and free:
                admit = np.zeros(B, bool)
                new_slots = []
                for b in free[:len(pending)]:
                    i = pending.popleft()
                    slot_req[b], slot_params[b] = i, plist[i]
                    admit[b] = True
                    steps[b] = 0
                    new_slots.append(b)
                T = bucket(max(len(prompts[slot_req[b]]) for b in new_slots))
                toks = np.zeros((B, T), np.int32)
                val = np.zeros((B, T), bool)
                for b in new_slots:
                    p = prompts[slot_req[b]]
                    toks[b, :len(p)], val[b, :len(p)] = p, True
                sampling = SlotSampling.from_params(slot_params, B)
                t1 = time.perf_counter()
                state, dstate, anchor = self._prefill_call(state, dstate, anchor, toks, val, admit, sampling, shape)
                first = np.asarray(anchor)
                t_prefill += time.perf_counter() - t1
                for b in new_slots:
                    i = slot_req[b]
                    if emit(i, [int(first[b])]):
                        slot_req[b] = -1
                continue   # admit more if slots freed at once; then run a round
            ahead = (inflight is not None and hint is None
                     and all(r < 0 or len(out[r]) + D + 1 < plist[r].max_tokens for r in slot_req))
            if inflight is None or ahead:
                nxt = dispatch() if any(r >= 0 for r in slot_req) else None
                if inflight is not None:
                    finish_round(inflight)
                inflight = nxt
            else:
                finish_round(inflight)
                inflight = None
        all_committed = [c for cs in committed for c in cs]
        acc_arr = np.asarray(accepted_all)
        seconds = time.perf_counter() - t0
        self.last_stats = SpecStats(
            mode=self.spec.mode, rounds=rounds, tau=float(np.mean(all_committed)) if all_committed else 0.0,
            accepted_per_position=[float(np.mean(acc_arr > k)) if len(acc_arr) else 0.0 for k in range(D)],
            # rounds overlap each other in the pipeline: their time is the generation's less its prefills
            seconds=seconds, prefill_seconds=t_prefill, round_seconds=seconds - t_prefill,
            verify_nodes=N, capacity=int(capacity), compilations_after_startup=self.compilations_after_startup,
            prefix_survival=prefix_survival(accepted, D))
        # rounds per second after the first round (as Generator's decode steps/s after the first step)
        warm = (t_last_done - t_first_done) if rounds > 1 else 0.0
        rate = (rounds - 1) / warm if warm > 0 else 0.0
        return [SpecResult(list(map(int, prompts[i])), out[i], finish[i], results_rounds[i], committed[i],
                           accepted[i], t_prefill, rate) for i in range(n)]

    # --------------------------------------------------------------------------------------------
    def phase_times(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                    repeats: int = 5, warmup: int = 1) -> dict:
        """Where a round's time goes: from the engine state after the prefill of `prompts` (the first
        `slots` of them, admitted at once as `generate` admits them; same bucket), time one round split into
        its phases — `round_draft` (draft, build, select), `round_verify` (the target's verify forward),
        `round_commit` (accept + commit of target and drafter) — each jitted on its own, and the fused round
        (`spec_round_jit`, as `generate` runs it). Median of `repeats` calls after `warmup`, each with
        block_until_ready; donated inputs (fused round, commit) are restored untimed before each call.

        Returns {"draft_ms", "verify_ms", "commit_ms", "kernels" (`compilation.kernel_count` of each phase, the
        fused round and one plain decoding step of the same bucket), "sum_ms", "round_ms", "sum_over_round", "identical"
        (the split round's committed tokens, counts, accepted and anchors equal the fused round's),
        "state_identical" (its new target and drafter states too, bit for bit: XLA may fuse across the phase
        boundaries differently), "mode", "batch", "kv_len", "verify_nodes", "active", "repeats"}. The split pieces are extra programs: they count in `compilations_after_startup`."""
        if repeats < 1 or warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
        (B, S, N, shape, admit, k, state, dstate, anchor, active, sampling, steps, capacity,
         hint) = self._round_inputs(prompts, params, "phase times")
        copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731

        draft, verify, commit_ = round_draft_jit, round_verify_jit, round_commit_jit
        tg, tp, dg, dp = self.tgraph, self.tparams, self.dgraph, self.dparams
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
            box["s"], box["d"] = copy(state), copy(dstate)
            return box["s"], box["d"]

        t_draft, (dtoks, tree, child_q) = timed(lambda: draft(tg, tp, dg, dp, state, dstate, anchor, active, sampling,
                                                               steps, capacity, hint, shape=shape))
        t_verify, (logits, taps, cache) = timed(lambda: verify(tg, tp, state, tree, dtoks, shape=shape))
        t_commit, split = timed(lambda: commit_(dg, dp, box["s"], box["d"], anchor, active, sampling, steps, dtoks,
                                                tree, child_q, logits, taps, cache, shape=shape), before=restore)
        t_round, fused = timed(lambda: spec_round_jit(tg, tp, dg, dp, box["s"], box["d"], anchor, active, sampling,
                                                      steps, capacity, hint, shape=shape), before=restore)
        same = lambda xs, ys: all(bool(np.array_equal(np.asarray(a), np.asarray(b)))  # noqa: E731
                                  for a, b in zip(jax.tree.leaves(xs), jax.tree.leaves(ys)))
        identical = same(split[2:], fused[2:])            # anchor, tokens, count, accepted
        state_identical = same(split[:2], fused[:2])      # target and drafter states, bit for bit
        total = t_draft + t_verify + t_commit
        from hyspec_jax.compilation import kernel_count
        from hyspec_jax.generate import _decode_jit
        kernels = dict(
            draft=kernel_count(draft.lower(tg, tp, dg, dp, state, dstate, anchor, active, sampling, steps, capacity,
                                           hint, shape=shape)),
            verify=kernel_count(verify.lower(tg, tp, state, tree, dtoks, shape=shape)),
            commit=kernel_count(commit_.lower(dg, dp, state, dstate, anchor, active, sampling, steps, dtoks, tree,
                                              child_q, logits, taps, cache, shape=shape)),
            round=kernel_count(spec_round_jit.lower(tg, tp, dg, dp, state, dstate, anchor, active, sampling, steps,
                                                    capacity, hint, shape=shape)),
            ar_step=kernel_count(_decode_jit.lower(tg, tp, state, np.zeros((B,), np.int32), np.asarray(admit),
                                                   sampling, np.asarray(0, np.int32), stochastic=shape.stochastic)))
        return dict(draft_ms=round(t_draft, 4), verify_ms=round(t_verify, 4), commit_ms=round(t_commit, 4),
                    kernels=kernels,
                    sum_ms=round(total, 4), round_ms=round(t_round, 4),
                    sum_over_round=round(total / t_round, 4) if t_round > 0 else float("nan"),
                    identical=identical, state_identical=state_identical, mode=self.spec.mode, batch=B, kv_len=S,
                    verify_nodes=N, active=k, repeats=repeats)

    def _round_inputs(self, prompts, params, what: str):
        """The inputs of one round after the prefill of `prompts` (the first `slots` of them, admitted at once
        as `generate` admits them; same bucket): (B, S, N, shape, admit, k, state, dstate, anchor, active,
        sampling, steps, capacity, hint)."""
        if self.spec.mode == "ar":
            raise ValueError(f"{what} need a speculative mode (ar has no draft / verify / commit)")
        if not prompts:
            raise ValueError(f"{what} need at least one prompt")
        plist = validate_prompts(prompts, params, self.config.vocab_size)
        n = len(prompts)
        B, S, N, shape = self._bucket_for(prompts, plist)
        k = min(n, B)
        admit = np.arange(B) < k
        T = bucket(max(len(p) for p in prompts[:k]))
        toks, val = np.zeros((B, T), np.int32), np.zeros((B, T), bool)
        for b in range(k):
            toks[b, :len(prompts[b])], val[b, :len(prompts[b])] = prompts[b], True
        sampling = SlotSampling.from_params(list(plist[:k]) + [SamplingParams()] * (B - k), B)
        state, dstate, anchor = self._buffers(B, S)
        state, dstate, anchor = self._prefill_call(state, dstate, anchor, toks, val, admit, sampling, shape)
        active, steps = jnp.asarray(admit), jnp.asarray(admit.astype(np.int32))
        capacity = jnp.asarray(self.spec.capacity or B * N, I32)
        hint = None                      # as `generate` without hints
        return B, S, N, shape, admit, k, state, dstate, anchor, active, sampling, steps, capacity, hint

    def round_kernels(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                      ) -> dict:
        """Kernels of the compiled fused round (`spec_round_io_jit`, the program `generate` runs for these prompts'
        bucket) by named scope (`compilation.kernel_count_by_scope`: draft/drafter_forward, draft/tree_build,
        verify, commit, ...), and of one plain decoding step of the same bucket: {"round": {scope: n},
        "round_total", "ar_step"}. Compiles on this backend; runs nothing but the prefill."""
        from hyspec_jax.compilation import kernel_count, kernel_count_by_scope
        from hyspec_jax.generate import _decode_jit
        (B, S, N, shape, admit, k, state, dstate, anchor, active, sampling, steps, capacity,
         hint) = self._round_inputs(prompts, params, "round kernels")
        host_in = pack_round_inputs(admit, admit.astype(np.int32), int(capacity), hint)
        scopes = kernel_count_by_scope(spec_round_io_jit.lower(self.tgraph, self.tparams, self.dgraph, self.dparams,
                                                               state, dstate, anchor, sampling, host_in, shape=shape),
                                       ROUND_SCOPES)
        ar = kernel_count(_decode_jit.lower(self.tgraph, self.tparams, state, np.zeros((B,), np.int32),
                                            np.asarray(admit), sampling, np.asarray(0, np.int32),
                                            stochastic=shape.stochastic))
        return {"round": dict(sorted(scopes.items(), key=lambda kv: -kv[1])), "round_total": sum(scopes.values()),
                "ar_step": ar}

    def _generate_ar(self, prompts, plist, on_tokens) -> list[SpecResult]:
        t0 = time.perf_counter()
        res = self._ar.generate(prompts, plist, on_tokens=on_tokens)
        rounds = max(len(r.token_ids) for r in res) - 1
        self.last_stats = SpecStats(mode="ar", rounds=rounds, tau=1.0, accepted_per_position=[],
                                    seconds=time.perf_counter() - t0,
                                    prefill_seconds=max(r.prefill_seconds for r in res), verify_nodes=1,
                                    compilations_after_startup=self.compilations_after_startup)
        return [SpecResult(r.prompt_token_ids, r.token_ids, r.finish_reason, len(r.token_ids) - 1,
                           [1] * (len(r.token_ids) - 1), [0] * (len(r.token_ids) - 1), r.prefill_seconds,
                           r.decode_steps_per_second) for r in res]


# ------------------------------------------------------------------------------------------------
# `hyspec generate` glue (the options are declared in hyspec_jax/cli.py)
# ------------------------------------------------------------------------------------------------
def engine_from_args(args, model: TargetModel, model_dir, dtype, batch: int | None = None) -> "SpecEngine | None":
    """The engine `hyspec generate` / `hyspec serve` asked for, or None for plain autoregressive decoding.

    With the embedded model (no --model) and no --drafter, its shipped drafter is used, and every option the
    user left unset takes the drafter's recommended value for this backend (explicit options always win).
    batch: the number of requests decoded together (`--slots` wins): where the recommendation was measured
    up to `max_slots` only and no --spec-mode was given, more slots decode plainly (e.g. on a 2-core CPU,
    verification is nearly free for one request but not for eight)."""
    from pathlib import Path

    from hyspec_jax.io.drafter_io import load_drafter
    from hyspec_jax.spec.options import recommended_settings
    drafter_dir = getattr(args, "drafter", None)
    rec: dict = {}
    table_path = getattr(args, "budget_table", None)
    if drafter_dir is None and getattr(args, "model", None) is None and getattr(args, "spec_mode", None) != "ar":
        from hyspec_jax.embedded import default_budget_table, default_drafter_dir, default_model_dir
        shipped = default_drafter_dir()
        if shipped is not None and default_model_dir() == Path(model_dir):
            drafter_dir = shipped
            table_path = table_path or default_budget_table()   # the embedded model's own calibration
            rec = recommended_settings(shipped, jax.default_backend())
            slots = getattr(args, "slots", None) or batch
            too_many = rec.get("max_slots") is not None and slots is not None and slots > rec["max_slots"]
            if getattr(args, "spec_mode", None) is None and (not rec or too_many):
                return None     # nothing measured for this backend, or measured slower than ar at this batch
    opt = lambda name, fallback=None: (getattr(args, name, None) if getattr(args, name, None) is not None  # noqa: E731
                                        else rec.get(name, fallback))
    mode = opt("spec_mode") or ("chain" if drafter_dir else "ar")
    if mode == "ar":
        return None
    if drafter_dir is None:
        raise ValueError(f"--spec-mode {mode} needs --drafter DIR")
    if getattr(args, "slots", None) is not None and args.slots < 1:
        raise ValueError(f"--slots must be >= 1, got {args.slots}")
    if not Path(drafter_dir).is_dir():
        raise ValueError(f"--drafter {drafter_dir}: no such directory")
    spec_kw = dict(mode=mode, chain_length=opt("chain_length"), verify_nodes=opt("verify_nodes"),
                   capacity=getattr(args, "budget", None), confidence_threshold=getattr(args, "confidence_threshold",
                                                                                        None),
                   kernels=getattr(args, "kernels", None) or "auto")
    if mode in ("tree", "tree-ready"):
        spec_kw["tree"] = TreeSpec(depth=opt("tree_depth", 4), top_k=opt("tree_topk", 2), beam=opt("tree_beam", 4))
    spec = SpecConfig(**spec_kw)
    drafter = load_drafter(drafter_dir, dtype=dtype, with_reader=spec.uses_reader)
    if spec.uses_reader and drafter.reader is None:
        raise ValueError(f"--spec-mode {mode} needs a drafter with a ReaDy reader ({drafter_dir}/reader/ is missing)")
    table = BudgetTable.load(table_path) if table_path else None
    name = model_id(model.config, Path(model_dir).name)
    return SpecEngine(model, drafter, spec, slots=getattr(args, "slots", None), budget_table=table, model_name=name)


def request_stats(engine: "SpecEngine | None", res) -> dict:
    """The speculative part of a request's `stats` (`hyspec generate --json`)."""
    if engine is None:
        n = max(len(res.token_ids) - 1, 0)
        return {"mode": "ar", "rounds": n, "tau": 1.0 if n else 0.0, "accepted_per_position": [],
                "prefix_survival": []}
    return {"mode": engine.spec.mode, "rounds": res.rounds, "tau": round(res.tau, 4),
            "accepted_per_position": [round(x, 4) for x in res.accepted_per_position(engine.depth)],
            "prefix_survival": rounded(res.prefix_survival(engine.depth)),
            "verify_nodes": engine.verify_nodes}


def _without_reader(drafter: Drafter) -> Drafter:
    """The same drafter with its reader detached (plain DSpark modes)."""
    graphdef, params = nnx.split(drafter)
    clone = nnx.merge(graphdef, params)
    clone.reader, clone.reader_config, clone.inject_at = None, None, -1
    return clone


def format_phase_times(pt: dict) -> str:
    """`SpecEngine.phase_times` as the lines `hyspec generate --phase-times` prints to stderr."""
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
        lines.append(f"[hyspec]   kernels (compiled; loops per iteration): draft {k['draft']}, verify {k['verify']}, commit "
                     f"{k['commit']}, fused round {k['round']}; one plain decoding step {k['ar_step']}")
    return "\n".join(lines)


__all__ = ["MODES", "SpecConfig", "RoundShape", "SpecResult", "SpecStats", "SpecEngine", "spec_round",
           "spec_round_jit", "spec_round_io", "spec_round_io_jit", "pack_round_inputs", "unpack_round_outputs",
           "round_draft", "round_verify", "round_commit", "prefill", "prefill_jit", "HINT_BIAS",
           "engine_from_args", "request_stats", "prefix_survival", "rounded", "format_phase_times"]
