"""The batch-wide node selection against a brute-force optimum, the expected accepted drafts per verify width, the
per-round width choice (`runtime.width`), and the engine with the width changing across rounds against plain
decoding (greedy outputs equal, the sampling distribution unchanged).

The models, prompts, scripted drafter and the sampling oracle are test_engine's (one tiny random target and drafter).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import tree as T
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.spec.budget import BudgetTable, packed_gains, root_floor, select_nodes, width_gains
from hyspec_jax.runtime.engine import Engine, SpecConfig
from hyspec_jax.runtime.width import (CalibrationCache, WidthBackend, WidthChooser, choose_width, kept_widths,
                                   round_seconds, round_signature, width_buckets)
from hyspec_jax.tree import TreeExpansion
from tests.test_budget import _forest as budget_forest
from tests.test_engine import (GAMMA, SAMPLES, SETTINGS, SLOTS, KV, SV, _chisq_pvalue, _cli, _oracle,  # noqa: F401
                               _spec, model_dirs, models, reference, small)
from tests.test_mtp_engine import greedy_setup  # noqa: F401  (fixture: one MTP model and reference per module)


# ------------------------------------------------------------------------------------------------
# Selection: brute force over every node subset of small forests
# ------------------------------------------------------------------------------------------------
def _forest(rng, B, M):
    """Small random forests with distinct scores (one optimum for the brute force)."""
    return budget_forest(rng, B, M, max_depth=3, tie_rate=0.0)


def _brute_force(score, parent, valid, active, C, row_cap):
    """max Σ exp(score) over node sets that are ancestor-closed, hold every active row's anchor and best root
    child, at most row_cap per row and at most max(C, floor) in all; inactive rows keep nothing."""
    B, M = score.shape
    nodes = [(b, i) for b in range(B) for i in range(M) if valid[b, i] and active[b]]
    floor = set()
    for b in range(B):
        if active[b]:
            floor.add((b, 0))
            kids = [i for i in range(M) if valid[b, i] and parent[b, i] == 0]
            if kids:
                floor.add((b, max(kids, key=lambda i: score[b, i])))
    best = -1.0
    for r in range(len(nodes) + 1):
        for sub in itertools.combinations(nodes, r):
            s = set(sub)
            if not floor <= s or len(s) > max(C, len(floor)):
                continue
            if any(sum(1 for (bb, _) in s if bb == b) > row_cap for b in range(B)):
                continue
            if any(parent[b, i] >= 0 and (b, parent[b, i]) not in s for b, i in s):
                continue
            best = max(best, sum(float(np.exp(score[b, i])) for b, i in s))
    return best


@functools.partial(jax.jit, static_argnames="row_cap")
def _select(score, parent, depth, valid, active, capacity, row_cap=3):
    forced = root_floor(score, parent, valid & active[:, None], active)
    return select_nodes(score, parent, depth, valid & active[:, None], forced, row_cap, capacity).kept


@pytest.mark.parametrize("seed", range(8))
def test_batch_selection_is_the_brute_force_optimum(seed):
    """top-C by ρ over the whole batch, each live row keeping its root child, ancestor-closed: the kept set's
    total ρ is the best any admissible set reaches."""
    rng = np.random.default_rng(seed)
    B, M = 3, 5
    score, parent, depth, valid = _forest(rng, B, M)
    active = rng.random(B) < 0.8
    active[0] = True
    C = int(rng.integers(1, 8))
    kept = np.asarray(_select(*map(jnp.asarray, (score, parent, depth, valid, active)), jnp.int32(C)))
    got = float(np.exp(score[kept]).sum())
    assert got == pytest.approx(_brute_force(score, parent, valid, active, C, 3), rel=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_width_gains_are_the_selection_at_each_width(seed):
    """width_gains(w) = Σ ρ over the non-anchor nodes `select_nodes` keeps at row capacity w and batch capacity
    slots · w (the brute-force optimum too)."""
    rng = np.random.default_rng(100 + seed)
    B, M = 4, 9
    score, parent, depth, valid = _forest(rng, B, M)
    active = np.array([True, True, False, True])
    widths = (1, 2, 4, 8)
    g = np.asarray(width_gains(jnp.asarray(score), jnp.asarray(valid), jnp.asarray(active), widths))
    assert g.shape == (B, len(widths)) and (g[~active] == 0).all() and (g[:, 0] == 0).all()
    for k, w in enumerate(widths):
        kept = np.asarray(_select(*map(jnp.asarray, (score, parent, depth, valid, active)), jnp.int32(B * w),
                                  row_cap=w))
        for b in range(B):
            nonroot = kept[b] & (np.arange(M) > 0)
            assert g[b, k] == pytest.approx(float(np.exp(score[b, nonroot]).sum()), rel=1e-5, abs=1e-7)
    sub = np.array([True, False, False, False])   # one row: brute force at width 4
    assert g[0, 2] + 1 == pytest.approx(_brute_force(score[:1], parent[:1], valid[:1], sub[:1], 4, 4), rel=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_packed_gains_are_the_batch_selection_at_each_packed_width(seed):
    """packed_gains(w), summed over the rows = Σ ρ over the non-anchor nodes `select_nodes` keeps at row capacity N
    and batch capacity slots · w (the nodes the packed verify of width w runs); each row's entry is its share."""
    rng = np.random.default_rng(200 + seed)
    B, M, N = 4, 9, 6
    score, parent, depth, valid = _forest(rng, B, M)
    active = np.array([True, False, True, True])
    widths = (1, 2, 3, 4)
    g = np.asarray(packed_gains(jnp.asarray(score), jnp.asarray(valid), jnp.asarray(active), widths, N))
    assert g.shape == (B, len(widths)) and (g[~active] == 0).all() and (g[:, 0] == 0).all()
    for k, w in enumerate(widths[1:], 1):
        kept = np.asarray(_select(*map(jnp.asarray, (score, parent, depth, valid, active)), jnp.int32(B * w),
                                  row_cap=N))
        for b in range(B):
            nonroot = kept[b] & (np.arange(M) > 0)
            assert g[b, k] == pytest.approx(float(np.exp(score[b, nonroot]).sum()), rel=1e-5, abs=1e-7)


