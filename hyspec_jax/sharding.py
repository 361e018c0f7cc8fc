"""Running the target over a `jax.sharding.Mesh`: tensor parallel over heads / MLP / experts / vocab on the
"model" axis, data parallel over batch slots on the "data" axis.

Sharding is applied from outside the model: nothing in `hyspec_jax.models` knows about meshes. Two tables say
where every array lives (the style of jax-ml/jax-llm-examples):

1. a rule table from array names to *logical* axes, one entry per dimension —
   `PARAM_RULES` for the parameters of `TargetModel` (keyed by the Hugging Face parameter names the module
   tree mirrors, e.g. ``model.layers.3.linear_attn.out_proj.weight``, weights [out, in]), and
   `STATE_RULES` / `CACHE_RULES` for the `TargetState` / `TreeCache` pytrees (keyed by field name);
2. `LOGICAL_AXIS_RULES`, from logical axes to mesh axes (``"data"``, ``"model"`` or ``None`` = replicated).

A dimension is sharded over its mesh axis only if the number of whole *units* along it (attention heads,
KV heads, GDN key-head groups, GDN value heads, experts; gate/up row pairs of a fused MLP; plain elements for
MLP / vocab / batch) is a multiple of the mesh axis size, so every device holds whole heads / groups / experts.
Otherwise that dimension falls back to replication. A parameter with no rule, a rule of the wrong rank, or a dimension
that is not a whole number of its units raises — fail closed, never a silent or misaligned sharding.

Layout notes (why the table looks the way it does):

- A GDN layer's one in-projection ``in_proj`` (both checkpoint layouts load into it) is grouped by key head:
  per key-head group g the rows are [q_g | k_g | v_g | z_g | b_g | a_g]. A contiguous split of the output dim
  over "model" keeps whole groups only when ``linear_num_key_heads`` is divisible by the axis size — that is
  the unit checked.
- The ``conv1d`` weight and the conv window are the concatenation [q (all heads) | k (all heads) | v (all
  heads)]. A contiguous split of that dim would cut across the q/k/v blocks instead of giving each device its
  heads' q, k and v. GSPMD would still compute correct values (a sharding is only a layout), but it would have
  to reshuffle at the split into q, k, v — communication on every layer. The logical axis ``gdn_qkv``
  therefore maps to ``None`` (replicated) by default: the depthwise conv runs replicated on the gathered
  q/k/v columns of the in-projection, while the in-projection itself, the value side (A_log, dt_bias,
  out_proj) and the recurrent state are sharded over heads. Map ``gdn_qkv`` to "model" to save the conv's
  memory at the price of more communication; the numbers are the same either way (tested).
- An MLP's fused ``gate_up_proj`` rows are gate/up pairs ([g0, u0, g1, u1, …]), sharded over "mlp" by whole
  pairs (the unit checked), so each device holds gate i with up i and the SwiGLU needs no communication.
- Routed experts are sharded whole (expert parallel over "model": ``gate_up_proj`` rows are [gate | up], so a
  split of that dim would not be per-expert tensor parallel). The router and the shared-expert gate are
  replicated. Embedding and ``lm_head`` are vocab-parallel; the logits returned by the jitted entry points
  are gathered over the vocab (sharded over "data" by slot).

Everything stays correct for any table (XLA inserts the collectives); the table decides the layout and thus
communication. Tests (`tests/test_sharding.py`) check equality with single-device outputs on fake CPU devices.

Entry points: `make_mesh`, `param_shardings` / `shard_params`, `state_shardings` / `shard_state`,
`cache_shardings`, `init_state_sharded`, and `jit_extend` / `jit_verify` (the functional
`hyspec_jax.models.target.extend` / `verify` jitted with these in/out shardings, the state donated, so the
state keeps its layout from step to step). `param_spec(name, shape, cfg, mesh)` serves a loader that wants to
place each checkpoint tensor as it is read.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hyspec_jax import gdn
from hyspec_jax.config import TargetConfig
from hyspec_jax.models import target as target_lib
from hyspec_jax.state import TargetState, TreeCache, check_state, init_state

DATA, MODEL = "data", "model"

# Logical axis -> mesh axis (None = replicated). Override per call with `axis_rules=`.
LOGICAL_AXIS_RULES: Mapping[str, str | None] = {
    "batch": DATA,              # request slots
    "vocab": MODEL,             # embedding rows / lm_head rows
    "heads": MODEL,             # attention query heads (q_proj rows [NH, 2·hd], o_proj columns [NH, hd])
    "kv_heads": MODEL,          # attention KV heads (k/v_proj rows, KV cache)
    "gdn_key_heads": MODEL,     # key-head groups of the GDN in_proj rows
    "gdn_value_heads": MODEL,   # GDN value heads (z, b, a, A_log, dt_bias, out_proj columns, recurrent state)
    "gdn_qkv": None,            # [q | k | v] concatenation (conv channels): see module doc
    "mlp": MODEL,               # dense / shared-expert MLP intermediate
    "experts": MODEL,           # routed experts (expert parallel)
}

# Parameter name (full match, first rule wins) -> logical axis per dimension (or (axis, elements per unit)).
# Weights are [out, in].
PARAM_RULES: tuple[tuple[str, tuple[str | tuple[str, int] | None, ...]], ...] = (
    (r"model\.embed_tokens\.weight", ("vocab", None)),
    (r"lm_head\.weight", ("vocab", None)),
    (r"lm_head\.bias", ("vocab",)),
    (r"model\.norm\.weight", (None,)),
    (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", (None,)),
    # full attention
    (r"model\.layers\.\d+\.self_attn\.q_proj\.weight", ("heads", None)),
    (r"model\.layers\.\d+\.self_attn\.q_proj\.bias", ("heads",)),
    (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.weight", ("kv_heads", None)),
    (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.bias", ("kv_heads",)),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", (None, "heads")),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.bias", (None,)),
    (r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", (None,)),
    # Gated DeltaNet (one in-projection, grouped by key head)
    (r"model\.layers\.\d+\.linear_attn\.in_proj\.weight", ("gdn_key_heads", None)),
    (r"model\.layers\.\d+\.linear_attn\.conv1d\.weight", ("gdn_qkv", None, None)),
    (r"model\.layers\.\d+\.linear_attn\.(A_log|dt_bias)", ("gdn_value_heads",)),
    (r"model\.layers\.\d+\.linear_attn\.norm\.weight", (None,)),
    (r"model\.layers\.\d+\.linear_attn\.out_proj\.weight", (None, "gdn_value_heads")),
    # dense MLP and the shared expert
    (r"model\.layers\.\d+\.mlp\.(shared_expert\.)?gate_up_proj\.weight", (("mlp", 2), None)),      # rows: gate/up pairs
    (r"model\.layers\.\d+\.mlp\.(shared_expert\.)?down_proj\.weight", (None, "mlp")),
    # sparse MoE: router and shared-expert gate replicated, routed experts whole per device
    (r"model\.layers\.\d+\.mlp\.gate\.weight", (None, None)),
    (r"model\.layers\.\d+\.mlp\.shared_expert_gate\.weight", (None, None)),
    (r"model\.layers\.\d+\.mlp\.experts\.gate_up_proj", ("experts", None, None)),
    (r"model\.layers\.\d+\.mlp\.experts\.down_proj", ("experts", None, None)),
)

# TargetState field -> logical axis per dimension (units = the dimension itself: the state is per head).
STATE_RULES: Mapping[str, tuple[str | None, ...]] = {
    "ssm": (None, "batch", "gdn_value_heads", None, None),   # [Lg, B, HV, dk, dv]
    "conv": (None, "batch", None, "gdn_qkv"),                # [Lg, B, K-1, conv_dim]
    "keys": (None, "batch", None, "kv_heads", None),         # [La, B, S, KVH, hd]
    "values": (None, "batch", None, "kv_heads", None),
    "lengths": ("batch",),                                   # [B]
    "pending": gdn.DeferredUpdates(                          # deferred commit's rows (None: off)
        log_decay=(None, "batch", "gdn_value_heads"),                  # c   [Lg, B, HV]
        row_decay=(None, "batch", "gdn_value_heads", None),            # c_i [Lg, B, HV, P]
        keys=(None, "batch", "gdn_value_heads", None, None),           # k_i [Lg, B, HV, P, dk]
        values=(None, "batch", "gdn_value_heads", None, None),         # v_i [Lg, B, HV, P, dv]
        count=(None, "batch")),                                        # [Lg, B]
}

# TreeCache field -> logical axes (the transient output of a tree verify).
CACHE_RULES: Mapping[str, Any] = {
    "factors": gdn.SolveFactors(
        log_decay=(None, "batch", "gdn_value_heads", None),           # Γ  [Lg, B, HV, N]
        keys=(None, "batch", None, "gdn_key_heads", None),            # k  [Lg, B, N, HK, dk]
        corrected=(None, "batch", "gdn_value_heads", None, None)),    # V' [Lg, B, HV, N, dv]
    "conv_inputs": (None, "batch", None, "gdn_qkv"),                  # [Lg, B, N, conv_dim]
    "keys": (None, "batch", None, "kv_heads", None),                  # [La, B, N, KVH, hd]
    "values": (None, "batch", None, "kv_heads", None),
    "mask": ("batch", None, None),                                    # [B, N, N]
}


class ShardingRuleError(ValueError):
    """A parameter without a rule, a rule of the wrong rank, or a dimension that is not whole units."""


# ------------------------------------------------------------------------------------------------
# Mesh
# ------------------------------------------------------------------------------------------------
def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first data·model devices (axis types Auto: GSPMD propagation).

    On CPU, fake devices come from XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax starts).
    """
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be ≥ 1, got data={data}, model={model}")
    devs = list(jax.devices() if devices is None else devices)
    n = data * model
    if len(devs) < n:
        raise ValueError(f"a ({data}, {model}) mesh needs {n} devices but only {len(devs)} are available"
                         " (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count before importing jax)")
    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devs[:n])


