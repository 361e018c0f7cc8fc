"""`hyspec bench serve-compare`: ratios taken within a pass, their median and range, the widths chosen."""

from __future__ import annotations

import json

import pytest

from hyspec_jax.bench import serve_compare


def _load(path, mode: str, dataset: str, tok_s: dict[int, float], widths: dict[str, int] | None = None,
          failed: int = 0) -> None:
    """A serve_load JSON: one result per concurrency level with the given output tok/s."""
    results = []
    for conc, t in tok_s.items():
        server = {"spec_tokens_per_round": 3.0, "spec_rounds_by_width": widths} if widths else {}
        server.update(engine_decode_steps=100, engine_steps_ahead=80 if widths else 90, engine_prefill_seconds=0.1,
                      engine_prefill_calls=40.0 if widths else 25.0)
        results.append({"concurrency": conc, "requests": 64, "ok": 64 - failed, "throughput_tok_s": t, "wall_s": 1.0,
                        "tpot_s": {"p50": 1e-3}, "server": server, "mode": mode})
    path.write_text(json.dumps({"meta": {"args": {"dataset": dataset}, "device_kind": "H100", "commit": "abc1234"},
                                "results": results}))


def test_ratios_pair_a_mode_with_the_baseline_of_its_own_pass(tmp_path, capsys):
    # pass 1: a slow baseline; pass 2 and 3: a fast one. Medians of tok/s would mix passes; the ratio must not.
    for p, (ar, spec) in {1: (100.0, 200.0), 2: (400.0, 440.0), 3: (500.0, 600.0)}.items():
        _load(tmp_path / f"serve_load_ar_random_{p}.json", "ar", "random", {8: ar})
        _load(tmp_path / f"serve_load_tree-ready_random_{p}.json", "tree-ready", "random", {8: spec},
              widths={"16": 10, "32": p})
    files = sorted(tmp_path.glob("*.json"))
    rep = serve_compare.collect(files, "ar")
    row = rep["rows"][0]
    s = row["tree-ready"]
    assert s["ratio_by_pass"] == {"1": 2.0, "2": 1.1, "3": 1.2}
    assert (s["ratio_median"], s["ratio_min"], s["ratio_max"]) == (1.2, 1.1, 2.0)
    assert s["tok_s_median"] == 440.0 and row["ar"]["tok_s_median"] == 400.0
    assert s["rounds_by_width"] == {"16": 30, "32": 6}
    assert rep["passes"] == ["1", "2", "3"]
    assert serve_compare.main([str(f) for f in files] + ["--json", str(tmp_path / "out" / "cmp.json")]) == 0
    md = (tmp_path / "out" / "cmp.md").read_text()
    assert "| random | 8 | 400 | 440 | **1.20x** | 1.10–2.00x |" in md
    assert "| 90% / 80% | 10% (25) / 10% (40) |" in md and s["ahead_fraction_median"] == 0.8
    assert "16: 30, 32: 6" in md and "Failed requests over all passes: 0." in md
    capsys.readouterr()


def test_a_pass_without_its_baseline_gives_no_ratio(tmp_path):
    _load(tmp_path / "serve_load_ar_heldout_1.json", "ar", "heldout", {1: 100.0})
    _load(tmp_path / "serve_load_tree-ready_heldout_1.json", "tree-ready", "heldout", {1: 150.0})
    _load(tmp_path / "serve_load_tree-ready_heldout_2.json", "tree-ready", "heldout", {1: 900.0})
    s = serve_compare.collect(sorted(tmp_path.glob("*.json")), "ar")["rows"][0]["tree-ready"]
    assert s["ratio_by_pass"] == {"1": 1.5} and s["passes"] == 2


def test_passes_from_folders(tmp_path):
    for p in ("a", "b"):
        (tmp_path / p).mkdir()
        _load(tmp_path / p / "ar.json", "ar", "random", {4: 100.0})
        _load(tmp_path / p / "spec.json", "tree", "random", {4: 130.0 if p == "a" else 110.0})
    rep = serve_compare.collect(sorted(tmp_path.glob("*/*.json")), "ar", pass_from_dir=True)
    assert rep["rows"][0]["tree"]["ratio_by_pass"] == {"a": 1.3, "b": 1.1}


def test_modes_from_file_names_compare_two_servers_of_one_spec_mode(tmp_path, capsys):
    # an A/B of the request loop: both servers report mode tree-ready; the file names tell them apart
    for p, (new, before) in {1: (130.0, 100.0), 2: (120.0, 110.0)}.items():
        _load(tmp_path / f"serve_load_new_heldout_{p}.json", "tree-ready", "heldout", {16: new})
        _load(tmp_path / f"serve_load_before_heldout_{p}.json", "tree-ready", "heldout", {16: before})
    files = sorted(tmp_path.glob("*.json"))
    with pytest.raises(serve_compare.CompareError, match="given twice"):
        serve_compare.collect(files, "before")
    rep = serve_compare.collect(files, "before", mode_from_name=True)
    assert rep["modes"] == ["new"] and rep["rows"][0]["new"]["ratio_by_pass"] == {"1": 1.3, "2": 1.091}
    _load(tmp_path / "odd.json", "ar", "heldout", {16: 1.0})
    assert serve_compare.main([str(tmp_path / "odd.json"), "--mode-from-name", "--pass-from-dir"]) == 1
    assert "not named serve_load_MODE_DATA_N" in capsys.readouterr().err


@pytest.mark.parametrize("case, message", [
    ("no_baseline", "no results of the baseline mode 'ar'"),
    ("no_pass", "no trailing _N"),
    ("twice", "given twice"),
    ("not_json", "not a readable serve_load JSON"),
])
def test_bad_inputs_exit_with_one_line(tmp_path, capsys, case, message):
    if case == "no_baseline":
        _load(tmp_path / "serve_load_tree_random_1.json", "tree", "random", {1: 1.0})
    elif case == "no_pass":
        _load(tmp_path / "ar.json", "ar", "random", {1: 1.0})
    elif case == "twice":
        _load(tmp_path / "serve_load_ar_random_1.json", "ar", "random", {1: 1.0})
        (tmp_path / "copy").mkdir()
        _load(tmp_path / "copy" / "serve_load_ar_random_1.json", "ar", "random", {1: 1.0})
    else:
        (tmp_path / "serve_load_ar_random_1.json").write_text("{not json")
    files = [str(f) for f in sorted(tmp_path.rglob("*.json"))]
    assert serve_compare.main(files) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hyspec bench serve-compare: ") and message in err[0]
