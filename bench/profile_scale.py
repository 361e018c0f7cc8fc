"""Where the time of the target's decode and verify goes, part by part, each part beside its own floor.

    hyspec bench profile-scale [--batch 1,8,32] [--nodes 8,32] [--prefix 512] [--kernels auto]
                               [--max-seconds S] [--json OUT.json] [--tiny | --config PATH] ...
    hyspec bench profile-scale --merge A.json B.json --json OUT.json
    python -m hyspec_jax.bench.profile_scale ...        (same options)

Programs, at the geometry of `hyspec bench verify-scale` (default Qwen3.8-27B; its random weights and committed
states, built on the device by its fillers — `bench/verify_scale.py`):

  T_dec(B)     one-token decode of every slot (`sharding.jit_extend`, T = 1, state donated), per --batch;
  T_ver(N, B)  the tree verify forward (`TargetModel.verify`, kernels `--kernels`, default auto: the Pallas
               tree solve and tree attention where the dispatcher takes them), per --batch and --nodes.

Each is timed untraced (the median of --repeats calls; `hyspec_jax/runtime/calibrate.py`'s timing), then run --trace-calls
times under `jax.profiler`. Every device kernel of the trace names the HLO instruction it runs (the trace's
`hlo_op` stat: GPU kernels on the device's stream lines, CPU thunks on the host threads); the compiled HLO text
(`compiled.as_text()`) gives each instruction's `op_name`, which carries the `jax.named_scope` tags of the model's
regions, and so its part:

  dense       `models.layers.dense` (every Linear: projections, MLP)           scope "dense"
  gdn         conv ("gdn_conv"), gates and q/k norm ("gdn_gates"), state update / tree solve ("gdn_state"):
              `hyspec_jax.gdn`'s functions and the dispatcher's `tree_solve` / `path_commit`
  attention   `attention.attend_parts`, the dispatcher's `tree_attention`    scope "attention"
  norm_act    `RMSNorm` / `GatedRMSNorm` (scope "norm"), and the activations jax.nn names (silu, sigmoid, softplus)
  logits      the LM head (a "dense" product whose result has a vocabulary-sized dimension) and sampling
              (`hyspec_jax.sampling`, the dispatcher's `biased_topk`: scope "sampling")
  rest        kernels of no tagged region: the embedding gather, RoPE, residual adds, KV-cache writes, state
              stacking, layout copies, the MoE experts ...; the largest are listed by name and op_name.

Innermost tag wins (a norm inside a GDN region is a norm). Two rules assign what the tags alone do not: a fusion
that mixes parts goes to its matrix product's part if it holds one (dot, convolution, or a library GEMM call), else
to the part most of its tagged instructions belong to, else rest; a matrix product whose op_name a compiler pass
dropped (XLA:CPU's dot rewrites do) is dense (logits if vocabulary-sized) when it reads a weight (an operand of the
`params…` arguments), else takes the part of its nearest tagged producer (three steps back at most). The time
assigned by these rules is reported per part ("by-rule ms").

Beside the parts: `unattributed` (device time of events naming no instruction of the program: copies, memsets),
`overlap` (≤ 0: kernels that ran concurrently, counted once per part but once in the busy time) and `gaps`
(measured − device busy time: launch latency, host work, idle). Parts + rest + unattributed + overlap + gaps =
the measured time, exactly.

Floors, from measured ceilings of the same run (a large bf16 (--dtype) matrix product: FLOP/s; a large
elementwise pass x → x + 1: bytes read + written per second) and the irreducible traffic / work of each part:

  dense      bytes: every 2-D weight but the embedding and LM head, read once; FLOPs 2·rows·parameters
  logits     bytes: the LM head (or tied embedding) + the fp32 logits written; FLOPs 2·rows·V·H
  gdn        bytes: recurrent states and conv windows read (decode: and written), the verify's commit factors and
             conv inputs written; FLOPs per (slot, layer, value head): decode 6·dk·dv, verify 4·T·dk·dv +
             4·T²·(dk + dv) (products with the committed state, and the T nodes' pairwise products)
  attention  bytes: the committed prefix's K/V read, the new K/V written; FLOPs 4·T·NH·hd·(prefix + T)
  norm_act   bytes: activations read and written once by each norm / activation as its own pass (no FLOPs)
  program    max(bytes / bandwidth, FLOPs / peak) over weights + state traffic (the parts above but norm_act,
             which a fused program needs not pay for, plus the embedding rows)

each floor = max(bytes / bandwidth, FLOPs / peak). No floor for rest.

Outputs (with --json OUT.json): OUT.json (run_metadata: device, versions, commit; the command; ceilings; per
program: measured, each part's ms, kernels per call, by-rule ms, bytes, FLOPs, floor, the largest rest kernels) and
OUT.md (tables). Rewritten after every program, so a run cut short leaves what it measured ("status":
"partial"). All programs are lowered (batch 1 first) and then compiled in parallel threads (--compile-workers),
then measured one after another; with --max-seconds S no program is lowered once S seconds have passed (those
compiled are still measured; the rest are listed as skipped).

One H200 (kind nvidia-h200, timeout_s 600), from the repository root (bench/verify_scale.py's convention). Nine
programs of 64 layers: lowered one after another (batch 1 first), compiled 8 at a time, then measured; --max-seconds
240 stops the lowering early enough that the compiles in flight, the measurements and the final write fit the call:

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \
        hyspec_jax.bench.profile_scale --max-seconds 240 --compile-cache .jax_cache --no-progress \
        --json $OUT/profile_scale_h200.json

If programs were skipped, run them in a further call on the warm machine (e.g. `--batch 32 --json
$OUT/profile_scale_h200_b32.json`; .jax_cache keeps what was compiled), then, here, `--merge A.json B.json --json
bench/results/profile_scale/profile_scale_h200.json` (no device).

CPU smoke run: `--tiny`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from hyspec_jax.runtime.calibrate import _ints, median_time, time_decode, time_verify
from hyspec_jax.bench.verify_scale import (_finite, _ms, _xla_stats, add_geometry_arguments, add_run_arguments, drive,
                                           compile_all, dense_weights, make_mesh, progress_bar, random_params,
                                           random_state, settle_merged, shape_inputs)

PARTS = ("dense", "gdn", "attention", "norm_act", "logits", "rest")
LABELS = {"dense": "dense matmuls", "gdn": "GDN (conv, gates, state / solve)", "attention": "attention",
          "norm_act": "norms and activations", "logits": "sampling / logits", "rest": "rest (untagged kernels)",
          "unattributed": "unattributed device time", "overlap": "overlap (concurrent kernels)",
          "gaps": "gaps (measured − device busy)"}
EXTRA = ("unattributed", "overlap", "gaps")
GDN_PARTS = ("conv", "gates", "state")
# named scope (the innermost one on an op's path wins) -> (part, GDN sub-part)
SCOPES = {"dense": ("dense", None), "gdn_conv": ("gdn", "conv"), "gdn_gates": ("gdn", "gates"),
          "gdn_state": ("gdn", "state"), "attention": ("attention", None), "norm": ("norm_act", None),
          "sampling": ("logits", None)}
ACTIVATIONS = ("jit(silu)", "jit(sigmoid)", "jit(softplus)", "jit(gelu)", "jit(relu)")
MATMULS = ("dot", "convolution")
TRIVIAL = ("parameter", "constant", "bitcast", "tuple", "get-tuple-element")
CONTAINERS = ("while", "conditional", "call")          # CPU thunks that run other thunks: their children count
DEFAULT_BATCH, DEFAULT_NODES = (1, 8, 32), (8, 32)


# ------------------------------------------------------------------------------------------------
# Compiled HLO -> part of every instruction
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HloOp:
    name: str
    opcode: str
    dims: tuple[int, ...]          # the result's (first array's) dimensions
    op_name: str
    calls: tuple[str, ...]         # fused computations
    gemm: bool                     # a library matrix product (cuBLAS / cuBLASLt custom call)
    operands: tuple[str, ...] = ()


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(")


def parse_hlo(text: str) -> tuple[str, dict[str, HloOp], dict[str, list[HloOp]]]:
    """(module name, {instruction: HloOp} over every computation, {computation: [HloOp]}) of `compiled.as_text()`."""
    from hyspec_jax.compilation import hlo_computations

    m = re.search(r"^HloModule ([\w.\-]+)", text, re.M)
    module = m.group(1) if m else ""
    ops, comps = {}, {}
    for comp, lines in hlo_computations(text).items():
        comps[comp] = []
        for line in lines:
            mi = _INSTR.match(line)
            if not mi:
                continue
            name, shape, opcode = mi.groups()
            d = re.search(r"[a-z][a-z0-9]*\[([\d,]*)\]", shape)
            dims = tuple(int(x) for x in d.group(1).split(",") if x) if d else ()
            on = re.search(r'op_name="([^"]*)"', line)
            target = re.search(r'custom_call_target="([^"]*)"', line)
            args = line[mi.end():].split(")", 1)[0]
            op = HloOp(name, opcode, dims, on.group(1) if on else "",
                       tuple(re.findall(r"calls=%?([\w.\-]+)", line)),
                       bool(target and ("gemm" in target.group(1) or "matmul" in target.group(1))),
                       tuple(re.findall(r"%([\w.\-]+)", args)))
            ops[name] = op
            comps[comp].append(op)
    return module, ops, comps


def scope_part(op: HloOp, vocab: int) -> tuple[str, str | None] | None:
    """The (part, GDN sub-part) an instruction's own op_name tags, or None (untagged)."""
    parts = op.op_name.split("/")
    hit = next((SCOPES[p] for p in reversed(parts) if p in SCOPES), None)
    if hit is None and any(p in ACTIVATIONS for p in parts):
        hit = ("norm_act", None)
    if hit is not None and hit[0] == "dense" and vocab in op.dims:
        return ("logits", None)                # the LM head: a weight product with a vocabulary-sized result
    return hit