# ------------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec
# ------------------------------------------------------------------------------------------------
def logical_units(cfg: TargetConfig) -> dict[str, int | None]:
    """Whole units along each logical axis of the parameters (None: every element is a unit)."""
    return {
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "gdn_key_heads": cfg.linear_num_key_heads,
        "gdn_value_heads": cfg.linear_num_value_heads,
        "experts": cfg.num_experts or None,
    }


def logical_to_spec(logical: Sequence[str | tuple[str, int] | None], shape: Sequence[int], mesh: Mesh, *,
                    units: Mapping[str, int | None] | None = None,
                    axis_rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES, name: str = "array") -> P:
    """PartitionSpec for an array of `shape` whose dimensions carry the logical axes `logical`.

    A dimension is sharded over its mesh axis iff that mesh axis exists, is not already used by an earlier
    dimension, and the dimension's whole units divide evenly over it; otherwise it is replicated. A logical
    axis given as (axis, width) counts `width` elements as one unit where `units` has no count for it.
    """
    units = units or {}
    if len(logical) != len(shape):
        raise ShardingRuleError(f"{name}: rule {tuple(logical)} has rank {len(logical)} but the array has shape "
                                f"{tuple(shape)}")
    spec, used = [], set()
    for dim, lax_name in zip(shape, logical):
        if lax_name is None:
            spec.append(None)
            continue
        width = 1
        if isinstance(lax_name, tuple):        # (axis, elements per unit): e.g. gate/up row pairs of "mlp"
            lax_name, width = lax_name
        if lax_name not in axis_rules:
            raise ShardingRuleError(f"{name}: logical axis {lax_name!r} has no entry in the axis rules")
        unit = units.get(lax_name) or (dim // width if dim % width == 0 else 0)
        if unit <= 0 or dim % unit:
            raise ShardingRuleError(f"{name}: dimension {dim} is not a whole number of {lax_name!r} units ({unit})")
        axis = axis_rules[lax_name]
        if axis is None or axis not in mesh.shape or axis in used or unit % mesh.shape[axis]:
            spec.append(None)          # fall back to replication
            continue
        spec.append(axis)
        used.add(axis)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def param_rule(name: str, rules=PARAM_RULES) -> tuple[str | None, ...]:
    """Logical axes of the parameter `name` (HF name, e.g. model.layers.0.mlp.down_proj.weight)."""
    for pattern, logical in rules:
        if re.fullmatch(pattern, name):
            return logical
    raise ShardingRuleError(f"no sharding rule for parameter {name!r}: add one to PARAM_RULES")


def param_spec(name: str, shape: Sequence[int], cfg: TargetConfig, mesh: Mesh, *, rules=PARAM_RULES,
               axis_rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES) -> P:
    """PartitionSpec of one parameter by HF name (also usable by a loader to place tensors as they load).

    Scanned layers (`models.target.scan_layers`), `model.scanned.{p}.…` [blocks, ...], take the rule of the layer
    at block position p with the block axis replicated."""
    scanned = re.fullmatch(r"model\.scanned\.(\d+)\.(.*)", name)
    if scanned:
        inner = param_spec(f"model.layers.{scanned.group(1)}.{scanned.group(2)}", shape[1:], cfg, mesh,
                           rules=rules, axis_rules=axis_rules)
        return P(None, *inner)
    return logical_to_spec(param_rule(name, rules), shape, mesh, units=logical_units(cfg),
                           axis_rules=axis_rules, name=name)


def _path_name(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":                  # nnx.Variable wraps its array under `.value`
                parts.append(k.name)
        else:
            parts.append(str(getattr(k, "key", k)))
    return ".".join(parts)


def _split_model(model_or_params, cfg: TargetConfig | None):
    if isinstance(model_or_params, nnx.Module):
        _, params = nnx.split(model_or_params)
        return params, cfg or model_or_params.config
    if cfg is None:
        raise TypeError("param_shardings/shard_params: pass cfg= with a params pytree "
                        "(head counts are not recoverable from shapes alone)")
    return model_or_params, cfg


def param_shardings(model_or_params, mesh: Mesh, cfg: TargetConfig | None = None, *, rules=PARAM_RULES,
                    axis_rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES):
    """NamedShardings with the structure of the params (a `TargetModel`, or its params state + `cfg`).

    Works on concrete or abstract (`jax.ShapeDtypeStruct`) leaves.
    """
    params, cfg = _split_model(model_or_params, cfg)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_path_name(path), x.shape, cfg, mesh, rules=rules,
                                                       axis_rules=axis_rules)), params)


