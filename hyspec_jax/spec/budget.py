"""Verification budget: Bole's hardware-calibrated batch-shared capacity (Algorithm 3) and DSpark's
confidence-based chain length.

Offline (`hyspec calibrate`, `hyspec_jax.runtime.calibrate`): for a bucket c = (device kind, model, batch slots B,
KV length S, tree depth d) measure the complete target verify forward T_ver(N | c) for every compiled node
capacity N (nodes per request row, anchor included) and the one-token decode T_dec(c), and store

    B_ver(c) = max { N : T_ver(N | c) ≤ (1 + ε) · T_dec(c) }        (Bole eq. 12)

in a JSON table (`BudgetTable`). The engine compiles its verify with row width N = B_ver(c).

Online (`select_nodes`, every round, on device, fixed shapes): the candidates of all requests compete for a
batch-wide capacity C (nodes, anchors included; a runtime scalar, so changing it never recompiles). The anchor
and the best root child of every active request are always kept (Bole's fairness floor); the remaining
capacity goes to the batch-wide highest-score nodes. Scores never increase down a path and ties are broken by
depth (shallower first), then slot, then node index — so every prefix of this order is ancestor-closed and
each request's selection is prefix-connected without a repair pass. A row holds at most N nodes (the compiled
verify width): a node is eligible only if fewer than N nodes of its row rank above it, which is again a
prefix of the row's order. Whether a node is kept depends only on the nodes ranked above it — never on its
own token or its descendants — which is what lossless tree sampling needs (`spec.select`).

Data layout: the selection is a [B, N] forest. Without a batch-wide budget below B·N the verify runs over it
as it is, and the engine makes its cost follow the capacity by choosing N per round from a small set of width
buckets, one compiled round each (`runtime.width`): width w selects C = slots · w nodes (per row: the anchor and its
w − 1 best candidates, `width_gains`), and the round at width w costs what the calibration measured for it. With
a budget C below slots · w (`--budget`), the verify packs the selected nodes into C rows (`packed_rows`, Bole's
packed forest): its row-wise work — embedding, projections, norms, MLP, LM head — costs C rows, not B·N, while the
per-request parts (conv windows, tree solve, tree attention) read the nodes in the [B, N] layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct

I32 = jnp.int32
F32 = jnp.float32


# ------------------------------------------------------------------------------------------------
# Online selection
# ------------------------------------------------------------------------------------------------
@struct.dataclass
class Selection:
    index: jax.Array   # [B, N] int32 candidate index of each kept node (in candidate order); padding: 0
    valid: jax.Array   # [B, N] bool
    parent: jax.Array  # [B, N] int32 parent in the compacted numbering (−1 for the anchor and padding)
    depth: jax.Array   # [B, N] int32
    kept: jax.Array    # [B, M] bool which candidates were kept


def packed_rows(capacity: int | None, slots: int, width: int) -> int:
    """Rows of a round's packed verify (`RoundShape.packed_rows`; 0 = the dense [slots, width] forest). A batch-wide
    budget C below slots · width packs the selected nodes into max(C, 2 · slots) rows, so the verify's row-wise
    work follows C (`tree.pack_nodes`): the selection keeps every active slot's anchor and best root child whatever
    C is (`root_floor`), hence never fewer rows than that. Width 1 (plain decoding) verifies nothing."""
    if capacity is None or width <= 1:
        return 0
    rows = max(int(capacity), 2 * slots)
    return rows if rows < slots * width else 0


def root_floor(score: jax.Array, parent: jax.Array, valid: jax.Array, active: jax.Array) -> jax.Array:
    """bool [B, M]: the anchor (candidate 0) and the best-scoring valid child of the anchor of every active
    row (ties: lowest index)."""
    B, M = score.shape
    child = valid & (parent == 0)
    best = jnp.argmax(jnp.where(child, score, -jnp.inf), axis=1)
    has = jnp.any(child, axis=1)
    idx = jnp.arange(M)[None]
    return active[:, None] & valid & ((idx == 0) | (has[:, None] & (idx == best[:, None])))


def select_nodes(score: jax.Array, parent: jax.Array, depth: jax.Array, valid: jax.Array, forced: jax.Array,
                 row_capacity: int, capacity: jax.Array | int, batch_capacity: bool = True) -> Selection:
    """Keep the forced nodes and the batch-wide best others, at most `capacity` nodes in all (but never fewer
    than the forced ones) and at most `row_capacity` per row; compact each row to width row_capacity.

    score [B,M] (log) selection scores, non-increasing down every path (−inf or invalid: never kept);
    parent/depth/valid [B,M] candidate forest in topological order (node 0 = anchor); forced [B,M].
    Kept rows stay in candidate order, so siblings keep their draw order. batch_capacity False: the caller
    guarantees capacity ≥ B · row_capacity, which then never binds — each row keeps its best row_capacity, ranked
    within the row alone (no batch-wide sort: fewer launches in a launch-bound round), the same selection.
    """
    B, M = score.shape
    chex.assert_shape([parent, depth, valid, forced], (B, M))
    N = int(row_capacity)
    valid = valid & (score > -jnp.inf) | forced
    score = jnp.where(valid, score, -jnp.inf).astype(F32)
    # the order: valid first, forced first, score desc, depth asc, row asc, index asc
    neg = jnp.where(valid, -score, jnp.inf)
    if not batch_capacity:
        # rank within each row: [B, i, j] compares node j's key with node i's, most significant first
        before, tied = jnp.zeros((B, M, M), bool), jnp.ones((B, M, M), bool)
        for key in ((~valid).astype(I32), (~forced).astype(I32), neg, depth,
                    jnp.broadcast_to(jnp.arange(M, dtype=I32)[None], (B, M))):
            before = before | (tied & (key[:, None, :] < key[:, :, None]))
            tied = tied & (key[:, None, :] == key[:, :, None])
        row_rank = jnp.sum(valid[:, None, :] & before, axis=2)
        kept = valid & (row_rank < N)
        return _compact(kept, parent, depth, N)
    row = jnp.broadcast_to(jnp.arange(B, dtype=I32)[:, None], (B, M)).reshape(-1)
    idx = jnp.broadcast_to(jnp.arange(M, dtype=I32)[None], (B, M)).reshape(-1)
    order = jnp.lexsort((idx, row, depth.reshape(-1), neg.reshape(-1), ~forced.reshape(-1), ~valid.reshape(-1)))
    rank = jnp.zeros((B * M,), I32).at[order].set(jnp.arange(B * M, dtype=I32)).reshape(B, M)
    above = valid[:, None, :] & (rank[:, None, :] < rank[:, :, None])          # [B, i, j]: j ranks above i
    row_rank = jnp.sum(above, axis=2)
    eligible = valid & (row_rank < N)
    e_sorted = eligible.reshape(-1)[order]
    e_rank = jnp.zeros((B * M,), I32).at[order].set(jnp.cumsum(e_sorted, dtype=I32) - 1).reshape(B, M)
    n_forced = jnp.sum(forced & eligible, dtype=I32)
    cap = jnp.maximum(jnp.asarray(capacity, I32), n_forced)
    kept = eligible & (e_rank < cap)
    return _compact(kept, parent, depth, N)


def _compact(kept: jax.Array, parent: jax.Array, depth: jax.Array, N: int) -> Selection:
    """The kept nodes of each row compacted to width N in candidate order (`select_nodes`' result)."""
    B, M = kept.shape
    if M < N:
        pad = lambda x, v: jnp.pad(x, ((0, 0), (0, N - M)), constant_values=v)  # noqa: E731
        kept_p, parent_p, depth_p = pad(kept, False), pad(parent, -1), pad(depth, 0)
    else:
        kept_p, parent_p, depth_p = kept, parent, depth
    take = jnp.argsort(~kept_p, axis=1, stable=True)[:, :N].astype(I32)
    sel_valid = jnp.take_along_axis(kept_p, take, axis=1)
    rows = jnp.arange(B)[:, None]
    inv = jnp.full(kept_p.shape, -1, I32).at[rows, take].set(
        jnp.where(sel_valid, jnp.arange(N, dtype=I32)[None], -1))
    par = jnp.take_along_axis(parent_p, take, axis=1)
    new_parent = jnp.where(sel_valid & (par >= 0), jnp.take_along_axis(inv, jnp.maximum(par, 0), axis=1), -1)
    index = jnp.where(sel_valid, jnp.minimum(take, M - 1), 0)
    return Selection(index=index, valid=sel_valid, parent=new_parent,
                     depth=jnp.where(sel_valid, jnp.take_along_axis(depth_p, take, axis=1), 0), kept=kept)


def width_gains(score: jax.Array, valid: jax.Array, active: jax.Array, widths: tuple[int, ...]) -> jax.Array:
    """The drafter's expected accepted drafts of every row at each verify width w (fp32 [B, len(widths)]).

    Width w verifies the selection `select_nodes` makes at row capacity w and batch capacity slots · w: every
    active row keeps its anchor and its w − 1 best other candidates (the best root child first — scores never
    increase down a path, so it is the row's best non-anchor node — then the rest by score, ancestor-closed
    by the same argument). Bole's objective for that selection is Σ ρ(v) over its non-anchor nodes: each
    node's path probability under the drafter is its estimate of the node being on the accepted path.
    score [B, M] log scores (node 0 = anchor); inactive rows and width 1 give 0."""
    B, M = score.shape
    k = max(1, min(max(widths) - 1, M - 1))
    s = jnp.where(valid & (jnp.arange(M)[None] > 0) & active[:, None], score, -jnp.inf).astype(F32)
    best = jax.lax.top_k(s, k)[0] if M > 1 else jnp.full((B, 1), -jnp.inf, F32)
    csum = jnp.concatenate([jnp.zeros((B, 1), F32), jnp.cumsum(jnp.exp(best), axis=1)], axis=1)   # [B, k + 1]
    return csum[:, [min(w - 1, k) for w in widths]]


def packed_gains(score: jax.Array, valid: jax.Array, active: jax.Array, widths: tuple[int, ...],
                 row_capacity: int) -> jax.Array:
    """The drafter's expected accepted drafts of every row at each packed width w (fp32 [B, len(widths)]): width w
    verifies the batch-wide selection of capacity C = slots · w at row capacity `row_capacity` (packed into C rows,
    `packed_rows`) — every active row's anchor and best root child, then the batch's best other candidates, at most
    row_capacity − 1 drafts a row. Row b's entry is Σ ρ over its drafts in that selection, so the mean over the live
    rows is the batch's expected accepted drafts per request. Ties among equal scores are broken by row order here,
    by depth in `select_nodes`: an estimate either way. score [B, M] log scores (node 0 = anchor)."""
    B, M = score.shape
    k = max(1, min(row_capacity - 1, M - 1))
    s = jnp.where(valid & (jnp.arange(M)[None] > 0) & active[:, None], score, -jnp.inf).astype(F32)
    best = jax.lax.top_k(s, k)[0] if M > 1 else jnp.full((B, 1), -jnp.inf, F32)       # [B, k], row's best first
    rho = jnp.exp(best)                                                                 # 0 where −inf
    # the floor: every live anchor, and the root child of every live row that drafted one
    floor = jnp.sum(active, dtype=I32) + jnp.sum(jnp.isfinite(best[:, 0]), dtype=I32)
    rest = best[:, 1:].reshape(-1)                                                      # beyond each root child
    order = jnp.argsort(-rest, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(rest.shape[0], dtype=order.dtype)).reshape(B, k - 1)
    out = []
    for w in widths:
        spare = jnp.maximum(B * w - floor, 0)
        kept = (rank < spare) & jnp.isfinite(best[:, 1:])
        row = jnp.where(jnp.isfinite(best[:, 0]) & (w > 1), rho[:, 0], 0.0) + jnp.sum(jnp.where(kept & (w > 1), rho[:, 1:], 0.0), axis=1)
        out.append(jnp.where(active, row, 0.0))
    return jnp.stack(out, axis=1)


def confident_length(confidence: jax.Array, threshold: float | jax.Array, min_length: int = 1) -> jax.Array:
    """DSpark's confidence-scheduled chain length: the number of leading draft slots whose prefix survival
    a_k = Π_{i≤k} c_i is ≥ threshold (at least min_length). confidence [B,G] -> [B] int32.

    Lossless with sampling: c_k depends on the slot's hidden state and the previous token only, so whether
    slot k is verified never depends on the token drafted at slot k."""
    surv = jnp.cumprod(confidence.astype(F32), axis=1)
    n = jnp.sum(surv >= threshold, axis=1, dtype=I32)
    return jnp.clip(n, min(min_length, confidence.shape[1]), confidence.shape[1])


# ------------------------------------------------------------------------------------------------
# Offline calibration table
# ------------------------------------------------------------------------------------------------
def b_ver(t_ver: dict[int, float], t_dec: float, eps: float) -> tuple[int, bool]:
    """(B_ver, within) — the largest capacity N with T_ver(N) ≤ (1+ε)·T_dec; when none is within the
    tolerance, the smallest capacity and within=False."""
    if not t_ver:
        raise ValueError("no verify timings")
    ok = [n for n, t in t_ver.items() if t <= (1.0 + eps) * t_dec]
    return (max(ok), True) if ok else (min(t_ver), False)


def model_id(config: Any, name: str = "") -> str:
    """A stable id of a target model: its directory name (if any) and a hash of its config."""
    if dataclasses.is_dataclass(config):      # fields marked identity=False (e.g. an MTP head's size) left out
        skip = {f.name for f in dataclasses.fields(config) if not f.metadata.get("identity", True)}
        raw = json.dumps({k: v for k, v in dataclasses.asdict(config).items() if k not in skip}, sort_keys=True,
                         default=str)
    else:
        raw = json.dumps(config, sort_keys=True, default=str)
    digest = hashlib.sha256(raw.encode()).hexdigest()[:12]
    return f"{name}@{digest}" if name else digest


def bucket_key(device_kind: str, model: str, batch: int, kv_len: int, depth: int) -> str:
    return f"{device_kind}|{model}|B={batch}|S={kv_len}|d={depth}"


@dataclasses.dataclass
class BudgetTable:
    """JSON table of calibrated capacities keyed by device kind, model and bucket."""

    entries: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    VERSION = 1

    @classmethod
    def load(cls, path: str | Path) -> "BudgetTable":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"budget table {path}: no such file")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"budget table {path}: invalid JSON ({e.msg})") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("entries"), dict):
            raise ValueError(f"budget table {path}: expected an object with \"entries\"")
        return cls(entries=dict(raw["entries"]))

    def save(self, path: str | Path) -> None:
        """Write the table atomically (a temporary file renamed over `path`): two writers at once (servers
        starting side by side) each leave a whole file, never a torn one."""
        import os
        import tempfile
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"version": self.VERSION, "entries": self.entries}, indent=2, sort_keys=True)
                        + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def add(self, entry: dict[str, Any]) -> str:
        """Add or replace a bucket's entry; the round times of other rounds an older entry held are kept."""
        key = bucket_key(entry["device_kind"], entry["model"], entry["batch"], entry["kv_len"], entry["max_depth"])
        rounds = {**(self.entries.get(key, {}).get("t_round_ms") or {}), **(entry.get("t_round_ms") or {})}
        self.entries[key] = {**entry, **({"t_round_ms": rounds} if rounds else {})}
        return key

    def lookup(self, device_kind: str, model: str, batch: int, kv_len: int, depth: int | None = None,
               round_signature: str | None = None) -> dict[str, Any] | None:
        """The entry of this bucket, else the smallest calibrated bucket covering it (batch ≥, kv_len ≥),
        preferring the given tree depth; None when no calibrated bucket covers it. round_signature: only
        entries holding round times of that round (`t_round_ms`, `runtime.width.round_signature`)."""
        cands = [e for e in self.entries.values()
                 if e["device_kind"] == device_kind and e["model"] == model and e["batch"] >= batch
                 and e["kv_len"] >= kv_len
                 and (round_signature is None or round_signature in (e.get("t_round_ms") or {}))]
        if not cands:
            return None
        return min(cands, key=lambda e: (depth is not None and e["max_depth"] != depth, e["batch"], e["kv_len"]))


__all__ = ["Selection", "packed_rows", "packed_gains", "root_floor", "select_nodes", "width_gains", "confident_length", "b_ver", "model_id", "bucket_key",
           "BudgetTable"]
