"""Routed mixture-of-experts math: the router's top-k, and the chosen experts' SwiGLU in two execution forms.

Expert weights keep the transformers layout the checkpoints and the sharding rules use: gate_up [E, 2I, H]
(gate rows first), down [E, H, I]. Both forms compute, for each token t and each of its k chosen experts e
with routing weight p:  y_te = down_e · (SiLU(gate_e x_t) ⊙ up_e x_t),  out_t = Σ_k p · y_te, with fp32
accumulation, the projections cast back to the activation dtype before the next op (as the dense form always
did), and the k-way combine accumulated in `accumulate` and rounded once. They differ only in how the work is
laid out, so they agree to rounding (tests/test_moe.py):

  "gather"   w[top_i]: a copy of only the T·k chosen experts' weights, then batched matrix-vector products.
             Reads T·k expert matrices (duplicates included) — the decode / few-row verify form.
  "dense"    every token through every expert, weighted by a [T, E] combine matrix that is zero off the
             top-k. Reads every expert once whatever T — the many-row form.

A third form, expert-sorted assignments through `jax.lax.ragged_dot_general`, was measured and removed: on one
H100 (bench/results/moe/moe_scale_h100.md) XLA's lowering of it did work over all E experts, slower than dense at
every row count (3.4 vs 1.1 ms a layer at T=1, 15.4 vs 2.5 at T=256) and no more accurate (0.11-0.12 off dense
after 8 bf16 layers, gather 0.06-0.09). If many-row sparse MoE must get nearer its floor, a grouped-GEMM kernel
(e.g. jax.experimental.pallas.ops.gpu's ragged_dot_mgpu) is the route.

Expert parallel (experts sharded over the mesh's `model` axis, `hyspec_jax.sharding`): both forms stay exact;
XLA partitions "gather" as a masked local gather plus an all-reduce of the gathered weights [T, k, 2I, H] (not
of the [T, H] outputs, as "dense" does), a communication cost a shard_map form would avoid.

`choose_form` is the static rule the model applies per call (on the token count); each form against its HBM /
compute floor at Qwen3-Next-80B-A3B geometry: bench/results/moe/moe_scale_h100.md (a one-time study,
bench/moe_scale.py, removed from the tree; git history has it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORMS = ("gather", "dense")


def route(logits: jax.Array, top_k: int, normalise: bool, accumulate=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, E] -> (top_p [T, k] in `accumulate`, top_i [T, k] int32): softmax over all experts,
    top-k (equal probabilities: the lower expert index first), optionally renormalised over the k."""
    probs = jax.nn.softmax(logits.astype(accumulate), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    if normalise:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return top_p, top_i.astype(jnp.int32)


def choose_form(tokens: int, num_experts: int, top_k: int) -> str:
    """The form for a call of `tokens` rows (static: shapes are static under jit): "gather" while the T·k
    routed assignments are at most E/4, "dense" above."""
    # Measured on one H100 at E=512, k=10 (bench/results/moe/moe_scale_h100.md): gather 0.13 vs dense 1.14 ms a
    # layer at T=1 (10 routes), 0.50 vs 1.19 at T=8 (80), but 1.69 vs 1.24 at T=32 (320). Gather reads T·k
    # expert copies, dense all E once; E/4 puts the switch between 80 and 320 routes.
    return "gather" if 4 * tokens * top_k <= num_experts else "dense"


def _swiglu(gu: jax.Array) -> jax.Array:
    gate, up = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _combine(y: jax.Array, top_p: jax.Array, accumulate) -> jax.Array:
    """Σ_k p · y over a token's k experts: y [T, k, H], top_p [T, k] -> [T, H] (accumulated, rounded once)."""
    return jnp.einsum("tkh,tk->th", y, top_p.astype(y.dtype), preferred_element_type=accumulate).astype(y.dtype)


def experts_gather(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array,
                   accumulate=jnp.float32) -> jax.Array:
    """x [T, H] through its k chosen experts by gathering only their weights: [T, H]."""
    dt = x.dtype
    gu = jnp.einsum("th,tkoh->tko", x.astype(w_gu.dtype), w_gu[top_i], preferred_element_type=accumulate).astype(dt)
    y = jnp.einsum("tki,tkhi->tkh", _swiglu(gu), w_d[top_i], preferred_element_type=accumulate).astype(dt)
    return _combine(y, top_p, accumulate)


def experts_dense(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array,
                  accumulate=jnp.float32) -> jax.Array:
    """x [T, H] through every expert, the outputs weighted by the routing weights (zero off the top-k): [T, H]."""
    T, dt = top_i.shape[0], x.dtype
    gu = jnp.einsum("th,eoh->teo", x.astype(w_gu.dtype), w_gu, preferred_element_type=accumulate).astype(dt)
    y = jnp.einsum("tei,ehi->teh", _swiglu(gu), w_d, preferred_element_type=accumulate).astype(dt)
    combine = jnp.zeros((T, w_gu.shape[0]), y.dtype).at[jnp.arange(T)[:, None], top_i].set(top_p.astype(y.dtype))
    return jnp.einsum("teh,te->th", y, combine, preferred_element_type=accumulate).astype(y.dtype)


_FORM_FNS = {"gather": experts_gather, "dense": experts_dense}


def experts(x: jax.Array, w_gu: jax.Array, w_d: jax.Array, top_p: jax.Array, top_i: jax.Array, *,
            form: str | None = None, accumulate=jnp.float32) -> jax.Array:
    """x [T, H] through the routed experts (top_p / top_i [T, k] from `route`): [T, H] in x's dtype.
    form: one of FORMS, default `choose_form` on T."""
    form = form or choose_form(x.shape[0], w_gu.shape[0], top_i.shape[1])
    if form not in _FORM_FNS:
        raise ValueError(f"unknown MoE form {form!r}; expected one of {', '.join(FORMS)}")
    return _FORM_FNS[form](x, w_gu, w_d, top_p, top_i, accumulate)
