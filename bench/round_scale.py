"""One speculative round at scale (issue #48, item 5): the engine's round against a decoding step at the
Qwen3.8-27B geometry, with a drafter of the published DSpark geometry, and the speed-up that PROJECTS.

    hyspec bench round-scale [--batch 1,8,32] [--nodes 8,32] [--prefix 512] [--mode tree-ready]
                             [--tree-depth 7] [--tree-topk 8] [--tree-beam 16] [--max-seconds S]
                             [--json OUT.json] [--tiny | --config PATH] ...
    hyspec bench round-scale --merge A.json B.json --json OUT.json
    python -m hyspec_jax.bench.round_scale ...        (same options)

Models, RANDOM weights created on the device leaf by leaf as `hyspec bench verify-scale` creates them
(`bench/verify_scale.py`: `random_params`, `random_state`, `fill_leaf`; the drafter by the same fillers):

  target   the Qwen3.8-27B geometry (`spec.memory.qwen38_27b`; or --config PATH / --tiny);
  drafter  the published geometry of a DSpark/DFlash drafter for a 64-layer 27B-class target
           (docs/reference/drafters.md §5.2): hidden = the target's (5120), 5 layers, 32 query heads, 8 KV
           heads, head_dim 128, intermediate 17408, vocabulary = the target's (248320), taps [1, 16, 31, 46, 61]
           (the z-lab / SGLang rule, `config.default_target_layer_ids`); block size γ = 7, the setting of ReaDy's
           Qwen3.8-27B results (arXiv 2610.20503, Table 1; its drafter starts from RadixArk/Qwen3.8-27B-DSpark,
           whose own block size is unpublished — drafters.md §9); DeepSpec's heads (the `DrafterConfig`
           defaults: a vanilla Markov head of rank 256, a confidence head); with a reader mode (`ready`,
           `tree-ready`), ReaDy's rank-8 reader of GDN layers 30 and 62 (`ReaderConfig.for_target`).
           --draft-layers, --block-size and --taps override those numbers; --drafter-config PATH takes a whole
           drafter config.json instead.

Programs, per batch B (slots) and verify width N, every slot holding a committed prefix of --prefix tokens
(random but deterministic target state and drafter context K/V; KV length S = --max-len, default
prefix + max(N, γ + 2)):

  T_round(B, N)   the engine's round: the backend `SpecEngine(target, drafter, SpecConfig(mode, tree, N)).backend(B,
                  S)` builds for the bucket, its program `spec.round.spec_round_io_jit` with the backend's greedy
                  round shape (draft, select, verify, accept, commit; target and drafter state donated), called as
                  `SpecBackend.dispatch` / `collect` call it (host inputs packed, the host output read back);
  T_draft(B, N)   the round's draft phase alone (`spec.round.round_draft_jit`: drafter forward, tree, selection);
  T_verify(B, N)  its verify phase alone (`spec.round.round_verify_jit` over the forest the draft selected);
  T_dec(B)        the request loop's plain decoding step (`runtime.programs.ar_step_jit`, as `ARBackend.dispatch`
                  / `collect` call it; state donated).

Every program is lowered (batch 1 first; the rounds and decoding steps before the phases alone) and then compiled
ahead of time in parallel threads (`verify_scale.compile_all`), then called through its compiled executable —
--warmup untimed calls, then the median of --repeats calls, each waited for (`calibrate.median_time`). A donated
state is fed back with its committed lengths restored before each call (untimed), so every call starts from the
same prefix. With random weights the drafts are almost never accepted: a round's cost does not depend on that
(every shape is static), but the JSON records the accepted drafts per round so nobody reads a τ into it.

PROJECTIONS, not measurements: speed-up = τ · T_dec / T_round (`projected_speedup`: a round commits τ tokens per
request on average where a decoding step commits one), at

  τ = 4.53   ReaDy's published mean on Qwen3.8-27B (arXiv 2610.20503, Table 1: 4.5285 over seven benchmarks,
             greedy, block size 7, one B200 — the τ of its own drafting, not of this tree; --published-tau);
  τ_emb      the embedded model's τ measured by `hyspec bench e2e` for the same mode, tree and N (--tau-from,
             default bench/results/e2e/e2e_h100_loop.json: tree-ready, tree depth 7 / top-k 8 / beam 16, N 32,
             τ 3.48 on held-out prompts); an N that file did not measure has no such projection.

Each row says whether a projection reaches --target (default 1.8×: the issue's target at B = 1..32).

Outputs (with --json OUT.json): OUT.json (run_metadata: device, versions, commit; the command; both models'
geometry; every time; the τ used and where it came from) and OUT.md, rewritten after every measured program
("status": "partial", and "skipped", when --max-seconds left programs out). `--merge A.json B.json --json OUT.json`
combines runs of other batches (no device).

One H200 (kind nvidia-h200, run with timeout_s 600), from the repository root (bench/verify_scale.py's convention;
.jax_cache is git-ignored, so a warm machine keeps the compiles between calls). The programs run 64 unrolled layers
(a round compiles about as long as a verify, 16–45 s each at this geometry: bench/results/README.md), and every
program is compiled before any is timed, so the rounds and decoding steps come first (9 programs), then, on the
warm machine, the whole set (the 9 from the cache, 12 phase programs new):

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \\
        hyspec_jax.bench.round_scale --no-phases --compile-workers 2 --max-seconds 240 \\
        --compile-cache .jax_cache --no-progress --json $OUT/round_scale_h200_rounds.json
    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \\
        hyspec_jax.bench.round_scale --compile-workers 2 --max-seconds 240 \\
        --compile-cache .jax_cache --no-progress --json $OUT/round_scale_h200.json

If a call left programs out (listed as skipped), run them in a further call on the warm machine (e.g. `--batch 32
--json $OUT/round_scale_h200_b32.json`), then, here, `--merge A.json B.json --json
bench/results/scale/round_scale_h200.json` (a later file's rows win). CPU smoke run: `--tiny`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from hyspec_jax.runtime.calibrate import _ints, median_time
from hyspec_jax.bench.verify_scale import (_count, _gib, _ms, _xla_stats, add_geometry_arguments, drive,
                                           add_run_arguments, compile_all, fill_leaf, make_mesh, progress_bar,
                                           random_params, random_state, settle_merged)

DEFAULT_BATCH, DEFAULT_NODES = (1, 8, 32), (8, 32)
DEFAULT_TREE = (7, 8, 16)             # depth, top-k, beam: bench/recipes/lib.sh WIDE_TREE (the GPU default)
MODES = ("tree-ready", "tree")        # the tree modes of a DSpark drafter
# The published drafter geometry for a 64-layer 27B-class target (docs/reference/drafters.md §5.2); hidden size and
# vocabulary are the target's (`DrafterConfig.from_target`), the taps its default rule.
PUBLISHED_DRAFTER = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=17408)
PUBLISHED_LAYERS = 5
PUBLISHED_BLOCK = 7                   # ReaDy's Qwen3.8-27B results (arXiv 2610.20503, Table 1)
DRAFTER_SOURCE = ("docs/reference/drafters.md §5.2 (64-layer 27B-class target: hidden 5120, 5 layers, 32 q / 8 kv "
                  "heads, head_dim 128, intermediate 17408, vocab 248320, taps [1,16,31,46,61]); block size 7 as "
                  "ReaDy's Qwen3.8-27B results (arXiv 2610.20503, Table 1); DeepSpec heads (Markov rank 256, "
                  "confidence head)")
PUBLISHED_TAU = 4.5285                # ReaDy, Qwen3.8-27B, mean of seven benchmarks (arXiv 2610.20503, Table 1)
PUBLISHED_TAU_SOURCE = ("ReaDy (arXiv 2610.20503) Table 1: mean τ 4.5285 on Qwen3.8-27B over seven benchmarks, "
                        "greedy, block size 7, one B200")
DEFAULT_TAU_FILE = Path(__file__).resolve().parent / "results" / "e2e" / "e2e_h100_loop.json"
TARGET = 1.8
DRAFTER_STREAM, DSTATE_STREAM = 1 << 20, 1 << 21     # fill_leaf streams apart from the target's (0, 1 + B)


# ------------------------------------------------------------------------------------------------
# The drafter: geometry, random weights, random context
# ------------------------------------------------------------------------------------------------
def drafter_config(tcfg, *, tiny: bool = False, path: str | None = None, layers: int | None = None,
                   block_size: int | None = None, taps: tuple[int, ...] | None = None):
    """(DrafterConfig, source): a drafter config.json (`path`), a small drafter of the tiny target (`tiny`), else
    the published geometry (module docstring) beside `tcfg`. layers / block_size / taps override (None: the
    file's, else the published layers and block size)."""
    from hyspec_jax.config import DrafterConfig

    if path:
        p = Path(path)
        cfg = DrafterConfig.from_hf_dict(json.loads((p / "config.json" if p.is_dir() else p).read_text()))
        over = dict(num_hidden_layers=layers, target_layer_ids=taps, block_size=block_size)
        cfg = dataclasses.replace(cfg, **{k: v for k, v in over.items() if v is not None})
        if cfg.hidden_size != tcfg.hidden_size or cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"{path}: drafter hidden {cfg.hidden_size} / vocab {cfg.vocab_size} do not match the "
                             f"target's {tcfg.hidden_size} / {tcfg.vocab_size}")
        return cfg, str(path)
    block_size = block_size or PUBLISHED_BLOCK
    if tiny:
        n = layers or 2
        return DrafterConfig.from_target(
            tcfg, num_layers=n, block_size=block_size, markov_rank=16, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128,
            target_layer_ids=taps or tuple(np.linspace(0, tcfg.num_hidden_layers - 2, n).round().astype(int).tolist())
        ), "tiny drafter"
    return DrafterConfig.from_target(tcfg, num_layers=layers or PUBLISHED_LAYERS, target_layer_ids=taps,
                                     block_size=block_size, **PUBLISHED_DRAFTER), DRAFTER_SOURCE