def test_packed_widths_greedy_equals_autoregressive(models, reference):
    """Packed widths (a batch-wide budget of slots · w nodes at row capacity N, verified packed): every width's
    round is packed (but the widest, which holds every node, and plain decoding), and the output is AR's as the
    width changes."""
    target, drafter = models
    prompts, params, ref = reference
    made = []
    eng = _forced(Engine(target, _oracle(drafter, prompts, ref), _spec("tree-ready", packed_widths=True),
                         slots=SLOTS, kv_len=KV), (8, 2, 1, 4, 2), made)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    (be,) = made
    shapes = {w: be.widths[w][False] for w in be.widths}
    assert {w: s.packed_rows for w, s in shapes.items()} == {1: 0, 2: 2 * SLOTS, 4: 4 * SLOTS, 8: 0}
    assert all(s.verify_nodes == 8 for w, s in shapes.items() if w > 1) and shapes[1].plain
    assert all(s.packed_gains for s in shapes.values())
    assert "|packed-widths" in round_signature("tree-ready", shapes[8], 0)
    with pytest.raises(ValueError, match="drop the fixed budget"):
        _spec("tree", packed_widths=True, capacity=12)


def test_packed_chooser_bounds_the_gain_by_the_batch_budget():
    """Packed: width w verifies slots · w nodes for the batch, so the gain per live request is bounded by
    (slots · w − live) / live, not w − 1: with 2 of 8 slots live, width 2 can carry 7 drafts a request."""
    seconds = {1: 1.0e-3, 2: 1.2e-3, 4: 2.0e-3}
    per_row = WidthChooser(seconds)
    packed = WidthChooser(seconds, packed_slots=8)
    for c in (per_row, packed):
        c.gain = {1: 0.0, 2: 6.0, 4: 7.0}
    assert per_row._best(2) == 4          # width 2 capped at 1 draft a request
    assert packed._best(2) == 2           # width 2 keeps its 6 expected drafts: the cheapest wins