def shard_params(model_or_params, mesh: Mesh, cfg: TargetConfig | None = None, **kw):
    """The params placed on the mesh (returns the params state; the model, if given, is left untouched)."""
    params, cfg = _split_model(model_or_params, cfg)
    return jax.device_put(_global_source(params), param_shardings(params, mesh, cfg, **kw))


# ------------------------------------------------------------------------------------------------
# State and tree cache
# ------------------------------------------------------------------------------------------------
def _field_shardings(obj, rules: Mapping[str, Any], mesh: Mesh, axis_rules, cls):
    def one(logical, x, name):
        if x is None:
            return None
        if isinstance(logical, tuple) and hasattr(logical, "_fields"):       # NamedTuple of rules
            return type(logical)(*(one(lg, xi, f"{name}.{f}")
                                   for lg, xi, f in zip(logical, x, logical._fields)))
        return NamedSharding(mesh, logical_to_spec(logical, x.shape, mesh, axis_rules=axis_rules, name=name))
    return cls(**{f: one(rules[f], getattr(obj, f), f"{cls.__name__}.{f}") for f in rules})


def state_shardings(cfg: TargetConfig | None, state: TargetState, mesh: Mesh, *,
                    axis_rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES) -> TargetState:
    """A TargetState of NamedShardings: slots over "data", GDN value heads / KV heads over "model".

    `state` may be concrete or abstract (`jax.eval_shape`); with `cfg` its shapes are checked first.
    """
    if cfg is not None:
        check_state(cfg, state)
    return _field_shardings(state, STATE_RULES, mesh, axis_rules, TargetState)