def drafter_init_rules(model, reader_cfg) -> dict:
    """{parameter path: (kind, scale)} of a drafter: verify-scale's rules (`INIT_RULES`), the reader's own
    projections drawn as its initialiser draws them (unit variance over the fan-in), and the drafter's Qwen3 norms
    (not zero-centred: weight 1, never 0 — a zero weight would zero the block)."""
    from flax import nnx

    from hyspec_jax.bench.verify_scale import INIT_RULES, param_init_rules
    from hyspec_jax.models.layers import RMSNorm

    extra = {}
    if reader_cfg is not None:
        extra = {("Reader", "w_q"): ("normal", 1 / math.sqrt(reader_cfg.hidden_size)),
                 ("Reader", "u"): ("normal", 1 / math.sqrt(reader_cfg.rank)),
                 ("Reader", "v"): ("normal", 1 / math.sqrt(reader_cfg.value_dim))}
    rules = param_init_rules(model, {**INIT_RULES, **extra})
    for p, n in nnx.iter_graph(model):
        if isinstance(n, RMSNorm) and not n.zero_centred:
            rules[tuple(p) + ("weight",)] = ("const", 1.0)
    return rules


def random_drafter(dcfg, reader_cfg, dtype, seed: int, mesh, compiler_options: dict | None = None):
    """A `Drafter` with random weights (`drafter_init_rules`), built leaf by leaf on the device(s), replicated
    over `mesh` (as the engine places a drafter beside a sharded target)."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from hyspec_jax.models.drafter import abstract_drafter

    model = abstract_drafter(dcfg, reader_cfg, dtype)
    rules = drafter_init_rules(model, reader_cfg)
    graphdef, abstract = nnx.split(model)
    rep = NamedSharding(mesh, P())
    leaves = []
    for i, (p, v) in enumerate(nnx.to_flat_state(abstract)):
        a, (kind, scale) = v.get_value(), rules[tuple(p)]
        leaves.append((p, v.replace(value=fill_leaf(kind, scale, a.shape, a.dtype, rep, seed=seed,
                                                    stream=DRAFTER_STREAM, index=i,
                                                    compiler_options=compiler_options))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def random_drafter_state(dcfg, batch: int, max_len: int, prefix: int, dtype, seed: int, mesh,
                         compiler_options: dict | None = None):
    """A drafter context as after `prefix` committed tokens: random context K/V (N(0, 1)), lengths = prefix, in the
    request loop's slot layout (`sharding.slot_shardings`)."""
    import jax

    from hyspec_jax.sharding import slot_shardings
    from hyspec_jax.state import DrafterState, init_drafter_state

    abstract = jax.eval_shape(lambda: init_drafter_state(dcfg, batch, max_len, dtype))
    sh = slot_shardings(abstract, mesh)
    fill = lambda j, name, kind, scale: fill_leaf(  # noqa: E731
        kind, scale, getattr(abstract, name).shape, getattr(abstract, name).dtype, getattr(sh, name), seed=seed,
        stream=DSTATE_STREAM + batch, index=j, compiler_options=compiler_options)
    return DrafterState(keys=fill(0, "keys", "normal", 1.0), values=fill(1, "values", "normal", 1.0),
                        lengths=fill(2, "lengths", "const", prefix))


