"""A GDN layer's decoding step (one token per slot) in one launch, from the in-projection's output row as it is:
conv, gates, q/k l2norm, state update, readout, window update and (optionally) the gated output norm.

Must equal `hyspec_jax.gdn.decode_layer(proj, window, conv_weight, A_log, dt_bias, S, valid, ..., norm)`: from the
in-projection's output proj [B, HK·G] (per key-head group [q | k | v | z | b | a], `gdn.in_proj_widths`), the conv
window [B, K−1, C] in the conv's order [q_all | k_all | v_all], the new window, the state S [B, HV, dk, dv] after the
token and the readout o [B, HV, dv] fp32 — or, with the norm, the layer's normed output
`gdn.gated_rms_norm(o.astype(proj.dtype), z, weight, eps)` in proj's dtype, ready for the out-projection.

One program per (slot b, value head h, value tile t of width block_v) reads, at offsets computed from the group
layout (`gdn.in_proj_offsets`; nothing is regrouped or copied before the launch), its key head's q and k columns
(key head h // (HV/HK): grouped heads are indexed, never copied), its value tile's v columns, its head's b and a (and
z tile for the norm) straight from proj; the raw columns are zeroed where the slot is not valid (HF zeroes padding
before the conv). With the window rows and the conv taps of the same columns (conv order) it forms the conv (SiLU),
the q/k l2norm and the gates with `hyspec_jax.gdn`'s own functions; then, on its state tile S[b, h, :, t] (fp32, in
registers), the decay, the delta rule and o = Sᵀq — each state tile read once and written once. The norm spans a
whole value head, so it is in the kernel only with block_v = dv (a static option: `eps` given). Every window column
is written by one program: the value tile's by its own, the key head's q/k columns by the key head's first value
head's first tile. The window and the state are written to new buffers (no aliasing: the q/k columns are read by
every program of their key head) — unless the state is handed over as the model's stack of every GDN layer's state
with the layer's index (`layer`): then each program updates its tile of that layer in place (the stack is
aliased to the output), and neither a slice of the stack before the step nor a write-back after it exists (those
were two copies of the state a layer). The window is then read from the model's stack of windows as well (no copy
of the layer's window out of it) and the new window written to a buffer of its own (in place, a program could
overwrite q/k columns that another program of the key head has yet to read). The index is an operand read by the
kernel, not a constant of it, so every layer of a program runs one Triton kernel (XLA compiles identical kernels
once); a static index made each layer's kernel a compile of its own.
What it replaces in the decoding step: the regroup of the in-projection's output into conv order and the slices of
b and a (three XLA kernels a GDN layer, counted in XLA's optimized HLO), the conv, the window update, the gates, the
l2norm and the state update (about nine; bench/results/scale/ has them counted) and, with the norm, the gated norm
(two): 12 kernels a GDN layer are left at batch 1 on an H100 (bench/results/scale/decode_hlo_h100_decode_row.md).

Lowering: Pallas' Triton lowering. The products are matrix-vector (one token): elementwise products and sums in
fp32 on the CUDA cores, as SGLang's and vLLM's recurrent kernels do them; no tensor cores. Loads are power-of-two
long (a head's columns, a value tile, a (1,)-long scalar for b and a); the row proj and the window keep their
full, non-power-of-two widths as blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hyspec_jax import gdn

F32 = jnp.float32
REFERENCE = "hyspec_jax.gdn.decode_layer"


def _pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def supported(key_heads: int, key_dim: int, value_heads: int, value_dim: int, block_v: int) -> bool:
    """Shapes the kernel takes: power-of-two head widths (each load of a Triton program is a power of two long) and a
    value tile that divides the value head."""
    return (_pow2(key_dim) and 16 <= key_dim <= 256 and _pow2(block_v) and block_v >= 4
            and value_dim % block_v == 0 and key_heads >= 1 and value_heads % key_heads == 0)


def _decode_kernel(layer_ref, valid_ref, proj_ref, win_ref, w_ref, alog_ref, dtb_ref, s_ref, *refs, key_heads: int,
                   key_dim: int, group: int, value_dim: int, block_v: int, eps: float | None):
    nw_ref, (o_ref, s_out_ref, win_out_ref) = (None, refs) if eps is None else (refs[0], refs[1:])
    slot, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # the stacks' whole refs, indexed at the layer read from memory: every layer runs this one kernel (a static
    # layer made each layer's kernel its own Triton compile)
    layer = jnp.sum(layer_ref[...])
    km1 = win_ref.shape[-2]                             # K − 1 window rows
    tile = pl.ds(t * block_v, block_v)
    valid = valid_ref[...] != 0
    widths = gdn.in_proj_widths(key_heads, key_heads * group, key_dim, value_dim)
    at = gdn.in_proj_offsets(widths)
    kh, hr = h // group, h % group                      # key head, and the head's place in its key head's group
    base = kh * sum(widths.values())                    # the key head's group in proj
    part = lambda name, offset, n: proj_ref[pl.ds(base + at[name] + offset, n)]      # noqa: E731

    def conv_columns(name: str, offset, start, n: int):
        """(SiLU(conv) fp32, the raw rows the window keeps after this token) of conv columns [start, start + n),
        whose new raw inputs are proj's part `name` from `offset` on."""
        cols = pl.ds(start, n)
        new = part(name, offset, n)
        new = jnp.where(valid, new, jnp.zeros_like(new))                              # HF zeroes padding
        rows = [win_ref[layer, slot, j, cols] for j in range(km1)] + [new]            # K rows, oldest first
        out = sum(rows[j].astype(F32) * w_ref[cols, j].astype(F32) for j in range(km1 + 1))
        return jax.nn.silu(out), rows

    kd = key_heads * key_dim
    v_start = 2 * kd + h * value_dim + t * block_v      # the value tile's conv columns
    q, q_rows = conv_columns("q", 0, kh * key_dim, key_dim)
    k, k_rows = conv_columns("k", 0, kd + kh * key_dim, key_dim)
    v, v_rows = conv_columns("v", hr * value_dim + t * block_v, v_start, block_v)
    q, k = gdn.prepare_qk(q, k)
    a, b = jnp.sum(part("a", hr, 1)), jnp.sum(part("b", hr, 1))     # the head's (1,)-long loads, as scalars
    g, beta = gdn.gates(a, b, alog_ref[...], dtb_ref[...])
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)                  # gdn.invalidate

    S = s_ref[layer, slot, h, :, tile] * jnp.exp(g)                                   # [dk, bv] fp32
    delta = beta * (v - jnp.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * delta[None, :]
    o = jnp.sum(S * q[:, None], axis=0)
    if nw_ref is None:
        o_ref[...] = o
    else:                                               # block_v = dv: the program holds its whole value head
        z = part("z", hr * value_dim, value_dim)
        o_ref[...] = gdn.gated_rms_norm(o.astype(o_ref.dtype), z, nw_ref[...], eps).astype(o_ref.dtype)
    s_out_ref[layer, slot, h, :, tile] = S

    def shift(start, n: int, rows):                     # the window after the token: a valid slot drops its oldest
        for j in range(km1):
            win_out_ref[j, pl.ds(start, n)] = jnp.where(valid, rows[j + 1], rows[j]).astype(win_out_ref.dtype)

    shift(v_start, block_v, v_rows)

    @pl.when((hr == 0) & (t == 0))
    def _():
        shift(kh * key_dim, key_dim, q_rows)
        shift(kd + kh * key_dim, key_dim, k_rows)


def decode_layer_pallas(proj, window, conv_weight, A_log, dt_bias, S, valid, norm_weight=None, *, key_heads: int,
                        key_dim: int, eps: float | None = None, layer: int | jax.Array | None = None,
                        block_v: int = 32, num_warps: int = 1, interpret: bool = False) -> gdn.DecodeStep:
    """Kernel entry, `gdn.decode_layer`'s contract: proj [B, HK·G] the in-projection's output row (groups as
    `gdn.in_proj_widths`), window [B, K−1, C] (conv order), conv_weight [C, K] (tap K−1 = the new token), A_log,
    dt_bias [HV], S [B, HV, dk, dv] fp32, valid [B] bool. C = 2·HK·dk + HV·dv. Returns `gdn.DecodeStep(o [B, HV, dv]
    fp32, state, window)`; with norm_weight [dv] and eps (block_v = dv), o is the normed output in proj's dtype.

    layer: S is the stack [L, B, HV, dk, dv] of every GDN layer's state, window the stack [L, B, K−1, C] of their
    windows, and the step is layer `layer`'s (an operand, not static: every layer runs one kernel); the returned state is the stack with that layer updated, in place
    (aliased: donate or carry the stack, else XLA copies it), the returned window the layer's new one [B, K−1, C]."""
    if layer is not None and isinstance(layer, int) and not (S.ndim == 5 and 0 <= layer < S.shape[0]):
        raise ValueError(f"layer {layer} of a state stack [L, B, HV, dk, dv], got S {S.shape}")
    return _decode_layer(proj, window, conv_weight, A_log, dt_bias, S, valid, norm_weight, key_heads=key_heads,
                         key_dim=key_dim, eps=eps, layer=layer, block_v=block_v, num_warps=num_warps,
                         interpret=interpret)


@functools.partial(jax.jit, static_argnames=("key_heads", "key_dim", "eps", "block_v", "num_warps", "interpret"))
def _decode_layer(proj, window, conv_weight, A_log, dt_bias, S, valid, norm_weight, *, key_heads: int, key_dim: int,
                  eps: float | None, layer, block_v: int, num_warps: int, interpret: bool) -> gdn.DecodeStep:
    """`decode_layer_pallas` once its layer index is checked (here a traced operand)."""
    B, P = proj.shape
    if layer is not None:
        if S.ndim != 5:
            raise ValueError(f"a layer of a state stack [L, B, HV, dk, dv], got S {S.shape}")
        if S.dtype != F32:
            raise ValueError(f"a state stack updated in place must be float32, got {S.dtype}")
        if window.ndim != 4 or window.shape[0] != S.shape[0]:
            raise ValueError(f"with a layer, window is the stack [L, B, K−1, C] of the state's L layers, got "
                             f"{window.shape} beside S {S.shape}")
    HV, dk, dv = S.shape[-3], S.shape[-2], S.shape[-1]
    km1, C = window.shape[-2], window.shape[-1]
    layer_window = window.shape[-3:]
    norm = eps is not None
    if (not supported(key_heads, key_dim, HV, dv, block_v) or dk != key_dim or C != 2 * key_heads * key_dim + HV * dv
            or P != key_heads * sum(gdn.in_proj_widths(key_heads, HV, key_dim, dv).values())
            or layer_window != (B, km1, C) or conv_weight.shape != (C, km1 + 1) or S.shape[-4] != B
            or norm != (norm_weight is not None) or (norm and (block_v != dv or norm_weight.shape != (dv,)))):
        raise ValueError(f"unsupported decode step: proj {proj.shape}, window {window.shape}, conv weight "
                         f"{conv_weight.shape}, S {S.shape}, {key_heads} key heads of {key_dim}, block_v {block_v}"
                         + (f", a norm over {dv} needs block_v {dv} and a weight [{dv}]" if norm else ""))
    kern = functools.partial(_decode_kernel, key_heads=key_heads, key_dim=key_dim, group=HV // key_heads,
                             value_dim=dv, block_v=block_v, eps=eps)
    row = lambda b, h, t: (b, 0)                     # noqa: E731
    stacked = layer is not None
    if not stacked:                                  # one layer's state and window: a stack of one
        S, window, layer = S[None], window[None], 0
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, t: (0,)),                                   # the layer
        pl.BlockSpec((None,), lambda b, h, t: (b,)),                                # valid
        pl.BlockSpec((None, P), row),                                               # proj
        pl.no_block_spec,                                                           # window stack
        pl.BlockSpec((C, km1 + 1), lambda b, h, t: (0, 0)),                         # conv weight
        pl.BlockSpec((None,), lambda b, h, t: (h,)),                                # A_log
        pl.BlockSpec((None,), lambda b, h, t: (h,)),                                # dt_bias
        pl.no_block_spec,                                                           # state stack
    ] + ([pl.BlockSpec((dv,), lambda b, h, t: (0,))] if norm else [])              # norm weight
    o, S_new, win_new = pl.pallas_call(
        kern,
        out_shape=[jax.ShapeDtypeStruct((B, HV, dv), proj.dtype if norm else F32), jax.ShapeDtypeStruct(S.shape, F32),
                   jax.ShapeDtypeStruct(layer_window, window.dtype)],
        grid=(B, HV, dv // block_v),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, block_v), lambda b, h, t: (b, h, t)),     # o (or the normed output)
                   pl.no_block_spec,                                                    # state stack, its tile set
                   pl.BlockSpec((None, km1, C), lambda b, h, t: (b, 0, 0))],            # window after
        # the stack's layer updated in place (aliased: donate or carry the stack); one layer's state is a new array
        # whose every tile the programs write
        input_output_aliases={7: 1} if stacked else {},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="gdn_decode_layer",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), valid.astype(jnp.int32), proj, window, conv_weight, A_log,
      dt_bias, S.astype(F32), *([norm_weight] if norm else []))
    return gdn.DecodeStep(o, S_new if stacked else S_new[0], win_new)