def classify(ops: dict[str, HloOp], comps: dict[str, list[HloOp]], vocab: int) -> dict[str, tuple]:
    """{instruction name: (part, GDN sub-part, by_rule)} by the module docstring's rules; by_rule: a fusion that
    mixes parts, or a matrix product whose op_name a compiler pass dropped."""
    def members(op: HloOp, seen=()) -> list[HloOp]:
        out = []
        for c in op.calls:
            if c in seen:
                continue
            for m in comps.get(c, ()):
                out += members(m, seen + (c,)) if m.opcode == "fusion" else ([m] if m.opcode not in TRIVIAL else [])
        return out

    def vote(tags: list):
        tags = [t for t in tags if t is not None]
        return collections.Counter(tags).most_common(1)[0][0] if tags else None

    out, untagged_matmuls = {}, []
    for name, op in ops.items():
        inner = members(op) if op.opcode == "fusion" else [op]
        tags = [scope_part(m, vocab) for m in inner]
        mm = [(m, t) for m, t in zip(inner, tags) if m.opcode in MATMULS or m.gemm]
        tag = vote([t for _, t in mm]) or vote(tags)
        if tag is None and mm:
            untagged_matmuls.append(name)
        out[name] = (*(tag or ("rest", None)), len({(t or ("rest",))[0] for t in tags}) > 1)
    for name in untagged_matmuls:
        op = ops[name]
        if any(o.startswith("params") for o in op.operands):          # reads a weight: jit names them params…
            out[name] = ("logits" if vocab in op.dims else "dense", None, True)
            continue
        seen, frontier = {name}, list(op.operands)                    # else its nearest tagged producer's part
        for _ in range(3):
            hit = next((out[o] for o in frontier if o in out and o not in untagged_matmuls
                        and out[o][0] != "rest"), None)
            if hit is not None:
                out[name] = (hit[0], hit[1], True)
                break
            seen |= set(frontier)
            frontier = [x for o in frontier if o in ops for x in ops[o].operands if x not in seen]
    return out


