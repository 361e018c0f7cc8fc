"""Tree topology for speculative verification (docs/design.md §4, docs/reference/target_model.md §14).

A tree (in general a forest) is a static envelope `TreeShape(max_nodes N, max_depth d)` plus per-row data
(`Tree`, a pytree batched over request slots B):

  parent [B, N] int32   −1 = child of the committed state; otherwise an earlier node (parent < own index,
                        i.e. nodes are in topological order).
  valid  [B, N] bool    invalid nodes are padding: isolated (parent −1, depth 0), no valid node hangs below one.
  depth  [B, N] int32   number of ancestors among the nodes: a node with parent −1 has depth 0.

Conventions (one home for them):
- In the engine the anchor (the last target-chosen token, not yet processed) is node 0 with parent −1 and
  depth 0; drafts hang below it. Node position = prefix_len + depth, so the anchor sits at prefix_len.
- `TreeShape.max_depth` is the largest depth of any node, i.e. the number of *edges* on the longest path
  (Bole's d: the strict-ancestor matrix satisfies G^{d+1} = 0). The number of *nodes* on that path is
  `TreeShape.path_nodes = max_depth + 1`, which is what `gdn.masked_solve(path_nodes=...)` and
  `gdn.unit_lower_inverse` take.
- "Steps past the root": walking up from a node of depth t, the j-th ancestor for j > t is encoded as
  −(j − t). So column 1 of `kth_ancestor` is exactly `parent`, and `(K−1) + kth_ancestor` indexes
  concat(committed conv window [K−1 rows, oldest first], node inputs [N rows]) — the conv tap table.

Two static shapes, kept apart because they answer different questions: `TreeExpansion` (depth, top_k,
beam) says how a draft tree is grown from one draft block, and so how many candidates there are;
`TreeShape` (max_nodes, max_depth) is the padded envelope of the tree the target verifies (chains too),
fixed per compiled program, after the budget picked max_nodes of those candidates. Both count depth in
edges below the anchor.

Everything on device is vectorised: at most O(max_depth) unrolled gathers of [B, N] index arrays, never a
Python loop over nodes. Host-side helpers (numpy) pad ragged trees into an envelope with clear errors and
generate random trees for tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Static envelope of a verified tree: the padded shape one compiled verify program takes (hashable: a
    static jit argument)."""
    max_nodes: int   # N
    max_depth: int   # d: largest node depth (edges on the longest path; the anchor has depth 0)

    def __post_init__(self):
        if self.max_nodes < 1:
            raise ValueError(f"max_nodes must be ≥ 1, got {self.max_nodes}")
        if self.max_depth < 0:
            raise ValueError(f"max_depth must be ≥ 0, got {self.max_depth}")

    @property
    def path_nodes(self) -> int:
        """Nodes on the longest root-to-leaf path (= `max_depth` argument of gdn.masked_solve)."""
        return self.max_depth + 1


@dataclasses.dataclass(frozen=True)
class TreeExpansion:
    """How a draft tree is grown from one draft block (EAGLE-2 style beam, hashable: a static jit argument).

    `depth` draft levels below the anchor (edges; ≤ γ, the block's draft slots), `top_k` children per
    expanded node, at most `beam` nodes kept per level.
    """
    depth: int
    top_k: int
    beam: int

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.beam < 1:
            raise ValueError(f"tree needs depth, top_k, beam >= 1, got {self}")

    def widths(self) -> tuple[int, ...]:
        """Nodes kept at depth 1 .. depth: min(beam, top_k · nodes kept one level up)."""
        out, w = [], 1
        for _ in range(self.depth):
            w = min(self.beam, w * self.top_k)
            out.append(w)
        return tuple(out)

    @property
    def num_candidates(self) -> int:
        """Candidates per row, anchor included."""
        return 1 + sum(self.widths())


@struct.dataclass
class Tree:
    parent: jax.Array  # [B, N] int32, −1 = child of the committed state; parent < own index
    valid: jax.Array   # [B, N] bool
    depth: jax.Array   # [B, N] int32, 0 for nodes with parent −1 (and for invalid nodes)
    envelope: TreeShape = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return self.parent.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.envelope.max_nodes

    @property
    def max_depth(self) -> int:
        return self.envelope.max_depth


def _take(a: jax.Array, idx: jax.Array) -> jax.Array:
    """a [B, N, ...] gathered at per-row node indices idx [B, M] (negative → clipped to 0; mask after)."""
    idx = jnp.maximum(idx, 0)
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


def _check(tree: Tree) -> None:
    chex.assert_shape([tree.parent, tree.valid, tree.depth], (None, tree.envelope.max_nodes))
    chex.assert_type([tree.parent, tree.depth], I32)
    chex.assert_type(tree.valid, bool)


