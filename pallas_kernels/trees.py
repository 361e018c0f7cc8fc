"""Small helpers for draft trees in topological order (shared by kernels, tests and the benchmark).

A tree of N nodes per request is given by `parents [B, N]` (int32, −1 = child of the committed state,
parents[i] < i) or by its ancestor-or-self mask `mask [B, N, N]` (bool, row i = e_i + row parents[i]).
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp


def mask_from_parents(parents: jax.Array) -> jax.Array:
    """Ancestor-or-self mask [B, N, N] from parents [B, N] (topological order, parents[i] < i)."""
    parents = jnp.asarray(parents, jnp.int32)
    B, N = parents.shape
    eye = jnp.eye(N, dtype=bool)

    def body(i, m):
        p = parents[:, i]
        prow = jnp.take_along_axis(m, jnp.maximum(p, 0)[:, None, None], axis=1)[:, 0]   # [B,N]
        prow = jnp.where((p >= 0)[:, None], prow, False)
        return m.at[:, i].set(prow | eye[i][None])

    return jax.lax.fori_loop(0, N, body, jnp.zeros((B, N, N), bool))


def parents_from_mask(mask: jax.Array) -> jax.Array:
    """Parent of each node = its nearest (largest-index) proper ancestor; −1 for roots. [B, N] int32."""
    N = mask.shape[-1]
    idx = jnp.arange(N, dtype=jnp.int32)
    proper = mask.astype(bool) & (idx[None, :] != idx[:, None])[None]
    return jnp.max(jnp.where(proper, idx[None, None, :], -1), axis=-1).astype(jnp.int32)


def depth_of(mask: jax.Array) -> jax.Array:
    """Nodes on each node's path (self included), [B, N]."""
    return jnp.sum(mask.astype(jnp.int32), axis=-1)


def random_parents(seed: int, batch: int, n: int, max_depth: int, single_root: bool = True) -> np.ndarray:
    """Random trees with n nodes whose longest root-to-leaf path has at most max_depth nodes.

    Node 0 is the root (parent −1). With single_root=False, later nodes may also hang off the committed
    state (parent −1), as a forest. Each tree reaches depth max_depth when n allows it (a chain is planted).
    """
    rng = np.random.default_rng(seed)
    parents = np.full((batch, n), -1, np.int32)
    for b in range(batch):
        depth = np.zeros(n, np.int32)
        depth[0] = 1
        chain = min(max_depth, n)
        for i in range(1, n):
            if i < chain:                       # plant one full-depth path
                p = i - 1
            else:
                cand = np.nonzero(depth[:i] < max_depth)[0]
                if len(cand) == 0 or (not single_root and rng.random() < 0.1):
                    p = -1                      # max_depth 1 forces a forest of roots
                else:
                    p = int(rng.choice(cand))
            parents[b, i] = p
            depth[i] = 1 if p < 0 else depth[p] + 1
        # shuffle nothing: topological order is required and kept
    return parents


def leaf_paths(parents: np.ndarray, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Root-to-leaf paths per request, padded: nodes [B, P, max_depth] (−1 pad), P = max leaves over B.

    Returns (path_nodes, valid) with valid [B, P, max_depth] bool.
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
    nodes = np.full((B, P, max_depth), -1, np.int32)
    for b, paths in enumerate(all_paths):
        for p, path in enumerate(paths):
            assert len(path) <= max_depth, (len(path), max_depth)
            nodes[b, p, :len(path)] = path
    return nodes, nodes >= 0