def shard_state(state: TargetState, mesh: Mesh, **kw) -> TargetState:
    return jax.device_put(state, state_shardings(None, state, mesh, **kw))


def init_state_sharded(cfg: TargetConfig, batch: int, max_len: int, mesh: Mesh, dtype=jnp.float32,
                       **kw) -> TargetState:
    """An empty state allocated directly in its sharded layout."""
    abstract = jax.eval_shape(lambda: init_state(cfg, batch, max_len, dtype))
    shardings = state_shardings(cfg, abstract, mesh, **kw)
    return jax.jit(lambda: init_state(cfg, batch, max_len, dtype), out_shardings=shardings)()


def cache_shardings(cfg: TargetConfig, batch: int, mesh: Mesh, *,
                    axis_rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES) -> TreeCache:
    """A TreeCache of NamedShardings for a verify over `batch` slots (any node count N: it is never sharded)."""
    lg, la = len(cfg.gdn_layers), len(cfg.attn_layers)
    N = 1                                                          # unsharded dims: any size will do
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    abstract = TreeCache(
        factors=gdn.SolveFactors(shape(lg, batch, hv, N), shape(lg, batch, N, hk, dk),
                                 shape(lg, batch, hv, N, dv)) if lg else gdn.SolveFactors(None, None, None),
        conv_inputs=shape(lg, batch, N, cfg.conv_dim) if lg else None,
        keys=shape(la, batch, N, cfg.num_key_value_heads, cfg.head_dim) if la else None,
        values=shape(la, batch, N, cfg.num_key_value_heads, cfg.head_dim) if la else None,
        mask=shape(batch, N, N))
    return _field_shardings(abstract, CACHE_RULES, mesh, axis_rules, TreeCache)


