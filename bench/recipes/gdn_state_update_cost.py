"""How a decoding step writes a large GDN state: step time and XLA temp memory of `TargetModel.extend` (one token,
state donated) with the embedded model's layers but a 27B-like recurrent state (48 value heads, dk = dv = 128,
random weights), unrolled and scanned (`scan_layers`). A step that copies the stacked state shows as a temp
allocation the size of the state and a slower step.

    python3 bench/recipes/gdn_state_update_cost.py [--batch 8] [--calls 15] [--json OUT.json]
    PYTHONPATH=OTHER_CHECKOUT python3 bench/recipes/gdn_state_update_cost.py ...    (another checkout's code)

Run it from a checkout's root (the model's config is read from checkpoints/default, or --config).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--calls", type=int, default=15, help="timed steps (median reported), after 3 untimed")
    p.add_argument("--config", default="checkpoints/default", help="model directory whose config.json to widen")
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    if a.batch < 1 or a.calls < 1:
        print("error: --batch and --calls must be >= 1", file=sys.stderr)
        return 2
    if not (Path(a.config) / "config.json").is_file():
        print(f"error: no config.json in {a.config}", file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import hyspec_jax
    from hyspec_jax.config import TargetConfig
    from hyspec_jax.models.target import create_model, extend
    from hyspec_jax.state import init_state

    cfg = dataclasses.replace(TargetConfig.from_pretrained(a.config), linear_num_value_heads=48,
                              linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
    rows = []
    for scan in (False, True):
        try:
            graphdef, params = nnx.split(create_model(cfg, scan=scan) if scan else create_model(cfg))
        except TypeError:       # a checkout from before scanned layers
            continue
        state = init_state(cfg, a.batch, 128)
        step = jax.jit(extend, static_argnums=(0,), donate_argnums=(2,))
        tok, valid = jnp.zeros((a.batch, 1), jnp.int32), jnp.ones((a.batch, 1), bool)
        temp = step.lower(graphdef, params, state, tok, valid).compile().memory_analysis().temp_size_in_bytes
        times = []
        for i in range(3 + a.calls):
            t0 = time.perf_counter()
            logits, state = step(graphdef, params, state, tok, valid)
            logits.block_until_ready()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        rows.append({"scanned": scan, "batch": a.batch, "state_mib": round(state.ssm.nbytes / 2**20, 1),
                     "step_ms": round(statistics.median(times) * 1e3, 2), "temp_mib": round(temp / 2**20, 1)})
    out = {"checkout": str(Path(hyspec_jax.__file__).resolve().parent.parent.name),
           "device": jax.devices()[0].device_kind, "rows": rows}
    for r in rows:
        print(f"{out['checkout']}  {'scanned ' if r['scanned'] else 'unrolled'}  B={r['batch']}  "
              f"state {r['state_mib']} MiB  step {r['step_ms']} ms  XLA temp {r['temp_mib']} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