# ------------------------------------------------------------------------------------------------
# Trace -> time per part
# ------------------------------------------------------------------------------------------------
def _event_hlo(name: str, stats: dict, ops: dict) -> tuple[str | None, str | None]:
    """(HLO instruction, module) an event names: its `hlo_op` / `hlo_module` stats, else the `#hlo_op=…#` fields
    of a string stat (a kernel's launch annotation), else the event's own name when it is an instruction."""
    op, module = stats.get("hlo_op"), stats.get("hlo_module")
    if op is None:
        for v in stats.values():
            m = re.search(r"hlo_op=([^,#\s]+)", v) if isinstance(v, str) else None
            if m:
                op = m.group(1)
                mm = re.search(r"hlo_module=([^,#\s]+)", v)
                module = mm.group(1) if mm else module
                break
    if op is None and name in ops:
        op = name
    return (None if op is None else str(op)), (None if module is None else str(module))


def device_events(data, module: str, ops: dict) -> list[tuple[int, int, str | None, str]]:
    """(start ns, duration ns, HLO instruction or None, event name) of every device kernel of the program
    `module` in a trace (`jax.profiler.ProfileData`). On a GPU: the events of the device's stream lines (kernels,
    copies, memsets; an event naming another module is dropped, one naming no instruction kept as None), or, where
    none of them names an instruction, the "XLA Ops" line (one event per instruction run). Without GPU planes:
    the CPU thunks of the host threads (the events naming an instruction)."""
    gpu = [p for p in data.planes if p.name.startswith("/device:GPU")]

    def collect(lines, keep_unnamed: bool, module: str | None = module) -> list:
        out = []
        for line in lines:
            for ev in line.events:
                with warnings.catch_warnings():        # jaxlib's stats type warns on iteration (no __module__)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stats = dict(ev.stats)
                op, mod = _event_hlo(ev.name, stats, ops)
                if (op is None and not keep_unnamed) or (module and mod is not None and mod != module):
                    continue
                out.append((int(ev.start_ns), int(ev.duration_ns), op, ev.name))
        return sorted(out)

    def pick(module):
        if not gpu:
            return collect([ln for p in data.planes if p.name.startswith("/host:CPU") for ln in p.lines], False,
                           module)
        lines = [ln for p in gpu for ln in p.lines]
        events = collect([ln for ln in lines if ln.name.startswith("Stream")], True, module)
        if not any(e[2] in ops for e in events):
            events = collect([ln for ln in lines if ln.name == "XLA Ops"], False, module) or events
        return events

    events = pick(module)
    # a profiler that spells the module otherwise than the HLO text: only this program ran while tracing
    return events if any(e[2] in ops for e in events) else pick(None)


