"""τ and tokens/s of the engine's modes against plain decoding (the numbers in bench/results/archive/engine_h200.json).

    python -m hyspec_jax.bench.spec_modes OUT.json [--model DIR] [--drafter DIR] [--batch 8] [--max-tokens 64]
                                                  [--dtype bfloat16|float32]

Without --drafter a RANDOM 2-layer DSpark drafter is used (τ ≈ 1: a lower bound); every mode also runs with
'+oracle' hints (the drafter's logits pushed toward the AR continuation: the machinery's upper bound). Each
configuration runs twice: `first_s` includes compiles, `warm_s` / `tok_s` are the second run. `equal_ar` says
whether the greedy output equals plain decoding token for token (exact in fp32; bf16 verify and decode round
differently, so greedy paths can part at near-ties).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spec_modes", description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--model", default="checkpoints/default")
    p.add_argument("--drafter")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from hyspec_jax.config import DrafterConfig
    from hyspec_jax.generate import Generator
    from hyspec_jax.io.drafter_io import load_drafter
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.models import drafter as D
    from hyspec_jax.sampling import SamplingParams
    from hyspec_jax.spec.engine import SpecConfig, SpecEngine
    from hyspec_jax.tree import TreeExpansion

    dt = jnp.float32 if a.dtype == "float32" else jnp.bfloat16
    if dt == jnp.float32:
        jax.config.update("jax_default_matmul_precision", "highest")
    cfg, target = load_pretrained(a.model, dtype=dt)
    if a.drafter:
        drafter = load_drafter(a.drafter, dtype=dt)
    else:
        drafter = D.create_drafter(DrafterConfig.from_target(cfg, num_layers=2, markov_rank=64, block_size=7),
                                   seed=1, dtype=dt)
    gamma = drafter.config.num_draft_tokens
    rng = np.random.default_rng(0)
    B, T = a.batch, a.max_tokens
    prompts = [list(map(int, rng.integers(10, cfg.vocab_size, a.prompt_len))) for _ in range(B)]
    params = [SamplingParams(max_tokens=T) for _ in range(B)]
    out: dict = {}

    def twice(fn):
        t = time.time()
        fn()
        first = time.time() - t
        t = time.time()
        res = fn()
        return res, first, time.time() - t

    gen = Generator.from_model(target)
    res, first, warm = twice(lambda: gen.generate(prompts, params))
    ref = [r.token_ids for r in res]
    out["ar"] = dict(first_s=round(first, 2), warm_s=round(warm, 3), tok_s=round(B * T / warm, 1))
    print("ar", out["ar"], flush=True)
    modes = [("chain", {}), ("tree", dict(tree=TreeExpansion(min(4, gamma), 2, 4), verify_nodes=16))]
    if drafter.reader is not None:
        modes += [("ready", {}), ("tree-ready", dict(tree=TreeExpansion(min(4, gamma), 2, 4), verify_nodes=16))]
    for mode, kw in modes:
        eng = SpecEngine(target, drafter, SpecConfig(mode=mode, **kw), slots=B)
        for hint in (None, lambda i, o: ref[i][len(o):len(o) + gamma]):
            res, first, warm = twice(lambda: eng.generate(prompts, params, hint=hint))
            st = eng.last_stats
            key = mode + ("+oracle" if hint else "")
            out[key] = dict(first_s=round(first, 2), warm_s=round(warm, 3), tok_s=round(B * T / warm, 1),
                            tau=round(st.tau, 3), rounds=st.rounds, verify_nodes=st.verify_nodes,
                            apos=[round(x, 3) for x in st.accepted_per_position],
                            equal_ar=[r.token_ids for r in res] == ref)
            print(key, out[key], flush=True)
    out["config"] = dict(device=jax.devices()[0].device_kind, model=a.model, drafter=a.drafter or "random",
                         batch=B, max_tokens=T, dtype=a.dtype)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