# ------------------------------------------------------------------------------------------------
# Constructors (device)
# ------------------------------------------------------------------------------------------------
def from_parents(parent: jax.Array, valid: jax.Array | None = None, *, max_depth: int | None = None) -> Tree:
    """Tree from parent pointers [B, N] (and validity [B, N]); depth derived on device in max_depth steps.

    Inputs are sanitised so the invariants hold inside jit, where nothing can raise: a node is kept valid
    only if it is marked valid, its parent is in [−1, own index), every ancestor is kept valid, and its
    depth is ≤ max_depth (deeper nodes are dropped with their subtrees). Dropped nodes become isolated
    (parent −1, depth 0). Use `pack_forest` on the host to get errors instead. max_depth defaults to N − 1
    (always enough; pass the bucket's depth to save steps).
    """
    parent = jnp.asarray(parent).astype(I32)
    chex.assert_rank(parent, 2)
    B, N = parent.shape
    valid = jnp.ones((B, N), bool) if valid is None else jnp.asarray(valid).astype(bool)
    chex.assert_shape(valid, (B, N))
    d = N - 1 if max_depth is None else int(max_depth)
    idx = jnp.arange(N, dtype=I32)[None]
    ok0 = valid & (parent >= -1) & (parent < idx)        # local checks (topological order, range)
    par = jnp.where(ok0, parent, -1)
    ok, depth, a = ok0, jnp.zeros((B, N), I32), par
    for _ in range(d):                                   # walk up: one gather per level
        up = a >= 0
        depth = depth + up
        ok = ok & (~up | _take(ok0, a))
        a = jnp.where(up, _take(par, a), -1)
    ok = ok & (a < 0)                                    # still an ancestor after d steps → too deep
    return Tree(parent=jnp.where(ok, par, -1), valid=ok, depth=jnp.where(ok, depth, 0),
                envelope=TreeShape(N, d))


def chain(batch: int, n: int, lengths: jax.Array | None = None) -> Tree:
    """A chain of n nodes per row (parent[i] = i − 1, depth i); nodes i ≥ lengths[b] are invalid."""
    idx = jnp.arange(n, dtype=I32)
    valid = jnp.ones((batch, n), bool) if lengths is None else idx[None] < jnp.asarray(lengths, I32)[:, None]
    chex.assert_shape(valid, (batch, n))
    return Tree(parent=jnp.where(valid, idx[None] - 1, -1), valid=valid,
                depth=jnp.where(valid, idx[None], 0), envelope=TreeShape(n, n - 1))


# ------------------------------------------------------------------------------------------------
# Derived tables (device, once per round)
# ------------------------------------------------------------------------------------------------
def kth_ancestor(tree: Tree, k_max: int) -> jax.Array:
    """int32 [B, N, k_max+1]: column j = the j-th ancestor (j = 0: self), or −(steps past the root).

    For a node of depth t, columns j ≤ t are node indices, column j > t is −(j − t); column 1 is `parent`.
    Invalid nodes behave as isolated roots (self, −1, −2, …).
    """
    _check(tree)
    B, N = tree.parent.shape
    a = jnp.broadcast_to(jnp.arange(N, dtype=I32)[None], (B, N))
    cols = [a]
    for j in range(k_max):
        if j < tree.max_depth:
            a = jnp.where(a >= 0, _take(tree.parent, a), a - 1)
        else:   # after max_depth steps only roots are left in the tree: their parent is −1, no gather needed
            a = jnp.where(a >= 0, -1, a - 1)
        cols.append(a)
    return jnp.stack(cols, axis=-1)


def ancestor_mask(tree: Tree) -> jax.Array:
    """bool [B, N, N]: mask[b, i, j] = j is an ancestor of i or i itself (row i = i's path).

    Invalid rows and columns hold only the diagonal, so with g = β = 0 on invalid nodes (gdn.invalidate)
    gdn.masked_solve treats them as isolated identity steps. The same mask serves attention over the nodes.
    """
    anc = kth_ancestor(tree, tree.max_depth)                       # [B, N, d+1]
    N = tree.max_nodes
    # j is an ancestor-or-self of i iff it is i's (depth_i − depth_j)-th ancestor: one gather, O(N²).
    gap = tree.depth[:, :, None] - tree.depth[:, None, :]          # [B, N, N]
    hit = jnp.take_along_axis(anc, jnp.clip(gap, 0, tree.max_depth), axis=2)
    mask = (gap >= 0) & (hit == jnp.arange(N, dtype=I32)[None, None, :])
    chex.assert_shape(mask, (tree.batch, N, N))
    return mask