# ------------------------------------------------------------------------------------------------
# The width choice
# ------------------------------------------------------------------------------------------------
def test_width_buckets():
    assert width_buckets(1) == (1,)
    assert width_buckets(8) == (1, 2, 4, 8)
    assert width_buckets(6) == (1, 2, 4, 6)
    with pytest.raises(ValueError):
        width_buckets(0)


def test_choice_is_plain_when_verification_is_costly_and_rho_low():
    seconds = {1: 1.0e-3, 2: 1.6e-3, 4: 2.0e-3, 8: 3.0e-3}
    gain = {2: 0.3, 4: 0.5, 8: 0.7}               # at most 1.7 tokens a round for 3x the time
    assert choose_width(seconds, gain, live=8) == 1


def test_choice_is_wide_when_rho_high_and_verification_cheap():
    seconds = {1: 1.0e-3, 2: 1.05e-3, 4: 1.1e-3, 8: 1.2e-3}
    gain = {2: 0.95, 4: 2.5, 8: 4.0}
    assert choose_width(seconds, gain, live=8) == 8
    # a chain-like middle: width 8 costs more than its last nodes are worth
    assert choose_width({**seconds, 8: 2.0e-3}, gain, live=8) == 4


def test_widths_slower_than_a_wider_one_are_never_kept():
    """A width strictly slower than a wider one is dropped (per decoding bucket where calibrated), and the choice
    over the kept widths is the choice over all of them for any gains that grow with the width."""
    ch = WidthChooser({1: 1.0, 2: 2.1, 4: 2.0, 8: 2.0, 16: 3.0},
                      rows_seconds={1: {1: 1.7, 2: 1.6, 4: 1.6, 8: 1.7, 16: 1.8}})
    assert ch.kept() == (1, 4, 8, 16)                   # 2 slower than 4 (equal times are both kept)
    assert ch.kept(1) == (2, 4, 8, 16)                  # one row: plain decoding slower than a drafting round
    assert ch.next(live=4) == 4                         # nothing read yet: the cheapest kept drafting round
    assert ch.next(live=1, rows=1) == 2
    rng = np.random.default_rng(0)
    for _ in range(200):
        t = {w: float(x) for w, x in zip((1, 2, 4, 8, 16), rng.uniform(1, 3, 5))}
        g = dict(zip((2, 4, 8, 16), np.cumsum(rng.uniform(0, 1, 4))))
        kept = WidthChooser(t).kept()
        assert choose_width({w: t[w] for w in kept}, g, live=4) == choose_width(t, g, live=4)


def test_widths_within_the_margin_of_a_wider_one_are_not_kept():
    """At margin m a drafting width goes when a kept wider one costs under (1 + m)x its time: the choice over the
    kept widths loses less than m of the best rate for any gains that grow with the width, and plain decoding
    stays wherever it can win."""
    h100_b16 = {1: 1.383, 2: 2.176, 4: 2.052, 8: 2.106, 16: 2.128, 32: 2.38}   # ms, H100 table at 16 slots
    assert tuple(kept_widths(h100_b16)) == (1, 4, 8, 16, 32)
    assert tuple(kept_widths(h100_b16, 0.05)) == (1, 16, 32)
    # plain decoding 1% cheaper than width 2 (which goes): kept at any margin; 1% dearer: dropped at any margin
    assert tuple(kept_widths({1: 1.0, 2: 1.01, 4: 1.2}, 0.5)) == (1, 4)
    assert tuple(kept_widths({1: 1.02, 2: 1.01, 4: 2.0}, 0.0)) == (2, 4)
    assert WidthChooser(h100_b16, margin=0.05, rows_seconds={4: h100_b16}).kept(4) == (1, 16, 32)
    rng = np.random.default_rng(1)
    for margin in (0.0, 0.03, 0.1):
        for _ in range(300):
            t = {w: float(x) for w, x in zip((1, 2, 4, 8, 16), rng.uniform(1, 1.5, 5))}
            g = dict(zip((2, 4, 8, 16), np.cumsum(rng.uniform(0, 0.3, 4))))
            kept = kept_widths(t, margin)
            rate = lambda w: (1 + g.get(w, 0.0)) / t[w]  # noqa: E731
            best, got = choose_width(t, g, live=4), choose_width(kept, g, live=4)
            assert rate(got) * (1 + margin) >= rate(best) - 1e-12
            if best == 1:
                assert got == 1


