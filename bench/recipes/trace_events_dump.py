"""Diagnostic: what a GPU profiler trace holds, to connect its kernel events to HLO instructions
(bench/profile_scale.py). Traces a small jitted MLP-like program three times and writes, per plane and line, the
first events' names and stats, plus the program's HLO instruction names, as JSON.

    PYTHONPATH=$PWD python3 bench/recipes/trace_events_dump.py $OUT/trace_events.json
"""
import json
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp


def main(out: str) -> None:
    @jax.jit
    def f(x, w1, w2):
        with jax.named_scope("dense"):
            h = jnp.dot(x, w1)
        with jax.named_scope("norm_act"):
            h = jax.nn.silu(h) * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        with jax.named_scope("dense"):
            return jnp.dot(h, w2)

    k = jax.random.key(0)
    x = jax.random.normal(k, (8, 4096), jnp.bfloat16)
    w1 = jax.random.normal(k, (4096, 8192), jnp.bfloat16)
    w2 = jax.random.normal(k, (8192, 4096), jnp.bfloat16)
    compiled = f.lower(x, w1, w2).compile()
    f(x, w1, w2).block_until_ready()
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(3):
            f(x, w1, w2).block_until_ready()
    import glob
    path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    planes = []
    for p in data.planes:
        lines = []
        for ln in p.lines:
            evs = []
            for i, ev in enumerate(ln.events):
                if i >= 12:
                    break
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    stats = {str(k): str(v)[:300] for k, v in dict(ev.stats).items()}
                evs.append({"name": ev.name, "duration_ns": ev.duration_ns, "stats": stats})
            lines.append({"name": ln.name, "events": evs})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pstats = {str(k): str(v)[:200] for k, v in dict(p.stats).items()} if hasattr(p, "stats") else {}
        planes.append({"name": p.name, "stats": pstats, "lines": lines})
    hlo = compiled.as_text()
    json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "planes": planes,
               "hlo_head": hlo[:6000]}, open(out, "w"), indent=1)
    print("wrote", out, [p["name"] for p in planes])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "trace_events.json")
