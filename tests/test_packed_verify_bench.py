"""`hyspec bench packed-verify`: the packed and dense verify of the same forest, end to end at a tiny geometry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hyspec_jax.bench import packed_verify as pv


def test_spread_forest_holds_the_budget_across_the_rows():
    tree = pv.spread_forest(np.random.default_rng(0), 4, 8, 13, 3)
    valid = np.asarray(tree.valid)
    assert valid.sum() == 13 and sorted(valid.sum(1)) == [3, 3, 3, 4]
    assert int(np.asarray(tree.depth).max()) <= 3
    with pytest.raises(ValueError, match="budget"):
        pv.spread_forest(np.random.default_rng(0), 4, 8, 33, 3)


def test_packed_verify_bench_runs_and_agrees(tmp_path, capsys):
    out = tmp_path / "pv.json"
    assert pv.main(["--tiny", "--batch", "4", "--nodes", "8", "--fill", "0.5,1", "--repeats", "2", "--prefix", "8",
                    "--kernels", "reference", "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    rows = {r["capacity"]: r for r in rep["rows"]}
    assert set(rows) == {16, 32}
    assert rows[16]["rows_packed"] == 16 and rows[32]["rows_packed"] == 32 == rows[32]["rows_dense"]
    for r in rep["rows"]:
        assert r["dense_ms"] > 0 and r["packed_ms"] > 0
        assert r["max_abs_logit_diff"] < 1e-4           # the same rows through products of another shape
    assert "| 4 | 8 | 16 | 32 | 16 |" in out.with_suffix(".md").read_text()
    assert "packed / dense" in capsys.readouterr().out


def test_packed_verify_bench_rejects_bad_fractions(capsys):
    with pytest.raises(SystemExit):
        pv.main(["--tiny", "--fill", "1.5"])
    assert "fractions must be in (0, 1]" in capsys.readouterr().err


def test_a_batch_out_of_device_memory_is_reported_and_the_next_runs(tmp_path, monkeypatch):
    """A batch whose programs do not fit the device: its rows say so, the other batches are still measured."""
    import jax
    real = pv._batch_rows

    def batch_rows(rows, cfg, B, *a, **kw):
        if B == 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.38GiB")
        return real(rows, cfg, B, *a, **kw)
    monkeypatch.setattr(pv, "_batch_rows", batch_rows)
    out = tmp_path / "pv.json"
    assert pv.main(["--tiny", "--batch", "2,4", "--nodes", "8", "--fill", "0.5", "--repeats", "1", "--prefix", "8",
                    "--kernels", "reference", "--no-progress", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0] == dict(batch=2, nodes=8, capacity=8, error="out of device memory")
    assert rows[1]["batch"] == 4 and rows[1]["packed_ms"] > 0
    assert "out of device memory" in out.with_suffix(".md").read_text()
