"""`hyspec bench e2e` on a tiny random target + random drafter with a reader (CPU, fp32): every mode's greedy
output equals `ar` (the run's own equality check says yes), the JSON / markdown / plots are written, and the
censored prefix survival follows ReaDy's rule on a hand-made example."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from hyspec_jax.bench.e2e import main as e2e_main, prefix_survival
from hyspec_jax.bench.report import busy_time_ns
from hyspec_jax.config import DrafterConfig
from hyspec_jax.io.drafter_io import save_drafter
from hyspec_jax.io.hf import save_pretrained
from hyspec_jax.models import drafter as D
from hyspec_jax.models.reader import ReaderConfig
from hyspec_jax.models.target import create_model

try:
    from tests.test_engine import TCFG
except ImportError:
    from test_engine import TCFG

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)


def test_prefix_survival_censors_the_last_round():
    # request 1: rounds accept 2, 0, then a last round of 1 (cut by max_tokens); request 2: 3 then last 0
    surv = prefix_survival([[2, 0, 1], [3, 0]], depth=3)
    # j=1: observable rounds = 2,0,3 (non-last) + last round 1 (accepted >= 1) -> hits 2+1 of 4
    # j=2: non-last 2,0,3 -> hits 2 of 3 (last rounds 1 and 0 are censored)
    # j=3: non-last -> hits 1 of 3
    assert surv == pytest.approx([3 / 4, 2 / 3, 1 / 3])
    assert math.isnan(prefix_survival([[0]], depth=1)[0])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    prev = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    root = tmp_path_factory.mktemp("e2e")
    save_pretrained(create_model(TCFG, seed=0), root / "target")
    dcfg = DrafterConfig.from_target(TCFG, num_layers=1, target_layer_ids=(0, 1), markov_rank=8, block_size=4)
    drafter = D.create_drafter(dcfg, ReaderConfig.for_target(TCFG, rank=4, mlp_hidden=16), seed=1)
    w = drafter.reader.fc_out.weight
    w.set_value(0.5 * jax.random.normal(jax.random.key(5), w[...].shape))
    save_drafter(drafter, root / "drafter")
    rng = np.random.default_rng(0)
    np.savez(root / "prompts.npz", tokens=rng.integers(3, TCFG.vocab_size, (6, 5)).astype(np.uint16),
             domain=np.array([0, 0, 0, 1, 1, 1], np.int32), domains=np.array(["code", "drama"]))
    yield root
    jax.config.update("jax_disable_most_optimizations", prev)


def test_ar_prefix_share_counts_tokens_before_the_first_difference():
    from hyspec_jax.bench.e2e import ar_prefix_share
    ar = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 9]]
    assert ar_prefix_share(ar, ar) == 1.0
    assert ar_prefix_share([[1, 2, 0, 4], [5, 6], [0, 8, 9, 9]], ar) == (2 + 2 + 0) / 10   # nothing after a difference
    assert ar_prefix_share([[1, 2], [5, 6], [7, 8, 9, 9]], ar) == (2 + 2 + 4) / 10           # a shorter output


def test_e2e_every_mode_equals_ar(dirs):
    out = dirs / "res" / "e2e.json"
    rc = e2e_main(["--json", str(out), "--model", str(dirs / "target"), "--drafter", str(dirs / "drafter"),
                   "--prompts", str(dirs / "prompts.npz"), "--prompts-per-domain", "3", "--batch", "2",
                   "--max-tokens", "6", "--repeats", "2", "--tree-depth", "3", "--tree-topk", "2",
                   "--tree-beam", "2", "--verify-nodes", "5", "--sweep-nodes", "3"])
    assert rc == 0
    rep = json.loads(out.read_text())
    res = rep["results"]
    assert rep["meta"]["status"] == "complete" and rep["meta"]["repeat_order"] == "round-robin over modes"
    # batch 2 over 3 prompts a domain: a full group and a ragged one
    assert set(res) == {f"{m}@b2" for m in ("ar", "chain", "ready", "tree", "tree-ready")} | {"tree-ready@b1@N3"}
    for key, row in res.items():
        for d, e in row["domains"].items():
            assert e["equal_ar"] is True and e["ar_prefix_share"] == 1.0, (key, d)
            assert e["tok_s"] > 0 and e["tokens"] == 3 * 6
            assert len(e["tok_s_runs"]) == 2 and abs(sum(e["tok_s_runs"]) / 2 - e["tok_s"]) < 0.2
            if row["mode"] != "ar":
                assert 1.0 <= e["tau"] <= 1 + row["verify_nodes"]
                assert e["speedup"] > 0 if f"ar@b{row['batch']}" in res else "speedup" not in e
                assert len(e["prefix_survival"]) == len(e["accepted_per_position"])
        if row["mode"] != "ar" and f"ar@b{row['batch']}" in res:        # the speed-up paired by repeat
            assert len(row["speedup_paired"]) == 2 and min(row["speedup_paired"]) > 0
            assert row["speedup_paired_std"] >= 0
    assert res["tree-ready@b1@N3"]["verify_nodes"] == 3 and "speedup_paired" not in res["tree-ready@b1@N3"]
    assert rep["meta"]["commit"] and rep["meta"]["device_kind"]
    assert out.with_suffix(".md").read_text().count("|") > 20
    assert out.with_suffix(".png").stat().st_size > 0 and (out.parent / "e2e_budget.png").stat().st_size > 0


def test_results_record_project_paths_relative(tmp_path):
    """Result JSONs name the project's own files relative to its root, never one machine's directories."""
    import hyspec_jax
    from hyspec_jax.bench.report import portable_path
    root = Path(hyspec_jax.__file__).resolve().parent.parent
    assert portable_path(root / "checkpoints" / "default") == str(Path("checkpoints") / "default")
    outside = str(tmp_path / "prompts.npz")                    # a file outside the project keeps its path
    assert portable_path(outside) == outside
    assert portable_path(None) is None
    from hyspec_jax.bench.report import portable_command
    cmd = portable_command("hyspec bench e2e", ["--json", str(tmp_path / "r" / "e2e.json"), f"--model={root / 'checkpoints'}",
                                                "--repeats", "3", "rel/x.json"])
    assert cmd == "hyspec bench e2e --json e2e.json --model=checkpoints --repeats 3 rel/x.json"


def test_round_profile_runs_and_reduces_traces(dirs):
    """`hyspec bench round-profile` on the tiny models (CPU: no GPU planes, wall times only), and its trace
    reduction on hand-made GPU events: overlapping streams count once, figures are per round."""
    from hyspec_jax.bench import round_profile as RP
    out = dirs / "res" / "rp.json"
    rc = RP.main(["--json", str(out), "--model", str(dirs / "target"), "--drafter", str(dirs / "drafter"),
                  "--prompts", str(dirs / "prompts.npz"), "--modes", "ar", "tree-ready", "--max-tokens", "6",
                  "--tree-depth", "3", "--tree-topk", "2", "--tree-beam", "2", "--verify-nodes", "5",
                  "--batch", "2", "--hlo", str(dirs / "res" / "hlo")])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert set(rep["modes"]) == {"ar", "tree-ready"} and rep["batch"] == 2
    for row in rep["modes"].values():
        assert row["rounds"] >= 1 and row["wall_us_per_round"] > 0 and row["tokens"] == 2 * 6
    hlo = (dirs / "res" / "hlo" / "round_tree-ready.hlo.txt").read_text()
    assert "ENTRY" in hlo and "tree_build" in hlo and not (dirs / "res" / "hlo" / "round_ar.hlo.txt").exists()
    assert rep["modes"]["ar"]["tau"] == 1.0 and rep["modes"]["tree-ready"]["tau"] >= 1.0
    kern = rep["modes"]["tree-ready"]["compiled_kernels"]
    assert kern["round"]["verify"] > 0 and kern["round"]["draft/tree_build"] > 0 and kern["ar_step"] > 0
    assert "compiled_kernels" not in rep["modes"]["ar"]
    md = out.with_suffix(".md").read_text()
    assert "| tree-ready |" in md and "draft/tree_build" in md and "batch 2" in md
    with pytest.raises(ValueError, match="runs past"):
        RP.main(["--json", str(out), "--model", str(dirs / "target"), "--drafter", str(dirs / "drafter"),
                 "--prompts", str(dirs / "prompts.npz"), "--batch", "1000"])
    # kernels a (0-10 ns, 20-30) and b (5-15, on another stream): busy 25 ns over 2 rounds
    ev = [(0, 10, "a"), (5, 10, "b"), (20, 10, "a")]
    assert busy_time_ns(ev) == 25
    s = RP.summarize_events(ev, rounds=2, top=1)
    assert s["gpu_ops_per_round"] == 1.5 and s["gpu_busy_us_per_round"] == 25 / 1e3 / 2
    assert s["top_kernels"] == [{"name": "a", "per_round": 1.0, "us_per_round": 20 / 1e3 / 2}]