def test_chooser_learns_rho_probes_and_corrects_by_acceptance():
    seconds = {1: 1.0, 2: 1.5, 4: 2.0}
    ch = WidthChooser(seconds, probe_every=3)
    assert ch.next(2) == 2                         # nothing known: the cheapest drafting round tells every gain
    active = np.array([True, True, False])
    gains = np.array([[0, 0.2, 0.3], [0, 0.2, 0.3], [-1, -1, -1]])
    ch.observe(2, gains, np.array([1, 0, 0]), active)
    assert ch.gain == pytest.approx({1: 0.0, 2: 0.2, 4: 0.3})
    assert ch.kappa == pytest.approx(1 / 0.4)
    assert ch.next(2) == 1                         # at most 1.75 tokens for 2x the time: plain decoding
    for _ in range(3):
        ch.observe(1, np.full((3, 3), -1.0), np.zeros(3), active)
    assert ch.next(2) == 2                         # probe after probe_every plain rounds
    ch.observe(2, np.array([[0, 0.9, 2.9]] * 3), np.array([1, 1, 1]), np.ones(3, bool))
    # κ = accepted / estimated over the drafted rounds, each weighted by decay per later drafted round
    assert ch.kappa == pytest.approx((0.9 * 1 + 3) / (0.9 * 0.4 + 2.7))
    assert ch.next(3) == 4


def test_chooser_backs_off_probing_while_plain_decoding_wins():
    ch = WidthChooser({1: 1.0, 2: 3.0, 4: 5.0}, probe_every=2, max_probe_every=8)
    low = np.array([[0, 0.1, 0.2]])
    one = np.ones(1, bool)
    assert ch.next(1) == 2
    ch.observe(2, low, np.zeros(1), one)
    widths = []
    for _ in range(30):
        w = ch.next(1)
        widths.append(w)
        ch.observe(w, low if w > 1 else np.full((1, 3), -1.0), np.zeros(1), one)
    probes = [i for i, w in enumerate(widths) if w > 1]
    assert np.diff(probes).tolist() == [5, 9, 9], widths     # after 2, 4, 8, 8 plain rounds


def test_round_seconds_from_a_table_entry():
    sig = "tree|tree=4x2x4|kernels=auto|deferred=0"
    e = {"t_round_ms": {sig: {"1": 1.0, "2": 2.0, "4": 3.0}}}
    assert round_seconds(e, sig, (1, 2, 4)) == {1: 1e-3, 2: 2e-3, 4: 3e-3}
    assert round_seconds(e, sig, (1, 2, 4, 8)) is None          # a width not calibrated
    assert round_seconds(e, "chain|chain=4|kernels=auto|deferred=0", (1, 2)) is None
    assert round_seconds(None, sig, (1,)) is None


# ------------------------------------------------------------------------------------------------
# The engine, the width changing across rounds
# ------------------------------------------------------------------------------------------------
def _forced(eng, widths, made: list):
    """Make `eng` run its rounds on width backends cycling through `widths`."""
    def backend(slots, kv_len, shapes=None):
        be = eng.width_backend(slots, kv_len, None, shapes)
        be.force = list(widths)
        made.append(be)
        return be
    eng.backend = backend
    return eng


