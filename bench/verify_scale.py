"""Verification cost at scale (issue [bench], item 3): T_ver(N) / T_dec of the Qwen3.8-27B target.

    hyspec bench verify-scale [--devices D] [--batch 1,4,8] [--nodes 1,8,16,32,64,128,256] [--prefix 512]
                              [--eps 0.3] [--max-seconds S] [--json OUT.json] [--tiny | --config PATH] ...
    python -m hyspec_jax.bench.verify_scale ...        (same options)

The Qwen3.8-27B geometry (docs/reference/target_model.md §15, `hyspec_jax.spec.memory.qwen38_27b`; or `--config` /
`--tiny`) with RANDOM weights distributed as the model's own initialiser draws them (`INIT_RULES`: N(0, 0.02)
matrices, RMSNorm / gated-norm weights, A_log, dt_bias and conv weights as in the modules), created leaf by
leaf directly on the device(s) in their final sharding by one small jitted filler per distinct (shape,
dtype, sharding) — the 64 layers share shapes, so the init compiles ~15 tiny programs whatever the depth (a
whole-model init jit tripped XLA's "very slow compile" alarm) and no weight passes through the host — on one
device or, with `--devices D`, tensor parallel over a (data 1, model D) mesh with `hyspec_jax.sharding`'s
rules and its pinned-sharding entry points `jit_extend` / `jit_verify`. The committed state is that of a
prefix of `--prefix` tokens (deterministic random recurrent states, conv windows and KV; the lengths set),
made by the same fillers. The only whole-model programs compiled are the decode / verify being measured
(and, with `--matmul-floor`, the floor).
For every batch B and node capacity N it measures (timing functions shared with `hyspec calibrate`,
hyspec_jax/runtime/calibrate.py: warm-up calls, then the median of `--repeats` calls, each with block_until_ready; no
input rotation is needed, since every call streams all the weights, far more than the L2 cache):

  T_dec(B)     one-token decode of every slot: `target.extend` of 1 token per request, state donated;
  T_ver(N, B)  the complete target verify forward (`target.verify`: logits of every node and the commit
               factors) over a seeded random tree of N nodes (anchor included) of depth min(--depth, N−1),
               the same tree for every request;

and reports T_ver/T_dec, B_ver(B) = max{N : T_ver ≤ (1+ε)·T_dec} (`spec.budget.b_ver`; the issue's target
is N = 64 within 1.3×), the transient verify-state memory of the factorized design against per-node state
snapshots at the same (N, B) (`spec.memory.verify_memory`, with the bytes of the TreeCache the verify really
returned and XLA's temp allocation beside it), lower / compile / first-call times of every program, and,
with `--matmul-floor`, the time of the dense matrix products alone (every 2-D weight but the embedding
applied to B·N random tokens) as a floor. Work runs in groups (`work_plan`): batch 1 with N ∈ {1, 64} first
(the issue's headline, T_ver(64) ≤ 1.3·T_dec at batch 1), then batch 1's other N, then batches 4 and 8;
the programs of a group are compiled ahead of time in parallel threads (`--compile-workers`), then timed one
after another with nothing else running. With `--max-seconds S` no new (batch, N) program is lowered or
compiled once S seconds have passed since the start (programs already compiled are still timed); the
report then lists what was skipped. Every output (logits) is checked finite; the exit status is 1 if one is
not.

Outputs (with --json OUT.json): OUT.json (run_metadata: device, versions, commit; the command line; every
number), OUT.md (report), OUT.png (T_ver/T_dec vs N, one line per batch, the 1+ε line). They are rewritten
after every measured decode and every N, so a run cut short (`--max-seconds`, or killed) leaves what it
measured ("status": "partial", and "skipped": [[B, N], ...] when --max-seconds stopped it). `--merge A.json B.json
--json OUT.json` re-renders (e.g. batches run as separate commands) without a device.

On the GPU machine the package is not pip-installed (bench/e2e.py's convention): map bench/ into the package,
run from the repository root, and pass the commit (no .git travels). One H200 (kind nvidia-h200, run with
timeout_s 600; --max-seconds 480 leaves two minutes for the compiles in flight at the deadline and the
final write — a call killed anyway still returns the JSON written after its last measured N):

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \
        hyspec_jax.bench.verify_scale --max-seconds 480 --compile-cache .jax_cache \
        --json $OUT/verify_scale_1gpu.json

Two H200, tensor parallel over "model" (kind nvidia-h200-x2):

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \
        hyspec_jax.bench.verify_scale --devices 2 --max-seconds 480 --compile-cache .jax_cache \
        --json $OUT/verify_scale_2gpu.json

.jax_cache is git-ignored, so a warm machine keeps it between calls and a repeated call skips the XLA
compiles. Compiling is the long part (24 programs of 64 unrolled layers; the init is ~15 tiny programs). If
one call leaves (B, N) skipped, run the rest in further calls (e.g. `--batch 4`, `--batch 8`, each with its
own --json; the compile cache carries over), then, here, `--merge b1.json b4.json b8.json --json
bench/results/verify_scale/verify_scale_1gpu.json` (a skipped (B, N) measured by another run counts as done). CPU smoke run: `--tiny`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hyspec_jax.runtime.calibrate import _ints, template_tree, time_decode, time_verify, median_time

DEFAULT_NODES = (1, 8, 16, 32, 64, 128, 256)
DEFAULT_BATCH = (1, 4, 8)
MIB = 2 ** 20


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------
def tiny_config(layers: int = 4):
    """A small geometry of the same shape family (3 GDN + 1 full-attention layer per 4; every head count
    even, so a 2-way model axis shards them): the CPU smoke run and the tests."""
    from hyspec_jax.config import FULL, LINEAR, TargetConfig

    n = layers
    return TargetConfig(
        model_type="qwen3_5_text", vocab_size=256, hidden_size=64, num_hidden_layers=n,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(n)),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rope_theta=1e7, partial_rotary_factor=0.25)


def resolve_config(tiny: bool = False, config: str | None = None):
    """(TargetConfig, name): --tiny, --config (a config.json or a model directory), else Qwen3.8-27B."""
    from hyspec_jax.config import TargetConfig
    from hyspec_jax.spec.memory import qwen38_27b

    if tiny:
        return tiny_config(), "tiny geometry"
    if config:
        p = Path(config)
        if p.is_dir():
            return TargetConfig.from_pretrained(p), str(p)
        return TargetConfig.from_hf_dict(json.loads(p.read_text())), str(p)
    return qwen38_27b(), "Qwen3.8-27B geometry"


# ------------------------------------------------------------------------------------------------
# Model, state and inputs on the device(s)
# ------------------------------------------------------------------------------------------------
def make_mesh(devices: int):
    from hyspec_jax import sharding as shd

    return shd.make_mesh(1, devices)


# (module class, attribute) -> (kind, scale): how the model's own initialisers (models/layers.py,
# models/target.py) fill each parameter. "normal": scale·N(0, 1) drawn in fp32; "const": every entry = scale;
# "log_uniform": log U(lo, hi), scale = (lo, hi).
INIT_RULES = {
    ("Linear", "weight"): ("normal", 0.02),
    ("Linear", "bias"): ("const", 0.0),
    ("Embedding", "weight"): ("normal", 0.02),
    ("Experts", "gate_up_proj"): ("normal", 0.02),
    ("Experts", "down_proj"): ("normal", 0.02),
    ("RMSNorm", "weight"): ("const", 0.0),            # zero-centred: x/rms(x) · (1 + w)
    ("GatedRMSNorm", "weight"): ("const", 1.0),
    ("DepthwiseConv", "weight"): ("normal", 0.3),
    ("GatedDeltaNet", "A_log"): ("log_uniform", (1.0, 16.0)),
    ("GatedDeltaNet", "dt_bias"): ("const", 1.0),
}


def param_init_rules(model, rules: dict | None = None) -> dict:
    """{parameter path (tuple): (kind, scale)} from the (abstract) model's module classes and `rules` (default
    `INIT_RULES`). A parameter with no rule is an error (add its rule), never a silent guess."""
    from flax import nnx

    nodes = list(nnx.iter_graph(model))
    owners = {tuple(p): type(n).__name__ for p, n in nodes if isinstance(n, nnx.Module)}
    table, out = INIT_RULES if rules is None else rules, {}
    for p, n in nodes:
        if isinstance(n, nnx.Param):
            key = (owners.get(tuple(p[:-1])), p[-1])
            if key not in table:
                raise KeyError(f"no init rule for parameter {'.'.join(map(str, p))} ({key[0]}.{key[1]}): "
                               "add one to verify_scale.INIT_RULES")
            out[tuple(p)] = table[key]
    return out


@functools.lru_cache(maxsize=None)
def _filler(kind: str, scale, shape: tuple, dtype, sharding, compiler_options: tuple):
    """One small jitted program per distinct (kind, scale, shape, dtype, sharding): f(seed, stream, index)
    -> the array, created directly in `sharding`. The key, fold_in(fold_in(key(seed), stream), index), is
    traced, so every leaf of one signature (e.g. the same projection in all 64 layers) reuses one compile."""
    import jax
    import jax.numpy as jnp

    def fill(seed, stream, index):
        if kind == "const":
            return jnp.full(shape, scale, dtype)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), index)
        if kind == "normal":
            return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        if kind == "log_uniform":
            lo, hi = scale
            return jnp.log(jax.random.uniform(key, shape, jnp.float32, lo, hi)).astype(dtype)
        raise ValueError(f"unknown init kind {kind!r}")

    return jax.jit(fill, out_shardings=sharding, compiler_options=dict(compiler_options) or None)


def fill_leaf(kind: str, scale, shape, dtype, sharding, *, seed: int, stream: int, index: int,
              compiler_options: dict | None = None):
    """A random (or constant) array of `shape`/`dtype` created on the device(s) in `sharding`."""
    fn = _filler(kind, scale, tuple(int(d) for d in shape), np.dtype(dtype), sharding,
                 tuple(sorted((compiler_options or {}).items())))
    return fn(np.int32(seed), np.int32(stream), np.int32(index))


def random_params(cfg, dtype, seed: int, mesh, compiler_options: dict | None = None, *, scan: bool = False):
    """(graphdef, params, shardings): random weights distributed as the model's own initialiser draws them
    (`INIT_RULES`), built leaf by leaf on the device(s), each directly in its tensor-parallel layout (nothing
    passes through the host). One small program per distinct leaf signature (`_filler`): the compile count
    and time do not grow with depth — a whole-model init jit of 64 layers is a very slow XLA compile."""
    from flax import nnx

    from hyspec_jax import sharding as shd
    from hyspec_jax.models import target as target_lib

    model = target_lib.abstract_model(cfg, dtype, scan=scan)
    graphdef, abstract = nnx.split(model)
    psh = shd.param_shardings(abstract, mesh, cfg)
    rules = param_init_rules(model)
    shardings = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(psh)}
    leaves = []
    for i, (p, v) in enumerate(nnx.to_flat_state(abstract)):
        a, (kind, scale) = v.get_value(), rules[tuple(p)]
        x = fill_leaf(kind, scale, a.shape, a.dtype, shardings[tuple(p)], seed=seed, stream=0, index=i,
                      compiler_options=compiler_options)
        leaves.append((p, v.replace(value=x)))
    return graphdef, nnx.from_flat_state(leaves), psh


def random_state(cfg, batch: int, max_len: int, prefix: int, dtype, seed: int, mesh,
                 compiler_options: dict | None = None):
    """(state, shardings): a committed state as after a prefill of `prefix` tokens — random but
    deterministic recurrent states (N(0, 0.05²), fp32), conv windows and KV (N(0, 1)), lengths = prefix —
    created leaf by leaf in its sharded layout (`fill_leaf`; no whole-state program). Never zeros (zeros can
    time faster than real data: hardware and libraries take shortcuts on them). The same (seed, batch) gives the
    same state."""
    import jax

    from hyspec_jax import sharding as shd
    from hyspec_jax.state import init_state

    abstract = jax.eval_shape(lambda: init_state(cfg, batch, max_len, dtype))
    sh = shd.state_shardings(cfg, abstract, mesh)
    fill = lambda j, name, kind, scale: fill_leaf(
        kind, scale, getattr(abstract, name).shape, getattr(abstract, name).dtype, getattr(sh, name),
        seed=seed, stream=1 + batch, index=j, compiler_options=compiler_options)
    state = abstract.replace(ssm=fill(0, "ssm", "normal", 0.05), conv=fill(1, "conv", "normal", 1.0),
                             keys=fill(2, "keys", "normal", 1.0), values=fill(3, "values", "normal", 1.0),
                             lengths=fill(4, "lengths", "const", prefix))
    return state, sh


def shape_inputs(cfg, batch: int, nodes: int, depth: int, seed: int, mesh, state_sh):
    """(tree, tokens [B,N], decode tokens [B,1]) of one shape, seeded by (seed, B, N), in the slot layout."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng([seed, batch, nodes])
    tree = template_tree(rng, nodes, depth, batch)
    toks = rng.integers(0, cfg.vocab_size, (batch, nodes))
    rows = NamedSharding(mesh, P(*state_sh.lengths.spec, None))
    dec = np.random.default_rng([seed, batch]).integers(0, cfg.vocab_size, (batch, 1))
    return (jax.device_put(tree, rows), jax.device_put(jnp.asarray(toks, jnp.int32), rows),
            jax.device_put(jnp.asarray(dec, jnp.int32), rows))


