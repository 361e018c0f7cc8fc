"""Building blocks of the hybrid target, in Flax NNX.

Parameters mirror Hugging Face names and layouts (`weight` is [out, in], no per-tensor transposes on load or
save), except where several checkpoint tensors feed one matmul: those are fused into one parameter so the step
runs one GEMM (one kernel launch) instead of several — an MLP's `gate_up_proj` (gate and up rows interleaved,
`gate_up`), a GatedDeltaNet's `in_proj` (rows grouped by key head, `gdn.key_head_groups`) and the routed experts'
`gate_up_proj`. The one home of the mapping between parameters and checkpoint tensors is `hyspec_jax.io.layout`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from hyspec_jax import gdn, kernels, moe
from hyspec_jax.attention import attend  # noqa: F401 (the models and train/forward.py import it from here)
from hyspec_jax.config import TargetConfig

F32 = jnp.float32


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, F32).astype(dtype))


@jax.named_scope("dense")
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] · wᵀ for a weight in the HF [out, in] layout -> [..., out] float32 (fp32 accumulation).

    The one home of the models' weight products (Linear, tied / shared LM heads). A few float32 rows on a CPU
    (speculative verify / draft) run the native streaming kernel, everything else XLA's dot (`kernels.dense`)."""
    # this module's F32: the fp64 gradient checks (tests/test_grad.py) repoint it at float64
    return kernels.dense(x, w, accumulate=F32)


class Linear(nnx.Module):
    """y = x Wᵀ (+ b); weight [out, in] as in torch (`weight`: its initial value, default drawn from `rngs`)."""

    def __init__(self, din: int, dout: int, *, bias: bool = False, dtype=F32, rngs: nnx.Rngs | None = None,
                 weight: jax.Array | None = None):
        self.weight = _normal(rngs, (dout, din), dtype) if weight is None else nnx.Param(weight.astype(dtype))
        chex.assert_shape(self.weight[...], (dout, din))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        y = dense(x.astype(w.dtype), w).astype(w.dtype)
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    """x/rms(x) (in fp32) times a learned per-channel scale `weight`, in the two forms checkpoints store.

    zero_centred=True (Qwen3.5/Next targets, the ReaDy reader): scale (1 + w), w initialised to 0, applied
    in fp32, then cast back to the input dtype.
    zero_centred=False (Qwen3 layers of DSpark / DFlash drafters, the GDN output norm): x/rms(x) cast back
    first, then · w, w initialised to 1. The two orders round differently in bf16, so each keeps its own.
    """

    def __init__(self, dim: int, eps: float, *, zero_centred: bool = True, dtype=F32):
        self.weight = nnx.Param((jnp.zeros if zero_centred else jnp.ones)((dim,), dtype))
        self.eps = eps
        self.zero_centred = zero_centred

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array) -> jax.Array:
        return gdn.rms_norm(x, self.weight[...], self.eps, zero_centred=self.zero_centred)

    def add(self, x: jax.Array, y: jax.Array | None, impl: kernels.Impl = "reference"
            ) -> tuple[jax.Array, jax.Array]:
        """The residual add x + y and this norm of it: (s, norm(s)) — one launch on the kernel path
        (`kernels.add_rms_norm`); y None: nothing to add, (x, norm(x))."""
        if y is None:
            return x, self(x)
        return kernels.add_rms_norm(x, y, self.weight[...], self.eps, zero_centred=self.zero_centred, impl=impl)


class GatedRMSNorm(RMSNorm):
    """GDN output norm: the plain (· w) RMSNorm, then · SiLU(z) in fp32, cast back."""

    def __init__(self, dim: int, eps: float, *, dtype=F32):
        super().__init__(dim, eps, zero_centred=False, dtype=dtype)

    @jax.named_scope("norm")
    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        return gdn.gated_rms_norm(x, z, self.weight[...], self.eps)

    @property
    def spec(self) -> gdn.OutputNorm:
        """The norm as `gdn.decode_layer` and the decode kernel take it."""
        return gdn.OutputNorm(self.weight[...], self.eps)


def _take(x, axis: int, index) -> jax.Array:
    return x[(slice(None),) * axis + (index,)]