@pytest.mark.parametrize("mode,widths", [("tree", (8, 1, 2, 4, 1, 1, 8)), ("chain", (5, 1, 2, 4)),
                                         ("tree-ready", (1, 4, 8, 2))])
@pytest.mark.parametrize("scripted", [True, False])
def test_greedy_equals_autoregressive_as_the_width_changes(mode, widths, scripted, models, reference):
    target, drafter = models
    prompts, params, ref = reference
    made = []
    if scripted:                                               # every scripted draft right
        drafter = _oracle(drafter, prompts, ref, wrong=False)
    eng = _forced(Engine(target, drafter, _spec(mode), slots=SLOTS, kv_len=KV), widths, made)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    (be,) = made
    assert set(be.history) == set(widths) and len(be.history) >= len(widths)
    if scripted:
        assert eng.last_stats.tau > 1.5


def _table(eng, ms: dict) -> BudgetTable:
    table = BudgetTable()
    table.add(dict(device_kind=jax.devices()[0].device_kind, model="m", batch=SLOTS, kv_len=KV, max_depth=4,
                   b_ver=8, t_round_ms={round_signature("tree", eng.round_shape(False, 8), 0): ms}))
    return table


def _calibrated(models, spec, ms: dict, probe_every: int, drafter=None):
    """An engine whose table holds round times `ms` for its signature, and the list of the backends it makes (their
    choosers probing every `probe_every` plain rounds); drafter: instead of the models' own."""
    target, own = models
    drafter = drafter or own
    base = Engine(target, drafter, spec, slots=SLOTS, kv_len=KV)
    eng = Engine(target, drafter, spec, slots=SLOTS, kv_len=KV, budget_table=_table(base, ms), model_name="m")
    made = []
    make = eng.backend

    def backend(*a, **kw):
        made.append(make(*a, **kw))
        made[-1].chooser.probe_every = probe_every
        return made[-1]
    eng.backend = backend
    return eng, made


@pytest.mark.parametrize("scripted", [False, True])
def test_engine_chooses_the_width_from_the_calibrated_table(scripted, models, reference):
    """With round times for its signature in the table, the engine's backend chooses the width each round, and
    the output equals plain decoding. Verification 2.5x a decode and more: after its first (widest) round plain
    decoding wins, with a probe every 4 plain rounds. Verification nearly free and the scripted drafter making every
    draft right: the widest tree wins."""
    target, drafter = models
    prompts, params, ref = reference
    spec = _spec("tree")
    ms = {"1": 1.0, "2": 1.2, "4": 1.4, "8": 1.5} if scripted else {"1": 1.0, "2": 2.5, "4": 5.0, "8": 9.0}
    right = _oracle(models[1], prompts, ref, wrong=False) if scripted else None   # every scripted draft right
    eng, made = _calibrated(models, spec, ms, probe_every=4, drafter=right)
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    (be,) = made
    assert isinstance(be, WidthBackend)
    hist = list(be.history)
    assert hist[0] == 2               # nothing read yet: the cheapest drafting round
    if scripted:
        assert 1 not in hist and hist.count(8) >= len(hist) // 2, hist
    else:
        assert hist.count(1) > len(hist) // 2 and 2 in hist and set(hist[2:]) <= {1, 2}, hist   # [1]: maybe dispatched before [0] was read
    # off: the fixed width
    off = Engine(target, drafter, SpecConfig(mode="tree", tree=spec.tree, verify_nodes=8, adaptive_width=False),
                 slots=SLOTS, kv_len=KV, budget_table=eng.budget_table, model_name="m")
    assert not isinstance(off.backend(SLOTS, KV), WidthBackend)


