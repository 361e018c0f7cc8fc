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


# ------------------------------------------------------------------------------------------------
# Weight construction: per-leaf fillers, compile count independent of depth
# ------------------------------------------------------------------------------------------------
def _init_compiles(layers: int) -> tuple[int, object]:
    import jax
    import jax.numpy as jnp

    from hyspec_jax.compilation import compile_count

    vs._filler.cache_clear()                       # fresh fillers: every signature compiles again
    mesh = vs.make_mesh(1)
    c0 = compile_count()
    _, params, _ = vs.random_params(vs.tiny_config(layers), jnp.float32, 0, mesh)
    jax.block_until_ready(params)
    return compile_count() - c0, params


def test_weight_construction_compiles_do_not_grow_with_depth():
    import jax

    n8, p8 = _init_compiles(8)
    n16, p16 = _init_compiles(16)
    assert len(jax.tree.leaves(p16)) > len(jax.tree.leaves(p8))
    # one small program per distinct (kind, shape, dtype, sharding), shared by every layer
    sigs = {(x.shape, str(x.dtype)) for x in jax.tree.leaves(p16)}
    assert 0 < n8 == n16 <= len(sigs) + 4, (n8, n16, len(sigs))
    # a second build of the same geometry compiles nothing; nor does a state (after its first build)
    from hyspec_jax.compilation import compile_count
    import jax.numpy as jnp

    c0 = compile_count()
    vs.random_params(vs.tiny_config(16), jnp.float32, 1, vs.make_mesh(1))
    cfg, mesh = vs.tiny_config(16), vs.make_mesh(1)
    vs.random_state(cfg, 2, 12, 5, jnp.float32, 0, mesh)
    c1 = compile_count()
    s1, _ = vs.random_state(cfg, 2, 12, 5, jnp.float32, 0, mesh)
    assert c1 - c0 <= 5 and compile_count() == c1          # ≤ 5 state leaves the first time, then none
    assert np.asarray(s1.lengths).tolist() == [5, 5] and float(np.asarray(s1.ssm).std()) == pytest.approx(0.05, rel=0.1)


def test_random_weights_follow_the_model_initialiser():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.models import target as target_lib

    cfg = vs.tiny_config()
    ref = nnx.split(target_lib.create_model(cfg, seed=0))[1]
    _, params, _ = vs.random_params(cfg, jnp.float32, 0, vs.make_mesh(1))
    assert jax.tree.structure(ref) == jax.tree.structure(params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(params)):
        a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.std() == 0:                                           # constants (norm weights, dt_bias): exact
            np.testing.assert_array_equal(a, b, err_msg=name)
        elif a.size >= 256:                                        # random: same scale
            assert b.std() == pytest.approx(a.std(), rel=0.2), name
        else:                                                      # A_log = log U(1, 16)
            assert 0 <= b.min() and b.max() <= np.log(16) + 1e-6, name


def test_init_rules_reject_an_unknown_parameter(monkeypatch):
    from hyspec_jax.models import target as target_lib

    monkeypatch.delitem(vs.INIT_RULES, ("DepthwiseConv", "weight"))
    with pytest.raises(KeyError, match="conv1d.weight"):
        vs.param_init_rules(target_lib.abstract_model(vs.tiny_config()))


# ------------------------------------------------------------------------------------------------
# Order of work and --max-seconds
# ------------------------------------------------------------------------------------------------
def test_work_plan_headline_first():
    assert vs.work_plan([8, 1, 4], [256, 1, 8, 64, 16]) == [
        (1, [1, 64]), (1, [8, 16, 256]), (4, [1, 8, 16, 64, 256]), (8, [1, 8, 16, 64, 256])]
    assert vs.work_plan([4, 2], [1, 4]) == [(2, [1, 4]), (4, [1, 4])]
    assert vs.work_plan([1], [64]) == [(1, [64])]


def test_max_seconds_stops_and_writes_partial_json(tmp_path, monkeypatch):
    """The clock jumps past --max-seconds after the first group (B=1, N=1): nothing more is started, the
    JSON (rewritten after the decode and after each N) is partial and lists the skipped (B, N)."""
    import time as real_time

    jump = {"s": 0.0}

    class Clock:
        perf_counter = staticmethod(lambda: real_time.perf_counter() + jump["s"])

    monkeypatch.setattr(vs, "time", Clock)
    run_group, writes = vs.BatchBench.run, []

    def run_then_jump(self, *a, **k):
        out = run_group(self, *a, **k)
        jump["s"] = 1e6
        return out

    monkeypatch.setattr(vs.BatchBench, "run", run_then_jump)
    write = vs.write_outputs
    monkeypatch.setattr(vs, "write_outputs", lambda rep, p: (writes.append(json.loads(json.dumps(rep, default=str))),
                                                             write(rep, p)))
    out = tmp_path / "p.json"
    argv = ["--tiny", "--batch", "1,2", "--nodes", "1,4", "--prefix", "6", "--repeats", "1", "--warmup", "1",
            "--max-seconds", "100", "--no-progress", "--json", str(out), *FAST]
    assert vs.main(argv) == 0
    rep = json.loads(out.read_text())
    assert rep["status"] == "partial" and rep["skipped"] == [[1, 4], [2, 1], [2, 4]]
    assert rep["settings"]["max_seconds"] == 100 and rep["settings"]["order"][0] == [1, [1]]
    assert [b["batch"] for b in rep["batches"]] == [1] and [r["nodes"] for r in rep["batches"][0]["verify"]] == [1]
    # written after the decode, after N=1, and at the end
    assert [len(w["batches"][0]["verify"]) for w in writes] == [0, 1, 1]
    assert "Not measured" in out.with_suffix(".md").read_text()
