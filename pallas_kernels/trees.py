"""Small helpers for draft trees in topological order (shared by kernels, tests and the benchmark).

A tree of N nodes per request is given by `parents [B, N]` (int32, −1 = child of the committed state,
parents[i] < i) or by its ancestor-or-self mask `mask [B, N, N]` (bool, row i = e_i + row parents[i]).
Depth counts edges, as in `hyspec_jax.tree`: a node whose parent is −1 has depth 0, and a tree of depth d has
d + 1 nodes on its longest path (what the kernels' and `gdn.masked_solve`'s `path_nodes` take).
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from hyspec_jax import tree as tree_lib


def mask_from_parents(parents: jax.Array) -> jax.Array:
    """Ancestor-or-self mask [B, N, N] from parents [B, N] (topological order) — hyspec_jax.tree's."""
    return tree_lib.ancestor_mask(tree_lib.from_parents(jnp.asarray(parents, jnp.int32)))


def parents_from_mask(mask: jax.Array) -> jax.Array:
    """Parent of each node = its nearest (largest-index) proper ancestor; −1 for roots. [B, N] int32."""
    N = mask.shape[-1]
    idx = jnp.arange(N, dtype=jnp.int32)
    proper = mask.astype(bool) & (idx[None, :] != idx[:, None])[None]
    return jnp.max(jnp.where(proper, idx[None, None, :], -1), axis=-1).astype(jnp.int32)


def depth_of(mask: jax.Array) -> jax.Array:
    """Depth of each node (its ancestors among the nodes; 0 for a child of the committed state), [B, N]."""
    return jnp.sum(mask.astype(jnp.int32), axis=-1) - 1


def random_parents(seed: int, batch: int, n: int, max_depth: int, single_root: bool = True) -> np.ndarray:
    """Random trees [batch, n] of depth exactly min(max_depth, n − 1) (edges on the longest root-to-leaf path).
    With single_root=False, a few extra nodes hang off the committed state (a forest)."""
    rng = np.random.default_rng(seed)
    edges = max(min(max_depth, n - 1), 0)
    out = []
    for _ in range(batch):
        roots = 1 if single_root or n < 4 else int(rng.integers(1, max(2, n // 8) + 1))
        roots = max(roots, 1) if edges > 0 else n            # depth 1: every node hangs off the state
        out.append(tree_lib.random_parents(rng, n, edges, min_depth=min(edges, n - roots), roots=roots))
    return np.stack(out).astype(np.int32)


def leaf_paths(parents: np.ndarray, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Root-to-leaf paths per request of trees of depth ≤ max_depth, padded: nodes [B, P, max_depth + 1] (−1 pad),
    P = max leaves over B.

    Returns (path_nodes, valid) with valid [B, P, max_depth + 1] bool.
    """
    B, N = parents.shape
    all_paths = []
    for b in range(B):
        is_parent = np.zeros(N, bool)
        for i in range(N):
            if parents[b, i] >= 0:
                is_parent[parents[b, i]] = True
        paths = []
        for leaf in np.nonzero(~is_parent)[0]:
            path, j = [], int(leaf)
            while j >= 0:
                path.append(j)
                j = int(parents[b, j])
            paths.append(path[::-1])
        all_paths.append(paths)
    P = max(len(p) for p in all_paths)
    nodes = np.full((B, P, max_depth + 1), -1, np.int32)
    for b, paths in enumerate(all_paths):
        for p, path in enumerate(paths):
            assert len(path) <= max_depth + 1, (len(path) - 1, max_depth)
            nodes[b, p, :len(path)] = path
    return nodes, nodes >= 0


def paths_to(parents: np.ndarray, nodes, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Root-first paths to `nodes` [B] (−1: empty) of trees of depth ≤ max_depth — hyspec_jax.tree's `path_to`,
    on the host: (path [B, max_depth + 1] int32, −1 padded; length [B] int32)."""
    tree = tree_lib.from_parents(jnp.asarray(parents, jnp.int32), max_depth=max_depth)
    path, length = tree_lib.path_to(tree, jnp.asarray(nodes, jnp.int32))
    return np.asarray(path, np.int32), np.asarray(length, np.int32)