# ------------------------------------------------------------------------------------------------
# Projection
# ------------------------------------------------------------------------------------------------
def projected_speedup(tau: float, t_dec_ms: float, t_round_ms: float) -> float:
    """Speed-up over plain decoding if every round commits τ tokens per request: τ · T_dec / T_round."""
    if tau <= 0 or t_dec_ms <= 0 or t_round_ms <= 0:
        raise ValueError(f"τ, T_dec and T_round must be > 0, got {tau}, {t_dec_ms}, {t_round_ms}")
    return tau * t_dec_ms / t_round_ms


def embedded_taus(path, mode: str, tree: tuple[int, int, int], nodes) -> dict[int, dict]:
    """{N: dict(tau, batch, entry, source)}: the τ a `hyspec bench e2e` JSON measured for `mode` with the same tree
    (its meta.tree depth / top_k / beam) at verify width N, for N in `nodes` (the smallest batch's entry where
    several batches measured it). Empty when the file's tree is another."""
    from hyspec_jax.bench.report import portable_path

    d = json.loads(Path(path).read_text())
    t = (d.get("meta") or {}).get("tree") or {}
    if (t.get("depth"), t.get("top_k"), t.get("beam")) != tuple(tree):
        return {}
    out: dict[int, dict] = {}
    for key, r in (d.get("results") or {}).items():
        N, tau = r.get("verify_nodes"), r.get("mean_tau")
        if r.get("mode") != mode or N not in nodes or tau is None:
            continue
        if N not in out or (r.get("batch") or 0) < (out[N]["batch"] or 0):
            out[N] = dict(tau=float(tau), batch=r.get("batch"), entry=key, source=portable_path(path))
    return out


def projections(row: dict, t_dec_ms: float, taus: dict, target: float) -> dict:
    """A row's projected speed-ups {published, embedded} (None without a τ) and whether each reaches `target`."""
    out = {}
    for name in ("published", "embedded"):
        tau = taus[name].get(str(row["nodes"])) if name == "embedded" else taus[name]
        tau = tau["tau"] if isinstance(tau, dict) else tau
        s = None if tau is None else round(projected_speedup(tau, t_dec_ms, row["t_round_ms"]), 4)
        out[name] = dict(tau=tau, speedup=s, meets=None if s is None else s >= target)
    return out


# ------------------------------------------------------------------------------------------------
# Programs of one batch
# ------------------------------------------------------------------------------------------------
class _Lower:
    """A `compile_all` job's function: .lower() of a jitted program with its static arguments bound."""

    def __init__(self, fn):
        self.lower = fn


