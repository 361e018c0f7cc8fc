"""One GDN layer's verify tree solve and decoding step at the inputs the model really passes ([verify-fast] 1–3).

    hyspec bench gdn-layer --json out.json [--configs 1:8,1:32,8:8,8:32] [--decode-batches 1,8,32] \
                           [--dtype bfloat16] [--sglang-wheel sglang-0.5.23-*.whl]

Tree solve. For each batch B and tree size N (one tree per request, its deepest node at depth min(8, N − 1)), the
inputs are one GDN layer's call of `kernels.tree_solve` as `TargetModel.verify` makes it
(`target.verify_solve_call`, the Qwen3.8-27B geometry: 16 key heads, 48 value heads, dk = dv = 128; the committed
state is a layer of the model's state stack, read where it lies; tests/test_verify_inputs.py keeps the two equal).
Variants, each through the dispatcher (impl "auto"):
  model            the call as the verify makes it: q/k at their key heads, the kernel's operands and precision
                   from the model's dtype (`kernels.verify_operands`; a bf16 model: fp32 q/k/v, one-pass tf32)
  bf16_tf32        q/k/v rounded to bf16 at their key heads, one-pass tf32 products (what vLLM's and SGLang's
                   kernels are handed)
  fp32_tf32x3      q/k/v in fp32 at their key heads, 3-pass products, in the one-launch form
  expanded_tf32x3  q/k in fp32 repeated to the 48 value heads, 3-pass products: what the verify passed before q/k
                   stayed at their key heads (the configuration [verify-fast] measured)
  fp32_tf32x3_split, fp32_ieee   the 3-pass products in the two-launch split form (an fp32 model's path:
                   `kernels.FP32_ACCURATE_SPLIT`), and IEEE fp32 products in one launch
  xla              the fp32 reference (`gdn.masked_solve`, triangular solve) jitted by XLA
  sglang           SGLang's serial tree verifier, `fused_sigmoid_gating_delta_rule_update` with
                   retrieve_parent_token (gates, q/k l2norm in the kernel; every node's state written), loaded from
                   the sglang wheel given with --sglang-wheel (only that file; its sglang imports stubbed), on the
                   same raw stream in the model's dtype
Decoding step (--decode-batches). For each batch, one GDN layer's `kernels.gdn_decode_layer` call as a decoding step
makes it (`target.decode_step_call`: the in-projection's output row as it is, the conv window, the fp32 state stack
— the layer's tiles stepped in place — and the gated output norm; `bench.kernels.time_chained` runs the sets as
consecutive layers of one donated stack):
  model            the dispatcher (impl "auto"): the fused Pallas kernel at its tiling (`kernels.gdn_decode_tiling`:
                   the value head whole, the norm in the kernel)
  fused_bvV_wW     the kernel at value tile V and W warps (the tiling sweep; V below dv: the norm after it, in XLA)
  xla              the same math (`gdn.decode_layer`: the split of the row, the step, the norm) as XLA compiles it
  sglang           SGLang's recurrent decode kernel (the same file, one token, the state updated in place): gates,
                   l2norm, state update and readout, but not the conv (SGLang runs causal_conv1d_update before it)
                   nor the norm
with its floor: the state read and written once, the row, the window and the output, at the copy bandwidth this run
measures.
Times: device time per layer from a profiler trace (GPU; `bench.kernels.time_multi`), each program running R layers'
input sets (R large enough that their states overflow L2, as 48 layers do); the host-clock median per call beside
it. sglang: the median of `triton.testing.do_bench_cudagraph` (its launches replayed from a CUDA graph, as SGLang
serves, timed by CUDA events; `do_bench` where capture fails, noted in the row). Errors: ‖o − o_ref‖ / ‖o_ref‖
against the fp32 reference at precision HIGHEST, beside the error of rounding o_ref itself to the model's dtype (the
verify rounds o to it before the gated norm anyway).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import re
import sys
import tempfile
import types
import zipfile

SGLANG_KERNEL = "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py"
STATE_L2_BYTES = 200 << 20      # the R input sets' states together: several times an H100 / H200's L2


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench gdn-layer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="1:8,1:32,8:8,8:32",
                    help="tree solve: B:N pairs, comma-separated (default %(default)s; '' for none)")
    ap.add_argument("--decode-batches", default="1,8,32",
                    help="decoding step: batches, comma-separated (default %(default)s; '' for none)")
    ap.add_argument("--decode-tilings", default="16:1,32:1,32:2,64:2,64:4,128:4,128:8",
                    help="decoding step: BLOCK_V:WARPS kernel tilings to sweep (default %(default)s)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the model's compute dtype (default %(default)s)")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per variant (default %(default)s)")
    ap.add_argument("--sglang-wheel", metavar="WHL", help="an sglang wheel: time its serial verifier beside ours")
    ap.add_argument("--interpret", action="store_true",
                    help="no GPU: run the kernels in Pallas interpret mode and check their errors only (no times)")
    ap.add_argument("--geometry", choices=("27b", "small"), default="27b",
                    help="27b: Qwen3.8-27B's GDN layer (default); small: 2 key / 4 value heads of 16 (CPU checks)")
    ap.add_argument("--variants", metavar="REGEX", default="",
                    help="only the variants whose name matches (e.g. 'model|xla|sglang'; default: all)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON (and FILE.md beside it)")
    return ap


def parse_configs(text: str, what: str = "--configs") -> list[tuple[int, int]]:
    """'A:B,C:D' → [(A, B), (C, D)] of positive integers ('' → [])."""
    try:
        out = [tuple(int(x) for x in c.split(":")) for c in text.split(",") if c]
        if any(len(c) != 2 or min(c) < 1 for c in out):
            raise ValueError
    except ValueError:
        raise ValueError(f"{what} takes pairs such as 1:8,8:32, got {text!r}") from None
    return out


def parse_batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x]
        if any(b < 1 for b in out):
            raise ValueError
    except ValueError:
        raise ValueError(f"--decode-batches takes positive integers such as 1,8,32, got {text!r}") from None
    return out


def rel_err(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (NaN where x is not finite): `bench.kernels`' error, imported when first used
    so that --help needs no JAX."""
    from hyspec_jax.bench.kernels import _rel
    return _rel(x, ref)


