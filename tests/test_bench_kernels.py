"""`hyspec bench kernels --merge`: result files combine (later runs win per variant) and render to md + png."""

import json

import pytest

from hyspec_jax.bench import kernels as K


def _result(B, N, variants, commit="c1"):
    return {"device_kind": "TestGPU", "git_commit": commit, "jax_version": "0", "copy_bandwidth_GBps": 4000.0,
            "tree": [{"B": B, "N": N, "depth": 8, "paths": 4, "floor_us": 10.0, "variants": variants}],
            "commit": []}


def test_merge_later_files_win_and_render(tmp_path):
    a = _result(8, 64, {"pallas_neumann_bv64": {"median_us": 200.0, "err_o": 3e-4},
                        "serial_pallas_bv64": {"median_us": 1000.0, "err_o": 1e-7},
                        "xla_solve": {"median_us": 400.0, "err_o": 0.0}})
    b = _result(8, 64, {"pallas_neumann_bv64": {"median_us": 100.0, "err_o": 3e-4}}, commit="c2")
    b["tree"][0]["floor_us"] = 20.0                          # the later run's own floor comes with it
    b["commit"].append({"B": 8, "N": 64, "layers": 48, "floor_us": 1.0, "variants": {}})    # measured nothing
    b["tree"].append({"B": 1, "N": 16, "depth": 4, "paths": 2, "floor_us": 1.0,
                      "variants": {"pallas_squaring_bv32": {"median_us": 30.0, "err_o": 2e-4},
                                   "pallas_squaring_bv64": {"median_us": 25.0, "err_o": 0.5}}})   # wrong: not best
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert K.main(["--merge", str(pa), str(pb), "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["git_commit"] == "c2" and m["merged_from"] == [str(pa), str(pb)]
    row = K._tree_row(next(e for e in m["tree"] if (e["B"], e["N"]) == (8, 64)))
    assert row["best"] == "pallas_neumann_bv64" and row["us"] == 100.0
    assert row["x_serial"] == 10.0 and row["x_xla"] == 4.0 and row["pct_floor"] == 20.0
    assert m["commit"] == []
    small = K._tree_row(next(e for e in m["tree"] if (e["B"], e["N"]) == (1, 16)))
    assert small["best"] == "pallas_squaring_bv32"          # the inaccurate faster variant is not picked
    md = (tmp_path / "m.md").read_text()
    assert md.index("| 1 | 16 |") < md.index("| 8 | 64 |") and "neumann_bv64 | 100.0" in md
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_two_part_attention_equals_concatenated():
    """attention.attend_prefix_tree == attention.attend over the concatenated [prefix | tree] keys, incl. a row with
    no key at all (zeros) and an empty prefix."""
    import jax
    import jax.numpy as jnp

    from hyspec_jax.attention import attend, attend_prefix_tree
    ks = jax.random.split(jax.random.key(0), 6)
    B, T, NH, KVH, hd, S, N = 2, 5, 4, 2, 16, 7, 5
    q = jax.random.normal(ks[0], (B, T, NH, hd))
    k, v = jax.random.normal(ks[1], (B, S, KVH, hd)), jax.random.normal(ks[2], (B, S, KVH, hd))
    tk, tv = jax.random.normal(ks[3], (B, N, KVH, hd)), jax.random.normal(ks[4], (B, N, KVH, hd))
    prefix = jnp.arange(S)[None] < jnp.array([3, 0])[:, None]
    tree = jax.random.bernoulli(ks[5], 0.5, (B, T, N)).at[1, 0].set(False)
    full = jnp.concatenate([jnp.broadcast_to(prefix[:, None], (B, T, S)), tree], -1)
    ref = attend(q, jnp.concatenate([k, tk], 1), jnp.concatenate([v, tv], 1), full)
    out = attend_prefix_tree(q, k, v, prefix, tk, tv, tree)
    assert float(jnp.max(jnp.abs(out - ref))) < 1e-5
    assert bool(jnp.all(out[1, 0] == 0)) and bool(jnp.all(ref[1, 0] == 0))


def test_attention_bench_runs_on_cpu(tmp_path):
    """The attention section (both XLA forms and the Pallas kernel in interpret mode, errors against the verify's
    form, floor ratio) and its md table."""
    import argparse
    ns = argparse.Namespace(reps=2, attention_kernels="interpret", attention_tilings=((16, 32), (16, 32, 2, 1)),
                            matmul_flops=1e9)                    # two, one with warps / stages named
    res = K.bench_attention(2, 8, 128, ns, 1e11, lambda s: None, geometry=(4, 2, 16))
    kernels = [n for n in res["variants"] if n.startswith("pallas_split_prefix")]
    assert kernels == ["pallas_split_prefix_r16_s32_x4", "pallas_split_prefix_r16_s32_x4_w2_g1"]
    for name in ("xla_concat_attend", "xla_two_part", *kernels):
        rec = res["variants"][name]
        assert rec["err_o"] < 1e-2 and rec["median_us"] > 0 and rec["x_floor"] > 0, (name, rec)
        assert rec["x_roofline"] == rec["median_us"] / res["roofline_us"]
    assert res["floor_us"] == 1e6 * K.attention_bytes(2, 8, 128, (4, 2, 16)) / 1e11
    # 4 query heads x 8 nodes against 136 keys, head_dim 16: 4 * 2 * 4 * 8 * 136 * 16 FLOPs at 1 GFLOP/s
    assert res["compute_floor_us"] == 1e6 * (4 * 2 * 4 * 8 * 136 * 16) / 1e9
    assert res["roofline_us"] == max(res["floor_us"], res["compute_floor_us"])
    results = {"device_kind": "cpu", "tree": [], "commit": [], "attention": [res], "matmul_TFLOPs": 1e-3}
    K.render(results, str(tmp_path / "a.json"))
    md = (tmp_path / "a.md").read_text()
    assert "| 2 | 8 | 128 |" in md and "best Pallas split-S" in md and "× roofline" in md


def test_attention_tilings_parse():
    assert K.parse_tilings("64:64,128:32:8,64:128:8:3") == ((64, 64, 4, 2), (128, 32, 8, 2), (64, 128, 8, 3))
    with pytest.raises(ValueError):
        K.parse_tilings("64")
    assert all(len(t) == 4 for t in K.ATTN_TILINGS)


def test_attention_splits_fill_the_gpu():
    from hyspec_jax.pallas_kernels.tree_attention import default_splits
    assert default_splits(1, 64 * 6, 4096, 4, 64, 64) == 16          # 4 heads x 6 row tiles x 16 = 384
    assert default_splits(32, 64 * 6, 4096, 4, 64, 64) == 1          # 768 programs without splitting
    assert default_splits(1, 16, 128, 4, 64, 64) == 2                # never below block_s keys a split


def test_deferred_bench_runs_on_cpu(tmp_path, monkeypatch):
    """The deferred-commit section at a small geometry with the kernels in interpret mode: the append and the
    merging solve agree with their references, the per-round sums use the measured parts, and it renders."""
    import argparse
    for name, value in (("HK", 1), ("HV", 2), ("DK", 16), ("DV", 16)):
        monkeypatch.setattr(K, name, value)
    ns = argparse.Namespace(reps=1, layers=4, deferred_rows="16", deferred_method="squaring", deferred_block_v=16,
                            interpret=True)
    res = K.bench_deferred(2, 16, ns, 1e11, lambda s: None)
    v = res["variants"]
    for name in ("commit_eager", "append_P16", "append_P16_l4", "solve_plain", "solve_deferred_P16",
                 "solve_merge_P16"):
        assert v[name]["median_us"] > 0, (name, v[name])
    for name in ("append_P16", "append_P16_l4"):     # each on its own (undonated) copy of the update buffers
        assert v[name]["err"] < 1e-6 and v[name]["count_ok"], (name, v[name])
    assert v["solve_deferred_P16"]["err_o"] < 1e-3 and v["solve_merge_P16"]["err_state"] < 1e-5
    x = res["per_round_layer_us"]["P16"]
    assert x["merge_every"] == 16 // K.DEPTH_FOR_N[16]
    R = x["merge_every"]
    want = ((R - 1) * v["solve_deferred_P16"]["median_us"] + v["solve_merge_P16"]["median_us"]) / R \
        + v["append_P16"]["median_us"] / 4
    assert abs(x["deferred"] - want) < 1e-9
    K.render({"device_kind": "cpu", "tree": [], "commit": [], "attention": [], "deferred": [res]},
             str(tmp_path / "d.json"))
    md = (tmp_path / "d.md").read_text()
    assert "Deferred commit" in md and "| 2 | 16 | 4 | 16 |" in md


def test_gpu_stream_time_sums_stream_events_only():
    """device_us: the GPU planes' "Stream" lines summed per call; the "XLA Ops" line (the same time again) and
    host planes are left out; a trace without GPU stream events is an error, not a zero."""
    from jax.profiler import ProfileData
    from hyspec_jax.bench.kernels import gpu_stream_time
    text = """
    planes { id: 1 name: "/device:GPU:0"
      lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 0
        events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 }
        events { metadata_id: 2 offset_ps: 6000000 duration_ps: 1000000 }
        events { metadata_id: 1 offset_ps: 9000000 duration_ps: 3000000 } }
      lines { id: 2 name: "XLA Ops" timestamp_ns: 0
        events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 } }
      event_metadata { key: 1 value { id: 1 name: "gdn_tree_apply" } }
      event_metadata { key: 2 value { id: 2 name: "fusion_3" } } }
    planes { id: 2 name: "/host:CPU"
      lines { id: 1 name: "python" timestamp_ns: 0 events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000000 } }
      event_metadata { key: 1 value { id: 1 name: "run" } } }
    """
    res = gpu_stream_time(ProfileData.from_text_proto(text), calls=2)
    assert res["device_us"] == pytest.approx(4.5)                 # (5 + 1 + 3) µs over 2 calls
    assert res["device_busy_us"] == pytest.approx(4.5)            # no overlap: the union is the sum
    overlapping = text.replace("offset_ps: 6000000 duration_ps: 1000000", "offset_ps: 4000000 duration_ps: 3000000")
    over = gpu_stream_time(ProfileData.from_text_proto(overlapping), calls=2)
    assert over["device_us"] == pytest.approx(5.5) and over["device_busy_us"] == pytest.approx(5.0)  # 0-7, 9-12 µs
    assert res["device_kernels_us"] == pytest.approx({"gdn_tree_apply": 4.0, "fusion_3": 0.5})
    host_only = 'planes { id: 2 name: "/host:CPU" }'
    with pytest.raises(RuntimeError, match="no GPU stream events"):
        gpu_stream_time(ProfileData.from_text_proto(host_only), calls=1)


def test_tree_bench_runs_on_cpu(tmp_path, monkeypatch):
    """The tree-solve sweep at a small geometry with the kernels in interpret mode: every form matches the
    reference, the serial kernel keeps its per-node states as transient memory (the kernels none), it renders."""
    import argparse
    for name, value in (("HK", 1), ("HV", 2), ("DK", 16), ("DV", 32)):
        monkeypatch.setattr(K, name, value)
    ns = argparse.Namespace(reps=1, interpret=True, profile=True,
                            variants=r"pallas_(squaring|inverse|split)_bv16|serial_pallas_bv32|xla_solve")
    res = K.bench_tree(1, 16, ns, 1e11, lambda s: None)
    v = res["variants"]
    assert set(v) == {"pallas_squaring_bv16", "pallas_inverse_bv16", "pallas_split_bv16", "serial_pallas_bv32",
                      "xla_solve"}
    for name, x in v.items():
        assert x["median_us"] > 0 and x["err_o"] < 1e-4, (name, x)
        assert "device_us" not in x                              # no profiler trace without a GPU
    per_node_states = 16 * K.HV * K.DK * K.DV * 4                # N fp32 states of one request
    assert v["serial_pallas_bv32"]["transient_bytes"] >= per_node_states
    row = K._tree_row(res)
    assert row["best"].startswith("pallas_") and row["serial_transient_mib"] >= per_node_states / 2**20
    K.render({"device_kind": "cpu", "tree": [res], "commit": [], "attention": [], "deferred": []},
             str(tmp_path / "t.json"))
    assert "transient MiB" in (tmp_path / "t.md").read_text()


def test_configs_take_an_optional_depth_and_reject_bad_input():
    import argparse
    assert K.parse_configs("1:64,8:16:16") == [(1, 64, None), (8, 16, 16)]      # 8:16:16 is a 16-node chain
    for bad in ("8", "8:48", "8:16:4:2", "a:16", "0:16"):
        with pytest.raises(argparse.ArgumentTypeError, match="B:N"):
            K.parse_configs(bad)
