"""ReaDy reader: position-specific reads of the target's committed Gated-DeltaNet states (papers/000, ReaDy).

For every (source GDN layer, value head) pair m with committed state S_m (HF layout [dk, dv], o = Sᵀq; the
paper's S̄ is its transpose) and every block slot j with draft representation h_j:

    S̄_m  = S_m / rms(S_m)                   (rms over the whole head state; log rms kept as a feature)
    z_jm = W_q,m RMSNorm(h_j)   ∈ R^r        (rank-r query bottleneck, W_q,m: r × d)
    q_jm = U_mᵀ z_jm            ∈ R^dk       (U_m: r × dk)
    T_m  = V_mᵀ S̄_m(paper)      ∈ R^{r_v×dk} (V_m: dv × r_v; shared by every slot of the block)
    u_jm = T_m q_jm / √dk       ∈ R^{r_v}
    f_j  = [u_j1 … u_jM | log rms(S_1) … log rms(S_M)]
    Δh_j = W_out SiLU(W_in f_j + b_in),       W_out initialised to 0 → an untrained reader is exactly DSpark.

Δh is added to the residual stream of the injection draft layer, after attention and before the MLP
(default, the paper's best) or before attention.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from hyspec_jax import gdn
from hyspec_jax.config import LINEAR, ConfigError, TargetConfig
from hyspec_jax.models.layers import Linear, RMSNorm

F32 = jnp.float32
POSITIONS = ("after_attention", "before_attention")


def default_source_layers(tcfg: TargetConfig) -> tuple[int, ...]:
    """The paper's choice generalised: the last GDN layer of the first half and the last GDN layer
    (layers 30 and 62 of a 64-layer 3:1 stack)."""
    gdn = tcfg.gdn_layers
    if not gdn:
        raise ConfigError("target has no GDN layers: nothing for a reader to read")
    first_half = [g for g in gdn if g <= tcfg.num_hidden_layers // 2 - 1]
    return tuple(dict.fromkeys([first_half[-1] if first_half else gdn[0], gdn[-1]]))


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    hidden_size: int
    source_layers: tuple[int, ...]   # target layer ids (GDN layers)
    source_slots: tuple[int, ...]    # their rows in TargetState.ssm
    num_heads: int                   # GDN value heads per layer (HV)
    key_dim: int                     # dk
    value_dim: int                   # dv
    rank: int = 8                    # query bottleneck r (<= dk; dk = full rank)
    value_rank: int = 8              # value compression r_v (<= dv)
    mlp_hidden: int = 256
    injection_layer: int = -1        # draft layer index; negative counts from the end
    position: str = "after_attention"
    eps: float = 1e-6

    def __post_init__(self):
        if not self.source_layers or len(self.source_layers) != len(self.source_slots):
            raise ConfigError("source_layers and source_slots must be non-empty and of equal length")
        if not 1 <= self.rank <= self.key_dim:
            raise ConfigError(f"rank must be in [1, key_dim={self.key_dim}], got {self.rank}")
        if not 1 <= self.value_rank <= self.value_dim:
            raise ConfigError(f"value_rank must be in [1, value_dim={self.value_dim}], got {self.value_rank}")
        if self.position not in POSITIONS:
            raise ConfigError(f"position must be one of {POSITIONS}, got {self.position!r}")
        if self.mlp_hidden < 1:
            raise ConfigError("mlp_hidden must be >= 1")

    @property
    def num_reads(self) -> int:
        """M: (layer, head) pairs read."""
        return len(self.source_layers) * self.num_heads

    @property
    def feature_dim(self) -> int:
        return self.num_reads * (self.value_rank + 1)

    def injection_index(self, num_layers: int) -> int:
        if not -num_layers <= self.injection_layer < num_layers:
            raise ConfigError(f"injection_layer {self.injection_layer} outside a {num_layers}-layer drafter")
        return self.injection_layer % num_layers

    @classmethod
    def for_target(cls, tcfg: TargetConfig, *, hidden_size: int | None = None,
                   source_layers: tuple[int, ...] | None = None, rank: int = 8, value_rank: int | None = None,
                   **overrides: Any) -> "ReaderConfig":
        layers = tuple(source_layers) if source_layers is not None else default_source_layers(tcfg)
        bad = [i for i in layers if not (0 <= i < tcfg.num_hidden_layers and tcfg.layer_types[i] == LINEAR)]
        if bad:
            raise ConfigError(f"reader source layers {bad} are not GDN layers of the target")
        return cls(hidden_size=tcfg.hidden_size if hidden_size is None else hidden_size, source_layers=layers,
                   source_slots=tuple(tcfg.layer_slot(i) for i in layers),
                   num_heads=tcfg.linear_num_value_heads, key_dim=tcfg.linear_key_head_dim,
                   value_dim=tcfg.linear_value_head_dim, rank=rank,
                   value_rank=rank if value_rank is None else value_rank, **overrides)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["source_layers"], d["source_slots"] = list(self.source_layers), list(self.source_slots)
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ReaderConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in raw.items() if k in known}
        kw["source_layers"] = tuple(int(i) for i in kw["source_layers"])
        kw["source_slots"] = tuple(int(i) for i in kw["source_slots"])
        return cls(**kw)


def select_states(cfg: ReaderConfig, ssm: jax.Array, pending: gdn.DeferredUpdates | None = None) -> jax.Array:
    """The states a reader reads, (layer, head) flattened: ssm [Lg,B,HV,dk,dv] -> [B,M,dk,dv]
    (or per block [Lg,B,A,HV,dk,dv] -> [B,A,M,dk,dv]). pending: TargetState.pending (deferred commit), folded
    into the source layers only (the committed state of the others is never formed)."""
    src = jnp.asarray(cfg.source_slots)
    s = ssm[src]                                                 # [Ls, B, (A,) HV, dk, dv]
    if pending is not None:
        s = jax.vmap(gdn.deferred_fold)(s, jax.tree.map(lambda x: x[src], pending))
    chex.assert_equal(s.shape[-3:], (cfg.num_heads, cfg.key_dim, cfg.value_dim))
    s = jnp.moveaxis(s, 0, -4)                                   # [B, (A,) Ls, HV, dk, dv]
    return s.reshape(s.shape[:-4] + (cfg.num_reads, cfg.key_dim, cfg.value_dim))


class Reader(nnx.Module):
    def __init__(self, cfg: ReaderConfig, *, dtype=F32, rngs: nnx.Rngs):
        M, r, rv, d = cfg.num_reads, cfg.rank, cfg.value_rank, cfg.hidden_size
        self.config = cfg
        self.norm = RMSNorm(d, cfg.eps, dtype=dtype)
        init = lambda shape, fan_in: nnx.Param(  # noqa: E731  unit-variance projections
            (jax.random.normal(rngs.params(), shape, F32) / math.sqrt(fan_in)).astype(dtype))
        self.w_q = init((M, r, d), d)
        self.u = init((M, r, cfg.key_dim), r)
        self.v = init((M, cfg.value_dim, rv), cfg.value_dim)
        self.fc_in = Linear(cfg.feature_dim, cfg.mlp_hidden, bias=True, dtype=dtype, rngs=rngs)
        self.fc_out = Linear(cfg.mlp_hidden, d, dtype=dtype, rngs=rngs)
        self.fc_out.weight.set_value(jnp.zeros_like(self.fc_out.weight[...]))  # untrained reader == DSpark

    def state_summary(self, states: jax.Array) -> tuple[jax.Array, jax.Array]:
        """states [B,A,M,dk,dv] -> (T [B,A,M,r_v,dk], log rms [B,A,M]); once per block, shared by its slots."""
        s = states.astype(F32)
        ms = jnp.mean(s * s, axis=(-2, -1))
        sbar = s * jax.lax.rsqrt(ms + self.config.eps)[..., None, None]
        T = jnp.einsum("bamkv,mvc->bamck", sbar, self.v[...].astype(F32))
        return T, 0.5 * jnp.log(ms + self.config.eps)

    def readout(self, h: jax.Array, T: jax.Array) -> jax.Array:
        """h [B,A,G,d], T [B,A,M,r_v,dk] -> u [B,A,G,M,r_v]."""
        z = jnp.einsum("bagd,mrd->bagmr", self.norm(h).astype(F32), self.w_q[...].astype(F32))
        q = jnp.einsum("bagmr,mrk->bagmk", z, self.u[...].astype(F32))
        return jnp.einsum("bamck,bagmk->bagmc", T, q) / math.sqrt(self.config.key_dim)

    def __call__(self, h: jax.Array, states: jax.Array) -> jax.Array:
        """h [B,A,G,d], states [B,A,M,dk,dv] -> Δh [B,A,G,d] (dtype of h)."""
        cfg = self.config
        B, A, G, _ = h.shape
        chex.assert_shape(states, (B, A, cfg.num_reads, cfg.key_dim, cfg.value_dim))
        T, log_rms = self.state_summary(states)
        u = self.readout(h, T)
        f = jnp.concatenate([u.reshape(B, A, G, -1),
                             jnp.broadcast_to(log_rms[:, :, None, :], (B, A, G, cfg.num_reads))], axis=-1)
        w_dtype = self.fc_in.weight[...].dtype
        return self.fc_out(jax.nn.silu(self.fc_in(f.astype(w_dtype)))).astype(h.dtype)


__all__ = ["ReaderConfig", "Reader", "select_states", "default_source_layers"]