class BatchRounds:
    """One batch B: its committed state (target, drafter context, anchors), the engine backend of every N, and the
    jobs of its programs; `measure_*` time a compiled program and return its JSON row."""

    def __init__(self, args, cfg, dcfg, B: int, engines: dict, *, mesh, dtype, max_len: int):
        import jax
        import jax.numpy as jnp

        from hyspec_jax.runtime.backend import Backend
        from hyspec_jax.spec.round import pack_round_inputs

        self.args, self.B, self.engines, self.max_len = args, B, engines, max_len
        copts = dict(args.xla_option) or None
        # the buckets' backends: round shapes and capacity as the engine builds them (their empty buffers are
        # dropped: the rounds run on the random committed state below)
        self.backends = {}
        for N, eng in engines.items():
            be = eng.backend(B, max_len, shapes=[(B, 16)])
            be.state = be.dstate = be.anchor = None
            self.backends[N] = be
        self.state, _ = random_state(cfg, B, max_len, args.prefix, dtype, args.seed, mesh, copts)
        self.dstate = random_drafter_state(dcfg, B, max_len, args.prefix, dtype, args.seed, mesh, copts)
        rng = np.random.default_rng([args.seed, B])
        self.anchor = jax.device_put(jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32),
                                     self.state.lengths.sharding)
        self.lengths = (np.asarray(self.state.lengths), np.asarray(self.dstate.lengths))
        z = np.zeros(B, np.float32)
        self.sampling = Backend.sampling(z, np.ones(B, np.float32), z.astype(np.int32), z.astype(np.uint32))
        self.active, self.steps = np.ones(B, bool), np.ones(B, np.int32)
        self.host_in = {N: pack_round_inputs(self.active, self.steps, be.capacity, None)
                        for N, be in self.backends.items()}
        eng = next(iter(engines.values()))
        self.tg, self.tp = eng.tgraph, eng.tparams

    def _phase_args(self, N: int):
        import jax.numpy as jnp

        be = self.backends[N]
        return (self.state, self.dstate, self.anchor, jnp.asarray(self.active), self.sampling,
                jnp.asarray(self.steps), jnp.asarray(be.capacity, jnp.int32), None)

    def jobs(self, phases: bool) -> list:
        """(key, lowerable, ()) of compile_all: ("decode", B, 0), ("round", B, N) and, with phases, ("draft", B, N)
        and ("verify", B, N)."""
        import functools

        import jax

        from hyspec_jax.runtime.programs import ar_step_jit
        from hyspec_jax.spec.round import round_draft, round_draft_jit, round_verify_jit, spec_round_io_jit

        B, tg, tp = self.B, self.tg, self.tp
        first = [(("decode", B, 0), _Lower(lambda: ar_step_jit.lower(
            tg, tp, self.state, self.anchor, self.active, self.sampling, self.steps, stochastic=False)), ())]
        extra = []
        for N, be in self.backends.items():
            shape = be.round_shapes[False]
            first.append((("round", B, N), _Lower(lambda be=be, shape=shape, N=N: spec_round_io_jit.lower(
                be.graphdef, be.params, be.dgraph, be.dparams, self.state, self.dstate, self.anchor, self.sampling,
                self.host_in[N], shape=shape)), ()))
            if not phases:
                continue
            pargs = self._phase_args(N)
            extra.append((("draft", B, N), _Lower(lambda be=be, shape=shape, pargs=pargs: round_draft_jit.lower(
                be.graphdef, be.params, be.dgraph, be.dparams, *pargs, shape=shape)), ()))
            # the verify reads the draft's forest: its shapes, without running it
            tokens, tree, _ = jax.eval_shape(functools.partial(round_draft, be.graphdef, be.params, be.dgraph,
                                                               be.dparams, shape=shape), *pargs)
            extra.append((("verify", B, N), _Lower(lambda be=be, shape=shape, tree=tree, tokens=tokens:
                                                   round_verify_jit.lower(be.graphdef, be.params, self.state, tree,
                                                                          tokens, shape=shape)), ()))
        return first, extra

    def _restore(self):
        """Untimed before each call of a donating program: the committed lengths of the prefix again."""
        import jax

        self.state = self.state.replace(lengths=jax.device_put(self.lengths[0], self.state.lengths.sharding))
        self.dstate = self.dstate.replace(lengths=jax.device_put(self.lengths[1], self.dstate.lengths.sharding))
        return self.state.lengths, self.dstate.lengths

    def _timing(self, t, prog) -> dict:
        compiled, lower_s, compile_s = prog
        return dict(t_ms=_ms(t.median_s), times_ms=[_ms(x) for x in t.times_s], first_ms=_ms(t.first_s),
                    spread=round(t.spread, 4), lower_s=round(lower_s, 3), compile_s=round(compile_s, 3),
                    **_xla_stats(compiled))

    def measure_decode(self, prog) -> dict:
        """T_dec: `ARBackend.dispatch` + `collect` of every slot, state donated and fed back."""
        from hyspec_jax.runtime.backend import start_host_copy

        step = prog[0]
        tp, args = self.tp, self.args

        def call():
            self.anchor, self.state = step(tp, self.state, self.anchor, self.active, self.sampling, self.steps)
            start_host_copy(self.anchor)
            return np.asarray(self.anchor), self.state.lengths

        t, _ = median_time(call, args.repeats, args.warmup, before=self._restore)
        return dict(batch=self.B, **self._timing(t, prog))

    def measure_round(self, N: int, prog) -> dict:
        """T_round: `SpecBackend.dispatch` + `collect`, target and drafter state donated and fed back."""
        from hyspec_jax.runtime.backend import start_host_copy
        from hyspec_jax.spec.round import pack_round_inputs, unpack_round_outputs

        rnd, be = prog[0], self.backends[N]
        box = {}

        def call():
            host_in = pack_round_inputs(self.active, self.steps, be.capacity, None)
            self.state, self.dstate, self.anchor, out = rnd(be.params, be.dparams, self.state, self.dstate,
                                                            self.anchor, self.sampling, host_in)
            start_host_copy(out)
            box["out"] = np.asarray(out)
            return self.state.lengths, self.dstate.lengths

        t, _ = median_time(call, self.args.repeats, self.args.warmup, before=self._restore)
        _, count, accepted = unpack_round_outputs(box["out"])
        shape = be.round_shapes[False]
        return dict(batch=self.B, nodes=N, depth=shape.depth, capacity=be.capacity, kernels=shape.kernel_impl,
                    accepted_per_round=round(float(np.mean(accepted)), 4),
                    committed_per_round=round(float(np.mean(count)), 4), **self._timing(t, prog))

    def measure_phases(self, N: int, draft, verify) -> dict:
        """T_draft and T_verify of N (either prog may be None: not compiled): no donation, the current state."""
        from hyspec_jax.bench.verify_scale import _finite

        out, be = {}, self.backends[N]
        if draft is None:
            return out
        pargs = self._phase_args(N)
        t, (tokens, tree, _) = median_time(lambda: draft[0](be.params, be.dparams, *pargs), self.args.repeats,
                                           self.args.warmup)
        out["draft"] = self._timing(t, draft)
        if verify is not None:
            t, (logits, _, _) = median_time(lambda: verify[0](be.params, self.state, tree, tokens), self.args.repeats,
                                            self.args.warmup)
            out["verify"] = dict(self._timing(t, verify), finite=_finite(logits))
        return out


