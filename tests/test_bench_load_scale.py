"""bench/load_scale.py at a tiny size on CPU: it writes a sharded checkpoint shard by shard, loads it (one device
or a mesh of fake CPU devices), checks it, reports, cleans up; bad options end in one line and exit status 2."""

from __future__ import annotations

import json
import math

import pytest

from hyspec_jax.bench import load_scale as ls
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.io.hf import flat_params, load_pretrained
from hyspec_jax.models.target import abstract_model


def test_tiny_run_writes_loads_checks_and_cleans_up(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out" / "load.json"
    assert ls.main(["--tiny", "--shard-size", "100KB", "--dir", str(ckpt), "--json", str(out), "--no-progress"]) == 0
    assert not ckpt.exists()                                  # deleted without --keep
    report = json.loads(out.read_text())
    assert report["checkpoint"]["files"] >= 3 and report["checkpoint"]["largest_file_bytes"] <= 100_000 + 4096
    assert [r["kind"] for r in report["loads"]] == ["cold", "warm"]
    cold = report["loads"][0]
    assert cold["verified_tensors"] == report["checkpoint"]["files"]
    assert cold["tensor_bytes"] == report["write"]["tensor_bytes"] == 2 * report["model"]["param_count"]
    assert 0 < cold["loader_peak_host_bytes"] <= cold["largest_file_tensor_bytes"] < cold["tensor_bytes"] / 2
    assert all(r["seconds"] > 0 and r["gbps"] > 0 for r in report["loads"])
    md = out.with_suffix(".md").read_text()
    assert "| cold |" in md and "--dir ckpt" in md and str(tmp_path) not in md
    assert "| warm |" in capsys.readouterr().out


def test_moe_config_kept_then_reused_on_a_mesh(tmp_path):
    """Per-expert tensors on disk (the writer splits fused experts as save_pretrained does); --keep, then --reuse
    loads it over a (1, 2) mesh; the kept checkpoint is what load_pretrained reads."""
    cfg = TargetConfig(model_type="qwen3_next", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                       layer_types=(LINEAR, FULL), linear_num_key_heads=2, linear_num_value_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    ckpt = tmp_path / "ckpt"
    layout = ls.disk_layout(cfg)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in layout
    assert ls.main(["--config", str(tmp_path / "config.json"), "--shard-size", "20KB", "--dir", str(ckpt), "--keep",
                    "--no-warm", "--no-progress"]) == 0
    loaded_cfg, model = load_pretrained(ckpt)
    assert loaded_cfg == cfg
    assert sum(math.prod(s) for s in layout.values()) == sum(
        math.prod(v.shape) for v in flat_params(model).values())
    out = tmp_path / "reuse.json"
    assert ls.main(["--reuse", "--dir", str(ckpt), "--mesh", "2", "--no-warm", "--no-progress",
                    "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["write"] is None and report["settings"]["mesh"] == 2 and ckpt.is_dir()
    assert report["loads"][0]["verified_tensors"] == report["checkpoint"]["files"] >= 3


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--dir", "{nonempty}"], "not empty"),
    (["--reuse", "--dir", "{empty}"], "no config.json"),
    (["--tiny", "--dir", "{new}", "--mesh", "64"], "needs 64 devices"),
])
def test_errors_are_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "empty").mkdir()
    paths = {"nonempty": tmp_path / "full", "empty": tmp_path / "empty", "new": tmp_path / "new"}
    assert ls.main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "new").exists()                    # nothing written before the options were checked


def test_sizes_and_the_9b_geometry():
    assert ls.parse_size("5GB") == 5_000_000_000 and ls.parse_size("4GiB") == 4 << 30
    assert ls.parse_size("200KB") == 200_000 and ls.parse_size("1000") == 1000
    with pytest.raises(Exception, match="size"):
        ls.parse_size("5XB")
    from hyspec_jax.spec.memory import qwen35_9b
    cfg = qwen35_9b()
    n = sum(math.prod(v.shape) for v in flat_params(abstract_model(cfg)).values())
    assert 8.5e9 < n < 9.5e9, n                               # a 9B model
    assert cfg.layer_types.count(FULL) == 8 and cfg.conv_dim == 8192