def entry_points(graphdef, mesh, param_sh, state_sh, cfg, batch: int, method: str,
                 compiler_options: dict | None = None):
    """(decode, verify): `sharding.jit_extend` (state donated) and `sharding.jit_verify` for this batch."""
    from hyspec_jax import sharding as shd

    cache_sh = shd.cache_shardings(cfg, batch, mesh)
    return (shd.jit_extend(graphdef, mesh, param_sh, state_sh, compiler_options=compiler_options),
            shd.jit_verify(graphdef, mesh, param_sh, state_sh, cache_sh, method=method,
                           compiler_options=compiler_options))


def verify_logits(cfg, *, devices: int, batch: int, nodes: int, prefix: int, max_len: int, depth: int = 8,
                  dtype=None, seed: int = 0, method: str = "squaring",
                  compiler_options: dict | None = None) -> np.ndarray:
    """The verify logits [B, N, V] of one shape, built exactly as the sweep builds it (tests: 1 vs D devices)."""
    import jax.numpy as jnp

    dtype = dtype or jnp.float32
    mesh = make_mesh(devices)
    graphdef, params, psh = random_params(cfg, dtype, seed, mesh, compiler_options)
    state, ssh = random_state(cfg, batch, max_len, prefix, dtype, seed, mesh, compiler_options)
    tree, toks, _ = shape_inputs(cfg, batch, nodes, depth, seed, mesh, ssh)
    _, verify = entry_points(graphdef, mesh, psh, ssh, cfg, batch, method, compiler_options)
    logits, _ = verify(params, state, tree, toks)
    return np.asarray(logits, np.float32)