# ------------------------------------------------------------------------------------------------
# The sweep
# ------------------------------------------------------------------------------------------------
def resolve_taus(args) -> dict:
    """{published: τ, published_source, embedded: {str(N): {...}}, embedded_note}."""
    out = dict(published=args.published_tau, published_source=(PUBLISHED_TAU_SOURCE
                                                                if args.published_tau == PUBLISHED_TAU
                                                                else "--published-tau"), embedded={})
    path = Path(args.tau_from) if args.tau_from else DEFAULT_TAU_FILE
    if not path.is_file():
        if args.tau_from:
            raise ValueError(f"--tau-from {args.tau_from}: no such file")
        out["embedded_note"] = f"{path.name} not found: no projection at the embedded model's τ"
        return out
    found = embedded_taus(path, args.mode, (args.tree_depth, args.tree_topk, args.tree_beam), set(args.nodes))
    out["embedded"] = {str(N): v for N, v in sorted(found.items())}
    missing = sorted(set(args.nodes) - set(found))
    if missing:
        from hyspec_jax.bench.report import portable_path
        out["embedded_note"] = (f"{portable_path(path)} has no {args.mode} τ with tree {args.tree_depth}/"
                                f"{args.tree_topk}/{args.tree_beam} at N = {', '.join(map(str, missing))}")
    return out