def batch_sharding(mesh: Mesh, batch: int, ndim: int, *,
                   axis_rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES) -> NamedSharding:
    """Sharding of a [B, ...] activation / token array: slots over "data" when divisible."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), (batch,) + (1,) * (ndim - 1),
                                               mesh, axis_rules=axis_rules, name="batch"))


# ------------------------------------------------------------------------------------------------
# Jitted entry points with pinned in/out shardings
# ------------------------------------------------------------------------------------------------
def jit_extend(graphdef: nnx.GraphDef, mesh: Mesh, params_sharding, state_sharding: TargetState, *,
               last_only: bool = False, donate_state: bool = True, **jit_kwargs):
    """`target.extend(graphdef, ·)` jitted over the mesh: f(params, state, tokens, valid) -> (logits, state).

    tokens / valid [B, T] and logits [B, T|1, V] follow the state's slot sharding; the new state keeps the
    layout of `state_sharding` (and reuses the donated buffers). `jit_kwargs` go to `jax.jit` (e.g.
    compiler_options).
    """
    batch_spec = state_sharding.lengths.spec
    tok = NamedSharding(mesh, P(*batch_spec, None))
    logits = NamedSharding(mesh, P(*batch_spec, None, None))
    fn = functools.partial(_extend, graphdef, last_only)
    return jax.jit(fn, in_shardings=(params_sharding, state_sharding, tok, tok),
                   out_shardings=(logits, state_sharding), donate_argnums=(1,) if donate_state else (), **jit_kwargs)


def _extend(graphdef, last_only, params, state, tokens, valid):
    return target_lib.extend(graphdef, params, state, tokens, valid, last_only=last_only)


def jit_verify(graphdef: nnx.GraphDef, mesh: Mesh, params_sharding, state_sharding: TargetState,
               cache_sharding: TreeCache, *, method: gdn.InverseMethod = "squaring", **jit_kwargs):
    """`target.verify(graphdef, ·)` jitted over the mesh: f(params, state, tree, tokens) -> (logits, cache).

    The tree ([B, N] leaves) and tokens follow the slot sharding; the committed state is read, not donated.
    """
    batch_spec = state_sharding.lengths.spec
    rows = NamedSharding(mesh, P(*batch_spec, None))
    logits = NamedSharding(mesh, P(*batch_spec, None, None))
    fn = functools.partial(_verify, graphdef, method)
    return jax.jit(fn, in_shardings=(params_sharding, state_sharding, rows, rows),
                   out_shardings=(logits, cache_sharding), **jit_kwargs)


def _verify(graphdef, method, params, state, tree, tokens):
    return target_lib.verify(graphdef, params, state, tree, tokens, method=method)


def describe(shardings) -> dict[str, P]:
    """{name: PartitionSpec} of a sharding pytree (for logs and `hyspec` diagnostics)."""
    flat = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0]
    return {_path_name(p): s.spec for p, s in flat if isinstance(s, NamedSharding)}


__all__ = ["DATA", "MODEL", "LOGICAL_AXIS_RULES", "PARAM_RULES", "STATE_RULES", "CACHE_RULES", "ShardingRuleError",
           "make_mesh", "logical_units", "logical_to_spec", "param_rule", "param_spec", "param_shardings",
           "shard_params", "state_shardings", "shard_state", "init_state_sharded", "cache_shardings",
           "batch_sharding", "jit_extend", "jit_verify", "describe"]


# ------------------------------------------------------------------------------------------------
# Placement that follows the weights (the request loop's buffers, a drafter)
# ------------------------------------------------------------------------------------------------
def params_mesh(params) -> Mesh | None:
    """The mesh the target's weights are sharded over (`shard_params`), or None when they sit on one device:
    the request loop places its buffers to match, and every jitted program then runs over the mesh."""
    for x in jax.tree.leaves(params):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
            return sh.mesh
    return None


def params_device(params) -> jax.Device | None:
    """The one device the weights sit on (None: several, or no arrays)."""
    devices = {d for x in jax.tree.leaves(params) if isinstance(x, jax.Array) for d in x.devices()}
    return next(iter(devices)) if len(devices) == 1 else None


def _global_source(tree):
    """What `device_put` onto a mesh takes: the arrays themselves, or, when the mesh spans processes (whose
    devices this one cannot address), their host values — equal on every process, which each runs the same."""
    return jax.tree.map(np.asarray, tree) if jax.process_count() > 1 else tree


def replicate(tree, mesh: Mesh):
    """Every leaf replicated over the mesh (a drafter beside a sharded target)."""
    return jax.device_put(_global_source(tree), NamedSharding(mesh, P()))


def data_parallel_size(params) -> int:
    """Data-parallel replicas of the weights `params` (the "data" axis of their mesh; 1 on one device): the
    request loop's slot count is a multiple of it, each replica decoding its own share of the slots."""
    mesh = params_mesh(params)
    return 1 if mesh is None else mesh.shape.get(DATA, 1)


