"""Which tree-solve kernel forms launch on this GPU at 64 / 128 nodes (the embedded model's geometry, fp32 and
bf16 inputs; each form × precision × value tile), as JSON rows with the first line of any launch error. Run on the
GPU machine from the repository root (PYTHONPATH=$PWD): python3 bench/recipes/tree_solve_launch_probe.py OUT.json.
Found at commit 608c10e: one-pass tf32 at 128 nodes launches (25 s to compile); the 3-pass forms were not reached
within that call's time (gdn_tree_solve.FP32_ACCURATE_MAX_NODES refuses them; the dispatcher takes the reference)."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from hyspec_jax.pallas_kernels import gdn_tree_solve as ts
from hyspec_jax.pallas_kernels import trees
from hyspec_jax.pallas_kernels.trees import mask_from_parents
rows = []
for N in (128, 64):                     # 128 first: the shape in question
    for dtype in (jnp.float32, jnp.bfloat16):
        B, HK, HV, dk, dv = 1, 4, 8, 64, 64
        par = trees.random_parents(0, B, N, 7, single_root=True)    # depth 7: 8 nodes on a path
        mask = mask_from_parents(jnp.asarray(par))
        r = np.random.default_rng(0)
        q = jnp.asarray(r.standard_normal((B, N, HK, dk)) * 0.1, dtype); k = q
        v = jnp.asarray(r.standard_normal((B, N, HV, dv)), dtype)
        g = -jnp.abs(jnp.asarray(r.standard_normal((B, N, HV)), jnp.float32)) * 0.1
        beta = jnp.full((B, N, HV), 0.5, jnp.float32)
        S0 = jnp.asarray(r.standard_normal((B, HV, dk, dv)), jnp.float32)
        for method in ("inverse", "split", "squaring"):
            for prec in ("tf32", "tf32x3"):
                for bv in (32, 64):
                    t = time.perf_counter()
                    try:
                        out = ts.tree_solve_pallas(S0, q, k, v, g, beta, mask, path_nodes=8, config=ts.SolveConfig(
                            method=method, block_v=bv, precision=prec))
                        jax.block_until_ready(out); err = ""
                    except Exception as e:  # noqa: BLE001
                        err = str(e).splitlines()[0][:200]
                    rows.append(dict(N=N, dtype=str(jnp.dtype(dtype)), method=method, precision=prec, block_v=bv,
                                     ok=not err, error=err, s=round(time.perf_counter() - t, 2)))
                    print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