@pytest.mark.parametrize("mode", ["chain", "tree", "tree-packed"])
def test_sampling_matches_autoregressive_distribution_as_the_width_changes(mode, small):
    """tree-packed: the packed widths (batch-wide budgets, each round verified packed into its rows)."""
    target, drafter, prompt, exact, greedy = small
    spec = (SpecConfig(mode="tree", tree=TreeExpansion(depth=2, top_k=3, beam=3), verify_nodes=5,
                       packed_widths=mode == "tree-packed") if mode.startswith("tree")
            else SpecConfig(mode="chain", chain_length=2))
    made = []
    eng = _forced(Engine(target, drafter, spec, slots=256, kv_len=128),
                  (1, 5, 2) if mode.startswith("tree") else (1, 3, 2), made)
    params = [SamplingParams(max_tokens=3, seed=i, **(SETTINGS[i % 3 - 1] if i % 3 else {}))
              for i in range(SAMPLES)]
    out = eng.generate([prompt] * SAMPLES, params)
    seqs = np.array([r.token_ids for r in out])
    assert len(set(made[0].history)) >= 2
    assert (seqs[0::3] == np.array(greedy)).all()
    for j in range(2):
        s = seqs[j + 1::3]
        code = s[:, 0] * SV * SV + s[:, 1] * SV + s[:, 2]
        assert _chisq_pvalue(code, exact[j]) > 1e-3, (mode, SETTINGS[j])


def test_cli_calibrate_times_the_engines_rounds_and_the_engine_uses_them(model_dirs, capsys, models, reference):
    """`hyspec calibrate --drafter … --spec-mode tree` times the engine's round at every width bucket; an engine of
    the same options then chooses its width each round from the table, its output still plain decoding's."""
    out = model_dirs / "rounds.json"
    argv = ["calibrate", "--model", str(model_dirs / "target"), "--batch", str(SLOTS), "--kv-len", str(KV),
            "--nodes", "1,2", "--depth", "4", "--repeats", "2", "--out", str(out), "--json",
            "--drafter", str(model_dirs / "drafter"), "--spec-mode", "tree", "--tree-depth", "4", "--tree-topk", "2",
            "--tree-beam", "4", "--verify-nodes", "8", "--kernels", "reference"]
    (entry,) = _cli(capsys, argv)[0]
    target, drafter = models
    spec = SpecConfig(mode="tree", tree=TreeExpansion(4, 2, 4), verify_nodes=8, kernels="reference")
    eng = Engine(target, drafter, spec, slots=SLOTS, kv_len=KV, budget_table=BudgetTable.load(out),
                 model_name=entry["model"])
    sig = round_signature("tree", eng.round_shape(False, 8), 0)
    assert set(entry["t_round_ms"]) == {sig} and set(entry["t_round_ms"][sig]) == {"1", "2", "4", "8"}
    assert all(t > 0 for t in entry["t_round_ms"][sig].values())
    assert eng.round_seconds(SLOTS, KV) == {int(w): t / 1e3 for w, t in entry["t_round_ms"][sig].items()}
    assert isinstance(eng.backend(SLOTS, KV), WidthBackend)
    prompts, params, ref = reference
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    # a second calibration of another round keeps the first one's times
    _cli(capsys, argv[:16] + ["--drafter", str(model_dirs / "drafter"), "--spec-mode", "chain",
                               "--kernels", "reference"])
    (e2,) = BudgetTable.load(out).entries.values()
    assert sig in e2["t_round_ms"] and len(e2["t_round_ms"]) == 2


@pytest.mark.parametrize("mode,widths", [("mtp", (4, 1, 2, 1)), ("mtp-tree", (1, 8, 2, 4))])
def test_mtp_greedy_equals_autoregressive_as_the_width_changes(mode, widths, greedy_setup):
    """The MTP head's cache is appended on plain rounds too (its drafts stay the target's: output == ar)."""
    from tests.test_mtp_engine import _spec as mtp_spec
    target, head, prompts, params, ref = greedy_setup
    made = []
    eng = _forced(Engine(target, head, mtp_spec(mode), slots=4, kv_len=128), widths, made)
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    assert set(made[0].history) == set(widths) and eng.last_stats.tau > 1.0, eng.last_stats