# The drafter's per-slot buffers (`DrafterState`, `MTPState`) by field -> logical axes: slots only. The drafter is
# replicated over "model" (its weights are), so its buffers are too.
SLOT_RULES: Mapping[str, tuple[str | None, ...]] = {
    "keys": (None, "batch", None, None, None),     # [L, B, S, KVH, hd]
    "values": (None, "batch", None, None, None),
    "hidden": ("batch", None),                     # MTP: [B, H]
    "lengths": ("batch",),                         # [B]
}


def slot_shardings(tree, mesh: Mesh, *, axis_rules: Mapping[str, str | None] = LOGICAL_AXIS_RULES):
    """Shardings of a per-slot buffer: a drafter state (by `SLOT_RULES`) or a [B, ...] array (the anchors) —
    slots over "data" when divisible, everything else replicated."""
    if isinstance(tree, jax.Array | np.ndarray):
        return batch_sharding(mesh, tree.shape[0], tree.ndim, axis_rules=axis_rules)
    fields = [f.name for f in dataclasses.fields(tree)]
    return _field_shardings(tree, {f: SLOT_RULES[f] for f in fields}, mesh, axis_rules, type(tree))


def place_buffers(config: TargetConfig, params, state: TargetState, *others):
    """(state, *others) placed like the weights `params`: the state by `STATE_RULES`, the others (a drafter's
    state, the anchors) by `SLOT_RULES`; with data-parallel replicas every buffer's slots are split over "data".
    On one device: committed to the weights' device, as every program's outputs are, so that a program compiled
    for the fresh buffers also takes its own outputs (an exported program's jit, `compilation.DiskCachedJit`,
    compiles again for a committed input)."""
    mesh = params_mesh(params)
    if mesh is None:
        device = params_device(params)
        return (state, *others) if device is None else tuple(jax.device_put(x, device) for x in (state, *others))
    replicas = mesh.shape.get(DATA, 1)
    if state.batch % replicas:
        raise ValueError(f"{state.batch} slots do not split over {replicas} data-parallel replicas: "
                         f"use a multiple of {replicas}")
    return (jax.device_put(_global_source(state), state_shardings(config, state, mesh)),
            *(None if o is None else jax.device_put(_global_source(o), slot_shardings(o, mesh)) for o in others))