def attribute(events, ops: dict[str, HloOp], parts: dict[str, tuple], calls: int, measured_ms: float,
              top: int = 10) -> dict:
    """Per call: each part's device time, kernels and time assigned by rule, the GDN sub-parts, unattributed,
    overlap, gaps; the `top` largest rest kernels, and the GDN part's kernels grouped by kind (the instruction name
    without its `.N` suffix: one kind per layer's copy of an operation). Parts + extras sum to `measured_ms`."""
    from hyspec_jax.bench.report import busy_time_ns

    ns = dict.fromkeys(PARTS + ("unattributed",), 0)
    mixed = dict.fromkeys(PARTS, 0)
    count = dict.fromkeys(PARTS + ("unattributed",), 0)
    gdn = dict.fromkeys(GDN_PARTS, 0)
    rest: dict[str, int] = collections.Counter()
    gdn_kind: dict[tuple, int] = collections.Counter()
    gdn_kind_n: dict[tuple, int] = collections.Counter()
    gdn_kind_op: dict[tuple, str] = {}
    kept = []
    for s, d, hlo, name in events:
        op = ops.get(hlo) if hlo else None
        if op is not None and op.opcode in CONTAINERS:
            continue                           # a CPU loop / branch thunk: the thunks inside it are events too
        kept.append((s, d, name))
        if op is None:
            ns["unattributed"] += d
            count["unattributed"] += 1
            continue
        part, sub, mix = parts[hlo]
        ns[part] += d
        count[part] += 1
        mixed[part] += d if mix else 0
        if part == "gdn" and sub:
            gdn[sub] += d
        if part == "gdn":
            kind = (re.sub(r"\.\d+$", "", hlo), op.opcode, sub)
            gdn_kind[kind] += d
            gdn_kind_n[kind] += 1
            gdn_kind_op.setdefault(kind, op.op_name[:200])
        if part == "rest":
            rest[hlo] += d
    busy = busy_time_ns(kept)
    per = lambda x: x / calls / 1e6            # ns over all calls -> ms per call
    out = {p: per(ns[p]) for p in PARTS + ("unattributed",)}
    out["overlap"] = per(busy - sum(ns.values()))
    out["gaps"] = measured_ms - per(busy)
    return dict(ms=out, kernels={p: count[p] / calls for p in count}, by_rule_ms={p: per(mixed[p]) for p in PARTS},
                gdn_ms={p: per(gdn[p]) for p in GDN_PARTS}, device_busy_ms=per(busy),
                device_sum_ms=per(sum(ns.values())),
                rest_top=[dict(hlo=h, op_name=ops[h].op_name[:200], opcode=ops[h].opcode, ms=per(t))
                          for h, t in rest.most_common(top)],
                gdn_top=[dict(kind=k[0], opcode=k[1], sub=k[2], op_name=gdn_kind_op[k], kernels=gdn_kind_n[k] / calls,
                              ms=per(t)) for k, t in gdn_kind.most_common(top)])


