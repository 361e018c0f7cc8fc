"""Accuracy of split_mgpu's operator chains on one path of 8, 16 or 64 nodes (of a 64-node tree) against the
triangular solve, in interpret mode (CPU): random keys, and keys nearly alike along
the path with β and decays near 1 (where the power series (I−L)(I+L²)… alone loses its digits;
gdn.block_inverse). Prints one line per case; bench/results/kernels/tree_solve_deep_paths.md has the numbers.

    PYTHONPATH=.:tests python bench/recipes/deep_path_accuracy.py
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from test_kernels import _unit, make_inputs, reference, rel

from hyspec_jax.pallas_kernels import trees
from hyspec_jax.pallas_kernels.gdn_tree_solve import SolveConfig, tree_solve_pallas

N, DK = 64, 64


def path_mask(depth: int):
    """A path of `depth` nodes from the root; the other nodes hang off the root."""
    parents = np.zeros((1, N), np.int32)
    parents[0, 0], parents[0, 1:depth] = -1, np.arange(depth - 1)
    return trees.mask_from_parents(jnp.asarray(parents))


def main() -> None:
    for depth in (8, 16, 64):
        for spread, beta_v, g_v in ((None, None, None), (0.1, 0.9, -0.01), (0.02, 0.97, -0.001)):
            _, _, (S0, q, k, v, g, beta) = make_inputs(5, 1, N, 1, 1, DK, DK, 8, dtype=jnp.bfloat16)
            if spread is not None:                  # keys nearly alike, β and decays near 1
                rng = np.random.default_rng(1)
                k = jnp.asarray(_unit(rng.standard_normal((1, 1, 1, DK)) + spread * rng.standard_normal((1, N, 1, DK))),
                                jnp.bfloat16)
                beta, g = jnp.full_like(beta, beta_v), jnp.full_like(g, g_v)
            mask = path_mask(depth)
            o_ref, _ = reference(S0, q, k, v, g, beta, mask)
            errs = []
            for chain in ("f16", "pair"):
                o, _, _ = tree_solve_pallas(S0, q, k, v, g, beta, mask, path_nodes=depth, interpret=True,
                                            config=SolveConfig(method="split_mgpu", operator_chain=chain))
                o = np.asarray(o, np.float64)
                errs.append(f"{chain} {rel(o, o_ref):.1e}" if np.isfinite(o).all() else f"{chain} non-finite")
            keys = "random keys" if spread is None else f"keys spread {spread}, beta {beta_v}, g {g_v}"
            print(f"path of {depth:2d} nodes, {keys}: " + ", ".join(errs), flush=True)


if __name__ == "__main__":
    main()
