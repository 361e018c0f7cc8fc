"""`hyspec bench ready-control`: the positive-control run's table from its e2e / training files."""

from __future__ import annotations

import json
import math

import pytest

from hyspec_jax.bench import ready_control

DOMAINS = ("code", "docs", "drama")


def _e2e(path, rows: dict, command: str) -> None:
    """A `bench e2e` JSON: rows {"mode@bB": {domain: tau}} (tau None: plain decoding)."""
    results = {}
    for key, taus in rows.items():
        mode, b = key.split("@b")
        doms = {d: {"tok_s": 1.0, "equal_ar": True, **({} if t is None else {"tau": t})} for d, t in taus.items()}
        results[key] = {"mode": mode, "batch": int(b), "domains": doms}
    path.write_text(json.dumps({"meta": {"command": command, "device_kind": "cpu", "commit": "abc"},
                                "results": results}))


def test_the_report_pairs_the_engine_runs_by_domain(tmp_path, capsys):
    ar = dict.fromkeys(DOMAINS)
    _e2e(tmp_path / "tau_own.json", {"ar@b1": ar, "chain@b1": dict(zip(DOMAINS, (2.0, 3.0, 4.0))),
                                     "ready@b1": dict(zip(DOMAINS, (2.2, 3.1, 4.3))), "ar@b4": ar,
                                     "chain@b4": dict(zip(DOMAINS, (2.0, 3.0, 4.0))),
                                     "ready@b4": dict(zip(DOMAINS, (2.2, 3.1, 4.3)))}, "e2e own")
    _e2e(tmp_path / "tau_swapped.json", {"ar@b4": ar, "ready@b4": dict(zip(DOMAINS, (2.0, 3.1, 4.0)))}, "e2e swap")
    _e2e(tmp_path / "tau_nostate.json", {"ar@b1": ar, "chain@b1": dict(zip(DOMAINS, (2.0, 3.0, 4.1)))}, "e2e no")
    (tmp_path / "reader" / "ready2").mkdir(parents=True)
    (tmp_path / "reader" / "reader_ablation.json").write_text(json.dumps(
        {"dspark_tau_hat": 1.5, "ready1": {"ready1_0": {"args": "--source-layers 6", "tau_hat": 1.6}}}))
    (tmp_path / "reader" / "ready2" / "summary.json").write_text(json.dumps(
        {"val": {"code": {"tau": 1.6}, "docs": {"tau": 1.8}}}))
    assert ready_control.main(["--run", str(tmp_path), "--json", str(tmp_path / "rep.json")]) == 0
    rep = json.loads((tmp_path / "rep.json").read_text())
    c = rep["comparisons"]
    gain = c["reader_gain"]                                   # differences 0.2, 0.1, 0.3
    assert gain["mean"] == pytest.approx(0.2) and gain["domains"] == 3
    assert gain["se"] == pytest.approx(math.sqrt(0.01 / 3), abs=1e-4)
    assert c["state_free_gain"]["mean"] == pytest.approx(0.1 / 3, abs=1e-4)
    assert c["state_use"]["by_domain"] == {"code": 0.2, "docs": 0.0, "drama": 0.3}
    assert "shipped_reader_gain" not in c                    # no tau_shipped.json: left out, not invented
    assert rep["rows"]["ready_swapped"]["batch"] == 4 and all(r["equal_ar"] for r in rep["rows"].values())
    assert rep["teacher_forced_tau_hat"] == {"dspark": 1.5, "ready1_0 (--source-layers 6)": 1.6, "ready2": 1.7}
    md = (tmp_path / "rep.md").read_text()
    assert "| reader gain | ReaDy, own state − DSpark, chain | +0.200 ± 0.058 | 3 |" in md
    assert "    e2e swap" in md


def test_a_run_without_its_engine_runs_fails_in_one_line(tmp_path, capsys):
    assert ready_control.main(["--run", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tau_own.json" in err[0]
