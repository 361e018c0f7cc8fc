"""Pallas GPU kernels for GDN tree verification; each has a pure-JAX twin in hyspec_jax.gdn (DESIGN §5).

- gdn_tree_solve: closed-form value-tiled tree solve (Bole Algorithm 1)
- gdn_tree_split_mgpu: its split form's passes in Mosaic GPU (TMA, bf16-pair wgmma; 64 nodes, Hopper)
- gdn_commit: cross-layer factorized path commit (Bole Algorithm 2, Phase C)
- gdn_serial: baselines (SGLang-style per-node serial kernel; XLA closed form and per-path scan)
- topk: the greedy tree build's per-level top-k + log-sum-exp (one row per program, or vocabulary chunks + a merge)
- dispatch: fail-closed dispatcher with custom_vjp
"""


def tile_dim_ok(x: int) -> bool:
    """A block dimension the Triton lowering takes: a power of two, at least 16 (tl.dot's smallest operand)."""
    return x >= 16 and (x & (x - 1)) == 0
