"""`hyspec bench kernels --merge`: result files combine (later runs win per variant) and render to md + png."""

import json

from hyspec_jax.bench import kernels as K


def _result(B, N, variants, commit="c1"):
    return {"device_kind": "TestGPU", "git_commit": commit, "jax_version": "0", "copy_bandwidth_GBps": 4000.0,
            "tree": [{"B": B, "N": N, "depth": 8, "paths": 4, "floor_us": 10.0, "variants": variants}],
            "commit": []}


def test_merge_later_files_win_and_render(tmp_path):
    a = _result(8, 64, {"pallas_neumann_bv64": {"median_us": 200.0, "err_o": 3e-4},
                        "serial_pallas_bv64": {"median_us": 1000.0, "err_o": 1e-7},
                        "xla_solve": {"median_us": 400.0, "err_o": 0.0}})
    b = _result(8, 64, {"pallas_neumann_bv64": {"median_us": 100.0, "err_o": 3e-4}}, commit="c2")
    b["tree"].append({"B": 1, "N": 16, "depth": 4, "paths": 2, "floor_us": 1.0,
                      "variants": {"pallas_squaring_bv32": {"median_us": 30.0, "err_o": 2e-4},
                                   "pallas_squaring_bv64": {"median_us": 25.0, "err_o": 0.5}}})   # wrong: not best
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert K.main(["--merge", str(pa), str(pb), "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["git_commit"] == "c2" and m["merged_from"] == [str(pa), str(pb)]
    row = K._tree_row(next(e for e in m["tree"] if (e["B"], e["N"]) == (8, 64)))
    assert row["best"] == "pallas_neumann_bv64" and row["us"] == 100.0
    assert row["x_serial"] == 10.0 and row["x_xla"] == 4.0 and row["pct_floor"] == 10.0
    small = K._tree_row(next(e for e in m["tree"] if (e["B"], e["N"]) == (1, 16)))
    assert small["best"] == "pallas_squaring_bv32"          # the inaccurate faster variant is not picked
    md = (tmp_path / "m.md").read_text()
    assert md.index("| 1 | 16 |") < md.index("| 8 | 64 |") and "neumann_bv64 | 100.0" in md
    assert (tmp_path / "m.png").stat().st_size > 1000
