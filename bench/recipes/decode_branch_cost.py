"""What the run-time greedy/sampling branch cost a decoding step (commit c562d9e6 removed it from greedy
batches): wall time per step of the embedded model's plain decoding, batch 1, in `Generator.generate`'s pipelined
pattern (step k+1 dispatched before step k's token is read), for `sample(..., stochastic=None)` (the `lax.cond`:
on a GPU its predicate is copied to the host and waited for) against the branch-free greedy program.

    python bench/recipes/decode_branch_cost.py OUT.json [--steps 200]

A diagnostic for the model card, not a benchmark command: median of 5 alternated runs of each flavour."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hyspec_jax.embedded import default_model_dir
from hyspec_jax.generate import Generator
from hyspec_jax.runtime.backend import start_host_copy
from hyspec_jax.runtime.programs import ar_prefill_jit, ar_step_jit
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.sampling import SamplingParams, SlotSampling


def per_step_us(gen: Generator, stochastic, steps: int) -> float:
    sampling = SlotSampling.from_params([SamplingParams()], 1)
    active = np.ones(1, bool)
    _, state, nxt = ar_prefill_jit(gen.graphdef, gen.params, gen.new_state(1, 256), np.zeros(1, np.int32),
                                   np.zeros(1, np.int32), np.full((1, 16), 5, np.int32), np.ones((1, 16), bool),
                                   np.ones(1, bool), sampling)
    t0 = time.perf_counter()
    inflight, state = ar_step_jit(gen.graphdef, gen.params, state, nxt, active, sampling, np.ones(1, np.int32),
                                  stochastic=stochastic)
    for k in range(steps):
        nxt = inflight
        inflight, state = ar_step_jit(gen.graphdef, gen.params, state, nxt, active, sampling,
                                      np.full(1, k + 2, np.int32), stochastic=stochastic)
        start_host_copy(inflight)
        np.asarray(nxt)
    jax.block_until_ready(inflight)
    return (time.perf_counter() - t0) / (steps + 1) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    _, model = load_pretrained(str(default_model_dir()), dtype=jnp.float32)
    gen = Generator.from_model(model)
    times: dict[str, list[float]] = {"branch": [], "greedy": []}
    for flavour in (None, False):                      # compile and warm both
        per_step_us(gen, flavour, 10)
    for _ in range(5):
        for name, flavour in (("branch", None), ("greedy", False)):
            times[name].append(per_step_us(gen, flavour, a.steps))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "steps": a.steps,
           **{f"{k}_us_per_step": round(statistics.median(v), 1) for k, v in times.items()},
           "runs_us": {k: [round(x, 1) for x in v] for k, v in times.items()}}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
