"""`hyspec bench round-scale` (bench/round_scale.py): the CPU tiny path end to end (the engine's round, its phases
and the decoding step timed per batch and width; every drafting mode, the MTP modes with the target's own MTP
head), the projection arithmetic against the results file's own τ and the published τ per mode, the published
drafter geometry, merge (across modes too), and one-line errors."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from hyspec_jax.bench import round_scale as rs

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "bench" / "results" / "e2e" / "e2e_h100_loop.json"
FAST = ["--xla-option", "xla_backend_optimization_level=0"]     # CPU compile time dominates; same semantics


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("round_scale") / "rs.json"
    argv = ["--tiny", "--batch", "2", "--nodes", "4,32", "--prefix", "6", "--repeats", "2", "--warmup", "1",
            "--no-progress", "--json", str(out), *FAST]
    assert rs.main(argv) == 0
    return out, json.loads(out.read_text())


@pytest.fixture(scope="module")
def modes_run(tmp_path_factory):
    """chain, mtp and mtp-tree in one process at N 4 (a chain of 3 drafts; a tree's 4 nodes), at the KV length of
    `run` (so the two merge)."""
    out = tmp_path_factory.mktemp("round_scale_modes") / "modes.json"
    argv = ["--tiny", "--mode", "chain,mtp,mtp-tree", "--batch", "2", "--nodes", "4", "--prefix", "6", "--max-len",
            "38", "--repeats", "2", "--warmup", "1", "--no-progress", "--json", str(out), *FAST]
    assert rs.main(argv) == 0
    return out, json.loads(out.read_text())


def test_rows_and_outputs(run):
    out, rep = run
    assert rep["status"] == "complete" and not rep["skipped"]
    assert "--tiny" in rep["command"] and rep["meta"]["commit"]
    s = rep["settings"]
    assert s["modes"] == ["tree-ready"] and s["nodes"] == {"tree-ready": [4, 32]}
    assert s["tree"] == dict(depth=7, top_k=8, beam=16) and rep["mtp"] is None
    assert s["max_len"] == 6 + 32 and rep["drafter"]["gamma"] == 7 and rep["drafter"]["reader"] is not None
    assert [d["batch"] for d in rep["decode"]] == [2] and rep["decode"][0]["t_ms"] > 0
    assert [(r["mode"], r["batch"], r["nodes"]) for r in rep["rows"]] == [("tree-ready", 2, 4), ("tree-ready", 2, 32)]
    t_dec = {d["batch"]: d["t_ms"] for d in rep["decode"]}
    for r in rep["rows"]:
        assert r["depth"] == min(7, r["nodes"] - 1) and r["capacity"] == r["batch"] * r["nodes"]
        assert r["t_round_ms"] > 0 and r["t_draft_ms"] > 0 and r["t_verify_ms"] > 0
        assert r["phases"]["verify"]["finite"] and len(r["times_ms"]) == 2
        assert r["t_dec_ms"] == t_dec[r["batch"]]
        assert r["round_over_dec"] == pytest.approx(r["t_round_ms"] / r["t_dec_ms"], rel=1e-3)
        # greedy: every active slot commits its accepted drafts and the bonus token
        assert r["committed_per_round"] == pytest.approx(r["accepted_per_round"] + 1)
    md = out.with_suffix(".md").read_text()
    assert "PROJECTED" in md and "2610.20503" in md and "e2e_h100_loop.json" in md and "T_round / T_dec" in md
    assert "τ 4.53 (ReaDy, published)" in md and "| mode |" in md


def test_every_mode(modes_run):
    """chain (DSpark drafter, no reader), mtp and mtp-tree (the target's MTP head, no drafter's reader): each mode's
    round and phases timed beside one decoding step; a chain's N is its node count (N − 1 drafts); the MTP head's
    geometry and parameter count reported; the published τ per mode (mtp at 3 drafts: 3.28; none for a chain of 3
    DSpark drafts or for mtp-tree)."""
    out, rep = modes_run
    s = rep["settings"]
    assert rep["status"] == "complete" and not rep["skipped"]
    assert s["modes"] == ["chain", "mtp", "mtp-tree"] and s["max_len"] == 38
    assert s["nodes"] == {"chain": [4], "mtp": [4], "mtp-tree": [4]}
    assert rep["decode"][0]["t_ms"] > 0 and len(rep["decode"]) == 1
    rows = {r["mode"]: r for r in rep["rows"]}
    assert sorted(rows) == ["chain", "mtp", "mtp-tree"]
    for mode, r in rows.items():
        assert r["batch"] == 2 and r["nodes"] == 4 and r["capacity"] == 2 * 4
        assert r["t_round_ms"] > 0 and r["t_draft_ms"] > 0 and r["t_verify_ms"] > 0
        assert r["t_dec_ms"] == rep["decode"][0]["t_ms"] and r["phases"]["verify"]["finite"]
        assert r["committed_per_round"] == pytest.approx(r["accepted_per_round"] + 1)
    assert rows["chain"]["depth"] == 3 and rows["mtp"]["depth"] == 3     # N − 1 drafts
    assert rows["mtp-tree"]["depth"] == 3                                   # a 4-node tree: at most 3 deep
    # the DSpark drafter without a reader (no ready mode); the MTP head: one layer at the target's hidden size
    d, h = rep["drafter"], rep["mtp"]
    assert d["reader"] is None and d["gamma"] == 7
    H, I = rep["model"]["config"]["hidden_size"], rep["model"]["config"]["intermediate_size"]
    assert h["layers"] == 1 and h["hidden_size"] == H and h["param_count"] > 0 and h["param_bytes"] > 0
    attn = H * h["num_attention_heads"] * h["head_dim"] * 2 + 2 * H * h["num_key_value_heads"] * h["head_dim"]
    attn += h["num_attention_heads"] * h["head_dim"] * H                  # q (+ gate), k, v, o
    norms = 5 * H + 2 * h["head_dim"]     # pre-fc embedding / hidden, input, post-attention, final; q / k norms
    assert h["param_count"] == 2 * H * H + attn + 3 * H * I + norms       # fc, gated attention, MLP, norms
    pub = rep["taus"]["published"]
    assert pub["mtp"]["tau"] == {"4": 3.28} and pub["chain"]["tau"] == {} and pub["mtp-tree"]["tau"] == {}
    assert rows["mtp"]["projections"]["published"]["speedup"] == pytest.approx(
        3.28 * rows["mtp"]["t_dec_ms"] / rows["mtp"]["t_round_ms"], rel=1e-3)
    assert rows["chain"]["projections"]["published"]["speedup"] is None
    md = out.with_suffix(".md").read_text()
    assert "MTP head (mtp, mtp-tree; no separate drafter)" in md and "τ 3.28 (Qwen3.8-27B MTP head, published)" in md
    for mode in rows:
        assert f"| {mode} | 2 | 4 |" in md


def test_published_taus_per_mode():
    nodes = {"chain": [6, 8], "ready": [6, 8], "tree": [8, 32], "mtp": [2, 3, 4, 5, 6], "mtp-tree": [8]}
    pub = rs.published_taus(list(nodes), nodes, None)
    assert pub["chain"]["tau"] == {"6": 3.73} and pub["ready"]["tau"] == {"8": 4.5285}
    assert pub["tree"]["tau"] == {"8": 4.5285, "32": 4.5285} and pub["tree"]["label"] == "ReaDy"
    assert pub["mtp"]["tau"] == {"2": 1.90, "3": 2.68, "4": 3.28, "5": 3.79} and pub["mtp-tree"]["tau"] == {}
    assert "drafters.md §10" in pub["mtp"]["source"] and "2610.20503" in pub["tree"]["source"]
    own = rs.published_taus(["mtp-tree"], {"mtp-tree": [8]}, 2.5)["mtp-tree"]
    assert own["tau"] == {"8": 2.5} and own["source"] == "--published-tau"


def test_mode_nodes():
    assert rs.mode_nodes("tree-ready", None, 7) == [8, 32] and rs.mode_nodes("mtp-tree", None, 0) == [8, 32]
    assert rs.mode_nodes("chain", None, 7) == [6, 8] and rs.mode_nodes("chain", None, 3) == [4]
    assert rs.mode_nodes("mtp", None, 0) == [4] and rs.mode_nodes("mtp", [2, 40], 0) == [2, 40]
    for mode, nodes in (("chain", [32]), ("chain", [1]), ("mtp", [1])):
        with pytest.raises(ValueError, match=f"does not apply to mode {mode}"):
            rs.mode_nodes(mode, nodes, 7)


def test_projection_arithmetic(run):
    """speed-up = τ · T_dec / T_round at the published τ and at the τ the e2e results file holds for the same
    mode, tree and N (read here straight from the file); no τ there, no projection."""
    _, rep = run
    e2e = json.loads(E2E.read_text())
    assert e2e["meta"]["tree"] == dict(depth=7, top_k=8, beam=16, verify_nodes=32)
    tau_emb = e2e["results"]["tree-ready@b1"]["mean_tau"]
    assert rep["taus"]["published"]["tree-ready"]["tau"] == {"4": 4.5285, "32": 4.5285}
    assert rep["taus"]["embedded"]["tree-ready"]["32"]["tau"] == tau_emb
    for r in rep["rows"]:
        p = r["projections"]
        want = 4.5285 * r["t_dec_ms"] / r["t_round_ms"]
        assert p["published"]["speedup"] == pytest.approx(want, rel=1e-3)
        assert p["published"]["meets"] == (p["published"]["speedup"] >= 1.8)
        if r["nodes"] == 32:
            assert p["embedded"]["tau"] == tau_emb
            assert p["embedded"]["speedup"] == pytest.approx(tau_emb * r["t_dec_ms"] / r["t_round_ms"], rel=1e-3)
            assert p["embedded"]["meets"] == (p["embedded"]["speedup"] >= 1.8)
        else:
            assert p["embedded"] == dict(tau=None, speedup=None, meets=None)
    assert rs.projected_speedup(4.0, 10.0, 20.0) == 2.0
    with pytest.raises(ValueError):
        rs.projected_speedup(4.0, 10.0, 0.0)


def test_embedded_taus_matches_the_tree(tmp_path):
    f = tmp_path / "e2e.json"
    res = {"tree-ready@b8": dict(mode="tree-ready", batch=8, verify_nodes=32, mean_tau=3.1),
           "tree-ready@b1": dict(mode="tree-ready", batch=1, verify_nodes=32, mean_tau=3.0),
           "tree@b1": dict(mode="tree", batch=1, verify_nodes=32, mean_tau=2.0),
           "ar@b1": dict(mode="ar", batch=1, verify_nodes=1)}
    f.write_text(json.dumps(dict(meta=dict(tree=dict(depth=7, top_k=8, beam=16)), results=res)))
    got = rs.embedded_taus(f, "tree-ready", (7, 8, 16), {8, 32})
    assert list(got) == [32] and got[32]["tau"] == 3.0 and got[32]["entry"] == "tree-ready@b1"
    assert rs.embedded_taus(f, "tree", (7, 8, 16), {32})[32]["tau"] == 2.0
    assert rs.embedded_taus(f, "tree-ready", (7, 4, 6), {32}) == {}      # another tree: no τ


def test_published_drafter_geometry():
    from hyspec_jax.spec.memory import qwen38_27b

    cfg, source = rs.drafter_config(qwen38_27b())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (5120, 5, 32, 8, 128, 17408, 248320)
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61) and cfg.block_size == 7 and cfg.num_draft_tokens == 7
    assert "drafters.md" in source and "2610.20503" in source
    assert rs.drafter_config(qwen38_27b(), block_size=16, layers=3)[0].block_size == 16


def test_drafter_config_file(tmp_path):
    """--drafter-config: the file's geometry and block size, unless a flag overrides; another target's is refused."""
    import dataclasses

    from hyspec_jax.bench import verify_scale as vs
    from hyspec_jax.spec.memory import qwen38_27b

    tiny = vs.tiny_config()
    own = dataclasses.replace(rs.drafter_config(tiny, tiny=True)[0], block_size=5)
    f = tmp_path / "config.json"
    f.write_text(json.dumps(own.to_hf_dict()))
    assert rs.drafter_config(tiny, path=str(tmp_path))[0] == own
    assert rs.drafter_config(tiny, path=str(f), block_size=3)[0].block_size == 3
    with pytest.raises(ValueError, match="do not match"):
        rs.drafter_config(qwen38_27b(), path=str(f))


def test_random_drafter_norms_are_one():
    """The drafter's Qwen3 norms (not zero-centred) get weight 1, the matrices random draws, the reader its own."""
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.bench import verify_scale as vs
    from hyspec_jax.models.reader import ReaderConfig

    tcfg = vs.tiny_config()
    dcfg, _ = rs.drafter_config(tcfg, tiny=True)
    d = rs.random_drafter(dcfg, ReaderConfig.for_target(tcfg), jnp.float32, 0, vs.make_mesh(1))
    assert np.all(np.asarray(d.layers[0].input_layernorm.weight[...]) == 1.0)
    assert np.all(np.asarray(d.norm.weight[...]) == 1.0)
    fc = np.asarray(d.fc.weight[...])
    assert fc.std() == pytest.approx(0.02, rel=0.1)
    assert np.asarray(d.reader.w_q[...]).std() == pytest.approx(1 / np.sqrt(dcfg.hidden_size), rel=0.1)
    import jax
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(d)))


