"""`hyspec bench oneshot`: one fresh `hyspec generate` process per prompt and mode, every call's times and tokens
recorded, pooled rates and the table; a bad option exits 2 with one line."""

from __future__ import annotations

import json

import pytest

from hyspec_jax.bench import oneshot
from hyspec_jax.embedded import default_model_dir


@pytest.mark.skipif(default_model_dir() is None, reason="no embedded model")
def test_oneshot_runs_fresh_processes_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "oneshot.json"
    assert oneshot.main(["--prompts-per-domain", "1", "--repeats", "1", "--modes", "ar", "--max-tokens", "3",
                         "--no-progress", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    (c,) = r["checkouts"]
    s = c["modes"]["ar"]
    assert s["trials"] == r["prompts"] == 6 and s["ran_mode"] == ["ar"]
    assert all(0 < t["tokens"] <= 3 and 0 < t["prefill_s"] <= t["call_s"] < t["process_s"] for t in s["runs"])
    assert s["tokens"] == sum(t["tokens"] for t in s["runs"])
    assert c["max_tokens"] == 3 and r["break_even"] == {}
    assert "| this checkout | 3 | ar | ar |" in out.with_suffix(".md").read_text()


def test_break_even_is_the_smallest_size_faster_on_both_times():
    def cell(n, call, process):
        return {"label": "this checkout", "max_tokens": n,
                "modes": {"ar": {"call_tok_s": 10.0, "process_tok_s": 5.0},
                          "default": {"call_tok_s": call, "process_tok_s": process}}}
    r = {"modes": ["ar", "default"], "checkouts": [cell(64, 9.0, 4.0), cell(128, 11.0, 4.9), cell(256, 10.0, 5.0),
                                                     cell(512, 9.0, 6.0)]}
    assert oneshot.break_even(r) == {"this checkout: default": 256}
    r["checkouts"] = r["checkouts"][:2]
    assert oneshot.break_even(r) == {"this checkout: default": None}


def test_bad_options_exit_2(capsys):
    assert oneshot.main(["--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert oneshot.main(["--base", "/nonexistent-checkout"]) == 2
