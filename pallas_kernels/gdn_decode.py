"""A GDN layer's decoding step (one token per slot) in one launch: conv, gates, q/k l2norm, state update, readout.

Must equal `hyspec_jax.gdn.decode_step(x, window, weight, a, b, A_log, dt_bias, S, valid, ...)`: from the layer's new
raw inputs x [B, C] (the in-projection's [q | k | v] columns, zeroed where a slot is not valid) and its conv window
[B, K−1, C], the new window, the state S [B, HV, dk, dv] after the token and the readout o [B, HV, dv].

One program per (slot b, value head h, value tile t of width block_v) reads the window and x columns of its key
head's q and k (key head h // (HV/HK): grouped heads are indexed, never copied) and of its own value tile, the conv
taps of those columns, a, b and the head's A_log, dt_bias; forms the conv (SiLU), the q/k l2norm and the gates with
`hyspec_jax.gdn`'s own functions; then, on its state tile S[b, h, :, t] (fp32, in registers), the decay, the delta
rule and o = Sᵀq — each state tile read once and written once. Every window column is written by one program: the
value tile's by its own, the key head's q/k columns by the key head's first value head's first tile. The window and
the state are written to new buffers (no aliasing: the q/k columns are read by every program of their key head) —
unless the state is handed over as the model's stack of every GDN layer's state with the layer's static index
(`layer`): then each program updates its tile of that layer in place (the stack is aliased to the output), and
neither a slice of the stack before the step nor a write-back after it exists (those were two copies of the state a
layer). The window is then read from the model's stack of windows as well (no copy of the layer's window out of it)
and the new window written to a buffer of its own (in place, a program could overwrite q/k columns that another
program of the key head has yet to read).
What it replaces in the decoding step: the conv, the window update, the gates, the l2norm and the state update as
separate XLA kernels (about nine a GDN layer; bench/results/scale/ has them counted).

Lowering: Pallas' Triton lowering. The products are matrix-vector (one token): elementwise products and sums in
fp32 on the CUDA cores, as SGLang's and vLLM's recurrent kernels do them; no tensor cores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax import gdn

F32 = jnp.float32
REFERENCE = "hyspec_jax.gdn.decode_step"


def _pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def supported(key_heads: int, key_dim: int, value_heads: int, value_dim: int, block_v: int) -> bool:
    """Shapes the kernel takes: power-of-two head widths (each load of a Triton program is a power of two long) and a
    value tile that divides the value head."""
    return (_pow2(key_dim) and 16 <= key_dim <= 256 and _pow2(block_v) and block_v >= 4
            and value_dim % block_v == 0 and key_heads >= 1 and value_heads % key_heads == 0)


def _decode_kernel(valid_ref, x_ref, win_ref, w_ref, a_ref, b_ref, alog_ref, dtb_ref, s_ref,
                   o_ref, s_out_ref, win_out_ref, *, key_heads: int, key_dim: int, group: int, value_dim: int,
                   block_v: int):
    h, t = pl.program_id(1), pl.program_id(2)
    km1 = win_ref.shape[0]                              # K − 1 window rows
    valid = valid_ref[...] != 0

    def conv_columns(start, n: int):
        """(SiLU(conv) fp32, the raw rows the window keeps after this token) of columns [start, start + n)."""
        cols = pl.ds(start, n)
        rows = [win_ref[j, cols] for j in range(km1)] + [x_ref[cols]]                 # K rows, oldest first
        out = sum(rows[j].astype(F32) * w_ref[cols, j].astype(F32) for j in range(km1 + 1))
        return jax.nn.silu(out), rows

    kd = key_heads * key_dim
    kh = h // group
    q, q_rows = conv_columns(kh * key_dim, key_dim)
    k, k_rows = conv_columns(kd + kh * key_dim, key_dim)
    v, v_rows = conv_columns(2 * kd + h * value_dim + t * block_v, block_v)
    q, k = gdn.prepare_qk(q, k)
    g, beta = gdn.gates(a_ref[...], b_ref[...], alog_ref[...], dtb_ref[...])
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)                  # gdn.invalidate

    S = s_ref[...] * jnp.exp(g)                                                       # [dk, bv] fp32
    delta = beta * (v - jnp.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * delta[None, :]
    o_ref[...] = jnp.sum(S * q[:, None], axis=0)
    s_out_ref[...] = S

    def shift(start, n: int, rows):                     # the window after the token: a valid slot drops its oldest
        for j in range(km1):
            win_out_ref[j, pl.ds(start, n)] = jnp.where(valid, rows[j + 1], rows[j]).astype(win_out_ref.dtype)

    shift(2 * kd + h * value_dim + t * block_v, block_v, v_rows)

    @pl.when((h % group == 0) & (t == 0))
    def _():
        shift(kh * key_dim, key_dim, q_rows)
        shift(kd + kh * key_dim, key_dim, k_rows)


@functools.partial(jax.jit, static_argnames=("key_heads", "key_dim", "layer", "block_v", "num_warps", "interpret"))
def decode_step_pallas(x, window, weight, a, b, A_log, dt_bias, S, valid, *, key_heads: int, key_dim: int,
                       layer: int | None = None, block_v: int = 32, num_warps: int = 1,
                       interpret: bool = False) -> gdn.DecodeStep:
    """Kernel entry, `gdn.decode_step`'s contract: x [B, C] new raw inputs, window [B, K−1, C], weight [C, K] (tap
    K−1 = the new token), a, b [B, HV], A_log, dt_bias [HV], S [B, HV, dk, dv] fp32, valid [B] bool. C = 2·HK·dk +
    HV·dv. Returns `gdn.DecodeStep(o [B, HV, dv] fp32, state, window)`.

    layer: S is the stack [L, B, HV, dk, dv] of every GDN layer's state, window the stack [L, B, K−1, C] of their
    windows, and the step is layer `layer`'s; the returned state is the stack with that layer updated, in place
    (aliased: donate or carry the stack, else XLA copies it), the returned window the layer's new one [B, K−1, C]."""
    B, C = x.shape
    if layer is not None:
        if S.ndim != 5 or not 0 <= layer < S.shape[0]:
            raise ValueError(f"layer {layer} of a state stack [L, B, HV, dk, dv], got S {S.shape}")
        if S.dtype != F32:
            raise ValueError(f"a state stack updated in place must be float32, got {S.dtype}")
        if window.ndim != 4 or window.shape[0] != S.shape[0]:
            raise ValueError(f"with a layer, window is the stack [L, B, K−1, C] of the state's L layers, got "
                             f"{window.shape} beside S {S.shape}")
    HV, dk, dv = S.shape[-3], S.shape[-2], S.shape[-1]
    km1 = window.shape[-2]
    layer_window = window.shape[-3:]
    if (not supported(key_heads, key_dim, HV, dv, block_v) or dk != key_dim
            or C != 2 * key_heads * key_dim + HV * dv or layer_window != (B, km1, C) or weight.shape != (C, km1 + 1)
            or S.shape[-4] != B):
        raise ValueError(f"unsupported decode step: x {x.shape}, window {window.shape}, weight {weight.shape}, "
                         f"S {S.shape}, {key_heads} key heads of {key_dim}, block_v {block_v}")
    kern = functools.partial(_decode_kernel, key_heads=key_heads, key_dim=key_dim, group=HV // key_heads,
                             value_dim=dv, block_v=block_v)
    row = lambda b, h, t: (b, 0)                     # noqa: E731
    if layer is None:
        state_spec = pl.BlockSpec((None, None, dk, block_v), lambda b, h, t: (b, h, 0, t))
        window_spec = pl.BlockSpec((None, km1, C), lambda b, h, t: (b, 0, 0))
        aliases = {}
    else:                                            # the layer's tiles of the stacks; the state's updated in place
        state_spec = pl.BlockSpec((None, None, None, dk, block_v), lambda b, h, t: (layer, b, h, 0, t))
        window_spec = pl.BlockSpec((None, None, km1, C), lambda b, h, t: (layer, b, 0, 0))
        aliases = {8: 1}
    o, S_new, win_new = pl.pallas_call(
        kern,
        out_shape=[jax.ShapeDtypeStruct((B, HV, dv), F32), jax.ShapeDtypeStruct(S.shape, F32),
                   jax.ShapeDtypeStruct(layer_window, window.dtype)],
        grid=(B, HV, dv // block_v),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, t: (b,)),                                # valid
            pl.BlockSpec((None, C), row),                                               # x
            window_spec,                                                                # window
            pl.BlockSpec((C, km1 + 1), lambda b, h, t: (0, 0)),                         # conv weight
            pl.BlockSpec((None, None), lambda b, h, t: (b, h)),                         # a
            pl.BlockSpec((None, None), lambda b, h, t: (b, h)),                         # b
            pl.BlockSpec((None,), lambda b, h, t: (h,)),                                # A_log
            pl.BlockSpec((None,), lambda b, h, t: (h,)),                                # dt_bias
            state_spec,                                                                 # S
        ],
        out_specs=[pl.BlockSpec((None, None, block_v), lambda b, h, t: (b, h, t)),     # o
                   state_spec,                                                          # S after
                   pl.BlockSpec((None, km1, C), lambda b, h, t: (b, 0, 0))],            # window after
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_decode_step",
    )(valid.astype(jnp.int32), x, window, weight, a, b, A_log, dt_bias, S.astype(F32))
    return gdn.DecodeStep(o, S_new, win_new)