def test_merge(run, tmp_path):
    out, rep = run
    a = dict(rep, rows=rep["rows"][:1], status="partial",
             skipped=["round tree-ready B=2 N=32", "verify tree-ready B=2 N=32"])
    b = dict(rep, rows=rep["rows"][1:])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    merged = tmp_path / "m.json"
    assert rs.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(merged)]) == 0
    m = json.loads(merged.read_text())
    assert m["rows"] == rep["rows"] and m["decode"] == rep["decode"] and m["status"] == "complete"
    assert merged.with_suffix(".md").is_file()


def test_merge_across_modes(run, modes_run, tmp_path):
    """Runs of different modes at one KV length merge into one table with a mode column; another KV length is
    refused in one line."""
    (out, rep), (out2, rep2) = run, modes_run
    merged = tmp_path / "m.json"
    assert rs.main(["--merge", str(out), str(out2), "--json", str(merged)]) == 0
    m = json.loads(merged.read_text())
    assert m["settings"]["modes"] == ["tree-ready", "chain", "mtp", "mtp-tree"] and m["status"] == "complete"
    assert [(r["mode"], r["nodes"]) for r in m["rows"]] == [("tree-ready", 4), ("tree-ready", 32), ("chain", 4),
                                                              ("mtp", 4), ("mtp-tree", 4)]
    assert m["drafter"]["reader"] is not None and m["mtp"] == rep2["mtp"]
    assert set(m["taus"]["published"]) == {"tree-ready", "chain", "mtp", "mtp-tree"}
    md = merged.with_suffix(".md").read_text()
    assert "| mode |" in md and "| mtp-tree | 2 | 4 |" in md and "at each row's τ" in md
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(rep2, settings=dict(rep2["settings"], max_len=15))))
    with pytest.raises(ValueError, match="max_len"):
        rs.merge([str(out), str(other)])


