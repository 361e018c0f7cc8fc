"""`hyspec bench gdn-layer` on a CPU: the Pallas kernels in interpret mode at a small GDN geometry, every variant
checked against the fp32 reference (the GPU run adds the times, the tiling sweep and SGLang's kernels)."""

from __future__ import annotations

import json

import pytest

from hyspec_jax.bench import gdn_layer

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)


def test_gdn_layer_bench_checks_every_variant(tmp_path):
    out = tmp_path / "ts.json"
    assert gdn_layer.main(["--interpret", "--geometry", "small", "--configs", "1:8,2:16", "--decode-batches", "1,3",
                           "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["status"] == "complete"
    rows = {(r["B"], r["N"], r["variant"]): r for r in report["rows"]}
    assert set(rows) == {(B, N, v) for B, N in ((1, 8), (2, 16))
                         for v in ("model", "bf16_tf32", "fp32_tf32x3", "expanded_tf32x3", "fp32_tf32x3_split",
                                   "fp32_ieee", "xla")}
    assert report["model_operands"] == {"dtype": "float32", "precision": "tf32"}
    for (B, N, variant), r in rows.items():
        assert "error" not in r, r
        assert r["depth"] == min(8, N - 1)
        if variant == "bf16_tf32":              # bf16 operands: their rounding, no more
            assert 1e-4 < r["err_o"] < 3e-2, r
        else:                                   # fp32 operands (interpret mode: exact products)
            assert r["err_o"] < 1e-5, r
        assert 1e-4 < r["err_o_rounded_to_dtype"] < 1e-2
    decode = {(r["B"], r["variant"]): r for r in report["decode_rows"]}
    assert set(decode) == {(B, v) for B in (1, 3) for v in ("model", "xla")}
    for (B, variant), r in decode.items():
        assert "error" not in r, r
        assert r["window_equal"] and r["err_o"] < 1e-5 and r["err_state"] < 1e-5, r
        # bf16: the fp32 state read and written, the row (2 key-head groups of 100), the window read and written,
        # the output
        assert r["floor_bytes"] == 2 * B * 4 * 16 * 16 * 4 + B * 200 * 2 + 2 * B * 3 * 128 * 2 + B * 4 * 16 * 2
    md = out.with_suffix(".md").read_text()
    assert "| 2 | 16 | expanded_tf32x3 |" in md and "float32 q/k/v at their key heads with tf32" in md
    assert "## The decoding step" in md and "| 3 | model |" in md


def test_gdn_layer_bench_refuses_bad_arguments():
    with pytest.raises(ValueError, match="pairs"):
        gdn_layer.parse_configs("8x32")
    with pytest.raises(ValueError, match="positive integers"):
        gdn_layer.parse_batches("1,-8")