def sweep(args, cfg, name: str, on_progress=None) -> dict:
    """Weights, every batch's state, every program lowered and compiled ahead of time, then each one timed;
    `on_progress(report)` after each measured program."""
    import jax
    from flax import nnx

    from hyspec_jax.bench.report import portable_args, portable_command, run_metadata
    from hyspec_jax.config import resolve_dtype
    from hyspec_jax.models.reader import ReaderConfig
    from hyspec_jax.spec.engine import SpecConfig, SpecEngine
    from hyspec_jax.tree import TreeExpansion

    t_start = time.perf_counter()
    deadline = None if args.max_seconds is None else t_start + args.max_seconds
    dtype = resolve_dtype(args.dtype)
    taus = resolve_taus(args)
    dcfg, dsource = drafter_config(cfg, tiny=args.tiny, path=args.drafter_config, layers=args.draft_layers,
                                   block_size=args.block_size, taps=args.taps)
    rcfg = ReaderConfig.for_target(cfg, hidden_size=dcfg.hidden_size) if args.mode == "tree-ready" else None
    tree = TreeExpansion(args.tree_depth, args.tree_topk, args.tree_beam)
    overshoot = dcfg.num_draft_tokens + 2                       # `SpecEngine.overshoot`
    max_len = args.max_len or args.prefix + max(max(args.nodes), overshoot)
    if max_len < args.prefix + overshoot:
        raise ValueError(f"--max-len {max_len} must hold --prefix {args.prefix} + a round's {overshoot} positions")
    mesh = make_mesh(1)
    copts = dict(args.xla_option) or None
    t0 = time.perf_counter()
    graphdef, params, _ = random_params(cfg, dtype, args.seed, mesh, copts, scan=args.scan_layers)
    drafter = random_drafter(dcfg, rcfg, dtype, args.seed, mesh, copts)
    jax.block_until_ready((params, nnx.state(drafter)))
    init_s = time.perf_counter() - t0
    target = nnx.merge(graphdef, params)
    engines = {N: SpecEngine(target, drafter, SpecConfig(mode=args.mode, tree=tree, verify_nodes=N,
                                                         kernels=args.kernels, adaptive_width=False))
               for N in args.nodes}
    count = lambda tree_: (sum(int(x.size) for x in jax.tree.leaves(tree_)),  # noqa: E731
                           sum(int(x.nbytes) for x in jax.tree.leaves(tree_)))
    (tn, tb), (dn, db) = count(params), count(nnx.state(drafter))
    report = dict(
        meta=run_metadata(), command=portable_command("hyspec bench round-scale", args.argv),
        argv=portable_args(args.argv), status="partial",
        model=dict(name=name, config=dataclasses.asdict(cfg), param_count=tn, param_bytes=tb),
        drafter=dict(source=dsource, config=dataclasses.asdict(dcfg), gamma=dcfg.num_draft_tokens,
                     reader=None if rcfg is None else rcfg.to_dict(), param_count=dn, param_bytes=db),
        settings=dict(mode=args.mode, tree=dict(depth=tree.depth, top_k=tree.top_k, beam=tree.beam),
                      dtype=str(np.dtype(dtype)), prefix=args.prefix, max_len=max_len, kernels=args.kernels,
                      repeats=args.repeats, warmup=args.warmup, batches=args.batch, nodes=args.nodes,
                      seed=args.seed, phases=not args.no_phases, target=args.target,
                      compile_workers=args.compile_workers, compile_cache=args.compile_cache,
                      xla_options=dict(args.xla_option), max_seconds=args.max_seconds,
                      scan_layers=args.scan_layers),
        taus=taus, init_s=round(init_s, 3), decode=[], rows=[], skipped=[])
    batches = {B: BatchRounds(args, cfg, dcfg, B, engines, mesh=mesh, dtype=dtype, max_len=max_len)
               for B in args.batch}
    main_jobs, extra_jobs = [], []
    for B in args.batch:                                        # batch 1 first; the phases alone after all rounds
        m, e = batches[B].jobs(not args.no_phases)
        main_jobs += m
        extra_jobs += e
    jobs = main_jobs + extra_jobs
    bar = progress_bar(2 * len(jobs), not args.no_progress)    # compile + measure
    t_dec: dict[int, float] = {}

    def update():
        report["wall_s"] = round(time.perf_counter() - t_start, 2)
        bar.update()
        if on_progress is not None:
            on_progress(report)

    try:
        bar.set_description("compile")
        progs = compile_all(jobs, args.compile_workers, bar, deadline=deadline)
        bar.set_description("measure")
        report["skipped"] = [f"{k[0]} B={k[1]}" + (f" N={k[2]}" if k[2] else "") for k, _, _ in jobs
                             if k not in progs]
        for B in args.batch:
            br = batches[B]
            if ("decode", B, 0) in progs:
                d = br.measure_decode(progs.pop(("decode", B, 0)))
                t_dec[B] = d["t_ms"]
                report["decode"].append(d)
                bar.set_postfix_str(f"T_dec B={B} {d['t_ms']:.3f} ms")
                update()
            for N in args.nodes:
                if ("round", B, N) not in progs:
                    continue
                row = br.measure_round(N, progs.pop(("round", B, N)))
                phases = br.measure_phases(N, progs.pop(("draft", B, N), None), progs.pop(("verify", B, N), None))
                row.update(t_round_ms=row.pop("t_ms"), phases=phases,
                           t_draft_ms=phases.get("draft", {}).get("t_ms"),
                           t_verify_ms=phases.get("verify", {}).get("t_ms"), t_dec_ms=t_dec.get(B))
                if B in t_dec:
                    row["round_over_dec"] = round(row["t_round_ms"] / t_dec[B], 4)
                    row["projections"] = projections(row, t_dec[B], taus, args.target)
                report["rows"].append(row)
                bar.set_postfix_str(f"T_round B={B} N={N} {row['t_round_ms']:.3f} ms")
                update()
                for _ in phases:
                    update()
            del batches[B]                                      # frees the batch's states
    finally:
        bar.close()
    if report["skipped"]:
        report["stopped"] = f"--max-seconds {args.max_seconds:g}: {len(report['skipped'])} program(s) not measured"
    report["status"] = "partial" if report["skipped"] else "complete"
    report["wall_s"] = round(time.perf_counter() - t_start, 2)
    report["device_memory"] = device_memory()
    return report


def device_memory() -> dict | None:
    """The device allocator's peak and limit (bytes) over the run, where the backend reports them (GPU)."""
    import jax

    try:
        m = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 — optional diagnostics, not every backend has them
        return None
    out = {k: int(m[k]) for k in ("peak_bytes_in_use", "bytes_limit") if k in m}
    return out or None


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def all_finite(report: dict) -> bool:
    """Every measured verify phase gave finite logits."""
    return all(r.get("phases", {}).get("verify", {}).get("finite", True) for r in report["rows"])


def _f(x, nd: int = 3) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def _proj(p: dict | None) -> str:
    if not p or p["speedup"] is None:
        return "—"
    return f"{p['speedup']:.2f}× ({'meets' if p['meets'] else 'below'})"


