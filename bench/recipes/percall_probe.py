"""Per-call and per-step cost of the library generate (ar, batch 1) in the tree on PYTHONPATH: median ms per call
at max_tokens 1 / 64 (MODES=tree-ready adds the wide tree), and a cProfile of 5 ar calls of 64 tokens."""
import cProfile, io, json, os, pstats, sys, time
import numpy as np, jax, jax.numpy as jnp
from hyspec_jax.embedded import default_model_dir, default_drafter_dir
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.io.drafter_io import load_drafter
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.spec.engine import SpecConfig, SpecEngine
try:
    from hyspec_jax.tree import TreeExpansion as TreeSpec
except ImportError:     # a checkout from before TreeExpansion (the probe compares two trees)
    from hyspec_jax.spec.select import TreeSpec
d = np.load("bench/data/heldout_prompts.npz")
prompt = list(map(int, d["tokens"][0]))
_, target = load_pretrained(default_model_dir(), dtype=jnp.float32)
out = {}
for mode in ["ar"] + os.environ.get("MODES", "").split():
    drafter = None if mode == "ar" else load_drafter(default_drafter_dir(), dtype=jnp.float32, with_reader=True)
    kw = {} if mode == "ar" else dict(tree=TreeSpec(depth=7, top_k=8, beam=16), verify_nodes=32)
    eng = SpecEngine(target, drafter, SpecConfig(mode=mode, **kw), slots=1)
    for m in (1, 64):
        p = SamplingParams(max_tokens=m)
        eng.generate([prompt], p); eng.generate([prompt], p)
        ts = []
        for _ in range(10):
            t0 = time.perf_counter(); eng.generate([prompt], p); ts.append(time.perf_counter() - t0)
        out[f"{mode}/{m}"] = round(1e3 * float(np.median(ts)), 3)
    if mode == "ar":
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5): eng.generate([prompt], SamplingParams(max_tokens=64))
        pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
        print(s.getvalue()[:2500], file=sys.stderr)
print(json.dumps(out))
