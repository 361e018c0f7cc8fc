"""`hyspec bench verify-scale` (bench/verify_scale.py): the CPU tiny path end to end, the B_ver rule on the
measured numbers, and tensor parallel (2 fake CPU devices) = 1 device."""

import json
import math

import numpy as np
import pytest

from hyspec_jax import cli
from hyspec_jax.bench import verify_scale as vs

FAST = ["--xla-option", "xla_backend_optimization_level=0"]     # CPU compile time dominates; same semantics


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify_scale") / "vs.json"
    argv = ["--tiny", "--batch", "1,2", "--nodes", "1,4", "--prefix", "6", "--repeats", "2", "--warmup", "1",
            "--no-progress", "--json", str(out), *FAST]
    assert vs.main(argv) == 0
    return out, json.loads(out.read_text())


def test_outputs_and_keys(run, capsys):
    out, rep = run
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 1000
    assert rep["status"] == "complete"
    for k in ("device_kind", "jax", "jaxlib", "commit", "time_utc"):
        assert k in rep["meta"]
    assert "--tiny" in rep["command"] and rep["argv"][0] == "--tiny"
    s = rep["settings"]
    assert s["nodes"] == [1, 4] and s["batches"] == [1, 2] and s["prefix"] == 6 and s["max_len"] == 10
    assert s["eps"] == 0.3 and s["devices"] == 1
    assert rep["model"]["param_count"] > 0 and rep["model"]["param_bytes"] == rep["model"]["param_bytes_per_device"]
    assert [b["batch"] for b in rep["batches"]] == [1, 2]
    for b in rep["batches"]:
        d = b["decode"]
        assert d["finite"] and d["t_ms"] > 0 and len(d["times_ms"]) == 2 and d["compile_s"] > 0
        assert [r["nodes"] for r in b["verify"]] == [1, 4]
        for r in b["verify"]:
            assert r["finite"] and r["t_ms"] > 0 and r["compile_s"] > 0 and r["lower_s"] > 0
            assert math.isfinite(r["ratio"]) and r["ratio"] > 0
            assert r["ratio"] == pytest.approx(r["t_ms"] / d["t_ms"], rel=1e-3)
            assert r["depth"] == min(8, r["nodes"] - 1) and r["tokens"] == b["batch"] * r["nodes"]
            m = r["memory"]
            # the accounting of spec.memory equals the TreeCache the verify returned; snapshots cost more
            assert m["measured_cache_bytes"] == m["factorized_bytes"] > 0
            assert m["snapshot_bytes"] > m["factorized_bytes"]
    md = out.with_suffix(".md").read_text()
    assert "B_ver" in md and "per-node snapshots" in md and rep["meta"]["commit"] in md


def test_b_ver_rule_on_the_measured_numbers(run):
    _, rep = run
    eps = rep["settings"]["eps"]
    for b in rep["batches"]:
        t_dec = b["decode"]["t_ms"]
        t_ver = {r["nodes"]: r["t_ms"] for r in b["verify"]}
        ok = [n for n, t in t_ver.items() if t <= (1 + eps) * t_dec]
        assert b["within"] == bool(ok)
        assert b["b_ver"] == (max(ok) if ok else min(t_ver))


def test_merge_rerenders_without_a_device(run, tmp_path):
    out, rep = run
    one = dict(rep, batches=rep["batches"][:1])
    two = dict(rep, batches=rep["batches"][1:])
    (tmp_path / "a.json").write_text(json.dumps(one))
    (tmp_path / "b.json").write_text(json.dumps(two))
    merged = tmp_path / "m.json"
    assert vs.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(merged)]) == 0
    m = json.loads(merged.read_text())
    assert [b["batch"] for b in m["batches"]] == [1, 2] and m["batches"] == rep["batches"]
    assert merged.with_suffix(".md").is_file() and merged.with_suffix(".png").is_file()


def test_tensor_parallel_equals_one_device():
    cfg = vs.tiny_config()
    kw = dict(batch=2, nodes=6, prefix=5, max_len=12, depth=3, compiler_options=dict(xla_backend_optimization_level=0))
    one = vs.verify_logits(cfg, devices=1, **kw)
    two = vs.verify_logits(cfg, devices=2, **kw)
    assert one.shape == (2, 6, cfg.vocab_size) and np.isfinite(one).all()
    err = np.linalg.norm(two - one) / np.linalg.norm(one)
    assert err < 1e-4, err
    assert (one.argmax(-1) == two.argmax(-1)).mean() > 0.9


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "verify-scale", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--devices" in out and "--tiny" in out and "T_ver" in out