def summary_table(report: dict) -> str:
    taus = report["taus"]
    emb = "/".join(f"{v['tau']:.2f}" for v in taus["embedded"].values()) or "—"
    head = ["B", "N", "T_round ms", "T_draft ms", "T_verify ms", "T_dec ms", "T_round / T_dec",
            f"PROJECTED speed-up, τ {taus['published']:.2f} (ReaDy, published)",
            f"PROJECTED speed-up, τ {emb} (embedded model, measured)", "accepted / round (random weights)"]
    out = ["| " + " | ".join(head) + " |", "|---:|---:|" + "---:|" * 5 + "---|---|---:|"]
    for r in sorted(report["rows"], key=lambda r: (r["batch"], r["nodes"])):
        p = r.get("projections") or {}
        out.append(f"| {r['batch']} | {r['nodes']} | {r['t_round_ms']:.3f} | {_f(r.get('t_draft_ms'))} | "
                   f"{_f(r.get('t_verify_ms'))} | {_f(r.get('t_dec_ms'))} | {_f(r.get('round_over_dec'), 2)} | "
                   f"{_proj(p.get('published'))} | {_proj(p.get('embedded'))} | {r['accepted_per_round']:.2f} |")
    return "\n".join(out)


def target_line(report: dict) -> str:
    """Which (B, N) reach the target at each τ (projections)."""
    tgt, parts = report["settings"]["target"], []
    for name, label in (("published", "published τ"), ("embedded", "embedded τ")):
        rows = [r for r in report["rows"] if (r.get("projections") or {}).get(name, {}).get("speedup") is not None]
        ok = [f"B={r['batch']} N={r['nodes']}" for r in rows if r["projections"][name]["meets"]]
        parts.append(f"at the {label}: " + ("no row projected" if not rows else
                                           f"{len(ok)} of {len(rows)} rows ({', '.join(ok) or 'none'})"))
    return f"Target ≥ {tgt:g}× (PROJECTED) — " + "; ".join(parts) + "."