# ------------------------------------------------------------------------------------------------
# Ceilings and floors
# ------------------------------------------------------------------------------------------------
def measure_ceilings(dtype, matmul_size: int, copy_mib: int, repeats: int, warmup: int) -> dict:
    """The device's measured peaks: a [n, n] · [n, n] product in `dtype` (fp32 accumulation) -> FLOP/s, and
    an elementwise x -> x + 1 over `copy_mib` MiB of fp32 (read + write) -> bytes/s; each the best of `repeats`
    calls (a ceiling: with the median, one H100 run read 2.29 TB/s while the same run's dense matmuls streamed their
    weights at 2.69 TB/s — bench/results/scale/profile_scale_h100_unpadded.md)."""
    import jax
    import jax.numpy as jnp

    n = matmul_size
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(dtype)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
    t_mm, _ = median_time(lambda: mm(a, b), repeats, warmup)
    del a, b
    x = jnp.zeros((copy_mib * 2 ** 20 // 4,), jnp.float32) + 0.5
    cp = jax.jit(lambda x: x + 1.0)
    t_cp, _ = median_time(lambda: cp(x), repeats, warmup)
    nbytes = 2 * int(x.nbytes)
    del x
    best_mm, best_cp = min(t_mm.times_s), min(t_cp.times_s)
    return dict(matmul_flops_per_s=2 * n ** 3 / best_mm, matmul_size=n, matmul_ms=_ms(best_mm),
                matmul_dtype=str(np.dtype(dtype)), bandwidth_bytes_per_s=nbytes / best_cp,
                copy_bytes=nbytes, copy_ms=_ms(best_cp))


def _nbytes(x) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def traffic(cfg, params, state, *, batch: int, tokens: int, prefix: int, decode: bool, cache=None) -> dict:
    """{part: (bytes, FLOPs)}: the irreducible traffic and work of each part of one program (module docstring),
    plus "program" (weights + state traffic, and all FLOPs). `cache`: the verify's TreeCache (arrays or
    ShapeDtypeStructs), whose factors, conv inputs and K/V are written."""
    import jax

    from hyspec_jax.sharding import _path_name

    B, T, rows = batch, tokens, batch * tokens
    H, V = cfg.hidden_size, cfg.vocab_size
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    named = {_path_name(p): x for p, x in flat}
    head = next((x for n, x in named.items() if "lm_head" in n), None)
    embed = next(x for n, x in named.items() if "embed_tokens" in n)
    act = np.dtype(embed.dtype).itemsize
    dense = [w for w in dense_weights(params) if head is None or w is not head]
    head = embed if head is None else head
    out = {"dense": (sum(_nbytes(w) for w in dense), 2 * rows * sum(int(np.prod(w.shape)) for w in dense)),
           "logits": (_nbytes(head) + rows * V * 4, 2 * rows * V * H)}

    lg, la = len(cfg.gdn_layers), len(cfg.attn_layers)
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    ssm, conv = _nbytes(state.ssm) if lg else 0, _nbytes(state.conv) if lg else 0
    if decode:
        g_bytes, g_flops = 2 * (ssm + conv), lg * B * hv * 6 * dk * dv
    else:
        written = sum(_nbytes(x) for x in jax.tree.leaves((cache.factors, cache.conv_inputs)))
        g_bytes, g_flops = ssm + conv + written, lg * B * hv * (4 * T * dk * dv + 4 * T * T * (dk + dv))
    out["gdn"] = (g_bytes, g_flops)

    kvh, nh, hd = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    kv = np.dtype(state.keys.dtype).itemsize if la else 0
    out["attention"] = (la * B * (prefix + T) * kvh * hd * 2 * kv, 4 * la * B * T * nh * hd * (prefix + T))

    per_token = 2 * H                                              # the final norm
    for i in range(cfg.num_hidden_layers):
        per_token += 4 * H                                         # input and post-attention RMSNorms
        if i in cfg.gdn_layers:
            per_token += 3 * hv * dv                               # gated norm: o and z in, y out
        else:
            per_token += 2 * (nh + kvh) * hd + 3 * nh * hd        # q / k norms, sigmoid output gate
        if not cfg.is_sparse_layer(i):
            per_token += 3 * cfg.intermediate_size                 # SwiGLU: gate and up in, product out
    out["norm_act"] = (rows * per_token * act, 0)
    weights_state = sum(out[p][0] for p in ("dense", "logits", "gdn", "attention")) + rows * H * act
    out["program"] = (weights_state, sum(out[p][1] for p in ("dense", "logits", "gdn", "attention")))
    return out


def floors(traffic_: dict, ceilings: dict) -> dict:
    """{part: dict(bytes, flops, floor_ms, bound)}: max(bytes / bandwidth, FLOPs / peak)."""
    bw, peak = ceilings["bandwidth_bytes_per_s"], ceilings["matmul_flops_per_s"]
    out = {}
    for p, (b, f) in traffic_.items():
        mem, comp = b / bw, f / peak
        out[p] = dict(bytes=int(b), flops=int(f), floor_ms=_ms(max(mem, comp)),
                      bound="compute" if comp > mem else "memory")
    return out


# ------------------------------------------------------------------------------------------------
# Programs
# ------------------------------------------------------------------------------------------------
def jit_verify(graphdef, mesh, param_sh, state_sh, cfg, batch: int, *, method: str, kernel_impl: str,
               compiler_options: dict | None = None):
    """`TargetModel.verify` with the dispatcher's `kernel_impl`, jitted with `sharding.jit_verify`'s layouts:
    f(params, state, tree, tokens) -> (logits, cache)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from hyspec_jax import sharding as shd

    spec = state_sh.lengths.spec

    def verify_auto(params, state, tree, tokens):
        logits, _, cache = nnx.merge(graphdef, params).verify(state, tree, tokens, method=method,
                                                             kernel_impl=kernel_impl)
        return logits, cache

    return jax.jit(verify_auto, in_shardings=(param_sh, state_sh, NamedSharding(mesh, P(*spec, None)),
                                              NamedSharding(mesh, P(*spec, None))),
                   out_shardings=(NamedSharding(mesh, P(*spec, None, None)), shd.cache_shardings(cfg, batch, mesh)),
                   compiler_options=compiler_options)


def profile_program(compiled, run, *, calls: int, vocab: int, measured_ms: float) -> dict:
    """Trace `calls` calls of `run()` (one call of `compiled` each) and attribute the device time to parts."""
    from hyspec_jax.bench.report import profile_trace

    module, ops, comps = parse_hlo(compiled.as_text())
    parts = classify(ops, comps, vocab)
    data = profile_trace(lambda: [run() for _ in range(calls)])
    events = device_events(data, module, ops)
    if not events:
        raise RuntimeError(f"the trace holds no device event of {module}")
    return attribute(events, ops, parts, calls, measured_ms)


def _row(kind: str, B: int, N: int, timing, compiled, lower_s: float, compile_s: float, prof: dict, fl: dict,
         finite: bool) -> dict:
    t = timing.median_s * 1e3
    return dict(program=kind, batch=B, nodes=N, rows=B * N, t_ms=_ms(timing.median_s),
                times_ms=[_ms(x) for x in timing.times_s], spread=round(timing.spread, 4), lower_s=round(lower_s, 3),
                compile_s=round(compile_s, 3), finite=finite, floors=fl,
                floor_ms=fl["program"]["floor_ms"], ratio=round(t / fl["program"]["floor_ms"], 3)
                if fl["program"]["floor_ms"] else None, **prof, **_xla_stats(compiled))


class BatchPrograms:
    """One batch: its committed state (read by the verifies), the decode and verify entry points and inputs.
    `jobs()` are `compile_all`'s jobs, keyed (B, 0) for the decode and (B, N) for a verify; `measure(N, ...)`
    times, traces and attributes one compiled program and returns its JSON row."""

    def __init__(self, args, cfg, B: int, *, mesh, graphdef, params, psh, dtype, max_len: int):
        import jax
        import jax.numpy as jnp

        from hyspec_jax import sharding as shd

        self.args, self.cfg, self.B, self.mesh, self.params = args, cfg, B, mesh, params
        self.dtype, self.max_len, self.copts = dtype, max_len, dict(args.xla_option) or None
        self.state, ssh = random_state(cfg, B, max_len, args.prefix, dtype, args.seed, mesh, self.copts)
        self.decode = shd.jit_extend(graphdef, mesh, psh, ssh, compiler_options=self.copts)
        self.verify = jit_verify(graphdef, mesh, psh, ssh, cfg, B, method=args.method, kernel_impl=args.kernels,
                                 compiler_options=self.copts)
        self.inputs = {N: shape_inputs(cfg, B, N, args.depth, args.seed, mesh, ssh) for N in args.nodes}
        self.dec_tok = shape_inputs(cfg, B, 1, args.depth, args.seed, mesh, ssh)[2]
        self.valid = jax.device_put(jnp.ones(self.dec_tok.shape, bool), self.dec_tok.sharding)

    def jobs(self) -> list:
        B, p = self.B, self.params
        return ([((B, 0), self.decode, (p, self.state, self.dec_tok, self.valid))]
                + [((B, N), self.verify, (p, self.state, *self.inputs[N][:2])) for N in self.args.nodes])

    def measure(self, N: int, prog, ceilings: dict) -> dict:
        import jax

        args, cfg, B, params = self.args, self.cfg, self.B, self.params
        compiled, lower_s, compile_s = prog
        if N == 0:
            # a second copy of the state: the decode donates it (self.state stays the verifies' state)
            dstate, _ = random_state(cfg, B, self.max_len, args.prefix, self.dtype, args.seed, self.mesh, self.copts)
            t, logits, dstate = time_decode(compiled, params, dstate, self.dec_tok, repeats=args.repeats,
                                            warmup=args.warmup)
            finite = _finite(logits)
            del logits
            box = {"s": dstate}

            def run():                         # the state is donated: feed it back (lengths grow by one a call)
                logits, box["s"] = compiled(params, box["s"], self.dec_tok, self.valid)
                jax.block_until_ready(logits)

            prof = profile_program(compiled, run, calls=args.trace_calls, vocab=cfg.vocab_size,
                                   measured_ms=_ms(t.median_s))
            tr = traffic(cfg, params, self.state, batch=B, tokens=1, prefix=args.prefix, decode=True)
            return _row("decode", B, 1, t, compiled, lower_s, compile_s, prof, floors(tr, ceilings), finite)
        tree, toks, _ = self.inputs[N]
        t, (logits, cache) = time_verify(compiled, params, self.state, tree, toks, repeats=args.repeats,
                                         warmup=args.warmup)
        finite = _finite(logits)
        del logits
        prof = profile_program(compiled, lambda: jax.block_until_ready(compiled(params, self.state, tree, toks)),
                               calls=args.trace_calls, vocab=cfg.vocab_size, measured_ms=_ms(t.median_s))
        tr = traffic(cfg, params, self.state, batch=B, tokens=N, prefix=args.prefix, decode=False, cache=cache)
        return _row("verify", B, N, t, compiled, lower_s, compile_s, prof, floors(tr, ceilings), finite)


def sweep(args, cfg, name: str, on_progress=None) -> dict:
    """Ceilings, weights, every batch's state; then every program lowered (batch 1 first) and compiled in
    parallel threads, then timed, traced and attributed one after another with nothing else running;
    `on_progress(report)` after each program. With `args.max_seconds`, programs not lowered by then are skipped."""
    import jax

    from hyspec_jax.bench.report import portable_args, portable_command, run_metadata
    from hyspec_jax.config import resolve_dtype

    t_start = time.perf_counter()
    deadline = None if args.max_seconds is None else t_start + args.max_seconds
    dtype = resolve_dtype(args.dtype)
    max_len = args.max_len or args.prefix + max(max(args.nodes), args.trace_calls + 1)
    if max_len <= args.prefix + args.trace_calls:
        raise ValueError(f"--max-len {max_len} must exceed --prefix {args.prefix} + --trace-calls "
                         f"{args.trace_calls} (every traced decode writes one position)")
    gpu = jax.default_backend() == "gpu"
    ceilings = measure_ceilings(dtype, args.matmul_size or (8192 if gpu else 512), args.copy_mib or
                                (2048 if gpu else 64), args.repeats, args.warmup)
    mesh = make_mesh(1)
    t0 = time.perf_counter()
    graphdef, params, psh = random_params(cfg, dtype, args.seed, mesh, dict(args.xla_option) or None,
                                          scan=args.scan_layers)
    jax.block_until_ready(params)
    leaves = jax.tree.leaves(params)
    report = dict(
        meta=run_metadata(), command=portable_command("hyspec bench profile-scale", args.argv),
        argv=portable_args(args.argv), status="partial",
        model=dict(name=name, config=dataclasses.asdict(cfg), param_count=sum(int(x.size) for x in leaves),
                   param_bytes=sum(int(x.nbytes) for x in leaves)),
        settings=dict(dtype=str(np.dtype(dtype)), prefix=args.prefix, max_len=max_len, depth=args.depth,
                      batches=args.batch, nodes=args.nodes, kernels=args.kernels, method=args.method,
                      repeats=args.repeats, warmup=args.warmup, trace_calls=args.trace_calls, seed=args.seed,
                      compile_workers=args.compile_workers, compile_cache=args.compile_cache,
                      xla_options=dict(args.xla_option), max_seconds=args.max_seconds,
                      scan_layers=args.scan_layers, command_buffers=args.keep_command_buffers),
        ceilings=ceilings, init_s=round(time.perf_counter() - t0, 3), programs=[], skipped=[])
    batches = {B: BatchPrograms(args, cfg, B, mesh=mesh, graphdef=graphdef, params=params, psh=psh, dtype=dtype,
                                max_len=max_len) for B in args.batch}
    jobs = [j for B in args.batch for j in batches[B].jobs()]
    bar = progress_bar(2 * len(jobs), not args.no_progress)              # compile + measure
    try:
        bar.set_description("compile")
        progs = compile_all(jobs, args.compile_workers, bar, deadline=deadline)
        bar.set_description("measure")
        for (B, N), _, _ in jobs:
            if (B, N) not in progs:
                report["skipped"].append(f"decode B={B}" if N == 0 else f"verify B={B} N={N}")
                continue
            report["programs"].append(batches[B].measure(N, progs.pop((B, N)), ceilings))
            report["wall_s"] = round(time.perf_counter() - t_start, 2)
            bar.update()
            if on_progress is not None:
                on_progress(report)
    finally:
        bar.close()
    if report["skipped"]:
        report["stopped"] = f"--max-seconds {args.max_seconds:g}: {len(report['skipped'])} program(s) not measured"
    report["status"] = "partial" if report["skipped"] else "complete"
    report["wall_s"] = round(time.perf_counter() - t_start, 2)
    return report


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def _name(r: dict) -> str:
    return f"decode B={r['batch']}" if r["program"] == "decode" else f"verify B={r['batch']} N={r['nodes']}"


def _f(x, nd: int = 3) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def summary_table(report: dict) -> str:
    """One row per program: measured, floor, ratio, then each part's ms."""
    head = ["program", "measured ms", "floor ms", "× floor", "bound"] + list(PARTS) + list(EXTRA)
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * 3 + "---|" + "---:|" * (len(PARTS) + len(EXTRA))]
    for r in report["programs"]:
        fl = r["floors"]["program"]
        out.append(f"| {_name(r)} | {r['t_ms']:.3f} | {fl['floor_ms']:.3f} | {_f(r['ratio'], 2)} | {fl['bound']} | "
                   + " | ".join(f"{r['ms'][p]:.3f}" for p in PARTS + EXTRA) + " |")
    return "\n".join(out)


def part_table(r: dict) -> str:
    """One program: each part's time, share, floor, ratio, traffic and kernels per call."""
    out = ["| part | ms | share | floor ms | × floor | bound | GB moved | GFLOP | kernels / call | by-rule ms |",
           "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    t = r["t_ms"]
    for p in PARTS + EXTRA:
        ms = r["ms"][p]
        fl = r["floors"].get(p)
        cells = [LABELS[p], f"{ms:.3f}", f"{100 * ms / t:.1f}%" if t else "—"]
        if fl:
            cells += [f"{fl['floor_ms']:.3f}", _f(ms / fl["floor_ms"], 2) if fl["floor_ms"] else "—", fl["bound"],
                      f"{fl['bytes'] / 1e9:.3f}", f"{fl['flops'] / 1e9:.1f}"]
        else:
            cells += ["—"] * 5
        cells += [f"{r['kernels'][p]:.0f}" if p in r["kernels"] else "—",
                  f"{r['by_rule_ms'][p]:.3f}" if p in r["by_rule_ms"] else "—"]
        out.append("| " + " | ".join(cells) + " |")
    fl = r["floors"]["program"]
    out.append(f"| **program** | {t:.3f} | 100% | {fl['floor_ms']:.3f} | {_f(r['ratio'], 2)} | {fl['bound']} | "
               f"{fl['bytes'] / 1e9:.3f} | {fl['flops'] / 1e9:.1f} | | |")
    g = r["gdn_ms"]
    lines = [*out, "", "GDN: " + ", ".join(f"{k} {g[k]:.3f} ms" for k in GDN_PARTS) + "."]
    if r["rest_top"]:
        lines += ["", "Largest rest kernels: " + "; ".join(f"`{k['hlo']}` ({k['opcode']}, "
                                                          f"{k['op_name'] or 'no op_name'}) {k['ms']:.3f} ms"
                                                          for k in r["rest_top"][:5]) + "."]
    if r.get("gdn_top"):
        lines += ["", "Largest GDN kernels (by kind): " + "; ".join(
            f"`{k['kind']}` ({k['opcode']}, {k['sub'] or 'no sub-part'}, {k['kernels']:.0f} a call, "
            f"{k['op_name'] or 'no op_name'}) {k['ms']:.3f} ms" for k in r["gdn_top"][:5]) + "."]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    meta, s, c, m = report["meta"], report["settings"], report["ceilings"], report["model"]
    lines = [
        f"# Where the time goes — {m['name']}, {meta['device_kind']}, {s['dtype']}, prefix {s['prefix']}", "",
        f"`{report['command']}`", "",
        f"commit {meta['commit']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, {meta['time_utc']}; status "
        f"**{report['status']}**" + (f", wall {report['wall_s']:.0f} s" if "wall_s" in report else ""), "",
        f"Random weights, {m['param_count'] / 1e9:.2f} B parameters ({m['param_bytes'] / 2**30:.1f} GiB). Verify "
        f"kernels `{s['kernels']}`, GDN inverse `{s['method']}`, trees of depth min({s['depth']}, N−1). Measured: "
        f"median of {s['repeats']} untraced calls; parts: device time per call over {s['trace_calls']} traced "
        "calls (`bench/profile_scale.py` says how kernels map to parts and how floors are counted).", "",
        f"Ceilings measured in this run (best of {s['repeats']} calls): matmul "
        f"{c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s "
        f"({c['matmul_dtype']} {c['matmul_size']}³), bandwidth {c['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s "
        f"(x + 1 over {c['copy_bytes'] / 2 / 2**20:.0f} MiB)"
        + ("; merged from runs whose ceilings were " + ", ".join(
            f"{x['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s and {x['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s"
            for x in report["merged_ceilings"]) + " (each program against its own run's)"
           if report.get("merged_ceilings") else "") + ".", "",
        "## All programs (ms per call)", "", summary_table(report), "",
    ]
    if report.get("skipped"):
        lines += [f"Not measured ({report.get('stopped', 'run cut short')}): " + ", ".join(report["skipped"]), ""]
    for r in report["programs"]:
        lines += [f"## {_name(r)}: {r['t_ms']:.3f} ms", "", part_table(r), ""]
    if not all(r["finite"] for r in report["programs"]):
        lines += ["**WARNING: non-finite logits in at least one program (see the JSON `finite` fields).**", ""]
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """One report from runs of the same model and settings but other batches / nodes (a later run's program
    wins). Each program keeps the floors of its own run's ceilings; `merged_ceilings` lists every run's."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    loose = {"batches", "nodes", "compile_workers", "compile_cache", "max_seconds"}        # may differ between runs
    key = lambda r: (r["model"]["name"], {k: v for k, v in r["settings"].items() if k not in loose})
    rows = {}
    for p, r in zip(paths, reports):
        if key(r) != key(reports[0]):
            raise ValueError(f"{p}: model or settings differ from {paths[0]}; cannot merge")
        rows.update({_name(x): x for x in r["programs"]})
    base = dict(reports[0], merged_from=list(paths), merged_ceilings=[r["ceilings"] for r in reports])
    base["programs"] = sorted(rows.values(), key=lambda x: (x["batch"], x["program"] != "decode", x["nodes"]))
    return settle_merged(base, reports, set(rows))


def write_outputs(report: dict, json_path: str | None) -> None:
    from hyspec_jax.bench.report import write_report
    write_report(report, json_path, markdown)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench profile-scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry_arguments(ap)
    ap.add_argument("--batch", type=_ints, default=list(DEFAULT_BATCH), metavar="B,..", help="batches (default 1,8,32)")
    ap.add_argument("--nodes", type=_ints, default=list(DEFAULT_NODES), metavar="N,..",
                    help="verified nodes per request, anchor included (default 8,32)")
    ap.add_argument("--prefix", type=int, default=512, metavar="P", help="committed tokens per request (default 512)")
    ap.add_argument("--max-len", type=int, metavar="S", help="KV cache length (default prefix + max N)")
    ap.add_argument("--depth", type=int, default=8, metavar="D", help="tree depth, edges (default 8)")
    ap.add_argument("--kernels", choices=("auto", "reference"), default="auto",
                    help="the verify's tree solve / attention (default auto: the dispatcher's choice)")
    ap.add_argument("--method", choices=("squaring", "neumann", "solve"), default="squaring",
                    help="GDN unit-lower inverse of the reference solve (default squaring)")
    ap.add_argument("--repeats", type=int, default=10, metavar="K", help="timed calls per program (default 10)")
    ap.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed calls first (default 2)")
    ap.add_argument("--trace-calls", type=int, default=3, metavar="C", help="calls traced per program (default 3)")
    ap.add_argument("--matmul-size", type=int, metavar="N", help="ceiling: N×N×N product (default 8192 GPU, 512 CPU)")
    ap.add_argument("--copy-mib", type=int, metavar="M", help="ceiling: x + 1 over M MiB (default 2048 GPU, 64 CPU)")
    ap.add_argument("--keep-command-buffers", action="store_true",
                    help="keep XLA's CUDA graphs (default: off for the run, so the trace names each kernel's "
                         "instruction; with them every kernel is unattributed)")
    add_run_arguments(ap, max_seconds="lower and compile no further program once S seconds have passed since the "
                      "start (those compiled are still measured); the JSON then has status partial and lists the "
                      "skipped")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    if min(args.repeats, args.warmup, args.trace_calls) < 1 or args.prefix < 0 or args.depth < 0:
        ap.error("--repeats, --warmup, --trace-calls must be ≥ 1 and --prefix, --depth ≥ 0")
    if args.max_seconds is not None and args.max_seconds <= 0:
        ap.error(f"--max-seconds must be > 0, got {args.max_seconds}")
    if any(x is not None and x < 1 for x in (args.matmul_size, args.copy_mib)):
        ap.error("--matmul-size and --copy-mib must be ≥ 1")
    if not args.merge and not args.keep_command_buffers:
        # XLA runs a GPU program's kernels inside CUDA graphs (command buffers); a trace then names only the graph
        # (`hlo_op` "command_buffer…"), never the instruction, and nothing can be attributed. Set before jax
        # starts its backend; every program of the run, timed and traced, runs without them (said in the report).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    return drive(ap, args, prog="hyspec bench profile-scale", merge=merge, sweep=sweep, write=write_outputs,
                 summary=summary_table, finite=lambda r: all(x["finite"] for x in r["programs"]))


if __name__ == "__main__":
    sys.exit(main())