def conv_taps(tree: Tree, K: int) -> jax.Array:
    """int32 [B, N, K] indices into concat(window [K−1 rows, oldest first], x [N rows]) for gdn.gathered_conv.

    Tap K−1 = the node itself, K−2 = its parent, …; past the root the walk continues into the committed
    window from its last (newest) row backwards.
    """
    taps = (K - 1) + kth_ancestor(tree, K - 1)[..., ::-1]
    chex.assert_shape(taps, (tree.batch, tree.max_nodes, K))
    return taps


def window_taps_after(tree: Tree, node: jax.Array, K: int) -> jax.Array:
    """int32 [B, K−1] rows of concat(window, x) forming the conv window after committing through `node` [B].

    node −1 (nothing accepted) keeps the old window. Use with the raw (pre-conv) node inputs of each layer.
    """
    chex.assert_shape(node, (tree.batch,))
    taps = _take(conv_taps(tree, K), node[:, None])[:, 0, 1:]      # [B, K−1]
    keep = jnp.broadcast_to(jnp.arange(K - 1, dtype=I32)[None], taps.shape)
    return jnp.where((node >= 0)[:, None], taps, keep)


def positions(tree: Tree, prefix_len: jax.Array) -> jax.Array:
    """int32 [B, N] token positions: prefix_len + depth (the anchor, depth 0, sits at prefix_len)."""
    _check(tree)
    chex.assert_shape(prefix_len, (tree.batch,))
    return jnp.asarray(prefix_len, I32)[:, None] + tree.depth


