"""What the verify's GDN tree solve costs per layer through the dispatcher (`kernels.tree_solve`, impl "auto"), at the
Qwen3.8-27B GDN geometry (HK 16, HV 48, dk = dv = 128, bf16 q/k/v, fp32 state), for trees of N nodes (depth
min(8, N - 1), one root), against the same tree padded with identity nodes to 64 (where the Mosaic GPU split form
runs) and the XLA reference. Asks why `hyspec bench profile-scale` measured the GDN state part at N = 32 twenty
times its N = 8 value. Run on the GPU machine from the repository root (PYTHONPATH=$PWD):
    python3 bench/recipes/tree_solve_dispatch_probe.py OUT.json
Each row: the form `auto_method` picks, median µs over 20 calls, max |o - reference|."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from hyspec_jax import kernels as K
from hyspec_jax.pallas_kernels import trees
from hyspec_jax.pallas_kernels.trees import mask_from_parents

HK, HV, DK, DV = 16, 48, 128, 128


def timed(f, *a, calls=20):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(calls):
        t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


rows = []
for B in (1, 8, 32):
    for N in (8, 16, 32, 48, 64):
        depth = min(8, N - 1)
        r = np.random.default_rng([B, N])
        mask = mask_from_parents(jnp.asarray(trees.random_parents(0, B, N, depth, single_root=True)))
        q = jnp.asarray(r.standard_normal((B, N, HK, DK)) / np.sqrt(DK), jnp.bfloat16)
        k = jnp.asarray(r.standard_normal((B, N, HK, DK)) / np.sqrt(DK), jnp.bfloat16)
        v = jnp.asarray(r.standard_normal((B, N, HV, DV)), jnp.bfloat16)
        g = -jnp.abs(jnp.asarray(r.standard_normal((B, N, HV)), jnp.float32)) * 0.1
        beta = jnp.asarray(r.uniform(0.1, 0.9, (B, N, HV)), jnp.float32)
        S0 = jnp.asarray(r.standard_normal((B, HV, DK, DV)) * 0.1, jnp.float32)
        path = depth + 1
        ref = jax.jit(lambda *a: K.tree_solve(*a, path_nodes=path, impl="reference")[0])
        o_ref = ref(S0, q, k, v, g, beta, mask)
        n_pad = K._padded_n(N)
        mgpu_ok = not K._split_mgpu_refusal(q, v, 64, None, "auto")
        row = dict(B=B, N=N, depth=depth, padded=n_pad, auto_form=K.auto_method(n_pad, DV, mgpu_ok)[0],
                   reference_us=round(timed(ref, S0, q, k, v, g, beta, mask), 1))
        variants = {"auto": lambda *a: K.tree_solve(*a, path_nodes=path, impl="auto")[0]}
        for form in ("inverse", "split"):
            variants[form] = (lambda m: lambda *a: K.tree_solve(*a, path_nodes=path, impl="pallas", method=m)[0])(form)

        def pad64(S0, q, k, v, g, beta, mask):
            qp, kp, vp, gp, bp, mp = K._pad_tree(64, q, k, v, g, beta, mask)
            return K.tree_solve(S0, qp, kp, vp, gp, bp, mp, path_nodes=path, impl="auto")[0][:, :N]
        if N < 64:
            variants["pad64_auto"] = pad64
        for name, f in variants.items():
            try:
                f = jax.jit(f)
                err = float(jnp.max(jnp.abs(f(S0, q, k, v, g, beta, mask) - o_ref)))
                row[name + "_us"], row[name + "_err"] = round(timed(f, S0, q, k, v, g, beta, mask), 1), err
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = str(e).splitlines()[0][:200]
        rows.append(row)
        print(row, flush=True)
json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows), open(sys.argv[1], "w"),
          indent=1)