def test_errors_are_one_line(tmp_path, capsys):
    assert rs.main(["--tiny", "--no-progress", "--tau-from", str(tmp_path / "none.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hyspec bench round-scale: error:")
    for argv in (["--tree-depth", "0"], ["--mode", "chain", "--nodes", "32"], ["--mode", "mtp,bogus"],
                 ["--mode", "mtp", "--block-size", "3"], ["--mode", "chain", "--block-size", "3", "--nodes", "8"]):
        with pytest.raises(SystemExit) as e:
            rs.main(["--tiny", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("hyspec bench round-scale: error:"), (argv, err)


def test_device_memory_default_and_out_of_memory_line(run, tmp_path, monkeypatch, capsys):
    """A scale benchmark lets JAX take 95% of the device unless the environment says otherwise; running out of
    device memory is one line that says what to change."""
    from hyspec_jax.bench import verify_scale as vs
    env = vs.MEM_FRACTION_ENV
    monkeypatch.setenv(env, "0.5")
    monkeypatch.delenv(env)                            # absent; restored to absent afterwards
    out, rep = run
    (tmp_path / "a.json").write_text(json.dumps(rep))
    assert rs.main(["--merge", str(tmp_path / "a.json"), "--json", str(tmp_path / "m.json")]) == 0
    assert os.environ[env] == vs.SCALE_MEM_FRACTION
    monkeypatch.setenv(env, "0.6")                     # the environment's share wins
    args = rs.build_parser().parse_args(["--tiny"])
    args.argv = []

    def sweep(*a, **kw):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB.\nstack ...")
    capsys.readouterr()
    assert vs.drive(rs.build_parser(), args, prog="hyspec bench round-scale", merge=None, sweep=sweep,
                    write=lambda *a: None, summary=str, finite=bool) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RESOURCE_EXHAUSTED" in err[0] and f"{env}: now 0.6" in err[0], err
    assert os.environ[env] == "0.6"


def test_registered_in_the_cli(capsys):
    from hyspec_jax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "round-scale", "--help"])
    assert e.value.code == 0 and "PROJECTIONS" in capsys.readouterr().out