def gate_up(x, axis: int = -1):
    """(gate, up) halves of a fused gate/up axis of 2I entries — the rows of `MLP.gate_up_proj` (axis 0) or its
    output (axis -1): interleaved per intermediate unit, [g0, u0, g1, u1, …], so that a split of the rows into
    whole pairs (the "mlp" sharding) keeps gate i with up i on one device. Views for numpy arrays."""
    axis %= x.ndim
    pairs = x.reshape(*x.shape[:axis], x.shape[axis] // 2, 2, *x.shape[axis + 1:])
    return _take(pairs, axis + 1, 0), _take(pairs, axis + 1, 1)


class MLP(nnx.Module):
    """SwiGLU: down(SiLU(gate x) ⊙ up x), gate and up as one matmul (`gate_up_proj` [2I, H], rows as `gate_up`)."""

    def __init__(self, hidden: int, inter: int, *, dtype=F32, rngs: nnx.Rngs):
        # drawn as the checkpoint's gate_proj then up_proj, paired row by row (`gate_up`): a seeded model is the
        # one the unfused layers drew
        gate, up = (_normal(rngs, (inter, hidden), dtype)[...] for _ in range(2))
        self.gate_up_proj = Linear(hidden, 2 * inter, dtype=dtype,
                                   weight=jnp.stack([gate, up], axis=1).reshape(2 * inter, hidden))
        self.down_proj = Linear(inter, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = gate_up(self.gate_up_proj(x))
        return self.down_proj(jax.nn.silu(gate) * up)


class Experts(nnx.Module):
    """All routed experts, fused as transformers holds them in memory: gate_up [E, 2I, H] (gate rows first),
    down [E, H, I]. The loader also accepts the per-expert on-disk form. Only the chosen experts run
    (`hyspec_jax.moe`: a gather of their weights for few rows, every expert densely for many)."""

    def __init__(self, num: int, hidden: int, inter: int, *, dtype=F32, rngs: nnx.Rngs):
        self.gate_up_proj = _normal(rngs, (num, 2 * inter, hidden), dtype)
        self.down_proj = _normal(rngs, (num, hidden, inter), dtype)

    def __call__(self, x: jax.Array, top_p: jax.Array, top_i: jax.Array, *, form: str | None = None) -> jax.Array:
        """x [T, H] through each row's chosen experts top_i [T, k], weighted by top_p [T, k]: [T, H].
        form: a `moe.FORMS` entry to force one execution form (tests, bench), default `moe.choose_form`."""
        return moe.experts(x, self.gate_up_proj[...], self.down_proj[...], top_p, top_i, form=form, accumulate=F32)


class SparseMoe(nnx.Module):
    """Top-k routed experts (softmax in fp32, optional renormalisation) + sigmoid-gated shared expert."""

    def __init__(self, cfg: TargetConfig, *, dtype=F32, rngs: nnx.Rngs):
        H = cfg.hidden_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(H, cfg.num_experts, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg.num_experts, H, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(H, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, *, form: str | None = None) -> jax.Array:
        """x [..., H] -> [..., H]; form as in `Experts`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_p, top_i = moe.route(self.gate(x), self.top_k, self.norm_topk, accumulate=F32)
        routed = self.experts(x, top_p.astype(x.dtype), top_i, form=form)
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (routed + shared).reshape(shape)


# ------------------------------------------------------------------------------------------------
# Rotary embedding (partial, rotate-half inside the rotated slice)
# ------------------------------------------------------------------------------------------------
def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))
    freqs = positions.astype(F32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, heads, hd]; cos/sin [B, T, rd]."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = jnp.split(xr, 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    c, s = cos[:, :, None].astype(x.dtype), sin[:, :, None].astype(x.dtype)
    return jnp.concatenate([xr * c + rot * s, xp], axis=-1)


class Attention(nnx.Module):
    """Gated full attention: q_proj packs [query | gate] per head, q/k norms before partial RoPE, GQA,
    sigmoid(gate) on the output before o_proj."""

    def __init__(self, cfg: TargetConfig, *, dtype=F32, rngs: nnx.Rngs):
        H, nh, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kvh, hd
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        b = cfg.attention_bias
        self.q_proj = Linear(H, nh * hd * 2, bias=b, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(H, kvh * hd, bias=b, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(H, kvh * hd, bias=b, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, H, bias=b, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Projections at `positions` [B,T]: (q [B,T,NH,hd] roped, gate [B,T,NH*hd], k roped, v)."""
        B, T, _ = x.shape
        qg = self.q_proj(x).reshape(B, T, self.num_heads, 2 * self.head_dim)
        q, gate = jnp.split(qg, 2, axis=-1)
        k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        return q, gate.reshape(B, T, -1), k, v

    def out(self, attn: jax.Array, gate: jax.Array) -> jax.Array:
        B, T = attn.shape[:2]
        return self.o_proj(attn.reshape(B, T, -1) * jax.nn.sigmoid(gate))


class DepthwiseConv(nnx.Module):
    """Holds the causal depthwise conv weight [C, 1, K] (torch Conv1d layout); the conv is `gdn.causal_conv`."""

    def __init__(self, channels: int, kernel: int, *, dtype=F32, rngs: nnx.Rngs):
        self.weight = _normal(rngs, (channels, 1, kernel), dtype, std=0.3)


# The in-projection tensors of each checkpoint layout (`TargetConfig.projection_layout`), in checkpoint order:
# name -> the parts of a key-head group it holds, in order ("split", Qwen3.5: each part for all heads, one block
# after the other; "interleaved", Qwen3-Next: the parts group by group)
IN_PROJ_TENSORS: dict[str, dict[str, tuple[str, ...]]] = {
    "split": {"in_proj_qkv": ("q", "k", "v"), "in_proj_z": ("z",), "in_proj_b": ("b",), "in_proj_a": ("a",)},
    "interleaved": {"in_proj_qkvz": ("q", "k", "v", "z"), "in_proj_ba": ("b", "a")},
}


def in_proj_tensor_parts(t, layout: str, name: str, widths: dict[str, int], heads: int) -> dict[str, jax.Array]:
    """The parts the checkpoint's in-projection tensor `name` [rows, ...] holds (`IN_PROJ_TENSORS`), each as
    [heads, width, ...] like `gdn.key_head_groups` gives them from the fused rows. Views for numpy arrays."""
    names = IN_PROJ_TENSORS[layout][name]
    if layout == "interleaved":
        return gdn.key_head_groups(t, {p: widths[p] for p in names}, heads, 0)
    out, start = {}, 0
    for p in names:
        n = heads * widths[p]
        out[p] = t[start:start + n].reshape(heads, widths[p], *t.shape[1:])
        start += n
    assert start == t.shape[0], (name, t.shape)
    return out


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet mixer. The math is in `hyspec_jax.gdn`; this module owns projections and layout.

    The in-projection is one matmul: `in_proj` [HK·G, H], per key-head group g the rows
    [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv) | b_g (r) | a_g (r)], r = HV/HK (`in_proj_widths`), so it
    shards over key heads. Checkpoints store it in `layout` (`IN_PROJ_TENSORS`), which `hyspec_jax.io.layout`
    maps to and from."""

    def __init__(self, cfg: TargetConfig, *, dtype=F32, rngs: nnx.Rngs):
        H = cfg.hidden_size
        self.layout = cfg.projection_layout
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # drawn tensor by tensor in checkpoint order, then regrouped: a seeded model is the one the unfused
        # projections drew
        widths, parts = self.in_proj_widths, {}
        for name, names in IN_PROJ_TENSORS[self.layout].items():
            t = _normal(rngs, (self.hk * sum(widths[p] for p in names), H), dtype)[...]
            parts.update(in_proj_tensor_parts(t, self.layout, name, widths, self.hk))
        self.in_proj = Linear(H, self.hk * sum(widths.values()), dtype=dtype,
                              weight=jnp.concatenate([parts[p] for p in widths], axis=1).reshape(-1, H))
        self.conv1d = DepthwiseConv(cfg.conv_dim, cfg.linear_conv_kernel_dim, dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.hv,), F32, 1.0, 16.0)).astype(dtype))
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), dtype))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(cfg.value_dim, H, dtype=dtype, rngs=rngs)

    @property
    def in_proj_widths(self) -> dict[str, int]:
        """Rows of each part in one key-head group of `in_proj`, in order."""
        return gdn.in_proj_widths(self.hk, self.hv, self.dk, self.dv)

    @property
    def conv_weight(self) -> jax.Array:
        return self.conv1d.weight[...][:, 0, :]

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [B,T,H] -> raw conv input qkv [B,T,conv_dim] ([q | k | v], head-major), z [B,T,HV,dv], b, a [B,T,HV]."""
        return tuple(gdn.split_in_proj(self.in_proj(x), **self.heads))

    @property
    def heads(self) -> dict[str, int]:
        """The head geometry by the names `hyspec_jax.gdn` takes it."""
        return {"key_heads": self.hk, "key_dim": self.dk, "value_heads": self.hv, "value_dim": self.dv}

    def mixer_inputs(self, conv_out: jax.Array, b: jax.Array, a: jax.Array, valid: jax.Array):
        """Post-conv stream -> gdn inputs (q, k [B,T,HK,dk] normalised, at their key heads; v [B,T,HV,dv]; g, β
        with invalid positions turned into identity steps)."""
        return gdn.mixer_inputs(conv_out, b, a, valid, self.A_log[...], self.dt_bias[...], key_heads=self.hk,
                                key_dim=self.dk)

    def output(self, o: jax.Array, z: jax.Array, dtype) -> jax.Array:
        """The readout o [B,T,HV,dv] through the gated norm (in `dtype`) and the out-projection."""
        return self.project_out(self.norm(o.astype(dtype), z))

    def project_out(self, y: jax.Array) -> jax.Array:
        """The normed output y [B,T,HV,dv] through the out-projection -> [B,T,H]."""
        B, T = y.shape[:2]
        return self.out_proj(y.reshape(B, T, -1))