def test_every_width_is_compiled_at_start_up(models, reference):
    """compile_buckets compiles the round of every width bucket: the width changing while serving compiles
    nothing."""
    target, drafter = models
    prompts, params, ref = reference
    spec = _spec("tree")
    base = Engine(target, drafter, spec, slots=SLOTS, kv_len=KV)
    eng = Engine(target, drafter, spec, slots=SLOTS, kv_len=KV, model_name="m",
                 budget_table=_table(base, {"1": 1.0, "2": 1.5, "4": 2.0, "8": 2.5}))
    eng.compile_buckets([(SLOTS, KV)], prompt_lengths=[max(map(len, prompts))], stochastic=(False,), progress=False,
                        cache=False)
    make = eng.backend

    def backend(*a, **kw):
        be = make(*a, **kw)
        be.force = [8, 1, 2, 4]
        return be
    eng.backend = backend
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    assert set(eng.last_stats.width_rounds) == {1, 2, 4, 8}, eng.last_stats.width_rounds
    assert eng.compilations_after_startup == 0


def test_only_the_kept_widths_compile_and_serving_compiles_nothing(models, reference):
    """Width 2 calibrated slower than width 4: its rounds are not compiled, never chosen, and the width changing
    while serving compiles nothing; greedy output equals plain decoding."""
    prompts, params, ref = reference
    eng, made = _calibrated(models, _spec("tree"), {"1": 1.0, "2": 1.6, "4": 1.5, "8": 1.8}, probe_every=2)
    eng.compile_buckets([(SLOTS, KV)], prompt_lengths=[max(map(len, prompts))], stochastic=(False,), progress=False,
                        cache=False)
    assert made[0].chooser.kept(SLOTS) == (1, 4, 8)
    assert made[0].describe_step(SLOTS).endswith("N in [1, 4, 8]")     # the start-up log names what compiles
    assert len(made[0]._warm_steps(None, False, SLOTS)) == 3
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    assert 2 not in made[-1].history and made[-1].history[0] == 4
    assert eng.compilations_after_startup == 0


def test_start_up_calibration_times_every_width_then_chooses(models, reference):
    """No table entry, calibrate_repeats set: the backend compiles every width's greedy round, times each over
    every decoding bucket, keeps the widths `kept_widths` keeps at its margin, compiles the sampling flavour of
    those only, starts its slots afresh (the timed rounds ran on them), and serves: greedy output equals plain
    decoding, nothing compiles while serving."""
    from hyspec_jax.compilation import CompileWatch
    target, drafter = models
    prompts, params, ref = reference
    eng = Engine(target, drafter, _spec("tree", calibrate_repeats=2), slots=SLOTS, kv_len=KV)
    be = eng.backend(SLOTS, KV, decode_buckets=(1,))
    assert isinstance(be, WidthBackend) and be.chooser is None and be.calibrate_repeats == 2
    compiled = []
    be.compile(compiled.append, prompt_lengths=[max(map(len, prompts))], workers=1)
    assert set(be.calibrated) == {1, SLOTS}
    assert all(sorted(t) == sorted(be.widths) and min(t.values()) > 0 for t in be.calibrated.values())
    for rows in (1, SLOTS):
        assert be.chooser.kept(rows) == tuple(kept_widths(be.calibrated[rows], be.width_margin))
    sampling = [c for c in compiled if "sampling" in c]
    assert sampling and all(str(list(be.chooser.kept(int(c.split("[")[2].split(",")[0])))) in c for c in sampling)
    eng.backend = lambda *a, **kw: be
    watch = CompileWatch()
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    assert watch.since == 0 and sum(be.width_counts.values()) > 0
    assert set(be.width_counts) <= set(be.chooser.kept(1)) | set(be.chooser.kept(SLOTS))
    with pytest.raises(ValueError, match="calibrate_repeats"):
        SpecConfig(mode="tree", calibrate_repeats=-1)


