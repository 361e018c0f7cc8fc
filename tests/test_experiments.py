"""experiments/: the controls run against the library from outside it. ReaDy's swapped-state control
(`experiments.reader_swap`): lossless, labelled, its drafts differ from the own-state reader's, batch 1 refused; and
nothing the library ships imports the package."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import reader_swap
from hyspec_jax.bench.e2e import load_models, make_engine
from hyspec_jax.spec.round import SlotState, StepInputs, round_draft_jit
from tests.test_bench_e2e import dirs  # noqa: F401  (the tiny target, drafter with a reader and prompts)
from tests.test_engine import TCFG

ROOT = Path(__file__).resolve().parent.parent


def test_swapped_reader_state_is_lossless_and_labelled(dirs, capsys):  # noqa: F811
    out = dirs / "res" / "e2e_swapped.json"
    rc = reader_swap.main(["--json", str(out), "--model", str(dirs / "target"), "--drafter", str(dirs / "drafter"),
                           "--prompts", str(dirs / "prompts.npz"), "--prompts-per-domain", "3", "--batch", "3",
                           "--max-tokens", "6", "--repeats", "1", "--modes", "ar", "ready", "--no-plots"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["meta"]["reader_state"] == "swapped"
    assert rep["meta"]["command"].startswith("python -m experiments.reader_swap --json")
    assert all(e["equal_ar"] is True for e in rep["results"]["ready@b3"]["domains"].values())
    assert "swapped-state control" in out.with_suffix(".md").read_text()
    # the swap reaches the drafter: its first draft block differs from the own-state reader's
    target, drafters = load_models(dirs / "target", dirs / "drafter", jnp.float32, True)
    blocks = []
    for d in (drafters[True], reader_swap.swapped(drafters[True])):
        eng = make_engine(target, {**drafters, True: d}, "ready", 3, kernels="reference", tree=None, verify_nodes=5)
        be = eng.backend(3, 128)
        rng = np.random.default_rng(0)
        samp = be.sampling(np.zeros(3, np.float32), np.ones(3, np.float32), np.zeros(3, np.int32),
                           np.zeros(3, np.uint32))
        be.prefill(np.arange(3, dtype=np.int32), rng.integers(3, TCFG.vocab_size, (3, 16)), np.ones((3, 16), bool),
                   np.ones(3, bool), samp)
        inputs = StepInputs(StepInputs.pack(np.ones(3, bool), np.zeros(3, np.int32), 15), samp)
        draft = round_draft_jit(be.graphdef, be.params, be.dgraph, be.dparams, SlotState(be.state, be.dstate),
                                be.anchor, inputs, shape=be.round_shapes[False])
        blocks.append(np.asarray(draft.tokens))
    assert (blocks[0] != blocks[1]).any()
    with pytest.raises(ValueError, match="ReaDy reader"):
        reader_swap.swapped(drafters[False])
    with pytest.raises(SystemExit):
        reader_swap.main(["--json", str(out), "--batch", "1"])
    assert "every --batch must be >= 2" in capsys.readouterr().err


def test_the_library_never_imports_experiments():
    pattern = re.compile(r"^\s*(from|import)\s+experiments\b", re.M)
    hits = [str(p.relative_to(ROOT)) for d in ("hyspec_jax", "serve", "train", "bench", "pallas_kernels")
            for p in sorted((ROOT / d).rglob("*.py")) if pattern.search(p.read_text())]
    assert not hits, hits
