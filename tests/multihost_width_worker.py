"""One process of tests/test_multihost_width.py: the server's multi-host request loop (`runtime.multihost`) over a
width-choosing backend (`runtime.width.WidthBackend`, its round times from a budget table), without HTTP.

Usage: python multihost_width_worker.py TARGET DRAFTER TABLE REQUESTS OUT_DIR
(under `launch.init_distributed`'s HYSPEC_* environment; one fake CPU device per process). The target's weights
are sharded over every process's devices (tensor parallel), so every round is one SPMD program over the processes.
Process 0 runs the requests of REQUESTS (JSON: prompts, max_tokens, stop_token_ids) through the `Scheduler` over
a `BroadcastBackend`, the others `follow` it; each writes OUT_DIR/<process>.json: the widths it launched, in order,
and on process 0 the generated tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SLOTS, KV = 4, 128        # tests/test_engine.py's bucket: the budget table's entry is for it
PROBE_EVERY = 4           # plain rounds in a row before a probe: the width changes within a few requests


def main(target_dir: str, drafter_dir: str, table_path: str, requests_path: str, out_dir: str) -> None:
    from hyspec_jax.launch import init_distributed
    init_distributed(None, None, None)      # from the environment, before JAX starts
    import jax

    from hyspec_jax.io.drafter_io import load_drafter
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.launch import shard_target
    from hyspec_jax.runtime.multihost import BroadcastBackend, Channel, follow
    from hyspec_jax.runtime.scheduler import run_batch
    from hyspec_jax.sampling import SamplingParams
    from hyspec_jax.spec.budget import BudgetTable
    from hyspec_jax.runtime.engine import Engine, SpecConfig
    from hyspec_jax.runtime.width import WidthBackend
    from hyspec_jax.tree import TreeExpansion

    _, target = load_pretrained(target_dir)
    shard_target(target, jax.device_count())
    drafter = load_drafter(drafter_dir, with_reader=False)
    spec = SpecConfig(mode="tree", tree=TreeExpansion(depth=4, top_k=2, beam=4), verify_nodes=8)
    engine = Engine(target, drafter, spec, slots=SLOTS, kv_len=KV, budget_table=BudgetTable.load(table_path),
                    model_name="m")
    backend = engine.backend(SLOTS, KV)
    assert isinstance(backend, WidthBackend) and backend.chooser is not None, "the table holds no round times"
    backend.chooser.probe_every = PROBE_EVERY
    out: dict = {}
    channel = Channel()
    if jax.process_index() == 0:
        req = json.loads(Path(requests_path).read_text())
        params = [SamplingParams(max_tokens=m, stop_token_ids=tuple(s))
                  for m, s in zip(req["max_tokens"], req["stop_token_ids"])]
        try:
            _, out["tokens"], _ = run_batch(BroadcastBackend(backend, channel), req["prompts"], params)
        finally:
            channel.close()
    else:
        follow(backend, channel)
    out["widths"] = list(backend.history)
    (Path(out_dir) / f"{jax.process_index()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