def path_to(tree: Tree, node: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Root-to-node path: (indices int32 [B, max_depth+1], length [B]); entries ≥ length are −1.

    The path includes the depth-0 root (the anchor), hence max_depth + 1 slots. node −1 → length 0.
    """
    chex.assert_shape(node, (tree.batch,))
    d = tree.max_depth
    up = _take(kth_ancestor(tree, d), node[:, None])[:, 0]        # [B, d+1], up[j] = j-th ancestor
    length = jnp.where(node >= 0, _take(tree.depth, node[:, None])[:, 0] + 1, 0)
    j = jnp.arange(d + 1, dtype=I32)[None]
    idx = jnp.take_along_axis(up, jnp.clip(length[:, None] - 1 - j, 0, d), axis=1)
    return jnp.where(j < length[:, None], idx, -1), length


@struct.dataclass
class NodePacking:
    """The valid nodes of a [B, N] forest as C packed rows (Bole's packed forest): the verify's row-wise work
    (embedding, projections, norms, MLP, LM head) runs on C rows instead of B·N, so its cost follows the
    batch-wide node budget C rather than the per-row envelope; the per-request parts (conv windows, the tree
    solve, tree attention) read the same nodes back in the [B, N] layout.

    index [C] int32: the flat node (b·N + n) of packed row i — every valid node, in row-major order, then
    invalid ones to fill the C rows (their rows compute harmless values that `unpack` drops again)."""
    index: jax.Array
    batch: int = struct.field(pytree_node=False)
    nodes: int = struct.field(pytree_node=False)

    @property
    def rows(self) -> int:
        return self.index.shape[0]

    def pack(self, x: jax.Array) -> jax.Array:
        """x [B, N, ...] -> [1, C, ...] (one packed "row" of C tokens, the layout the dense layers take)."""
        chex.assert_shape(x, (self.batch, self.nodes, ...))
        return x.reshape((self.batch * self.nodes,) + x.shape[2:])[self.index][None]

    def unpack(self, x: jax.Array) -> jax.Array:
        """x [1, C, ...] -> [B, N, ...]: each packed row back at its node; nodes not packed are zero."""
        chex.assert_shape(x, (1, self.rows, ...))
        flat = jnp.zeros((self.batch * self.nodes,) + x.shape[2:], x.dtype).at[self.index].set(
            x[0], unique_indices=True)
        return flat.reshape((self.batch, self.nodes) + x.shape[2:])


def pack_nodes(tree: Tree, rows: int) -> NodePacking:
    """The packing of `tree`'s valid nodes into `rows` rows (C). The caller guarantees at most `rows` valid nodes
    (the budget's selection keeps at most C, `spec.budget.select_nodes`); a valid node past the C-th would not
    be computed."""
    _check(tree)
    B, N = tree.valid.shape
    if not 0 < rows <= B * N:
        raise ValueError(f"packed rows must be in [1, B·N = {B * N}], got {rows}")
    order = jnp.argsort(~tree.valid.reshape(-1), stable=True)       # valid nodes first, each group in order
    return NodePacking(order[:rows].astype(I32), B, N)


# ------------------------------------------------------------------------------------------------
# Host side: validation, packing ragged trees into one forest, random trees for tests
# ------------------------------------------------------------------------------------------------
def parent_depths(parent: np.ndarray) -> np.ndarray:
    """Depths of a 1-D parent array (host); raises ValueError unless −1 ≤ parent[i] < i."""
    parent = np.asarray(parent)
    if parent.ndim != 1:
        raise ValueError(f"parent array must be 1-D, got shape {parent.shape}")
    depth = np.zeros(len(parent), np.int32)
    for i, p in enumerate(parent.tolist()):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must be −1 or an earlier node "
                             "(topological order)")
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth


def pack_forest(parents: Sequence[np.ndarray], envelope: TreeShape, batch: int | None = None) -> Tree:
    """Pack ragged per-request trees (1-D parent arrays of their valid nodes) into one forest [batch, N].

    Rows beyond len(parents) are empty (all nodes invalid). Raises ValueError when a tree does not fit.
    """
    batch = len(parents) if batch is None else batch
    if len(parents) > batch:
        raise ValueError(f"{len(parents)} trees do not fit a batch of {batch} slots")
    N = envelope.max_nodes
    P = np.full((batch, N), -1, np.int32)
    V = np.zeros((batch, N), bool)
    D = np.zeros((batch, N), np.int32)
    for b, p in enumerate(parents):
        p = np.asarray(p, np.int64)
        if len(p) > N:
            raise ValueError(f"tree {b} has {len(p)} nodes; the envelope holds max_nodes={N}")
        try:
            depth = parent_depths(p)
        except ValueError as e:
            raise ValueError(f"tree {b}: {e}") from None
        if len(p) and depth.max() > envelope.max_depth:
            raise ValueError(f"tree {b} has depth {int(depth.max())}; the envelope allows max_depth="
                             f"{envelope.max_depth} (the anchor has depth 0)")
        P[b, :len(p)], V[b, :len(p)], D[b, :len(p)] = p, True, depth
    return Tree(parent=jnp.asarray(P), valid=jnp.asarray(V), depth=jnp.asarray(D), envelope=envelope)


def unpack(tree: Tree) -> list[np.ndarray]:
    """Inverse of pack_forest: per row, the parent array of its valid nodes, renumbered in order."""
    P, V = np.asarray(tree.parent), np.asarray(tree.valid)
    out = []
    for p, v in zip(P, V):
        keep = np.flatnonzero(v)
        new = np.full(len(p), -1, np.int64)
        new[keep] = np.arange(len(keep))
        out.append(np.where(p[keep] >= 0, new[np.maximum(p[keep], 0)], -1).astype(np.int32))
    return out


def random_parents(rng: np.random.Generator, n: int, max_depth: int, min_depth: int = 0,
                   roots: int = 1) -> np.ndarray:
    """A random forest of n nodes in a random topological order, deepest node depth in [min_depth, max_depth].

    `roots` nodes have parent −1 (the engine uses 1: the anchor). A spine guarantees min_depth; the other
    nodes attach uniformly to nodes shallower than max_depth; labels are a random topological order, so
    siblings interleave (nothing may assume BFS or DFS numbering).
    """
    if not 1 <= roots <= n:
        raise ValueError(f"need 1 ≤ roots ≤ n, got roots={roots}, n={n}")
    if max_depth == 0 and n > roots:
        raise ValueError(f"max_depth=0 allows only roots, but n={n} > roots={roots}")
    if min_depth > max_depth or min_depth > n - roots:
        raise ValueError(f"cannot reach depth {min_depth} with n={n}, roots={roots}, max_depth={max_depth}")
    par = [-1] * roots
    dep = [0] * roots
    spine = int(rng.integers(min_depth, min(max_depth, n - roots) + 1))
    for _ in range(spine):                               # one deep path first
        par.append(len(par) - 1)
        dep.append(dep[-1] + 1)
    while len(par) < n:
        open_ = [i for i in range(len(par)) if dep[i] < max_depth]
        p = int(open_[rng.integers(len(open_))])
        par.append(p)
        dep.append(dep[p] + 1)
    # random topological relabelling
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(par):
        if p >= 0:
            children[p].append(i)
    ready, order = [i for i in range(n) if par[i] < 0], []
    while ready:
        order.append(ready.pop(int(rng.integers(len(ready)))))
        ready.extend(children[order[-1]])
    label = np.empty(n, np.int64)
    label[order] = np.arange(n)
    out = np.full(n, -1, np.int32)
    for old, p in enumerate(par):
        out[label[old]] = -1 if p < 0 else label[p]
    return out