def test_a_start_up_calibration_is_kept_for_the_next_start(models, reference, tmp_path):
    """The times a start-up calibration measured are kept (`save_round_times`, one entry per decoding bucket and
    the full bucket), and a second engine with the same cache chooses from them without timing: its rounds are
    the kept widths' alone, greedy output equals plain decoding. Times kept by other code (another source digest),
    fewer repeats than asked, or reuse turned off (`--recalibrate`): timed again."""
    import json

    from hyspec_jax.compilation import source_digest
    target, drafter = models
    prompts, params, ref = reference
    cache = tmp_path / "hyspec" / "width_times.json"

    def backend(repeats: int = 2, reuse: bool = True, engine: list | None = None):
        eng = Engine(target, drafter, _spec("tree", calibrate_repeats=repeats), slots=SLOTS, kv_len=KV,
                     calibration_cache=CalibrationCache(cache, reuse=reuse))
        if engine is not None:
            engine.append(eng)
        return eng.backend(SLOTS, KV, decode_buckets=(1,))

    first = backend()
    assert first.chooser is None and not cache.exists()
    first.compile(None, prompt_lengths=[max(map(len, prompts))], workers=1)
    assert first.calibration_saved == cache and set(first.calibrated) == {1, SLOTS}
    entries = json.loads(cache.read_text())["entries"]
    assert sorted(e["batch"] for e in entries.values()) == [1, SLOTS]
    assert all(e["source"] == source_digest() and e["kv_len"] == KV for e in entries.values())

    made = []
    second = backend(engine=made)
    assert second.chooser is not None and second.calibrate_repeats == 0 and str(cache) in second.times_origin
    for rows, seconds in ((SLOTS, second.chooser.seconds), (1, second.chooser.rows_seconds[1])):
        assert seconds == pytest.approx(first.calibrated[rows], rel=1e-3, abs=1e-7)
    compiled = []
    second.compile(compiled.append, prompt_lengths=[max(map(len, prompts))], workers=1)
    assert not second.calibrated and second.calibration_saved is None
    rounds = [c for c in compiled if " round " in c]
    assert rounds and all(str(list(second.chooser.kept(int(c.split("[")[2].split(",")[0])))) in c for c in rounds)
    made[0].backend = lambda *a, **kw: second
    assert [r.token_ids for r in made[0].generate(prompts, params)] == ref

    assert backend(repeats=3).chooser is None                      # fewer repeats than asked: timed again
    assert backend(reuse=False).chooser is None                    # --recalibrate
    cache.write_text(json.dumps({"version": 1, "entries": {k: {**e, "round_repeats": "x"}
                                                           for k, e in entries.items()}}))
    assert backend().chooser is None                               # a malformed entry: timed again
    entries = {k: {**e, "source": "other code"} for k, e in entries.items()}
    cache.write_text(json.dumps({"version": 1, "entries": entries}))
    assert backend().chooser is None                               # kept by other code
    cache.write_text("{not json")
    assert backend().chooser is None                               # unreadable: nothing kept


@pytest.mark.parametrize("mode,widths,packed", [("tree", (8, 1, 4, 1, 2), False), ("ready", (1, 5, 2), False),
                                                ("tree", (2, 8, 1, 4), True)])
def test_deferred_commit_with_the_width_changing(mode, widths, packed, models, reference):
    """The deferred commit's rings (8 rows: folds inside every generation) under rounds of changing width (packed:
    the packed widths' rounds)."""
    target, drafter = models
    prompts, params, ref = reference
    made = []
    eng = _forced(Engine(target, _oracle(drafter, prompts, ref), _spec(mode, deferred_rows=8,
                                                                           packed_widths=packed),
                         slots=SLOTS, kv_len=KV), widths, made)
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    assert set(made[0].history) == set(widths)
