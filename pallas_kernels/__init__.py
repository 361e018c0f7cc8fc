"""Pallas GPU kernels for speculative verification; each has a pure-JAX twin it must equal (docs/design.md §5).

- gdn_tree_solve: closed-form value-tiled GDN tree solve (Bole Algorithm 1), its form a `SolveConfig`
- gdn_tree_split_mgpu: the split form's value pass in Mosaic GPU (TMA, bf16-pair wgmma; 64 nodes, Hopper)
- add_norm: a residual add and the RMSNorm after it in one launch (the decoder layer's add + norm)
- gdn_commit: cross-layer factorized path commit (Bole Algorithm 2, Phase C)
- gdn_serial: baselines (SGLang-style per-node serial kernel; XLA closed form and per-path scan)
- tree_attention: a full-attention layer's verify over the KV cache + the tree (split-S prefix kernel)
- topk: the greedy tree build's per-level top-k + log-sum-exp (one row per program, or vocabulary chunks + a merge)
- trees: host helpers for random draft trees (tests, benchmarks)

A leaf package: it imports from hyspec_jax only the math its kernels must equal (hyspec_jax.gdn, .tree,
.attention). The library reaches these kernels through one door, `hyspec_jax.kernels`, which decides (fail-closed)
where a kernel runs and where its reference does. docs/kernels.md has each kernel form's measurements.
"""


def tile_dim_ok(x: int) -> bool:
    """A block dimension the Triton lowering takes: a power of two, at least 16 (tl.dot's smallest operand)."""
    return x >= 16 and (x & (x - 1)) == 0
