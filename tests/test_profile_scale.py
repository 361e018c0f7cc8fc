"""`hyspec bench profile-scale`: HLO instructions -> parts, trace events -> time per part, traffic, the CLI at a tiny
geometry on the CPU (the profiler's thunk events name their HLO instructions there too)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hyspec_jax.bench import profile_scale as ps

V = 1000

HLO = """HloModule jit_f, is_scheduled=true

%fused_dense (param_0: f32[2,64], param_1: f32[128,64]) -> f32[2,128] {
  %param_0 = f32[2,64]{1,0} parameter(0)
  %param_1 = f32[128,64]{1,0} parameter(1)
  %rsqrt.1 = f32[2,64]{1,0} rsqrt(%param_0), metadata={op_name="jit(f)/norm/rsqrt"}
  %mul.1 = f32[2,64]{1,0} multiply(%rsqrt.1, %param_0), metadata={op_name="jit(f)/norm/mul"}
  ROOT %dot.1 = f32[2,128]{1,0} dot(%mul.1, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/dense/dot_general"}
}

%fused_elementwise (param_0.1: f32[2,64]) -> f32[2,64] {
  %param_0.1 = f32[2,64]{1,0} parameter(0)
  %exp.1 = f32[2,64]{1,0} exponential(%param_0.1), metadata={op_name="jit(f)/attention/exp"}
  %add.1 = f32[2,64]{1,0} add(%exp.1, %param_0.1), metadata={op_name="jit(f)/attention/add"}
  ROOT %neg.1 = f32[2,64]{1,0} negate(%add.1), metadata={op_name="jit(f)/gdn_state/norm/neg"}
}

%fused_untagged (param_0.2: f32[2,64]) -> f32[2,64] {
  %param_0.2 = f32[2,64]{1,0} parameter(0)
  ROOT %add.2 = f32[2,64]{1,0} add(%param_0.2, %param_0.2), metadata={op_name="jit(f)/add"}
}

%fused_silu (param_0.3: f32[2,64]) -> f32[2,64] {
  %param_0.3 = f32[2,64]{1,0} parameter(0)
  ROOT %logistic.1 = f32[2,64]{1,0} logistic(%param_0.3), metadata={op_name="jit(f)/jit(silu)/logistic"}
}

ENTRY %main (params__w.1: f32[128,64], params__head.1: f32[1000,64], x.1: f32[2,64]) -> f32[2,1000] {
  %params__w.1 = f32[128,64]{1,0} parameter(0), metadata={op_name="params[\\'w\\']"}
  %params__head.1 = f32[1000,64]{1,0} parameter(1)
  %x.1 = f32[2,64]{1,0} parameter(2)
  %fusion.1 = f32[2,128]{1,0} fusion(%x.1, %params__w.1), kind=kOutput, calls=%fused_dense, metadata={op_name="jit(f)/dense/dot_general"}
  %fusion.2 = f32[2,64]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_elementwise
  %fusion.3 = f32[2,64]{1,0} fusion(%fusion.2), kind=kLoop, calls=%fused_untagged
  %fusion.4 = f32[2,64]{1,0} fusion(%fusion.3), kind=kLoop, calls=%fused_silu
  %dot.2 = f32[2,1000]{1,0} dot(%fusion.4, %params__head.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %dot.3 = f32[2,2]{1,0} dot(%fusion.3, %fusion.3), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %custom-call.1 = (f32[2,128]{1,0}, s8[64]{0}) custom-call(%x.1, %params__w.1), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/gdn_conv/dense/dot_general"}
  %copy.1 = f32[2,64]{1,0} copy(%x.1)
  ROOT %dot.4 = f32[2,1000]{1,0} dot(%x.1, %params__head.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/dense/dot_general"}
}
"""


def test_classify_rules():
    module, ops, comps = ps.parse_hlo(HLO)
    assert module == "jit_f"
    assert ops["custom-call.1"].gemm and ops["custom-call.1"].dims == (2, 128)
    assert ops["dot.2"].operands == ("fusion.4", "params__head.1")
    parts = ps.classify(ops, comps, V)
    assert parts["fusion.1"] == ("dense", None, True)          # a matmul fusion goes to its dot, though mixed
    assert parts["fusion.2"] == ("attention", None, True)      # majority of tagged; the innermost tag of neg: norm
    assert parts["fusion.3"] == ("rest", None, False)          # untagged
    assert parts["fusion.4"] == ("norm_act", None, False)      # an activation jax.nn names
    assert parts["dot.2"] == ("logits", None, True)            # no op_name, reads a weight, vocabulary-sized
    assert parts["dot.3"] == ("attention", None, True)         # no op_name: its nearest tagged producer (fusion.2)
    assert parts["custom-call.1"] == ("dense", None, False)    # innermost: dense inside gdn_conv
    assert parts["copy.1"] == ("rest", None, False)
    assert parts["dot.4"] == ("logits", None, False)           # a dense product with a vocabulary-sized result
    assert ps.scope_part(ps.HloOp("x", "add", (4,), "jit(f)/gdn_conv/add", (), False), V) == ("gdn", "conv")


def test_attribute_sums_to_measured():
    _, ops, comps = ps.parse_hlo(HLO)
    parts = ps.classify(ops, comps, V)
    # two calls; fusion.1 and copy.1 overlap by 50 ns; one event names no instruction
    events = [(0, 100, "fusion.1", "k1"), (50, 100, "copy.1", "k2"), (200, 40, "fusion.2", "k3"),
              (300, 10, None, "memset"), (1000, 100, "fusion.1", "k1"), (1200, 60, "dot.2", "k4")]
    a = ps.attribute(events, ops, parts, calls=2, measured_ms=0.001)
    ms = a["ms"]
    assert set(ms) == set(ps.PARTS + ps.EXTRA)
    assert ms["dense"] == pytest.approx(200 / 2 / 1e6)
    assert ms["rest"] == pytest.approx(100 / 2 / 1e6)
    assert ms["attention"] == pytest.approx(40 / 2 / 1e6)
    assert ms["logits"] == pytest.approx(60 / 2 / 1e6)
    assert ms["unattributed"] == pytest.approx(10 / 2 / 1e6)
    assert ms["overlap"] == pytest.approx(-50 / 2 / 1e6)
    assert a["device_busy_ms"] == pytest.approx(360 / 2 / 1e6)
    assert sum(ms.values()) == pytest.approx(0.001)
    assert a["kernels"]["dense"] == 1 and a["rest_top"][0]["hlo"] == "copy.1"


def test_gdn_kernels_grouped_by_kind():
    """Each layer's copy of a GDN operation (`fusion.7`, `fusion.9`, ...) counts under one kind."""
    ops = {h: ps.HloOp(h, "fusion", (4,), f"jit(f)/gdn_state/{h}", (), False) for h in ("fusion.7", "fusion.9")}
    ops["solve.1"] = ps.HloOp("solve.1", "custom-call", (4,), "jit(f)/gdn_state/pallas", (), False)
    parts = {h: ("gdn", "state", False) for h in ops}
    events = [(0, 30, "fusion.7", "a"), (40, 50, "fusion.9", "b"), (100, 20, "solve.1", "c")]
    a = ps.attribute(events, ops, parts, calls=1, measured_ms=0.0001)
    top = a["gdn_top"]
    assert [(k["kind"], k["kernels"]) for k in top] == [("fusion", 2), ("solve", 1)]
    assert top[0]["ms"] == pytest.approx(80 / 1e6) and top[0]["sub"] == "state"


def test_traffic_splits_the_weights():
    """dense + LM head + embedding + every non-matrix parameter = all parameter bytes; decode moves each state twice."""
    import jax
    import jax.numpy as jnp

    from hyspec_jax.bench import verify_scale as vs

    cfg = vs.tiny_config()
    mesh = vs.make_mesh(1)
    _, params, _ = vs.random_params(cfg, jnp.float32, 0, mesh)
    state, _ = vs.random_state(cfg, 2, 32, 8, jnp.float32, 0, mesh)
    t = ps.traffic(cfg, params, state, batch=2, tokens=1, prefix=8, decode=True)
    leaves = jax.tree.leaves(params)
    total = sum(int(x.nbytes) for x in leaves)
    not_matrix = sum(int(x.nbytes) for x in leaves if x.ndim != 2)
    embed = cfg.vocab_size * cfg.hidden_size * 4
    head = embed                                          # the tiny config has its own LM head of the same shape
    assert t["dense"][0] + head + embed + not_matrix == total
    assert t["logits"] == (head + 2 * cfg.vocab_size * 4, 2 * 2 * cfg.vocab_size * cfg.hidden_size)
    assert t["gdn"][0] == 2 * (int(state.ssm.nbytes) + int(state.conv.nbytes))
    fl = ps.floors(t, dict(bandwidth_bytes_per_s=1e9, matmul_flops_per_s=1e12))
    assert fl["program"]["floor_ms"] >= max(fl[p]["floor_ms"] for p in ("dense", "logits", "gdn", "attention"))


def test_cli_tiny(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = ps.main(["--tiny", "--batch", "1", "--nodes", "4", "--prefix", "8", "--repeats", "1", "--warmup", "1",
                  "--trace-calls", "1", "--matmul-size", "64", "--copy-mib", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["status"] == "complete" and not r["skipped"]
    assert {"device_kind", "jax", "commit", "time_utc"} <= set(r["meta"])
    assert r["ceilings"]["matmul_flops_per_s"] > 0 and r["ceilings"]["bandwidth_bytes_per_s"] > 0
    assert [(p["program"], p["batch"], p["nodes"]) for p in r["programs"]] == [("decode", 1, 1), ("verify", 1, 4)]
    for p in r["programs"]:
        assert set(p["ms"]) == set(ps.PARTS + ps.EXTRA)
        assert sum(p["ms"].values()) == pytest.approx(p["t_ms"], abs=1e-6)
        assert p["ms"]["unattributed"] == 0                       # every CPU thunk names an instruction
        assert set(p["floors"]) == set(ps.PARTS) - {"rest"} | {"program"}
        assert p["floor_ms"] > 0 and p["finite"]
        assert sum(p["gdn_ms"].values()) <= p["ms"]["gdn"] + 1e-9
    ver = r["programs"][1]
    for part in ("dense", "gdn", "attention", "norm_act", "logits"):   # the named scopes reach the trace
        assert ver["ms"][part] > 0, part
        assert ver["kernels"][part] >= 1, part
    assert all(ver["gdn_ms"][k] > 0 for k in ps.GDN_PARTS)
    md = out.with_suffix(".md").read_text()
    assert "| program | measured ms | floor ms |" in md and "## verify B=1 N=4" in md
    assert "| decode B=1 |" in capsys.readouterr().out

    # --merge: another run's programs (here: the verify row as if N=8 had been measured by a second run)
    other = dict(r, settings=dict(r["settings"], nodes=[8]), programs=[dict(ver, nodes=8, rows=8)],
                 skipped=["verify B=1 N=16"], status="partial")
    (tmp_path / "o.json").write_text(json.dumps(other))
    merged = tmp_path / "m.json"
    assert ps.main(["--merge", str(out), str(tmp_path / "o.json"), "--json", str(merged)]) == 0
    m = json.loads(merged.read_text())
    assert [ps._name(x) for x in m["programs"]] == ["decode B=1", "verify B=1 N=4", "verify B=1 N=8"]
    assert m["skipped"] == ["verify B=1 N=16"] and m["status"] == "partial" and len(m["merged_ceilings"]) == 2
    bad = dict(r, settings=dict(r["settings"], prefix=9))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert ps.main(["--merge", str(out), str(tmp_path / "bad.json"), "--json", str(merged)]) == 1
    assert "cannot merge" in capsys.readouterr().err


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as e:
        ps.main(["--max-seconds", "0"])
    assert e.value.code != 0
    assert ps.main(["--tiny", "--prefix", "8", "--max-len", "8", "--no-progress", "--matmul-size", "8",
                    "--copy-mib", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hyspec bench profile-scale: error: --max-len 8")
