"""Baselines for tree verification on GDN layers.

- `serial_tree_pallas`: what SGLang's tree verify kernel does (docs/reference/target_model.md §13.2): one program
  per (request, value head, value tile) walks the N nodes in topological order; node i loads its
  parent's state from a per-node HBM buffer (the committed state for roots), applies one GDN step and
  writes its own state back, so every node costs a full state-tile read and write.
- `serial_paths_xla`: plain XLA, one `lax.scan` serial recurrence (gdn.serial_recurrence) per
  root-to-leaf path, the paths batched.
- `masked_solve_xla`: plain XLA closed form (gdn.masked_solve, jitted).

All must equal gdn.masked_solve's outputs o [B,N,HV,dv]; the serial kernel's per-node states equal
gdn.node_state for every node.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax import gdn
from hyspec_jax.pallas_kernels import tile_dim_ok

F32 = jnp.float32


def _serial_kernel(parent_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, buf_ref, *, barrier):
    n = parent_ref.shape[0]

    def body(i, carry):
        p = parent_ref[i]
        S = lax.cond(p >= 0, lambda: buf_ref[jnp.maximum(p, 0)], lambda: s0_ref[...])   # [dk, bv]
        S = S * jnp.exp(g_ref[i])
        k = k_ref[i, :].astype(F32)                                   # [dk]
        m = jnp.sum(S * k[:, None], axis=0)                           # Sᵀk  [bv]
        delta = beta_ref[i] * (v_ref[i, :].astype(F32) - m)
        S = S + k[:, None] * delta[None, :]
        o_ref[i, :] = jnp.sum(S * q_ref[i, :].astype(F32)[:, None], axis=0).astype(o_ref.dtype)
        buf_ref[i] = S
        if barrier:
            pltriton.debug_barrier()  # this node's state is visible before a child reloads it
        return carry

    lax.fori_loop(0, n, body, 0)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "out_dtype", "interpret"))
def serial_tree_pallas(S0, q, k, v, g, beta, parents, *, block_v: int = 64, num_warps: int = 4,
                       out_dtype=F32, interpret: bool = False):
    """q, k [B,N,HK,dk]; v [B,N,HV,dv]; g, β [B,N,HV]; S0 [B,HV,dk,dv]; parents [B,N] (−1 = root).

    Returns (o [B,N,HV,dv], per-node states [B,HV,N,dk,dv]) — the states are the HBM scratch SGLang keeps.
    """
    B, N, HK, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    if not (tile_dim_ok(N) and tile_dim_ok(dk) and tile_dim_ok(block_v) and dv % block_v == 0 and HV % HK == 0):
        raise ValueError(f"unsupported shape N={N} dk={dk} dv={dv} block_v={block_v} HV={HV} HK={HK}")
    r = HV // HK
    nv = dv // block_v
    in_specs = [
        pl.BlockSpec((None, N), lambda b, h, t: (b, 0)),                        # parents
        pl.BlockSpec((None, N, None, dk), lambda b, h, t: (b, 0, h // r, 0)),   # q
        pl.BlockSpec((None, N, None, dk), lambda b, h, t: (b, 0, h // r, 0)),   # k
        pl.BlockSpec((None, N, None, block_v), lambda b, h, t: (b, 0, h, t)),   # v
        pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),               # g
        pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),               # beta
        pl.BlockSpec((None, None, dk, block_v), lambda b, h, t: (b, h, 0, t)),  # S0
    ]
    out_specs = [
        pl.BlockSpec((None, N, None, block_v), lambda b, h, t: (b, 0, h, t)),              # o
        pl.BlockSpec((None, None, N, dk, block_v), lambda b, h, t: (b, h, 0, 0, t)),       # states
    ]
    out_shape = [jax.ShapeDtypeStruct((B, N, HV, dv), out_dtype),
                 jax.ShapeDtypeStruct((B, HV, N, dk, dv), F32)]
    return pl.pallas_call(
        functools.partial(_serial_kernel, barrier=not interpret), out_shape=out_shape, grid=(B, HV, nv), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_serial_tree",
    )(parents.astype(jnp.int32), q, k, v, g.astype(F32), beta.astype(F32), S0.astype(F32))


@functools.partial(jax.jit, static_argnames=("method", "path_nodes"))
def masked_solve_xla(S0, q, k, v, g, beta, mask, *, method="solve", path_nodes=None):
    """gdn.masked_solve jitted (q, k at their key heads [B,N,HK,dk], expanded inside)."""
    return gdn.masked_solve(S0, q, k, v, g, beta, mask, method=method, path_nodes=path_nodes)


@jax.jit
def serial_paths_xla(S0, q, k, v, g, beta, path_nodes):
    """One lax.scan recurrence per root-to-leaf path. path_nodes [B,P,D] (−1 pad, see trees.leaf_paths).

    Returns o [B,N,HV,dv] (each node written by any path through it; all agree).
    """
    B, N = q.shape[:2]
    P, D = path_nodes.shape[1:]
    valid = path_nodes >= 0
    idx = jnp.maximum(path_nodes, 0)

    def gather(x):                                               # [B,N,...] -> [B*P, D, ...]
        y = jax.vmap(lambda xb, ib: xb[ib])(x, idx)              # [B,P,D,...]
        return y.reshape(B * P, D, *x.shape[2:])

    qp, kp = gather(q), gather(k)                                # key heads: gdn.step expands them
    vp = gather(v)
    vmask = valid.reshape(B * P, D)
    gp, bp = gdn.invalidate(gather(g), gather(beta), vmask)
    S = jnp.repeat(S0.astype(F32), P, axis=0)
    o, _ = gdn.serial_recurrence(S, qp.astype(F32), kp.astype(F32), vp, gp, bp)    # [B*P, D, HV, dv]
    o = o.reshape(B, P, D, *o.shape[2:])
    tgt = jnp.where(valid, path_nodes, N)                        # padding → dropped
    out = jnp.zeros((B, N + 1) + o.shape[3:], o.dtype)
    out = jax.vmap(lambda ob, tb, vb: ob.at[tb.reshape(-1)].set(vb.reshape(-1, *vb.shape[2:])))(out, tgt, o)
    return out[:, :N]
