"""The engine: the one synchronous driver of the request loop (`hyspec_jax.runtime.scheduler`), for every mode.

`Engine(target, drafter, spec).generate(prompts, params)` submits the prompts to a fresh loop whose backend holds
the bucket's slots (batch slots B, KV length S; `Engine.bucket_for`, the one rule) — an `ARBackend` for plain
decoding, a `SpecBackend` (or `WidthBackend`) built from the `SpecConfig` and the round shapes otherwise — runs it
to completion and reports one `GenerationResult` per request and the batch's statistics (`SpecStats`). The round
itself is `hyspec_jax.spec.round`; the loop — admission into free slots, chunked prefill, pipelined steps, exact
stop / max_tokens handling — is the same loop `hyspec serve` runs over `Engine.backend`. Modes: `ar` (plain
decoding; `Engine(target)`), `chain` (DSpark), `ready` (DSpark + ReaDy reader), `tree` (DSpark tree, Bole
verification), `tree-ready`, `mtp` (the target's own MTP head, a chain of recursive steps), `mtp-tree` (that head
expanded as a tree, Bole verification).

Start-up: `Engine.warmup()` / `compile_buckets(buckets)` compile every configured bucket (the step or round, greedy
and sampling, and the prefill of every prompt bucket) through JAX's persistent compilation cache;
`compilations_after_startup` (also in `SpecStats`) counts the XLA compilations since — 0 while every request
fits a compiled bucket.

Statistics (`SpecStats` of the last `generate`, `hyspec generate --stats` / `--json`): rounds, τ, accepted
drafts per position, ReaDy's censored prefix survival (`prefix_survival`: the last round of each request
censored), times. Where a round's time goes: `hyspec_jax.bench.phases`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyspec_jax.compilation import CompileWatch, enable_compilation_cache, source_digest, split_for_jit
from hyspec_jax.models.drafter import Drafter
from hyspec_jax.models.mtp import MTPHead
from hyspec_jax.models.target import TargetModel
from hyspec_jax.runtime.backend import (ARBackend, Backend, JitModel, SlotLayout, SpecBackend, batch_shapes, bucket,
                                        compile_backends)
from hyspec_jax.runtime.scheduler import run_batch
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.sharding import params_mesh, replicate
from hyspec_jax.spec.budget import BudgetTable, packed_rows
from hyspec_jax.spec.options import KERNEL_IMPLS, MODES, MTP_DEFAULT_STEPS, MTP_MODES, TREE_MODES
from hyspec_jax.spec.round import RoundShape
from hyspec_jax.spec.stats import prefix_survival, rounded
from hyspec_jax.runtime.width import (CalibrationCache, RoundTimesKey, WidthBackend, WidthOptions, cached_round_times,
                                      round_seconds, round_signature, save_round_times, width_buckets)
from hyspec_jax.state import TargetState, init_state
from hyspec_jax.tree import TreeExpansion

log = logging.getLogger("hyspec.spec")


def use_compilation_cache() -> None:
    """Start-up compiles go through JAX's persistent cache: the configured directory, else hyspec's default."""
    enable_compilation_cache(jax.config.jax_compilation_cache_dir)


def validate_prompts(prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                     vocab_size: int) -> list[SamplingParams]:
    """Check a batch request (non-empty prompts of in-vocabulary ids, one SamplingParams or one per prompt) and
    return the per-prompt parameter list. Raises ValueError with the user-facing message."""
    n = len(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
    if len(plist) != n:
        raise ValueError(f"{n} prompts but {len(plist)} sampling params")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return plist


def default_slots(requests: int, params) -> int:
    """The slots of a batch of `requests` when none are asked for: bucket(requests, 1), rounded up to a multiple
    of the weights' data-parallel replicas (`sharding.data_parallel_size`; each replica decodes an equal share)."""
    from hyspec_jax.sharding import data_parallel_size
    replicas = data_parallel_size(params)
    return -(-bucket(requests, 1) // replicas) * replicas


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """User-level speculation settings (the engine derives the static round shape from them)."""
    mode: str = "chain"
    chain_length: int | None = None          # drafts per chain (default γ of the drafter)
    tree: TreeExpansion | None = None        # tree modes (default: depth min(γ, 4), top-k 2, beam 4)
    verify_nodes: int | None = None          # N: verify width per slot, anchor included (e.g. Bole's B_ver)
    capacity: int | None = None              # C: batch-wide node budget (default B·N)
    confidence_threshold: float | None = None  # chain: DSpark confidence-scheduled length
    method: str = "squaring"                 # tree-solve inverse method
    kernels: str = "auto"                # Pallas top-k, tree solve, tree attention, commit where supported (GPU)
    # Deferred GDN commit: P accepted rows per slot and GDN layer kept beside a checkpoint state, folded when full
    # (`TargetState.pending`); 0 = every round writes the state. Must hold a round's path (depth + 1 rows).
    deferred_rows: int = 0
    # The verify width chosen each round (`runtime.width`) from the budget table's calibrated round times of the
    # bucket — between plain decoding and verify_nodes; without them (or False) every round verifies N nodes.
    adaptive_width: bool = True
    # Widths not compiled: a drafting width whose calibrated round is within this fraction of a kept wider one's
    # time (`runtime.width.kept_widths`) — the wider round runs instead, at most this much slower per round; on the
    # H100 table of a 64-slot server 13 of 24 widths stay at 0.05, 17 at 0
    width_margin: float = 0.05
    # Without calibrated round times for a bucket: time every width's round at start-up, this many rounds each
    # per decoding bucket (`WidthBackend.calibrate`), and choose from those; 0 = every round verifies N nodes
    # (`hyspec serve` sets it on a GPU: `--startup-calibration`)
    calibrate_repeats: int = 0
    # Packed widths (Bole's packed forest as the per-round choice): width w = a batch-wide budget of slots · w
    # nodes at row capacity N, the verify packed into those rows (`budget.packed_rows`), instead of w nodes a row
    packed_widths: bool = False

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
        if self.deferred_rows < 0:
            raise ValueError("deferred_rows must be >= 0")
        if self.calibrate_repeats < 0:
            raise ValueError(f"calibrate_repeats must be >= 0, got {self.calibrate_repeats}")
        if not 0.0 <= self.width_margin < 1.0:
            raise ValueError(f"width_margin must be in [0, 1), got {self.width_margin}")
        if self.packed_widths and self.capacity is not None:
            raise ValueError("packed widths choose the batch-wide budget every round: drop the fixed budget")

    @property
    def is_tree(self) -> bool:
        return self.mode in TREE_MODES

    @property
    def uses_reader(self) -> bool:
        return self.mode in ("ready", "tree-ready")

    @property
    def uses_mtp(self) -> bool:
        """Drafted by the target's own MTP head (`hyspec_jax.models.mtp`), not a DSpark drafter."""
        return self.mode in MTP_MODES



@dataclasses.dataclass
class GenerationResult:
    """One request of an `Engine.generate` batch, in every mode (plain decoding: a step is a round of one token)."""
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str                       # "stop" | "length"
    rounds: int = 0                          # steps / rounds this request took part in (after its prefill)
    committed: list[int] = dataclasses.field(default_factory=list)   # tokens committed per round (bonus incl.)
    accepted: list[int] = dataclasses.field(default_factory=list)    # drafts accepted per round (ar: 0)
    seconds: float = 0.0                     # batch totals: wall time of the whole batch (compiles included),
    prefill_seconds: float = 0.0             # its prefills,
    decode_steps_per_second: float = 0.0     # and its steps / rounds per second after the first (compiling) one

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
    # rounds run at each verify width, when the width was chosen each round (`runtime.width`; else empty)
    width_rounds: dict[int, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tau"] = round(self.tau, 4)
        d["accepted_per_position"] = [round(x, 4) for x in self.accepted_per_position]
        d["prefix_survival"] = rounded(self.prefix_survival)
        for k in ("seconds", "prefill_seconds", "round_seconds"):
            d[k] = round(d[k], 4)
        return d



class Engine:
    """Batched generation — plain decoding or speculative — with continuous admission between steps: the one
    synchronous driver of the request loop, and the backends the server's loop runs (`backend`)."""

    def __init__(self, target: TargetModel, drafter: Drafter | MTPHead | None = None, spec: SpecConfig | None = None,
                 *, slots: int | None = None,
                 kv_len: int | None = None, budget_table: BudgetTable | None = None, model_name: str = "",
                 calibration_cache: CalibrationCache | None = None):
        """spec: the mode and its options (default: plain decoding, `SpecConfig(mode="ar")`, which takes no
        drafter); slots / kv_len fix the bucket (default: `bucket_for` the request batch); budget_table: Bole's
        calibrated B_ver per bucket sets the verify width N when spec.verify_nodes is not given;
        calibration_cache: with spec.calibrate_repeats, where the round times timed at start-up are kept
        (`runtime.width.save_round_times`) and, with its `reuse`, looked up first where the budget table has
        none for a bucket (`runtime.width.cached_round_times`): a second start chooses without timing again."""
        spec = SpecConfig(mode="ar") if spec is None else spec
        self.spec = spec
        self.budget_table, self.model_name = budget_table, model_name
        self.calibration_cache = calibration_cache
        self.config = target.config
        self.tgraph, self.tparams = split_for_jit(target)      # cheap to pass every round (compilation.py)
        leaves = jax.tree.leaves(self.tparams)
        self.dtype = leaves[0].dtype if leaves else jnp.float32
        self.slots, self.kv_len = slots, kv_len
        self.last_stats: SpecStats | None = None
        self.watch = CompileWatch()
        if spec.mode == "ar":
            self.drafter = None
            self._gamma, self._tree, self._default_nodes, self._max_nodes = 0, None, 1, 1
            return
        if drafter is None:
            raise ValueError(f"spec mode {spec.mode!r} needs " + ("the model's MTP head" if spec.uses_mtp
                                                                  else "a drafter"))
        if spec.uses_mtp != isinstance(drafter, MTPHead):
            raise ValueError(f"spec mode {spec.mode!r} needs " + ("the model's MTP head, not a DSpark drafter"
                                                                  if spec.uses_mtp else "a DSpark drafter"))
        if spec.uses_mtp:
            self._init_mtp(drafter, spec)
            return
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
        gamma = dcfg.num_draft_tokens
        self._set_drafter(drafter)
        self._set_draft_shape(spec, TreeExpansion(depth=min(gamma, 4), top_k=2, beam=4), gamma, limit=gamma)

    def _init_mtp(self, head: MTPHead, spec: SpecConfig) -> None:
        """The MTP modes: no block limits the depth (each step is one more head forward)."""
        if dataclasses.replace(head.config, mtp_num_hidden_layers=0) != dataclasses.replace(self.config,
                                                                                        mtp_num_hidden_layers=0):
            raise ValueError("the MTP head was built for another target geometry")
        self._set_drafter(head)
        self._set_draft_shape(spec, TreeExpansion(depth=4, top_k=2, beam=4), MTP_DEFAULT_STEPS)

    def _set_drafter(self, drafter) -> None:
        self.drafter = drafter
        self.dgraph, self.dparams = split_for_jit(drafter)
        if (mesh := params_mesh(self.tparams)) is not None:      # beside a tensor-parallel target
            self.dparams = replicate(self.dparams, mesh)

    def _set_draft_shape(self, spec: SpecConfig, default_tree: TreeExpansion, default_chain: int,
                         limit: int | None = None) -> None:
        """The draft's shape: the tree (spec.tree or default_tree) or the chain (spec.chain_length or
        default_chain), at most `limit` deep (a DSpark block's draft slots), and the default verify width."""
        if spec.is_tree:
            tspec = spec.tree or default_tree
            if limit is not None and tspec.depth > limit:
                raise ValueError(f"tree depth {tspec.depth} exceeds the drafter's {limit} draft slots")
            if tspec.top_k > self.config.vocab_size:
                raise ValueError(f"tree top-k {tspec.top_k} exceeds the vocabulary")
            self._max_nodes = tspec.num_candidates
            self._tree, self._gamma = tspec, tspec.depth
            self._default_nodes = spec.verify_nodes or min(tspec.num_candidates, 16)
        else:
            g = spec.chain_length or default_chain
            if limit is not None and g > limit:
                raise ValueError(f"chain length {g} exceeds the drafter's {limit} draft slots")
            self._max_nodes = g + 1
            self._tree, self._gamma = None, g
            self._default_nodes = spec.verify_nodes or g + 1

    @property
    def verify_nodes(self) -> int:
        """N of the last `generate`'s bucket (before any: the default N). A report: programs take their
        `RoundShape`."""
        if self.last_stats is not None and self.spec.mode != "ar":
            return self.last_stats.verify_nodes
        return self._default_nodes

    @property
    def depth(self) -> int:
        """Most drafts a round of the last `generate`'s bucket accepts (0 for ar)."""
        return 0 if self.spec.mode == "ar" else max(0, min(self._gamma, self.verify_nodes - 1))

    @property
    def compilations_after_startup(self) -> int:
        """XLA compilations since the end of `warmup` / `compile_buckets` (never warmed up: since construction).
        Process-wide: anything else compiling meanwhile counts too."""
        return self.watch.since

    def new_state(self, batch: int, max_len: int) -> TargetState:
        """An empty target state of `batch` rows and KV length `max_len` (the engine's dtype and deferred rows)."""
        return init_state(self.config, batch, max_len, self.dtype, self.spec.deferred_rows)

    def nodes_for(self, batch: int, kv_len: int) -> int:
        """Verify width N of a bucket: spec.verify_nodes, else the calibrated B_ver, else the default."""
        if self.spec.verify_nodes is None and self.budget_table is not None:
            e = self.budget_table.lookup(jax.devices()[0].device_kind, self.model_name, batch, kv_len,
                                         self._gamma)
            if e is not None:
                return max(1, min(int(e["b_ver"]), self._max_nodes))
        return self._default_nodes

    def round_shape(self, stochastic: bool, verify_nodes: int, slots: int | None = None) -> RoundShape:
        """The frozen static shape of a round of verify width N = verify_nodes (with `slots`: its verify packed
        to spec.capacity rows where that budget is below slots · N, `budget.packed_rows`)."""
        mtp = self.spec.uses_mtp
        taps = (self.config.num_hidden_layers - 1,) if mtp else tuple(self.drafter.config.target_layer_ids)
        return RoundShape(tree=self._tree, gamma=self._gamma, verify_nodes=verify_nodes,
                          reader=self.spec.uses_reader, stochastic=stochastic,
                          confidence_threshold=(None if self._tree is not None or mtp
                                                else self.spec.confidence_threshold),
                          method=self.spec.method, tap_layers=taps, kernel_impl=self.spec.kernels,
                          drafter="mtp" if mtp else "dspark",
                          packed_rows=0 if slots is None else packed_rows(self.spec.capacity, slots, verify_nodes),
                          # without a user budget C every backend passes slots · N or more: it never binds (a
                          # budget below that is packed: packed_rows)
                          batch_budget=self.spec.capacity is not None)

    def round_seconds(self, slots: int, kv_len: int, rows: int | None = None) -> dict[int, float] | None:
        """The calibrated round time of every width bucket of this bucket (`runtime.width.round_seconds`), or None;
        rows: of that bucket's rounds over `rows` of its slots (calibrated as a bucket of `rows` slots)."""
        return self._round_times(slots, kv_len, rows)[0]

    def _round_signature(self, slots: int, kv_len: int) -> tuple[tuple[int, ...], str]:
        widths = width_buckets(self.nodes_for(slots, kv_len))
        return widths, round_signature(self.spec.mode, self._width_shapes(slots, widths)[max(widths)][False],
                                       self.spec.deferred_rows)

    def _round_times(self, slots: int, kv_len: int, rows: int | None = None) -> tuple[dict[int, float] | None, str]:
        """`round_seconds` and where they came from: the budget table, else (with spec.calibrate_repeats and
        the calibration cache's reuse) the times an earlier start-up calibration of exactly this bucket kept."""
        if self.spec.mode == "ar":
            return None, ""
        widths, sig = self._round_signature(slots, kv_len)
        device = jax.devices()[0].device_kind
        if self.budget_table is not None:
            e = self.budget_table.lookup(device, self.model_name, rows or slots, kv_len, self._gamma, sig)
            if (t := round_seconds(e, sig, widths)) is not None:
                return t, "the budget table"
        cache = self.calibration_cache
        if cache is not None and cache.reuse and self.spec.calibrate_repeats > 0:
            t = cached_round_times(self._times_key(device, kv_len, sig), rows or slots, widths)
            if t is not None:
                return t, f"an earlier start-up calibration ({cache.path})"
        return None, ""

    def _times_key(self, device_kind: str, kv_len: int, signature: str) -> RoundTimesKey:
        """Where and for what this engine's start-up calibration keeps its round times (`calibration_cache`)."""
        return RoundTimesKey(self.calibration_cache.path, device_kind, self.model_name, kv_len, self._gamma, signature,
                             self.spec.calibrate_repeats, source_digest())

    def _save_calibration(self, kv_len: int, signature: str, times: dict[int, dict[int, float]]) -> Path | None:
        """Keep a start-up calibration's times in `calibration_cache` (nowhere without one); a cache that cannot
        be written costs the next start a calibration, never this one its start: logged, None."""
        if self.calibration_cache is None:
            return None
        try:
            save_round_times(self._times_key(jax.devices()[0].device_kind, kv_len, signature), times)
        except OSError as e:
            log.warning("could not keep the start-up calibration in %s: %s", self.calibration_cache.path, e)
            return None
        return self.calibration_cache.path

    def width_backend(self, slots: int, kv_len: int, seconds: dict[int, float] | None = None,
                      shapes: Sequence[tuple[int, int]] | None = None,
                      decode_buckets: Sequence[int] = (), times_origin: str | None = None,
                      logprobs: int = 0) -> WidthBackend:
        """A backend with one round per width bucket up to `nodes_for` (`runtime.width`): the width chosen each
        round from `seconds` (calibrated round time per width; times_origin: where they came from, for the
        logs), fixed at the widest without them; a round over a decoding bucket's R rows chooses from the round
        times calibrated for R where the table has them."""
        widths, sig = self._round_signature(slots, kv_len)
        rounds = self._width_shapes(slots, widths)
        shapes = shapes or batch_shapes(slots, self.max_prompt_len(kv_len))
        rows_seconds = {}
        if seconds is not None:
            for r in decode_buckets:
                if r < slots and (t := self.round_seconds(slots, kv_len, rows=r)) is not None:
                    rows_seconds[r] = t
        calibrates = seconds is None and self.spec.calibrate_repeats > 0
        choice = WidthOptions(widths=rounds, seconds=seconds, user_capacity=self.spec.capacity,
                              rows_seconds=rows_seconds, width_margin=self.spec.width_margin,
                              calibrate_repeats=self.spec.calibrate_repeats if calibrates else 0,
                              on_calibrated=(functools.partial(self._save_calibration, kv_len, sig) if calibrates
                                             else None),
                              times_origin=times_origin)
        return WidthBackend(self._target, self._drafter,
                            self._layout(slots, kv_len, shapes, decode_buckets, logprobs),
                            mode=self.spec.mode, choice=choice)

    def _width_shapes(self, slots: int, widths: tuple[int, ...]) -> dict[int, dict[bool, RoundShape]]:
        """{w: {flavour: round shape}} of the width buckets: w nodes a row, or with spec.packed_widths a batch-wide
        budget of slots · w nodes at row capacity max(widths), packed (width 1: plain decoding either way)."""
        if not self.spec.packed_widths:
            return {w: {s: dataclasses.replace(self.round_shape(s, w, slots), gain_widths=widths)
                        for s in (False, True)} for w in widths}
        N = max(widths)
        return {w: {s: dataclasses.replace(self.round_shape(s, 1 if w == 1 else N), gain_widths=widths,
                                           packed_gains=True, batch_budget=True,
                                           packed_rows=packed_rows(slots * w, slots, N) if w > 1 else 0)
                    for s in (False, True)} for w in widths}

    def backend(self, slots: int, kv_len: int, shapes: Sequence[tuple[int, int]] | None = None,
                decode_buckets: Sequence[int] = (), logprobs: int = 0) -> Backend:
        """The backend of this engine for the bucket (slots, KV length): plain decoding, an `ARBackend`; else one of
        this engine's drafter and rounds: with spec.adaptive_width and calibrated round times of the bucket, the
        width chosen each round (`width_backend`); without them but with spec.calibrate_repeats, the same from round
        times the backend measures when it compiles (`WidthBackend.calibrate`); else N from `nodes_for`, capacity
        spec.capacity or slots · N. Prefill shapes (default: all `slots` rows of every prompt bucket the KV length
        holds); decoding buckets: the row counts below `slots` a round is also compiled for (`Backend.step_rows`);
        logprobs: the top alternatives every program computes beside each emitted token's logprob
        (`SlotLayout.logprobs`; 0: none)."""
        if self.spec.mode == "ar":
            return ARBackend(self._target, self._layout(slots, kv_len, shapes, decode_buckets, logprobs))
        seconds, origin = self._round_times(slots, kv_len) if self.spec.adaptive_width else (None, "")
        if seconds is not None:
            return self.width_backend(slots, kv_len, seconds, shapes, decode_buckets, times_origin=origin,
                                      logprobs=logprobs)
        if self.spec.adaptive_width and self.spec.calibrate_repeats and self.nodes_for(slots, kv_len) > 1:
            return self.width_backend(slots, kv_len, None, shapes, decode_buckets,       # timed at start-up
                                      logprobs=logprobs)
        N = self.nodes_for(slots, kv_len)
        return SpecBackend(self._target, self._drafter, self._layout(slots, kv_len, shapes, decode_buckets, logprobs),
                           mode=self.spec.mode, round_shapes={s: self.round_shape(s, N, slots) for s in (False, True)},
                           capacity=self.spec.capacity or slots * N)

    @property
    def _target(self) -> JitModel:
        return JitModel(self.config, self.tgraph, self.tparams)

    @property
    def _drafter(self) -> JitModel:
        """The drafter as the round takes it (an MTP head: the target's config, the head's graph and params)."""
        return JitModel(self.drafter.config, self.dgraph, self.dparams)

    def _layout(self, slots: int, kv_len: int, shapes: Sequence[tuple[int, int]] | None,
                decode_buckets: Sequence[int], logprobs: int = 0) -> SlotLayout:
        """The bucket's layout: every prompt bucket the KV length holds over all slots unless `shapes` are given."""
        return SlotLayout(slots, kv_len, shapes or batch_shapes(slots, self.max_prompt_len(kv_len)),
                          self.spec.deferred_rows, decode_buckets, logprobs)

    def bucket_for(self, prompts, plist) -> tuple[int, int]:
        """The bucket a request batch runs in: (slots B, KV length S) — the engine's slots, else
        `default_slots(#prompts)`; its KV length, else bucket(longest prompt + largest max_tokens + `overshoot`,
        128), the rule a server's KV length follows too (max-model-len + overshoot). One rule for every mode,
        `generate` and the profilers."""
        B = self.slots or default_slots(len(prompts), self.tparams)
        need = max(len(p) for p in prompts) + max(p.max_tokens for p in plist) + self.overshoot
        S = self.kv_len or bucket(need, 128)
        if need > S:
            raise ValueError(f"kv_len {S} is too short: prompts + max_tokens + draft depth need {need}")
        return B, S

    @property
    def overshoot(self) -> int:
        """KV positions a round may write past a request's last token (γ + 2; 0 for ar)."""
        return 0 if self.spec.mode == "ar" else self._gamma + 2

    def max_prompt_len(self, kv_len: int) -> int:
        """Longest prompt a KV length holds (with one new token and the round's overshoot)."""
        return kv_len - 1 - self.overshoot

    def compile_buckets(self, buckets: Sequence[tuple[int, int]], prompt_lengths: Sequence[int] | None = None,
                        stochastic: Sequence[bool] = (False, True), progress: bool = True, cache: bool = True) -> int:
        """Start-up compile: for every (batch slots, KV length) bucket, the prefill of every prompt bucket
        (prompt_lengths rounded up to powers of two ≥ 16; default: every one the KV length holds) and the step or
        round (greedy and/or sampling: separate programs); then mark start-up (`compilations_after_startup` counts
        from here). A `generate` call runs in `bucket_for` its batch. cache: use JAX's persistent compilation
        cache. Returns the number of programs compiled."""
        if cache:
            use_compilation_cache()
        watch = CompileWatch()
        compile_backends([self.backend(B, S) for B, S in buckets], prompt_lengths, stochastic, progress)
        self.watch.mark()
        return watch.since

    def warmup(self, batch: int | None = None, kv_len: int | None = None, progress: bool = True, cache: bool = True,
               stochastic: Sequence[bool] = (False, True)) -> int:
        """Start-up compile of one bucket: the slots of `batch` requests (unset: the engine's slots, else 1
        request's) and KV length kv_len (unset: the engine's, else 128), with every prompt bucket; see
        compile_buckets."""
        slots = default_slots(batch, self.tparams) if batch else self.slots or default_slots(1, self.tparams)
        return self.compile_buckets([(slots, kv_len or self.kv_len or 128)], progress=progress, cache=cache,
                                    stochastic=stochastic)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for ragged prompts in the bucket `bucket_for` gives them; `on_tokens(request_index, new_ids)`
        streams tokens as steps commit them. The batch's statistics: `last_stats`."""
        if not prompts:
            return []
        plist = validate_prompts(prompts, params, self.config.vocab_size)
        t0 = time.perf_counter()
        B, S = self.bucket_for(prompts, plist)
        be = self.backend(B, S)
        reqs, got, loop = run_batch(be, prompts, plist, on_tokens)
        seconds = time.perf_counter() - t0
        spec = isinstance(be, SpecBackend)
        D = be.depth if spec else 0
        # plain decoding: every step commits one token and accepts no draft
        accepted = [list(r.accepted) if spec else [0] * len(r.committed) for r in reqs]
        committed = [c for r in reqs for c in r.committed]
        acc_all = np.asarray([a for acc in accepted for a in acc])
        self.last_stats = SpecStats(
            mode=self.spec.mode, rounds=loop.steps_collected,
            tau=float(np.mean(committed)) if committed else 0.0,
            accepted_per_position=[float(np.mean(acc_all > k)) if len(acc_all) else 0.0 for k in range(D)],
            # steps overlap each other in the pipeline: their time is the generation's less its prefills
            seconds=seconds, prefill_seconds=loop.prefill_seconds, round_seconds=seconds - loop.prefill_seconds,
            verify_nodes=be.verify_nodes if spec else 1, capacity=be.capacity if spec else 0,
            compilations_after_startup=self.compilations_after_startup,
            prefix_survival=prefix_survival(accepted, D),
            width_rounds=dict(sorted(be.width_counts.items())) if isinstance(be, WidthBackend) else {})
        return [GenerationResult(list(map(int, p)), got[i], r.finish_reason, len(r.committed), list(r.committed),
                                 accepted[i], seconds, loop.prefill_seconds, loop.warm_steps_per_second)
                for i, (p, r) in enumerate(zip(prompts, reqs))]


def _without_reader(drafter: Drafter) -> Drafter:
    """The same drafter with its reader detached (plain DSpark modes)."""
    graphdef, params = nnx.split(drafter)
    clone = nnx.merge(graphdef, params)
    clone.reader, clone.reader_config, clone.inject_at = None, None, -1
    return clone


__all__ = ["MODES", "Engine", "GenerationResult", "SpecConfig", "SpecStats", "default_slots", "use_compilation_cache",
           "validate_prompts"]