def markdown(report: dict) -> str:
    meta, s, m, d, taus = report["meta"], report["settings"], report["model"], report["drafter"], report["taus"]
    t = s["tree"]
    dc = d["config"]
    emb = "; ".join(f"N={n}: τ {v['tau']:.3f} ({v['source']}, entry `{v['entry']}`)" for n, v in
                    taus["embedded"].items()) or "none"
    lines = [
        f"# One speculative round at scale — {m['name']}, {meta['device_kind']}, {s['dtype']}, prefix {s['prefix']}",
        "", f"`{report['command']}`", "",
        f"commit {meta['commit']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, {meta['time_utc']}; status "
        f"**{report['status']}**" + (f", wall {report['wall_s']:.0f} s" if "wall_s" in report else "")
        + (f" (merged from {', '.join(report['merged_from'])})" if report.get("merged_from") else ""), "",
        f"Random weights. Target {_count(m['param_count'])} parameters ({_gib(m['param_bytes'])}). "
        f"Drafter {_count(d['param_count'])} parameters ({_gib(d['param_bytes'])}): "
        f"{dc['num_hidden_layers']} layers, hidden {dc['hidden_size']}, {dc['num_attention_heads']} q / "
        f"{dc['num_key_value_heads']} kv heads of {dc['head_dim']}, intermediate {dc['intermediate_size']}, "
        f"taps {dc['target_layer_ids']}, γ {d['gamma']}, Markov rank {dc['markov_rank']}"
        + (f", ReaDy reader of layers {d['reader']['source_layers']} (rank {d['reader']['rank']})" if d["reader"]
           else "") + f" — {d['source']}.", "",
        f"Mode `{s['mode']}`, tree depth {t['depth']} / top-k {t['top_k']} / beam {t['beam']}, kernels "
        f"`{s['kernels']}`, KV length {s['max_len']}. Each time: median of {s['repeats']} calls after "
        f"{s['warmup']} warm-up call(s). T_round: the engine's round program for the bucket (draft + verify + "
        "commit, state donated), called as the request loop calls it; T_draft / T_verify: its draft and verify "
        "phases jitted alone; T_dec: the request loop's plain decoding step.", "",
        "**Speed-ups are PROJECTIONS** (τ · T_dec / T_round), not measurements: random weights accept "
        "(almost) no draft (last column). τ used: "
        f"published {taus['published']:.4f} — {taus['published_source']} (ReaDy's own drafting, not this tree); "
        f"embedded model — {emb}" + (f" ({taus['embedded_note']})" if taus.get("embedded_note") else "") + ".", "",
        summary_table(report), "", target_line(report), "",
    ]
    if report.get("skipped"):
        lines += [f"Not measured ({report.get('stopped', 'run cut short')}): " + ", ".join(report["skipped"]), ""]
    dec = ", ".join(f"B={x['batch']} {x['t_ms']:.3f} ms (compile {x['compile_s']:.0f} s)" for x in report["decode"])
    comp = ", ".join(f"B={r['batch']} N={r['nodes']} {r['compile_s']:.0f} s" for r in report["rows"])
    mem = report.get("device_memory") or {}
    lines += [f"T_dec: {dec or '—'}. Round compiles: {comp or '—'}."
              + (f" Device memory: peak {_gib(mem['peak_bytes_in_use'])} of {_gib(mem['bytes_limit'])}."
                 if {"peak_bytes_in_use", "bytes_limit"} <= set(mem) else ""), ""]
    if not all_finite(report):
        lines += ["**WARNING: non-finite verify logits in at least one row (see the JSON).**", ""]
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    """One report from runs of the same models and settings but other batches / nodes (a later run's rows win)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    loose = {"batches", "nodes", "compile_workers", "compile_cache", "max_seconds", "phases"}
    key = lambda r: (r["model"]["name"], r["drafter"]["config"],  # noqa: E731
                     {k: v for k, v in r["settings"].items() if k not in loose})
    rows, dec = {}, {}
    for p, r in zip(paths, reports):
        if key(r) != key(reports[0]):
            raise ValueError(f"{p}: models or settings differ from {paths[0]}; cannot merge")
        rows.update({(x["batch"], x["nodes"]): x for x in r["rows"]})
        dec.update({x["batch"]: x for x in r["decode"]})
    base = dict(reports[0], merged_from=list(paths))
    base["rows"] = [rows[k] for k in sorted(rows)]
    base["decode"] = [dec[k] for k in sorted(dec)]
    done = {f"decode B={b}" for b in dec} | {f"{k} B={b} N={n}" for (b, n), x in rows.items()
                                               for k in ("round", *x.get("phases", {}))}
    return settle_merged(base, reports, done)


def write_outputs(report: dict, json_path: str | None) -> None:
    from hyspec_jax.bench.report import write_report
    write_report(report, json_path, markdown)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _taps(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {s!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative layer ids, got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hyspec bench round-scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_geometry_arguments(ap, "a small target and drafter (CPU smoke run, tests)",
                           "target config.json or model directory (default: Qwen3.8-27B)")
    ap.add_argument("--batch", type=_ints, default=list(DEFAULT_BATCH), metavar="B,..", help="batches (default 1,8,32)")
    ap.add_argument("--nodes", type=_ints, default=list(DEFAULT_NODES), metavar="N,..",
                    help="verify widths N, anchor included (default 8,32)")
    ap.add_argument("--mode", choices=MODES, default=MODES[0], help="speculative mode (default tree-ready)")
    ap.add_argument("--tree-depth", type=int, default=DEFAULT_TREE[0], metavar="D", help="tree levels (default 7)")
    ap.add_argument("--tree-topk", type=int, default=DEFAULT_TREE[1], metavar="K",
                    help="children per tree node (default 8)")
    ap.add_argument("--tree-beam", type=int, default=DEFAULT_TREE[2], metavar="W",
                    help="tree nodes kept per level (default 16)")
    ap.add_argument("--kernels", choices=("auto", "reference"), default="auto",
                    help="tree top-k, tree solve, tree attention, commit (default auto: the engine's default)")
    ap.add_argument("--prefix", type=int, default=512, metavar="P", help="committed tokens per slot (default 512)")
    ap.add_argument("--max-len", type=int, metavar="S", help="KV length (default prefix + max(max N, γ + 2))")
    ap.add_argument("--block-size", type=int, metavar="G",
                    help="drafter block size γ (default 7: ReaDy's Qwen3.8-27B setting; with --drafter-config: its own)")
    ap.add_argument("--draft-layers", type=int, metavar="L", help="drafter layers (default 5; --tiny 2)")
    ap.add_argument("--taps", type=_taps, metavar="I,..", help="tapped target layers (default: the z-lab rule)")
    ap.add_argument("--drafter-config", metavar="PATH", help="a drafter config.json (or its directory) instead of "
                                                             "the published geometry")
    ap.add_argument("--published-tau", type=float, default=PUBLISHED_TAU, metavar="T",
                    help="τ of the first projection (default 4.5285: ReaDy, Qwen3.8-27B, arXiv 2610.20503 Table 1)")
    ap.add_argument("--tau-from", metavar="E2E.json", help="a `hyspec bench e2e` JSON whose τ of the same mode, "
                    "tree and N gives the second projection (default bench/results/e2e/e2e_h100_loop.json)")
    ap.add_argument("--target", type=float, default=TARGET, metavar="X", help="speed-up target (default 1.8)")
    ap.add_argument("--no-phases", action="store_true", help="time the round and the decoding step only")
    ap.add_argument("--repeats", type=int, default=10, metavar="K", help="timed calls per program (default 10)")
    ap.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed calls first (default 2)")
    add_run_arguments(ap, max_seconds="lower no further program once S seconds have passed since the start (those "
                      "compiled are still measured); the JSON then has status partial and lists the skipped")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    if min(args.repeats, args.warmup, args.tree_depth, args.tree_topk, args.tree_beam, args.block_size or 1) < 1:
        ap.error("--repeats, --warmup, --tree-depth, --tree-topk, --tree-beam and --block-size must be ≥ 1")
    if args.prefix < 0 or (args.draft_layers is not None and args.draft_layers < 1):
        ap.error("--prefix must be ≥ 0 and --draft-layers ≥ 1")
    if args.max_seconds is not None and args.max_seconds <= 0:
        ap.error(f"--max-seconds must be > 0, got {args.max_seconds}")
    if args.published_tau <= 0 or args.target <= 0:
        ap.error("--published-tau and --target must be > 0")
    return drive(ap, args, prog="hyspec bench round-scale", merge=merge, sweep=sweep, write=write_outputs,
                 summary=lambda r: summary_table(r) + "\n" + target_line(r), finite=all_finite)


if __name__ == "__main__":
    sys.exit(main())
