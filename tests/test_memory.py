"""Verification memory accounting: counts equal the bytes of the arrays each design really holds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import gdn, tree as T
from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.spec import memory as M

TINY = TargetConfig(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, intermediate_size=48,
    layer_types=(LINEAR, LINEAR, FULL, LINEAR, FULL), linear_num_key_heads=2, linear_num_value_heads=6,
    linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4)


def _nbytes(*xs) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(xs))


@pytest.fixture(scope="module")
def tiny_verify():
    """What a verify round over a random 7-node tree really holds per GDN layer, for batch 2."""
    cfg, batch, n = TINY, 2, 7
    HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    rng = np.random.default_rng(0)
    tr = T.pack_forest([T.random_parents(rng, n, 3) for _ in range(batch)], T.TreeShape(n, 3))
    f = lambda *s: rng.standard_normal(s).astype(np.float32)

    @jax.jit   # one compile instead of op-by-op dispatch
    def verify(tr, q_raw, k_raw, v, a, b, A_log, dt_bias, S0):
        mask = T.ancestor_mask(tr)
        q, k = gdn.prepare_qk(q_raw, k_raw)
        g, beta = gdn.gates(a, b, A_log, dt_bias)
        _, fac = gdn.masked_solve(S0, q, k, v, g, beta, mask)
        D = gdn.path_decay(mask.astype(jnp.float32)[:, None], fac.log_decay, fac.log_decay)  # [B,HV,N,N]
        return fac, gdn.l2norm(k_raw), D

    fac, k_shared, D = verify(tr, f(batch, n, HK, dk), f(batch, n, HK, dk), f(batch, n, HV, dv),
                              f(batch, n, HV), f(batch, n, HV), f(HV), f(HV), f(batch, HV, dk, dv))
    x_conv = jnp.zeros((batch, n, cfg.conv_dim), jnp.bfloat16)  # raw per-node conv inputs (bf16 activations)
    return cfg, batch, n, fac, k_shared, D, x_conv


def test_factor_bytes_equal_masked_solve_outputs(tiny_verify):
    cfg, batch, n, fac, k_shared, D, x_conv = tiny_verify
    Lg = len(cfg.gdn_layers)
    m = M.verify_memory(cfg, batch, n)          # defaults: this library's layout (keys per key head)
    assert m.log_decay_bytes == Lg * _nbytes(fac.log_decay)
    assert m.key_bytes == Lg * _nbytes(fac.keys)
    assert m.corrected_bytes == Lg * _nbytes(fac.corrected)
    assert m.factor_bytes == Lg * _nbytes(fac)
    assert m.conv_input_bytes == Lg * _nbytes(x_conv)
    assert m.interaction_bytes == 0
    assert m.bole_bytes == Lg * (_nbytes(fac) + _nbytes(x_conv))

    assert m.key_bytes == Lg * _nbytes(k_shared)                # keys before the GVA repeat
    expanded = M.verify_memory(cfg, batch, n, dataclasses.replace(M.OURS, shared_keys=False))
    assert expanded.key_bytes == Lg * _nbytes(k_shared) * cfg.linear_num_value_heads // cfg.linear_num_key_heads
    shared = M.verify_memory(cfg, batch, n, dataclasses.replace(M.OURS, interaction=True))
    assert shared.interaction_bytes == 2 * _nbytes(D)           # G and C: two [B, HV, N, N] fp32, one layer
    assert shared.bole_bytes == (Lg * (_nbytes(fac.log_decay, fac.corrected, k_shared, x_conv))
                                 + 2 * _nbytes(D))
    no_conv = M.verify_memory(cfg, batch, n, M.BOLE_TABLE_I)
    assert no_conv.conv_input_bytes == no_conv.snapshot_conv_bytes == 0


def test_snapshot_bytes_equal_sglang_buffers():
    cfg, batch, n = TINY, 3, 5
    Lg, HV = len(cfg.gdn_layers), cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    # SGLang mem_cache/memory_pool.py scratch, per request: intermediate_ssm and intermediate_conv_window
    ssm = [np.zeros((Lg, n, HV, dv, dk), np.float32) for _ in range(batch)]
    conv = [np.zeros((Lg, n, cfg.conv_dim, K - 1), jnp.bfloat16) for _ in range(batch)]
    m = M.verify_memory(cfg, batch, n)
    assert m.snapshot_ssm_bytes == _nbytes(ssm)
    assert m.snapshot_conv_bytes == _nbytes(conv)
    assert m.sglang_bytes == _nbytes(ssm, conv)
    assert m.ratio == m.sglang_bytes / m.bole_bytes


def test_qwen38_27b_ratio():
    cfg = M.qwen38_27b()
    assert (len(cfg.gdn_layers), len(cfg.attn_layers), cfg.conv_dim) == (48, 16, 10240)
    HK, HV, dk, dv = 16, 48, 128, 128
    # per (request, node, GDN layer): snapshot = HV·dv·dk fp32 (+ bf16 window conv_dim·(K−1)),
    # factors = HV Γ + (HV or HK)·dk keys + HV·dv corrected fp32 (+ bf16 conv inputs conv_dim)
    snap, snap_conv = HV * dv * dk * 4, 10240 * 3 * 2
    fac, fac_shared, fac_conv = HV * (1 + dk + dv) * 4, (HV + HK * dk + HV * dv) * 4, 10240 * 2
    rows = M.memory_table()
    assert [r.nodes for r in rows] == [32, 64, 128]
    for r in rows:
        assert r.snapshot_ssm_bytes == 48 * r.nodes * snap        # the spec's ≈151 MB per draft token
        assert r.ratio == pytest.approx((snap + snap_conv) / (fac_shared + fac_conv))
        assert 59.5 < r.ratio < 60.5
    table_i = M.memory_table(design=M.BOLE_TABLE_I)
    for r in table_i:
        assert r.ratio == pytest.approx(snap / fac_shared)
        assert 95 < r.ratio < 96
    # materialised N×N matrices are one layer's worth: the ratio falls slowly with N
    expanded = M.memory_table(design=dataclasses.replace(M.OURS, shared_keys=False))
    assert all(r.ratio == pytest.approx((snap + snap_conv) / (fac + fac_conv)) for r in expanded)
    gc = M.memory_table(design=dataclasses.replace(M.OURS, interaction=True))
    assert gc[0].ratio > gc[1].ratio > gc[2].ratio
    assert gc[2].interaction_bytes == 2 * HV * 128 * 128 * 4
    text = M.format_table(rows)
    assert "| 128 | 1 |" in text and "60.0x" in text
    with pytest.raises(ValueError):
        M.verify_memory(cfg, 0, 32)


def test_bench_memory_rows_are_the_27b_counts(tmp_path, capsys):
    """`hyspec bench memory` (bench/memory.py) at the default Qwen3.8-27B geometry: one row per N for each of its
    three designs, the bytes equal to the per-(request, node, GDN layer) counts written out by hand from the
    geometry (48 GDN layers, 16 key / 48 value heads of 128, conv_dim 10240, kernel 4)."""
    import json
    from hyspec_jax import cli
    out = tmp_path / "mem.json"
    assert cli.main(["bench", "memory", "--batch", "2", "--nodes", "8,16", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["model"] == "Qwen3.8-27B geometry" and rep["batch"] == 2
    Lg, HK, HV, dk, dv, conv = 48, 16, 48, 128, 128, 10240
    designs = rep["designs"]
    assert list(designs) == ["this library", "keys per value head (an expanded copy)",
                             "Bole Table I accounting (no conv windows)"]
    for label, rows in designs.items():
        assert [r["nodes"] for r in rows] == [8, 16] and all(r["batch"] == 2 for r in rows)
        for r in rows:
            cells = Lg * 2 * r["nodes"]                          # (GDN layer, request, node) triples
            keys = (HV if label.startswith("keys per value head") else HK) * dk
            with_conv = not label.startswith("Bole")
            assert r["snapshot_ssm_bytes"] == cells * HV * dv * dk * 4
            assert r["snapshot_conv_bytes"] == (cells * conv * 3 * 2 if with_conv else 0)
            assert (r["log_decay_bytes"], r["key_bytes"], r["corrected_bytes"]) == (
                cells * HV * 4, cells * keys * 4, cells * HV * dv * 4)
            assert r["conv_input_bytes"] == (cells * conv * 2 if with_conv else 0)
            assert r["interaction_bytes"] == 0
            bole = cells * ((HV + keys + HV * dv) * 4 + (conv * 2 if with_conv else 0))
            sglang = cells * (HV * dv * dk * 4 + (conv * 3 * 2 if with_conv else 0))
            assert r["ratio"] == pytest.approx(sglang / bole)
    assert 59.5 < designs["this library"][0]["ratio"] < 60.5
    printed = capsys.readouterr().out
    assert printed.count("| N | batch | factors MiB |") == 3 and "| 16 | 2 |" in printed
