"""Multi-host serving with the verify width chosen every round (`runtime.width`), on one machine: two processes of one
fake CPU device each (`jax.distributed` over loopback, gloo collectives), the target tensor parallel over both,
a budget table holding the round times of every width. Process 0 runs the request loop over a `BroadcastBackend`
and process 1 follows it (`runtime.multihost`, as `hyspec serve` does; tests/multihost_width_worker.py).

Only process 0 reads the rounds, so only its chooser learns: each round's width must be its choice, sent to the
follower, or the two launch different programs (the follower's chooser, never reading a round, would stay at its
first width). Both processes launch the same widths, and the tokens are one process's plain greedy decode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_engine import model_dirs, models, reference  # noqa: F401  (fixtures)
from tests.test_width import _table

try:
    from tests.multihost_runs import launch
except ImportError:
    from multihost_runs import launch

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)

WORKER = Path(__file__).with_name("multihost_width_worker.py")
# verification costly and the drafter its own (random): after the first (narrowest drafting) rounds plain decoding
# wins, with a probe at width 2 every few plain rounds, so the width changes as the chooser reads the rounds
ROUND_MS = {"1": 1.0, "2": 2.5, "4": 5.0, "8": 9.0}
TIMEOUT = 300      # diverging widths launch different SPMD programs: the collectives may wait forever


def test_two_processes_launch_process_0s_widths_and_give_its_tokens(model_dirs, models, reference, tmp_path):
    from hyspec_jax.runtime.engine import Engine
    from tests.test_engine import KV, SLOTS, _spec

    target, drafter = models
    prompts, params, want = reference
    table = tmp_path / "table.json"
    _table(Engine(target, drafter, _spec("tree"), slots=SLOTS, kv_len=KV), ROUND_MS).save(table)
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps({"prompts": prompts, "max_tokens": [p.max_tokens for p in params],
                                    "stop_token_ids": [list(p.stop_token_ids) for p in params]}))
    args = [str(model_dirs / "target"), str(model_dirs / "drafter"), str(table), str(requests), str(tmp_path)]
    launch(args, processes=2, devices=1, program=[sys.executable, str(WORKER)],
           env={"HYSPEC_PROGRAM_CACHE": "0", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}).wait(TIMEOUT)
    lead, follower = (json.loads((tmp_path / f"{i}.json").read_text()) for i in (0, 1))
    assert lead["tokens"] == want
    assert 1 in lead["widths"] and 2 in lead["widths"], lead["widths"]     # the chooser switched widths
    assert follower["widths"] == lead["widths"]