# ------------------------------------------------------------------------------------------------
# Dense matmul floor
# ------------------------------------------------------------------------------------------------
def dense_weights(params) -> list:
    """Every 2-D weight of the params but the embedding (a gather, not a product)."""
    import jax

    from hyspec_jax.sharding import _path_name

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [x for p, x in flat if x.ndim == 2 and "embed_tokens" not in _path_name(p)]


def matmul_floor_fn(tokens: int, compiler_options: dict | None = None):
    """f(weights, key) -> scalar: x[T, in] @ Wᵀ for every weight W [out, in] (random bf16/f32 x, one per
    input width), each product reduced so none is dead code. Same weights and layout as the model."""
    import jax
    import jax.numpy as jnp

    def f(weights, key):
        xs, acc = {}, jnp.zeros((), jnp.float32)
        for w in weights:
            n_in = w.shape[1]
            if n_in not in xs:
                xs[n_in] = jax.random.normal(jax.random.fold_in(key, n_in), (tokens, n_in), jnp.float32
                                             ).astype(w.dtype)
            y = jnp.einsum("ti,oi->to", xs[n_in], w, preferred_element_type=jnp.float32)
            acc = acc + jnp.sum(y)
        return acc

    return jax.jit(f, compiler_options=compiler_options)


# ------------------------------------------------------------------------------------------------
# Compile ahead of time, in parallel
# ------------------------------------------------------------------------------------------------
class _NoBar:
    def __init__(self, *a, **k):
        pass

    def update(self, n=1):
        pass

    def set_description(self, s):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:               # tqdm is a dependency of the package, but not every image has it
        return _NoBar()
    return tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)


def compile_all(jobs: list, workers: int, bar, deadline: float | None = None) -> dict:
    """jobs: [(key, jitted_fn, args)] -> {key: (compiled, lower_s, compile_s)}. Lowering (Python tracing)
    runs here one job at a time, all of it before any compile; then XLA compiles run in `workers` threads (the
    compiler releases the GIL). Lowering does not overlap the compiles because JAX lowers into an MLIR context
    it keeps per thread and reuses for several programs: a compile in a worker would read the module of one
    lowering while this thread adds the next one's operations to the same context. Once `deadline`
    (time.perf_counter) has passed, the remaining jobs are neither lowered nor compiled (absent from the
    result)."""
    out = {}

    def comp(lowered):
        t0 = time.perf_counter()
        c = lowered.compile()
        return c, time.perf_counter() - t0

    lowered_jobs = []
    for key, fn, args in jobs:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        bar.set_postfix_str(f"lower {key}")
        t0 = time.perf_counter()
        lowered = fn.lower(*args)
        lowered_jobs.append((key, time.perf_counter() - t0, lowered))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        futs = [(key, lower_s, ex.submit(comp, lowered)) for key, lower_s, lowered in lowered_jobs]
        for key, lower_s, fut in futs:
            compiled, compile_s = fut.result()
            out[key] = (compiled, lower_s, compile_s)
            bar.set_postfix_str(f"compiled {key}")
            bar.update()
    return out