def load_sglang_verifier(wheel: str):
    """`fused_sigmoid_gating_delta_rule_update` from an sglang wheel: that one file, its sglang imports stubbed
    with what they answer on this GPU (CUDA, the device's SM; no ROCm)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    stubs = {
        "sglang.kernels.jit.utils": {"is_arch_support_pdl": lambda: major >= 9},
        "sglang.srt.utils": {"get_device_sm": lambda: major * 10 + minor, "is_cuda": lambda: True,
                             "is_gfx95_supported": lambda: False, "is_hip": lambda: False,
                             "is_sm90_supported": lambda: major == 9},
    }
    for name in ("sglang", "sglang.kernels", "sglang.kernels.jit", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    for name, attrs in stubs.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
    # Triton's @jit reads its function's source from the file: extract the one file and import it from there
    folder = tempfile.mkdtemp(prefix="sglang_peer_")
    with zipfile.ZipFile(wheel) as z:
        path = z.extract(SGLANG_KERNEL, folder)
    spec = importlib.util.spec_from_file_location("sglang_fused_sigmoid_gating_recurrent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fused_sigmoid_gating_delta_rule_update


def peer_time(run) -> dict:
    """A torch launch's device time: CUDA-graph replays timed by events (no Python launch cost in the time, as
    SGLang serves); plain `do_bench` if capture fails."""
    import triton

    try:
        return {"device_us": 1e3 * triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median"),
                "timing": "cuda graph"}
    except Exception as e:  # noqa: BLE001 — capture refused: time the launches as they are
        return {"device_us": 1e3 * triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median"),
                "timing": f"do_bench (graph capture failed: {type(e).__name__})"}


def sglang_row(verifier, call, cfg, dtype_name: str, o_ref) -> dict:
    """SGLang's serial verifier on `call`'s raw stream: time (`peer_time`) and error against o_ref."""
    import numpy as np
    import torch

    s = call.stream
    B, N = s.parent.shape
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    tdtype = getattr(torch, dtype_name)
    dev = torch.device("cuda")
    t = lambda x, dt=tdtype: torch.from_numpy(np.asarray(x, np.float32)).to(dev, dt).contiguous()   # noqa: E731
    raw = np.asarray(s.conv_out, np.float32)
    kd = hk * dk
    q, k = t(raw[..., :kd].reshape(B, N, hk, dk)), t(raw[..., kd:2 * kd].reshape(B, N, hk, dk))
    v = t(raw[..., 2 * kd:].reshape(B, N, hv, dv))
    a, b = t(s.a), t(s.b)
    A_log, dt_bias = t(s.A_log, torch.float32), t(s.dt_bias, torch.float32)
    state = t(np.swapaxes(np.asarray(call.S0[call.layer]), -1, -2), torch.float32)  # SGLang keeps [HV, dv, dk]
    slots = torch.arange(B, device=dev, dtype=torch.int32)
    buffer = torch.empty((B, N, hv, dv, dk), device=dev, dtype=torch.float32)
    parents = torch.from_numpy(np.asarray(s.parent, np.int32)).to(dev).contiguous()

    def run():
        return verifier(A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0, q=q, k=k,
                        v=v, b=b, initial_state_source=state, initial_state_indices=slots, scale=dk ** -0.5,
                        use_qk_l2norm_in_kernel=True, disable_state_update=True,
                        intermediate_states_buffer=buffer, intermediate_state_indices=slots, cache_steps=N,
                        retrieve_parent_token=parents)

    o = run()
    torch.cuda.synchronize()
    err = rel_err(o.float().cpu().numpy().reshape(B, N, hv, dv), o_ref)
    return {"variant": "sglang", **peer_time(run), "err_o": err}


def sglang_decode_row(verifier, call, dtype_name: str, want) -> dict:
    """SGLang's recurrent decode kernel (one token, state in place) on `call`'s post-conv columns: time and error of
    its state against `want` (gdn.decode_layer's)."""
    import numpy as np
    import torch

    from hyspec_jax import gdn

    parts = call.parts
    B, C = parts.x.shape
    hv, dk, dv = call.S.shape[-3:]
    hk = call.key_heads
    tdtype = getattr(torch, dtype_name)
    dev = torch.device("cuda")
    t = lambda x, dt=tdtype: torch.from_numpy(np.asarray(x, np.float32)).to(dev, dt).contiguous()   # noqa: E731
    # its input is the conv's output (SGLang convolves first, in causal_conv1d_update), in the model's dtype
    conv = np.asarray(gdn.causal_conv(parts.x[:, None], call.window[call.layer], call.conv_weight)[:, 0], np.float32)
    kd = hk * dk
    q, k = t(conv[:, :kd].reshape(B, 1, hk, dk)), t(conv[:, kd:2 * kd].reshape(B, 1, hk, dk))
    v = t(conv[:, 2 * kd:].reshape(B, 1, hv, dv))
    a, b = t(parts.a).reshape(B, 1, hv), t(parts.b).reshape(B, 1, hv)
    A_log, dt_bias = t(call.A_log, torch.float32), t(call.dt_bias, torch.float32)
    state0 = t(np.swapaxes(np.asarray(call.S[call.layer]), -1, -2), torch.float32)            # SGLang keeps [HV, dv, dk]
    state = state0.clone()
    slots = torch.arange(B, device=dev, dtype=torch.int32)

    def run():
        return verifier(A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0, q=q, k=k,
                        v=v, b=b, initial_state_source=state, initial_state_indices=slots, scale=dk ** -0.5,
                        use_qk_l2norm_in_kernel=True)

    run()
    torch.cuda.synchronize()
    err = rel_err(np.swapaxes(state.cpu().numpy(), -1, -2), np.asarray(want.state))
    state.copy_(state0)                 # the timed calls update it in place: time them from the same state
    return {"variant": "sglang", **peer_time(run), "err_state": err, "note": "no conv (SGLang runs it before)"}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        wanted = re.compile(a.variants).search
    except re.error as e:
        ap.error(f"--variants: not a regular expression ({e})")
    configs = parse_configs(a.configs)
    batches = parse_batches(a.decode_batches)
    tilings = parse_configs(a.decode_tilings, "--decode-tilings")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from hyspec_jax import gdn, kernels
    from hyspec_jax.bench.kernels import chain_steps, copy_bandwidth, time_chained, time_multi
    from hyspec_jax.bench.report import portable_command, publish_report, run_metadata, write_report
    from hyspec_jax.models.target import decode_step_call, verify_solve_call
    from hyspec_jax.spec.memory import qwen38_27b

    gpu = jax.default_backend() == "gpu"
    if not gpu and not a.interpret:
        raise ValueError("bench gdn-layer times GPU kernels: run it on an NVIDIA GPU, or pass --interpret to "
                         "check the errors only")
    impl = "interpret" if a.interpret else "auto"
    verifier = load_sglang_verifier(a.sglang_wheel) if a.sglang_wheel and gpu and wanted("sglang") else None
    cfg = qwen38_27b() if a.geometry == "27b" else dataclasses.replace(
        qwen38_27b(), linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16)
    dtype = jnp.dtype(a.dtype)
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    F32 = jnp.float32

    def measure(row: dict, fn, sets, check) -> dict:
        try:
            row.update(check(jax.jit(functools.partial(fn, 0))(*sets[0])) if a.interpret else
                       time_multi(fn, sets, a.reps, check=check, profile=True, indexed=True))
        except Exception as e:  # noqa: BLE001 — record and go on
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
        return row

    def measure_chained(row: dict, fn, sets, state, check) -> dict:
        try:
            if a.interpret:
                st, outs = jax.jit(functools.partial(chain_steps, fn))(state, sets)
                row.update(check(outs[0], st))
            else:
                row.update(time_chained(fn, sets, state, a.reps, check=check, profile=True))
        except Exception as e:  # noqa: BLE001 — record and go on
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
        return row

    def layer_sets(B: int) -> int:
        """Input sets a program rotates over: enough layers' states to overflow L2, as 48 layers do."""
        return 1 if a.interpret else min(48, max(4, -(-STATE_L2_BYTES // (B * hv * dk * dv * 4))))

    def solve_variants(path_nodes: int) -> dict:
        """fn(i, S0 stack, q, k, v, g, β, mask): layer i's solve, as the unrolled verify calls the dispatcher."""
        return {n: f for n, f in all_solve_variants(path_nodes).items() if wanted(n)}

    def decode_variants(heads: dict) -> dict:
        return {n: f for n, f in all_decode_variants(heads).items() if wanted(n)}

    def all_solve_variants(path_nodes: int) -> dict:
        solve = lambda i, *args, **kw: kernels.tree_solve(*args, path_nodes, impl=impl, layer=i, **kw)  # noqa: E731
        f32 = lambda x: x.astype(F32)                                                           # noqa: E731
        bf16 = lambda x: x.astype(jnp.bfloat16)                                                 # noqa: E731
        expand = lambda x: gdn.value_heads(x, hv).astype(F32)                                   # noqa: E731
        return {
            "model": lambda i, S0, q, k, v, g, b, m: solve(i, S0, q, k, v, g, b, m, compute_dtype=dtype),
            "bf16_tf32": lambda i, S0, q, k, v, g, b, m: solve(i, S0, bf16(q), bf16(k), bf16(v), g, b, m,
                                                               precision="tf32"),
            "fp32_tf32x3": lambda i, S0, q, k, v, g, b, m: solve(i, S0, f32(q), f32(k), f32(v), g, b, m,
                                                                 precision="tf32x3", method="inverse"),
            "expanded_tf32x3": lambda i, S0, q, k, v, g, b, m: solve(i, S0, expand(q), expand(k), f32(v), g, b, m,
                                                                     precision="tf32x3", method="inverse"),
            "fp32_tf32x3_split": lambda i, S0, q, k, v, g, b, m: solve(i, S0, f32(q), f32(k), f32(v), g, b, m,
                                                                       precision="tf32x3", method="split"),
            "fp32_ieee": lambda i, S0, q, k, v, g, b, m: solve(i, S0, f32(q), f32(k), f32(v), g, b, m,
                                                               precision="ieee", method="inverse"),
            "xla": lambda i, S0, q, k, v, g, b, m: kernels.tree_solve(S0, q, k, v, g, b, m, path_nodes,
                                                                      impl="reference", layer=i),
        }

    def all_decode_variants(heads: dict) -> dict:
        """fn(i, stack, proj, window, conv_weight, A_log, dt_bias, valid) -> ((output, window), stack): layer i's
        step on the state stack, as the unrolled model's decoding step makes it (heads: the keywords besides)."""
        def step(**kw):
            def fn(i, S, proj, window, conv_weight, A_log, dt_bias, valid):
                out = kernels.gdn_decode_layer(proj, window, conv_weight, A_log, dt_bias, S, valid, **heads, layer=i,
                                               **kw)
                return (out.o, out.window), out.state
            return fn
        out = {"model": step(impl=impl)}
        for bv, w in ([] if a.interpret else tilings):
            out[f"fused_bv{bv}_w{w}"] = step(impl="pallas", tiling=(bv, w))
        out["xla"] = step(impl="reference")
        return out

    solve_rows, decode_rows = [], []
    operands, precision = kernels.verify_operands(dtype)

    def report(status: str) -> dict:
        return {"status": status, "geometry": {"HK": cfg.linear_num_key_heads, "HV": hv, "dk": dk, "dv": dv},
                "dtype": a.dtype, "interpret": a.interpret,
                "model_operands": {"dtype": str(operands), "precision": precision},
                "decode_tiling": list(kernels.gdn_decode_tiling(1, hv, dv, norm=True)), "copy_bandwidth": bandwidth,
                "sglang_wheel": a.sglang_wheel.rsplit("/", 1)[-1] if a.sglang_wheel else None,
                "rows": solve_rows, "decode_rows": decode_rows}

    def save_partial() -> None:
        """What is measured so far, written whole: a run stopped by its time limit keeps its last configuration."""
        partial = report("partial")
        partial["meta"] = {**run_metadata(), "command": portable_command("hyspec bench gdn-layer",
                                                                         argv if argv is not None else sys.argv[1:])}
        write_report(partial, a.json, markdown)

    bandwidth = None
    per_solve = len(solve_variants(1)) + bool(verifier)
    per_decode = len(decode_variants({})) + bool(verifier)
    bar = tqdm(total=len(configs) * per_solve + len(batches) * per_decode, desc="bench gdn-layer", unit="variant")
    for B, N in configs:
        depth = min(8, N - 1)
        R = layer_sets(B)
        # the sets are layers 0 … R−1 of one state stack, each with its own tree and mixer inputs
        first = verify_solve_call(cfg, B, N, depth=depth, dtype=dtype, seed=1000 * B + N)
        calls = [first] + [verify_solve_call(cfg, B, N, depth=depth, dtype=dtype, seed=1000 * B + N + i, layer=i,
                                             states=first.S0) for i in range(1, R)]
        sets = [c.args for c in calls]
        ref = jax.jit(lambda S0, *args: gdn.masked_solve(S0[0], *args, method="solve",
                                                         path_nodes=first.path_nodes)[0])
        o_ref = np.asarray(ref(*sets[0]), np.float32)
        base = {"B": B, "N": N, "depth": depth, "sets": R,
                "err_o_rounded_to_dtype": rel_err(np.asarray(jnp.asarray(o_ref).astype(dtype).astype(F32)), o_ref)}
        check = lambda out: {"err_o": rel_err(np.asarray(out[0], np.float32), o_ref)}          # noqa: E731
        for name, fn in solve_variants(calls[0].path_nodes).items():
            solve_rows.append(measure({**base, "variant": name}, fn, sets, check))
            bar.update(1)
        if verifier is not None:
            try:
                solve_rows.append({**base, **sglang_row(verifier, calls[0], cfg, a.dtype, o_ref)})
            except Exception as e:  # noqa: BLE001
                solve_rows.append({**base, "variant": "sglang", "error": f"{type(e).__name__}: {e}"[:1000]})
            bar.update(1)
        save_partial()
    bandwidth = copy_bandwidth() if gpu and batches and not a.interpret else None
    for B in batches:
        R = layer_sets(B)               # the sets are layers 0 … R−1 of one state stack, stepped one after another
        first = decode_step_call(cfg, B, dtype=dtype, seed=77 * B)
        calls = [first] + [decode_step_call(cfg, B, dtype=dtype, seed=77 * B + i, layer=i, states=first.S)
                           for i in range(1, R)]
        heads = {"key_heads": first.key_heads, "key_dim": first.key_dim, "norm": first.norm}
        sets = [tuple(x for n, x in enumerate(c.args) if n != 5) for c in calls]       # all but the stack
        want = jax.jit(lambda proj, window, S, *args: gdn.decode_layer(
            proj, window[0], *args[:3], S[0], args[3], **heads))(first.proj, first.window, first.S,
                                                                   *first.args[2:5], first.valid)
        stack = np.asarray(first.S)                                                      # each variant's own copy
        # the state read and written, the row read, the window read and written, the output written
        floor_bytes = (2 * B * hv * dk * dv * 4 + first.proj.nbytes + 2 * first.window[0].nbytes
                       + B * hv * dv * dtype.itemsize)
        base = {"B": B, "sets": R, "floor_bytes": floor_bytes,
                "floor_us": 1e6 * floor_bytes / bandwidth if bandwidth else None}

        def check(out, state, want=want):
            o, window = out
            return {"err_o": rel_err(o, want.o), "err_state": rel_err(state[0], want.state),
                    "window_equal": bool(np.array_equal(np.asarray(window, np.float32),
                                                        np.asarray(want.window, np.float32)))}
        for name, fn in decode_variants(heads).items():
            decode_rows.append(measure_chained({**base, "variant": name}, fn, sets, jnp.asarray(stack), check))
            bar.update(1)
        if verifier is not None:
            try:
                decode_rows.append({**base, **sglang_decode_row(verifier, calls[0], a.dtype, want)})
            except Exception as e:  # noqa: BLE001
                decode_rows.append({**base, "variant": "sglang", "error": f"{type(e).__name__}: {e}"[:1000]})
            bar.update(1)
        save_partial()
    bar.close()
    return publish_report(report("complete"), "hyspec bench gdn-layer", argv, a.json, markdown)


def _f(x, nd: int = 1) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def _e(x) -> str:
    return "—" if x is None else f"{x:.1e}"


def markdown(report: dict) -> str:
    meta = report.get("meta", {})
    g = report["geometry"]
    ops = report["model_operands"]
    lines = [f"# One GDN layer at the model's inputs — {meta.get('device_kind', '?')}"
             + (" (partial: stopped before its last configuration)" if report.get("status") == "partial" else ""), "",
             f"`{meta.get('command', '')}`", "",
             f"commit {meta.get('commit', '?')}, jax {meta.get('jax', '?')}, {meta.get('time_utc', '')}", "",
             f"GDN layer: HK {g['HK']}, HV {g['HV']}, dk {g['dk']}, dv {g['dv']}; model dtype {report['dtype']}. "
             "device µs: device time per layer (profiler); host µs: per call with its dispatch; × sglang: device "
             "µs over SGLang's (CUDA events).", ""]
    if report["rows"]:
        lines += ["## The verify's tree solve", "",
                  f"The call `TargetModel.verify` makes (`target.verify_solve_call`); `model` hands the kernel "
                  f"{ops['dtype']} q/k/v at their key heads with {ops['precision']} products "
                  "(`kernels.verify_operands`). err o: ‖o − o_ref‖/‖o_ref‖ against the fp32 reference; "
                  "o_ref → dtype: the error of rounding the reference's own output to the model dtype.", "",
                  "| B | N | variant | device µs | host µs | err o | o_ref → dtype | × sglang |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|"]
        peer = {(r["B"], r["N"]): r.get("device_us") for r in report["rows"] if r["variant"] == "sglang"}
        for r in report["rows"]:
            if "error" in r:
                lines.append(f"| {r['B']} | {r['N']} | {r['variant']} | failed: {r['error'][:120]} | | | | |")
                continue
            p = peer.get((r["B"], r["N"]))
            ratio = f"{r['device_us'] / p:.2f}" if p and r.get("device_us") else "—"
            lines.append(f"| {r['B']} | {r['N']} | {r['variant']} | {_f(r.get('device_us'))} | "
                         f"{_f(r.get('median_us'))} | {_e(r.get('err_o'))} | {_e(r['err_o_rounded_to_dtype'])} | "
                         f"{ratio} |")
        lines.append("")
    if report.get("decode_rows"):
        bv, w = report["decode_tiling"]
        lines += ["## The decoding step", "",
                  "The call a decoding step makes (`target.decode_step_call`): from the in-projection's output row, "
                  "conv, gates, l2norm, state update, readout and the gated norm of one token per slot. `model`: the "
                  f"dispatcher (fused kernel, block_v {bv}, {w} warp(s)); `xla`: the same math as XLA compiles it; "
                  "`sglang`: its recurrent kernel without the conv and the norm. Floor: the state read and written "
                  "once, the row, the window and the output, at the copy bandwidth measured here. err: against "
                  "`gdn.decode_layer` (fp32 inside, its output in the model's dtype, as the model's).", "",
                  "| B | variant | device µs | host µs | floor µs | × floor | err o | err state | window "
                  "| × sglang |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
        peer = {r["B"]: r.get("device_us") for r in report["decode_rows"] if r["variant"] == "sglang"}
        for r in report["decode_rows"]:
            if "error" in r:
                lines.append(f"| {r['B']} | {r['variant']} | failed: {r['error'][:120]} | | | | | | | |")
                continue
            us, fl, p = r.get("device_us"), r.get("floor_us"), peer.get(r["B"])
            lines.append(f"| {r['B']} | {r['variant']} | {_f(us)} | {_f(r.get('median_us'))} | {_f(fl, 2)} | "
                         f"{_f(us / fl if us and fl else None, 2)} | {_e(r.get('err_o'))} | {_e(r.get('err_state'))} | "
                         f"{'equal' if r.get('window_equal') else ('—' if 'window_equal' not in r else 'DIFFERS')} | "
                         f"{f'{us / p:.2f}' if us and p else '—'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