def _xla_stats(compiled) -> dict:
    """XLA's own accounting of a compiled program (per device): temp bytes, FLOPs, bytes accessed."""
    out = {}
    try:
        m = compiled.memory_analysis()
        if m is not None:
            out["xla_temp_bytes"] = int(m.temp_size_in_bytes)
            out["xla_output_bytes"] = int(m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 — optional diagnostics, not every backend has them
        pass
    try:
        c = compiled.cost_analysis()
        c = c[0] if isinstance(c, (list, tuple)) else c
        if c:
            out["xla_flops"] = float(c.get("flops", float("nan")))
            out["xla_bytes_accessed"] = float(c.get("bytes accessed", float("nan")))
    except Exception:  # noqa: BLE001
        pass
    return out


def _finite(x) -> bool:
    import jax.numpy as jnp

    return bool(jnp.isfinite(x).all())


def _ms(t: float) -> float:
    return round(1e3 * t, 4)


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------
HEADLINE_BATCH, HEADLINE_NODES = 1, (1, 64)


def work_plan(batches, nodes) -> list[tuple[int, list[int]]]:
    """The (batch, [N, ...]) groups in the order they are compiled and timed: batch 1 with N ∈ {1, 64} first
    (the issue's headline: T_ver(64) ≤ 1.3·T_dec at batch 1), then batch 1's other N, then every other batch
    in increasing order. A cut-short run (`--max-seconds`, or killed) has measured the headline first."""
    batches, nodes = sorted(set(batches)), sorted(set(nodes))
    plan = []
    if HEADLINE_BATCH in batches:
        head = [n for n in nodes if n in HEADLINE_NODES]
        rest = [n for n in nodes if n not in HEADLINE_NODES]
        plan += [(HEADLINE_BATCH, g) for g in (head, rest) if g]
    return plan + [(b, nodes) for b in batches if b != HEADLINE_BATCH]


class BatchBench:
    """One batch: its committed state, entry points, inputs and results (`result`, the JSON's batch entry).
    `run(Ns)` compiles the programs of those N (plus the decode, the first time) in parallel, then times
    them one after another; a batch may be run in several groups (`work_plan`)."""

    def __init__(self, cfg, *, mesh, graphdef, params, param_sh, weights, batch: int, prefix: int, max_len: int,
                 depth: int, dtype, seed: int, method: str, repeats: int, warmup: int, eps: float, floor: bool,
                 compiler_options: dict | None = None):
        import jax
        import jax.numpy as jnp

        from hyspec_jax.spec.memory import OURS

        self.cfg, self.mesh, self.params, self.weights, self.batch = cfg, mesh, params, weights, batch
        self.prefix, self.max_len, self.depth, self.dtype, self.seed = prefix, max_len, depth, dtype, seed
        self.repeats, self.warmup, self.eps, self.floor, self.copts = repeats, warmup, eps, floor, compiler_options
        self.state, self.ssh = random_state(cfg, batch, max_len, prefix, dtype, seed, mesh, compiler_options)
        self.decode, self.verify = entry_points(graphdef, mesh, param_sh, self.ssh, cfg, batch, method,
                                                compiler_options)
        self.dec_tok = shape_inputs(cfg, batch, 1, depth, seed, mesh, self.ssh)[2]   # depends on (seed, B) only
        self.key = jax.random.key(seed)
        self.design = dataclasses.replace(OURS, act_bytes=jnp.dtype(dtype).itemsize)
        self.floors: dict[int, float] = {}
        self.t_ver: dict[int, float] = {}
        self.result = dict(batch=batch, decode=None, verify=[], b_ver=None, within=False, eps=eps)

    def _jobs(self, Ns, inputs) -> list:
        import jax.numpy as jnp

        jobs = []
        if self.result["decode"] is None:
            jobs.append((("decode",), self.decode,
                         (self.params, self.state, self.dec_tok, jnp.ones(self.dec_tok.shape, bool))))
        jobs += [(("verify", N), self.verify, (self.params, self.state, inputs[N][0], inputs[N][1])) for N in Ns]
        if self.floor:
            need = ({self.batch} if self.result["decode"] is None else set()) | {self.batch * N for N in Ns}
            jobs += [(("floor", T), matmul_floor_fn(T, self.copts), (self.weights, self.key))
                     for T in sorted(need - set(self.floors))]
        return jobs

    def _floor_ms(self, progs, T):
        if not self.floor:
            return None
        if T not in self.floors and ("floor", T) in progs:
            compiled = progs[("floor", T)][0]
            self.floors[T] = _ms(median_time(lambda: compiled(self.weights, self.key), self.repeats,
                                             self.warmup)[0].median_s)
        return self.floors.get(T)

    def run(self, Ns: list[int], *, workers: int, bar, deadline: float | None = None, on_update=None) -> list[int]:
        """Compile and time the verify of every N in `Ns` (and the decode, once). Past `deadline`
        (perf_counter) no further program is lowered or compiled; what was compiled is timed. Calls
        `on_update(result)` after the decode and after every N. Returns the N measured."""
        import jax

        from hyspec_jax.spec.budget import b_ver
        from hyspec_jax.spec.memory import verify_memory

        B = self.batch
        inputs = {N: shape_inputs(self.cfg, B, N, self.depth, self.seed, self.mesh, self.ssh) for N in Ns}
        bar.set_description(f"B={B} compile")
        progs = compile_all(self._jobs(Ns, inputs), workers, bar, deadline=deadline)
        bar.set_description(f"B={B} time")
        if self.result["decode"] is None:
            if ("decode",) not in progs:
                return []
            # T_dec: a second copy of the state (the decode donates it; self.state stays the verify's state)
            compiled, lower_s, compile_s = progs[("decode",)]
            dec_state, _ = random_state(self.cfg, B, self.max_len, self.prefix, self.dtype, self.seed, self.mesh,
                                        self.copts)
            t, logits, dec_state = time_decode(compiled, self.params, dec_state, self.dec_tok,
                                               repeats=self.repeats, warmup=self.warmup)
            self.result["decode"] = dict(
                t_ms=_ms(t.median_s), times_ms=[_ms(x) for x in t.times_s], first_ms=_ms(t.first_s),
                spread=round(t.spread, 4), lower_s=round(lower_s, 3), compile_s=round(compile_s, 3),
                finite=_finite(logits), floor_ms=self._floor_ms(progs, B), **_xla_stats(compiled))
            del logits, dec_state
            bar.set_postfix_str(f"T_dec {self.result['decode']['t_ms']:.3f} ms")
            bar.update()
            if on_update is not None:
                on_update(self.result)
        t_dec = self.result["decode"]["t_ms"] / 1e3
        done = []
        for N in Ns:
            if ("verify", N) not in progs:
                continue
            compiled, lower_s, compile_s = progs[("verify", N)]
            tree, toks, _ = inputs[N]
            t, (logits, cache) = time_verify(compiled, self.params, self.state, tree, toks, repeats=self.repeats,
                                             warmup=self.warmup)
            mem = verify_memory(self.cfg, B, N, self.design)
            cache_bytes = sum(int(x.nbytes) for x in jax.tree.leaves((cache.factors, cache.conv_inputs)))
            self.t_ver[N] = t.median_s
            rows = self.result["verify"]
            rows.append(dict(
                nodes=N, depth=int(tree.envelope.max_depth), tokens=B * N, t_ms=_ms(t.median_s),
                times_ms=[_ms(x) for x in t.times_s], first_ms=_ms(t.first_s), spread=round(t.spread, 4),
                lower_s=round(lower_s, 3), compile_s=round(compile_s, 3), ratio=t.median_s / t_dec,
                finite=_finite(logits), floor_ms=self._floor_ms(progs, B * N), **_xla_stats(compiled),
                memory=dict(factorized_bytes=mem.bole_bytes, snapshot_bytes=mem.sglang_bytes,
                            ratio=round(mem.ratio, 3), measured_cache_bytes=cache_bytes)))
            rows.sort(key=lambda r: r["nodes"])
            del logits, cache
            self.result["b_ver"], self.result["within"] = b_ver(self.t_ver, t_dec, self.eps)
            done.append(N)
            bar.set_postfix_str(f"N={N} T_ver/T_dec {rows[-1]['ratio']:.2f}")
            bar.update()
            if on_update is not None:
                on_update(self.result)
        del progs
        return done


def sweep(args, cfg, name: str, on_progress=None) -> dict:
    """Init the weights, then run `work_plan`'s groups in order; `on_progress(report)` after every
    measured decode and verify (the JSON is rewritten there). With `args.max_seconds`, no program is started
    once that many seconds have passed since the start (the skipped (B, N) are listed in the report)."""
    import jax

    from hyspec_jax.bench.report import portable_args, portable_command, run_metadata

    t_start = time.perf_counter()
    from hyspec_jax.config import resolve_dtype
    dtype = resolve_dtype(args.dtype)
    nodes, batches = sorted(set(args.nodes)), sorted(set(args.batch))
    max_len = args.max_len or args.prefix + max(nodes)
    if max_len <= args.prefix:
        raise ValueError(f"--max-len {max_len} must exceed --prefix {args.prefix} (the decode writes there)")
    if jax.device_count() < args.devices:
        raise ValueError(f"--devices {args.devices}: only {jax.device_count()} device(s) visible")
    max_seconds = getattr(args, "max_seconds", None)
    deadline = None if max_seconds is None else t_start + max_seconds
    plan = work_plan(batches, nodes)
    mesh = make_mesh(args.devices)
    t0 = time.perf_counter()
    copts = dict(args.xla_option) or None
    graphdef, params, psh = random_params(cfg, dtype, args.seed, mesh, copts, scan=args.scan_layers)
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0
    leaves = jax.tree.leaves(params)
    embed = sum(int(x.size) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                if "embed_tokens" in jax.tree_util.keystr(p))
    count = sum(int(x.size) for x in leaves)
    report = dict(
        meta=run_metadata(), command=portable_command("hyspec bench verify-scale", args.argv),
        argv=portable_args(args.argv), status="partial",
        model=dict(name=name, config=dataclasses.asdict(cfg), param_count=count,
                   param_bytes=sum(int(x.nbytes) for x in leaves),
                   param_bytes_per_device=sum(int(x.addressable_shards[0].data.nbytes) for x in leaves),
                   dense_flops_per_token=2 * (count - embed)),
        settings=dict(devices=args.devices, mesh=dict(data=1, model=args.devices), dtype=str(np.dtype(dtype)),
                      prefix=args.prefix, max_len=max_len, depth=args.depth, eps=args.eps, repeats=args.repeats,
                      warmup=args.warmup, method=args.method, nodes=nodes, batches=batches, seed=args.seed,
                      compile_workers=args.compile_workers, compile_cache=args.compile_cache,
                      matmul_floor=args.matmul_floor, xla_options=dict(args.xla_option), max_seconds=max_seconds,
                      order=[[b, ns] for b, ns in plan]),
        init_s=round(init_s, 3), batches=[], skipped=[])
    weights = dense_weights(params) if args.matmul_floor else None
    floors = lambda B: len({B} | {B * n for n in nodes}) if args.matmul_floor else 0
    bar = progress_bar(sum(2 * (len(nodes) + 1) + floors(B) for B in batches), not args.no_progress)  # compile + time

    def update(result):
        if not any(b is result for b in report["batches"]):
            report["batches"].append(result)
            report["batches"].sort(key=lambda b: b["batch"])
        report["wall_s"] = round(time.perf_counter() - t_start, 2)
        if on_progress is not None:
            on_progress(report)

    groups_left = {B: sum(1 for b, _ in plan if b == B) for B in batches}
    benches: dict[int, BatchBench] = {}
    try:
        for B, Ns in plan:
            groups_left[B] -= 1
            if deadline is not None and time.perf_counter() >= deadline:
                report["skipped"] += [[B, N] for N in Ns]
                continue
            if B not in benches:
                benches[B] = BatchBench(
                    cfg, mesh=mesh, graphdef=graphdef, params=params, param_sh=psh, weights=weights, batch=B,
                    prefix=args.prefix, max_len=max_len, depth=args.depth, dtype=dtype, seed=args.seed,
                    method=args.method, repeats=args.repeats, warmup=args.warmup, eps=args.eps,
                    floor=args.matmul_floor, compiler_options=copts)
            done = benches[B].run(Ns, workers=args.compile_workers, bar=bar, deadline=deadline, on_update=update)
            report["skipped"] += [[B, N] for N in Ns if N not in done]
            if not groups_left[B]:
                del benches[B]                         # frees the batch's states
    finally:
        bar.close()
    if report["skipped"]:
        report["stopped"] = f"--max-seconds {max_seconds:g}: {len(report['skipped'])} (batch, N) not measured"
        print(f"[verify-scale] {report['stopped']}: {report['skipped']}", file=sys.stderr)
    report["status"] = "partial" if report["skipped"] else "complete"
    report["wall_s"] = round(time.perf_counter() - t_start, 2)
    return report


# ------------------------------------------------------------------------------------------------
# Reports: stdout table, markdown, plot
# ------------------------------------------------------------------------------------------------
def all_finite(report: dict) -> bool:
    return all(b["decode"]["finite"] and all(r["finite"] for r in b["verify"]) for b in report["batches"])


def ratio_table(report: dict) -> str:
    """Markdown table: N down, per batch T_ver (ms) and T_ver/T_dec; T_dec and B_ver rows last."""
    bs = report["batches"]
    nodes = sorted({r["nodes"] for b in bs for r in b["verify"]})
    head = "| N | " + " | ".join(f"B={b['batch']} T_ver ms | ×T_dec" for b in bs) + " |"
    out = [head, "|---|" + "---:|---:|" * len(bs)]
    for N in nodes:
        cells = []
        for b in bs:
            r = next((r for r in b["verify"] if r["nodes"] == N), None)
            cells.append(f"{r['t_ms']:.3f} | {r['ratio']:.2f}" if r else " | ")
        out.append(f"| {N} | " + " | ".join(cells) + " |")
    out.append("| T_dec | " + " | ".join(f"{b['decode']['t_ms']:.3f} | 1.00" for b in bs) + " |")
    out.append("| B_ver | " + " | ".join(
        ("—" if b["b_ver"] is None else f"{b['b_ver']}{'' if b['within'] else ' (none within)'}")
        + f" | ≤{1 + b['eps']:.2f}" for b in bs) + " |")
    return "\n".join(out)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def _gib(x: int) -> str:
    return f"{x / 2**30:.1f} GiB" if x >= 2**28 else f"{x / MIB:.2f} MiB"


def target_line(report: dict, n: int = 64) -> str:
    """The issue's target: T_ver(64) within (1+ε)·T_dec, per batch."""
    eps, cells = report["settings"]["eps"], []
    for b in report["batches"]:
        r = next((r for r in b["verify"] if r["nodes"] == n), None)
        if r is not None:
            cells.append(f"B={b['batch']}: {r['ratio']:.2f}× ({'met' if r['ratio'] <= 1 + eps else 'missed'})")
    return f"Target T_ver(N={n}) ≤ {1 + eps:g}·T_dec — " + ("; ".join(cells) if cells else f"N={n} not measured")


def _mib(x: float) -> str:
    return f"{x / MIB:,.1f}" if x >= 10 * MIB else f"{x / MIB:.4f}"


def memory_table(report: dict) -> str:
    out = ["| N | B | factorized MiB (this library) | TreeCache returned MiB | per-node snapshots MiB | ratio | "
           "XLA temp MiB (verify, per device) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for b in report["batches"]:
        for r in b["verify"]:
            m = r["memory"]
            tmp = r.get("xla_temp_bytes")
            out.append(f"| {r['nodes']} | {b['batch']} | {_mib(m['factorized_bytes'])} | "
                       f"{_mib(m['measured_cache_bytes'])} | {_mib(m['snapshot_bytes'])} | "
                       f"{m['ratio']:.1f}× | {'' if tmp is None else _mib(tmp)} |")
    return "\n".join(out)


def compile_table(report: dict) -> str:
    out = ["| program | B | N | lower s | compile s | first call ms | median ms | spread | dense-matmul floor ms |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in report["batches"]:
        d = b["decode"]
        fl = lambda r: "" if r.get("floor_ms") is None else f"{r['floor_ms']:.3f}"
        out.append(f"| decode | {b['batch']} | 1 | {d['lower_s']:.2f} | {d['compile_s']:.2f} | {d['first_ms']:.1f} | "
                   f"{d['t_ms']:.3f} | {d['spread']:.2f} | {fl(d)} |")
        for r in b["verify"]:
            out.append(f"| verify | {b['batch']} | {r['nodes']} | {r['lower_s']:.2f} | {r['compile_s']:.2f} | "
                       f"{r['first_ms']:.1f} | {r['t_ms']:.3f} | {r['spread']:.2f} | {fl(r)} |")
    return "\n".join(out)


def _title(report: dict) -> str:
    meta, s = report["meta"], report["settings"]
    return (f"{report['model']['name']}, {meta['device_kind']} × {s['devices']}"
            f"{' (tensor parallel)' if s['devices'] > 1 else ''}, {s['dtype']}, prefix {s['prefix']}")


def markdown(report: dict) -> str:
    meta, s, m = report["meta"], report["settings"], report["model"]
    lines = [
        f"# Verification cost at scale — {_title(report)}", "",
        f"`{report['command']}`", "",
        f"commit {meta['commit']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, {meta['device_count']} "
        f"{meta['platform']} device(s) visible, {meta['time_utc']}; status **{report['status']}**"
        + (f", wall {report['wall_s']:.0f} s" if "wall_s" in report else "")
        + (f" (merged from {', '.join(report['merged_from'])})" if report.get("merged_from") else ""), "",
        f"Random weights ({_count(m['param_count'])} parameters, {_gib(m['param_bytes'])}, "
        f"{_gib(m['param_bytes_per_device'])} per device; created on device in {report['init_s']:.1f} s). "
        f"Mesh data 1 × model {s['devices']}. KV length {s['max_len']}, committed prefix {s['prefix']}; "
        f"trees: random, depth min({s['depth']}, N−1), anchor included in N; GDN inverse `{s['method']}`. "
        f"Median of {s['repeats']} timed calls after {s['warmup']} warm-up call(s).", "",
        f"## T_ver / T_dec and B_ver = max{{N : T_ver ≤ (1+ε)·T_dec}}, ε = {s['eps']}", "",
        ratio_table(report), "", target_line(report), "",
        *([f"Not measured ({report.get('stopped', 'run cut short')}): "
           + ", ".join(f"B={b} N={n}" for b, n in report["skipped"]), ""] if report.get("skipped") else []),
        "## Transient verify-state memory: factorized (Γ, k, V′, conv inputs) vs per-node state snapshots", "",
        "Both counted by `hyspec_jax.spec.memory.verify_memory` (docstring there); beside them the bytes of "
        "the factors + conv inputs the verify really returned, and XLA's temp allocation of the verify program.", "",
        memory_table(report), "",
        "## Programs: lower / compile time, first call, timing spread ((max − min) / median)", "",
        compile_table(report), "",
    ]
    if not all_finite(report):
        lines += ["**WARNING: non-finite logits in at least one program (see the JSON `finite` fields).**", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[verify-scale] matplotlib missing: no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    eps = report["settings"]["eps"]
    for b in report["batches"]:
        ns = [r["nodes"] for r in b["verify"]]
        if not ns:
            continue
        line, = ax.plot(ns, [r["ratio"] for r in b["verify"]], "o-", label=f"batch {b['batch']} (B_ver {b['b_ver']})")
        if b["within"]:
            r = next(r for r in b["verify"] if r["nodes"] == b["b_ver"])
            ax.plot([r["nodes"]], [r["ratio"]], "*", ms=14, color=line.get_color())
    ax.axhline(1 + eps, color="k", ls="--", lw=1, label=f"1 + ε = {1 + eps:g}")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["nodes"] for b in report["batches"] for r in b["verify"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("verified nodes per request N (anchor included)")
    ax.set_ylabel("T_ver(N) / T_dec")
    ax.set_title(_title(report), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from hyspec_jax.bench.report import save_png
    save_png(fig, path)
    plt.close(fig)
    return True


def write_outputs(report: dict, json_path: str | None) -> None:
    from hyspec_jax.bench.report import write_report
    p = write_report(report, json_path, markdown)
    if p is not None and report["batches"]:
        plot(report, p.with_suffix(".png"))


MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
SCALE_MEM_FRACTION = "0.95"     # the scale benchmarks' default share of device memory (the environment's wins)


def drive(ap: argparse.ArgumentParser, args, *, prog: str, merge, sweep, write, summary, finite) -> int:
    """A scale benchmark's run after its own argument checks: `--merge` (no device), or the compile cache, the
    geometry and `sweep(args, cfg, name, on_progress)` — the report written after every program — then the
    summary; one-line errors (out of device memory: with what to change), and exit 1 when a program's logits are
    not finite (`finite(report)`). JAX may take SCALE_MEM_FRACTION of the device unless the environment says."""
    name = prog.rsplit(" ", 1)[-1]
    # a scale benchmark holds the device alone: JAX's default share (75%) leaves an 80 GB H100 short of the 27B
    # round at B = 32 (68 GiB, `bench/results/scale/round_scale_h100.md`); read when the backend starts
    os.environ.setdefault(MEM_FRACTION_ENV, SCALE_MEM_FRACTION)
    try:
        if args.merge:
            if not args.json:
                ap.error("--merge needs --json OUT.json")
            report = merge(args.merge)
            write(report, args.json)
            print(summary(report))
            return 0
        if args.compile_cache:
            from hyspec_jax.compilation import enable_compilation_cache
            enable_compilation_cache(Path(args.compile_cache).resolve())
        cfg, geometry = resolve_config(args.tiny, args.config)
        report = sweep(args, cfg, geometry, on_progress=lambda r: write(r, args.json))
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        hint = (f" (fewer --batch / --nodes, or a larger {MEM_FRACTION_ENV}: now "
                f"{os.environ.get(MEM_FRACTION_ENV)})" if "RESOURCE_EXHAUSTED" in str(e) else "")
        print(f"{prog}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}{hint}", file=sys.stderr)
        return 1
    write(report, args.json)
    print("\n" + summary(report))
    if args.json:
        print(f"\n[{name}] wrote {args.json} and its .md", file=sys.stderr)
    if not finite(report):
        print(f"{prog}: error: non-finite logits (see the JSON)", file=sys.stderr)
        return 1
    return 0


def settle_merged(base: dict, reports: list[dict], done: set) -> dict:
    """A merged report's skipped programs (those no merged run measured: `done` names the measured ones as the
    runs' `skipped` lists do) and its status — partial while anything is skipped, or a run stopped short without
    saying what it skipped. Returns `base`."""
    base["skipped"] = sorted({x for r in reports for x in r.get("skipped", [])} - done)
    base["status"] = "partial" if base["skipped"] or any(r["status"] != "complete" and not r.get("skipped")
                                                        for r in reports) else "complete"
    if base["status"] == "complete":
        base.pop("stopped", None)
    base.pop("wall_s", None)
    return base


def merge(paths: list[str]) -> dict:
    """One report from several runs of the same model and settings but different batches (later wins)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    base = dict(reports[0])
    loose = {"batches", "compile_workers", "compile_cache", "max_seconds", "order"}   # may differ between runs
    key = lambda r: (r["model"]["name"], {k: v for k, v in r["settings"].items() if k not in loose})
    by_batch = {}
    for p, r in zip(paths, reports):
        if key(r) != key(reports[0]):
            raise ValueError(f"{p}: model or settings differ from {paths[0]}; cannot merge")
        for b in r["batches"]:
            by_batch[b["batch"]] = b
    base["batches"] = [by_batch[k] for k in sorted(by_batch)]
    base["settings"] = dict(base["settings"], batches=sorted(by_batch))
    measured = {(b["batch"], r["nodes"]) for b in base["batches"] for r in b["verify"]}
    base["skipped"] = sorted({tuple(x) for r in reports for x in r.get("skipped", [])} - measured)
    base["skipped"] = [list(x) for x in base["skipped"]]
    # a report cut short by --max-seconds lists what it skipped: complete once another run measured those
    done = lambda r: r["status"] == "complete" or (bool(r.get("skipped")) and all(
        tuple(x) in measured for x in r["skipped"]))
    base["status"] = "complete" if all(done(r) for r in reports) else "partial"
    if base["status"] == "complete":
        base.pop("stopped", None)
    base["merged_from"] = list(paths)
    base.pop("wall_s", None)
    return base


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _kv(s: str) -> tuple[str, str]:
    k, sep, v = s.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    return k, v


def add_geometry_arguments(ap: argparse.ArgumentParser, tiny: str = "a small geometry (CPU smoke run, tests)",
                           config: str = "a config.json or model directory (default: Qwen3.8-27B)") -> None:
    """--tiny | --config: the scale benchmarks' geometry (`resolve_config`)."""
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tiny", action="store_true", help=tiny)
    g.add_argument("--config", metavar="PATH", help=config)


def add_run_arguments(ap: argparse.ArgumentParser, *, max_seconds: str, json: str = "write OUT.json and OUT.md",
                      merge: str = "merge earlier results (other batches / nodes) into --json; no device") -> None:
    """The options the scale benchmarks share: weights' dtype, seed, scanned layers, how their programs compile,
    the time limit (`max_seconds`: what it stops), the output files and the progress bar."""
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="weights / activations (auto: bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scan-layers", action="store_true",
                    help="run the repeating block under lax.scan over stacked weights (models.target.scan_layers)")
    ap.add_argument("--compile-workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)), metavar="W",
                    help="parallel XLA compiles (default min(8, cores/2))")
    ap.add_argument("--compile-cache", metavar="DIR", help="JAX persistent compilation cache directory")
    ap.add_argument("--xla-option", type=_kv, action="append", default=[], metavar="KEY=VALUE",
                    help="XLA compiler option for every program (repeatable), e.g. xla_backend_optimization_level=0")
    ap.add_argument("--max-seconds", type=float, metavar="S", help=max_seconds)
    ap.add_argument("--json", metavar="OUT.json", help=json)
    ap.add_argument("--merge", nargs="+", metavar="IN.json", help=merge)
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench verify-scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry_arguments(ap)
    ap.add_argument("--devices", type=int, default=1, metavar="D", help="tensor-parallel width: a (1, D) mesh")
    ap.add_argument("--batch", type=_ints, default=list(DEFAULT_BATCH), metavar="B,..", help="batches (default 1,4,8)")
    ap.add_argument("--nodes", type=_ints, default=list(DEFAULT_NODES), metavar="N,..",
                    help="verified nodes per request, anchor included (default 1,8,16,32,64,128,256)")
    ap.add_argument("--prefix", type=int, default=512, metavar="P", help="committed tokens per request (default 512)")
    ap.add_argument("--max-len", type=int, metavar="S", help="KV cache length (default prefix + max N)")
    ap.add_argument("--depth", type=int, default=8, metavar="D", help="tree depth, edges (default 8)")
    ap.add_argument("--eps", type=float, default=0.3, metavar="E", help="B_ver tolerance ε (default 0.3)")
    ap.add_argument("--repeats", type=int, default=10, metavar="K", help="timed calls per program (default 10)")
    ap.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed calls first (default 2)")
    ap.add_argument("--method", choices=("squaring", "neumann", "solve"), default="squaring",
                    help="GDN unit-lower inverse in the verify (default squaring)")
    ap.add_argument("--matmul-floor", action="store_true", help="also time the dense matmuls alone (floor)")
    add_run_arguments(ap, max_seconds="start no new (batch, N) program once S seconds have passed since the start "
                      "(programs already compiled are still timed); the JSON then has status partial and lists the "
                      "skipped (batch, N). Batch 1 with N in {1, 64} is measured first",
                      json="write OUT.json, OUT.md and OUT.png",
                      merge="re-render (and merge) earlier results; no device")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    if args.merge:
        report = merge(args.merge)
        write_outputs(report, args.json)
        print(f"\n{_title(report)}\n{ratio_table(report)}")
        return 0
    if args.devices < 1 or args.prefix < 0 or args.depth < 0 or args.repeats < 1 or args.warmup < 1:
        ap.error("--devices, --repeats, --warmup must be ≥ 1 and --prefix, --depth ≥ 0")
    if args.max_seconds is not None and args.max_seconds <= 0:
        ap.error(f"--max-seconds must be > 0, got {args.max_seconds}")
    if not 0 <= args.eps <= 10:
        ap.error(f"--eps must be in [0, 10], got {args.eps}")
    if args.compile_cache:
        import jax
        jax.config.update("jax_compilation_cache_dir", str(Path(args.compile_cache).expanduser().resolve()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    cfg, name = resolve_config(args.tiny, args.config)

    def checkpoint(report):
        write_outputs(report, args.json)

    report = sweep(args, cfg, name, on_progress=checkpoint)
    write_outputs(report, args.json)
    print(f"\n{_title(report)}\n{ratio_table(report)}\n{target_line(report)}\n\n{memory_table(report)}")
    if args.json:
        print(f"\n[verify-scale] wrote {args.json} and its .md / .png", file=sys.stderr)
    if not all_finite(report):
        print("[verify-scale] ERROR: non-finite logits (see the JSON 'finite' fields)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
