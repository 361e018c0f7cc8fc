"""The verify width chosen each round: from the calibrated round costs and the drafter's ρ, the number of nodes
per request that maximizes the whole batch's expected tokens per second — down to a chain, or to plain decoding.

The verify forward runs over a dense [B, N] forest (`hyspec_jax.tree`), so its cost is that of B·N nodes. The
engine compiles one round per width bucket w ∈ {1, 2, 4, …, N_max} (`width_buckets`; w = 1 is plain decoding:
no draft, the anchor alone is verified) and picks one bucket per round, so the verify's cost follows the
batch-total capacity C = slots · w the round selects (`spec.budget.width_gains` says which nodes).

The choice (`choose_width`): for every width with a calibrated round time T(B, w) (`hyspec calibrate`: the
engine's own round programs, `t_round_ms` in the budget table),

    rate(w) = live · (1 + κ · g(w)) / T(B, w),       g(1) = 0,

where g(w) is the mean over live requests of the expected accepted drafts at width w — Σ ρ(v) over the nodes
width w selects, reported by every drafting round (`RoundShape.gain_widths`) — and κ the measured ratio of
accepted drafts to the drafter's estimate at the width that ran (ρ is the drafter's belief, not a calibrated
probability). Plain decoding therefore wins whenever no width's expected tokens pay for its extra time.

Rounds are pipelined (the next is dispatched before the host reads the last), so a round's width is chosen from
the estimates of the rounds read so far. Every drafting round drafts the whole candidate tree, whatever its width,
so one round at the narrowest speculative width tells the gains of every width: the first round runs there. A plain
round drafts nothing and so reports no ρ: after `probe_every` plain rounds in a row one narrowest round refreshes
the estimates, and while plain decoding keeps winning the interval doubles (up to `max_probe_every`), so probing
costs little where speculation does not pay.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from hyspec_jax.runtime.backend import JitModel, SlotLayout, SpecBackend, StepResult
from hyspec_jax.runtime.programs import spread_rows
from hyspec_jax.spec.budget import BudgetTable, bucket_key
from hyspec_jax.spec.round import RoundOutput, RoundShape

HISTORY = 4096   # recent round widths a WidthBackend keeps

def width_buckets(max_width: int) -> tuple[int, ...]:
    """The compiled widths: 1 (plain decoding), the powers of two below max_width, and max_width."""
    if max_width < 1:
        raise ValueError(f"max_width must be >= 1, got {max_width}")
    out, w = [], 1
    while w < max_width:
        out.append(w)
        w *= 2
    return tuple(out + [max_width])


def round_signature(mode: str, shape: RoundShape, deferred_rows: int) -> str:
    """What a calibrated round time depends on beside the bucket (device, model, B, S): the mode, the draft's
    shape, the kernels and the deferred commit — the key of `t_round_ms` in a budget-table entry."""
    draft = (f"tree={shape.tree.depth}x{shape.tree.top_k}x{shape.tree.beam}" if shape.tree is not None
             else f"chain={shape.gamma}")
    packed = (f"|packed={shape.packed_rows}" if shape.packed_rows else "") + ("|packed-widths" if shape.packed_gains
                                                                              else "")
    return f"{mode}|{draft}|kernels={shape.kernel_impl}|deferred={deferred_rows}{packed}"


def round_seconds(entry: Mapping | None, signature: str, widths: Sequence[int]) -> dict[int, float] | None:
    """{width: seconds} of the calibrated round times of a budget-table entry for this round signature, when
    every one of `widths` was calibrated (else None: the round runs at its fixed width)."""
    if entry is None:
        return None
    ms = (entry.get("t_round_ms") or {}).get(signature) or {}
    if not all(str(w) in ms for w in widths):
        return None
    return {int(w): float(ms[str(w)]) / 1e3 for w in widths}


def choose_width(seconds: Mapping[int, float], gain: Mapping[int, float], live: int) -> int:
    """The width of highest expected tokens per second, live · (1 + gain[w]) / seconds[w] (gain[1] = 0; a
    width without a gain counts none); ties go to the narrower width."""
    if not seconds:
        raise ValueError("no calibrated round times")
    live = max(1, int(live))
    rate = {w: live * (1.0 + (0.0 if w == 1 else max(0.0, gain.get(w, 0.0)))) / t for w, t in seconds.items()}
    return max(sorted(rate), key=lambda w: (rate[w], -w))


def kept_widths(seconds: Mapping[int, float], margin: float = 0.0) -> dict[int, float]:
    """{width: seconds} of the widths worth compiling, in width order: from the widest down, a drafting width is
    dropped when a kept wider one costs less than (1 + margin) times as much — a wider round verifies a superset
    of the nodes, so its expected tokens are never fewer and the rate lost by running it instead is below the
    margin. Plain decoding (width 1) is dropped only when a wider width is strictly cheaper, so speculation never
    runs slower than plain decoding for the margin's sake. margin 0: exactly the widths that can win."""
    kept: dict[int, float] = {}
    for w in sorted(seconds, reverse=True):
        bound = seconds[w] * (1.0 if w == 1 else 1.0 + margin)
        if all(t >= bound for t in kept.values()):
            kept[w] = seconds[w]
    return dict(sorted(kept.items()))


@dataclasses.dataclass
class WidthChooser:
    """The host's per-round choice (see the module docstring): the latest per-request gains of each width and
    κ, the accepted / estimated ratio (exponentially weighted sums, `decay` per round that drafted)."""
    seconds: dict[int, float]
    probe_every: int = 16      # plain rounds in a row before one speculative round refreshes ρ (a setting)
    max_probe_every: int = 256  # the interval doubles up to this while probes find plain decoding best (a setting)
    margin: float = 0.0        # drop a width within this fraction of a wider one's round time (`kept_widths`)
    decay: float = 0.9         # weight of the past in κ's sums per drafted round (a setting)
    packed_slots: int = 0      # > 0: packed widths (width w = slots · w nodes for the batch), else w nodes a row
    # {R: {width: seconds}}: the calibrated round times of a round over R rows (`Backend.step_rows`), where known
    rows_seconds: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)
    gain: dict[int, float] = dataclasses.field(default_factory=dict)
    _accepted: float = 0.0
    _estimated: float = 0.0
    _plain_run: int = 0
    _interval: int = 0         # the current probe interval (0: probe_every)
    _probing: bool = False     # a probe was dispatched and not yet read
    # {R: {width: seconds}} of the kept widths (`kept`) per calibrated row count, None: the whole batch's
    _kept: dict[int | None, dict[int, float]] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # the tables are fixed: which widths can win is decided once, not every round
        self._kept = {r: kept_widths(t, self.margin) for r, t in {None: self.seconds, **self.rows_seconds}.items()}

    def _kept_seconds(self, rows: int | None) -> dict[int, float]:
        return self._kept.get(rows) or self._kept[None]

    def kept(self, rows: int | None = None) -> tuple[int, ...]:
        """The widths a round over `rows` rows can choose (the round times calibrated for that many rows where
        known, else the whole batch's): `kept_widths` at this chooser's margin. A wider round verifies a superset
        of the nodes, so its expected tokens are at least as many: a width strictly slower than a wider one never
        has the higher rate, one within the margin loses less than the margin; neither is chosen nor compiled."""
        return tuple(self._kept_seconds(rows))

    @property
    def kappa(self) -> float:
        return self._accepted / self._estimated if self._estimated > 0 else 1.0

    def next(self, live: int, rows: int | None = None) -> int:
        """The width of the next round for `live` decoding requests, run over `rows` rows (the round times of that
        many rows where calibrated, else those of the whole batch)."""
        spec = [w for w in self.kept(rows) if w > 1]
        if not spec:
            return 1
        if not self.gain:                      # nothing drafted yet: the cheapest drafting round tells every gain
            return spec[0]
        if self._plain_run >= (self._interval or self.probe_every):
            self._plain_run = 0                # one probe (the rounds in flight are not read yet)
            self._probing = True
            return spec[0]
        return self._best(live, rows)

    def _best(self, live: int, rows: int | None = None) -> int:
        # κ·g can pass what a width verifies (a few lucky rounds): w − 1 drafts a request, or packed, the batch's
        # slots · w nodes less the live anchors, shared by the live requests
        most = ((lambda w: (self.packed_slots * w - live) / max(live, 1)) if self.packed_slots
                else (lambda w: w - 1))
        return choose_width(self._kept_seconds(rows), {w: min(self.kappa * g, most(w)) for w, g in self.gain.items()},
                            live)

    def observe(self, width: int, gains: np.ndarray, accepted: np.ndarray, active: np.ndarray,
                rows: int | None = None) -> None:
        """A collected round: its width, gains [B, len(widths)] (−1: not drafted) in the order of
        `sorted(seconds)`, accepted drafts [B], active slots [B], the rows it ran over (None: every slot)."""
        active = np.asarray(active, bool)
        if width == 1 or not active.any():
            self._plain_run += width == 1
            return
        g = np.asarray(gains, np.float64)[active]
        if (g < 0).any():
            return
        self.gain = {w: float(v) for w, v in zip(sorted(self.seconds), g.mean(axis=0))}
        k = sorted(self.seconds).index(width)
        self._accepted = self.decay * self._accepted + float(np.asarray(accepted)[active].sum())
        self._estimated = self.decay * self._estimated + float(g[:, k].sum())
        if self._probing:                      # a probe read: back off while plain decoding still wins
            self._probing = False
            plain = self._best(int(active.sum()), rows) == 1
            self._interval = min(2 * (self._interval or self.probe_every), self.max_probe_every) if plain else 0
        self._plain_run = 0


@dataclasses.dataclass(frozen=True)
class WidthOptions:
    """The width buckets of a `WidthBackend` and how it chooses among them.

    widths: {w: {flavour: round shape}} (every shape reporting the same gain widths, sorted(widths)); seconds:
    calibrated round time per width (None: no choice, the widest width runs unless forced); user_capacity: a fixed
    batch-wide node budget (default slots · w); rows_seconds: {R: round time per width} of the decoding buckets'
    rounds, where calibrated; width_margin: `kept_widths`' margin; calibrate_repeats: without `seconds`, > 0 times
    every width's round at start-up (`compile`), that many rounds each per decoding bucket, and chooses from those
    times; on_calibrated(times): called with them, returns where it kept them (`calibration_saved`); times_origin:
    where `seconds` came from (logs)."""
    widths: dict[int, dict[bool, RoundShape]]
    seconds: dict[int, float] | None = None
    user_capacity: int | None = None
    rows_seconds: dict[int, dict[int, float]] | None = None
    width_margin: float = 0.0
    calibrate_repeats: int = 0
    on_calibrated: Callable[[dict[int, dict[int, float]]], Path | None] | None = None
    times_origin: str | None = None


class WidthBackend(SpecBackend):
    """A `SpecBackend` with one round per width bucket, the width chosen per round by a `WidthChooser` (or taken
    from `force`: calibration and tests). Its reported depth / verify_nodes are the widest round's."""

    def __init__(self, target: JitModel, drafter: JitModel, layout: SlotLayout, *, mode: str, choice: WidthOptions):
        """target, drafter, layout, mode: as `SpecBackend`; choice: the width buckets and how one is chosen
        (`WidthOptions`)."""
        widths, seconds, user_capacity = choice.widths, choice.seconds, choice.user_capacity
        rows_seconds, width_margin = choice.rows_seconds, choice.width_margin
        calibrate_repeats = choice.calibrate_repeats
        on_calibrated, times_origin = choice.on_calibrated, choice.times_origin
        super().__init__(target, drafter, layout, mode=mode, round_shapes=widths[max(widths)],
                         capacity=user_capacity or 1)
        self.widths = {w: self.with_logprobs(shapes) for w, shapes in widths.items()}
        self.user_capacity = user_capacity
        self.width_margin, self.calibrate_repeats = width_margin, int(calibrate_repeats)
        self.chooser = self._chooser(seconds, rows_seconds) if seconds else None
        self.calibrated: dict[int, dict[int, float]] = {}     # {rows: {width: seconds}} timed at start-up
        self.on_calibrated, self.times_origin = on_calibrated, times_origin
        self.calibration_saved: Path | None = None
        self.force: list[int] | None = None     # widths to cycle through instead of choosing
        # a server runs rounds without end: the recent widths for inspection, counts for the stats
        self.history: collections.deque[int] = collections.deque(maxlen=HISTORY)
        self.width_counts: collections.Counter[int] = collections.Counter()
        self.rounds = 0                         # rounds dispatched
        self.capacity = self.slots * max(widths) if user_capacity is None else int(user_capacity)

    def _chooser(self, seconds: dict[int, float], rows_seconds: dict[int, dict[int, float]] | None) -> WidthChooser:
        packed = self.widths[max(self.widths)][False].packed_gains
        return WidthChooser(seconds, packed_slots=self.slots if packed else 0, rows_seconds=dict(rows_seconds or {}),
                            margin=self.width_margin)

    def compile(self, progress=None, stochastic=(False, True), prompt_lengths=None, workers=None) -> None:
        """`Backend.compile`; without calibrated round times and with calibrate_repeats, first the greedy rounds
        of every width, then their times (`calibrate`), then the other flavour's rounds of the kept widths only."""
        if self.chooser is not None or self.calibrate_repeats < 1 or self.force:
            return super().compile(progress, stochastic, prompt_lengths, workers)
        super().compile(progress, (False,), prompt_lengths, workers)
        self.calibrate(self.calibrate_repeats)
        if any(stochastic):
            super().compile(progress, (True,), [], workers)       # no prompt bucket: the prefills are compiled

    def calibrate(self, repeats: int) -> dict[int, dict[int, float]]:
        """Time this backend's own greedy round at every width (`time_widths`, `repeats` rounds each) over every
        decoding bucket's rows and over all slots, choose from those times from now on (`WidthChooser` at this
        backend's margin), and start the slots afresh. The rounds run on the fresh slots' state: at start-up, not
        while serving. Returns {rows: {width: seconds}}."""
        from hyspec_jax.sharding import params_mesh
        if params_mesh(self.params) is not None:
            raise ValueError("start-up width calibration runs on one device; calibrate with `hyspec calibrate`")
        B = self.slots
        # a slot's context grows by up to depth + 1 tokens a round: the slots start afresh every `fits` repeats,
        # before their rounds could outgrow the KV length, and at every bucket's first
        fits = max(1, (self.kv_len - self.overshoot) // ((self.depth + 1) * len(self.widths)))

        def fresh_every_fits_repeats() -> Callable[[], None]:
            count = itertools.count()
            return lambda: self.reset_buffers() if next(count) % fits == 0 else None
        out = {R: time_widths(self, np.arange(B) < R, repeats, before_repeat=fresh_every_fits_repeats())
               for R in sorted(set(self.decode_buckets) | {B})}
        self.reset_buffers()
        self.calibrated = out
        self.chooser = self._chooser(out[B], {R: t for R, t in out.items() if R < B})
        if self.on_calibrated is not None:
            self.calibration_saved = self.on_calibrated(out)
        return out

    def describe_step(self, rows: int | None = None) -> str:
        """The widths a round over `rows` rows compiles (`_warm_steps`)."""
        widths = sorted(self.widths) if self.chooser is None or rows is None else list(self.chooser.kept(rows))
        return f"{self.mode} round N in {widths}"

    def _warm_steps(self, sampling, stochastic, rows):
        """One no-op round of every width a round over `rows` rows can choose (`WidthChooser.kept`; all of them
        without a chooser: a forced width may be any)."""
        B = self.slots
        active, steps = np.zeros(B, bool), np.zeros(B, np.int32)

        def round_of(w: int):
            return self.collect(self._run(w, active, sampling, steps, stochastic, None, self.step_rows(active)))
        widths = sorted(self.widths) if self.chooser is None else self.chooser.kept(rows)
        return [functools.partial(round_of, w) for w in widths]

    def next_width(self, live: int, rows: int | None = None) -> int:
        if self.force:
            return self.force[self.rounds % len(self.force)]
        return self.chooser.next(live, rows) if self.chooser is not None else max(self.widths)

    def round_width(self, active: np.ndarray) -> int:
        """The width of the next round over the `active` slots (`next_width` for their live count and rows). The
        chooser moves on (a probe is counted), so call it once per round: `dispatch` does, unless given the width."""
        active = np.asarray(active, bool)
        return self._width_over(active, self.step_rows(active))

    def _width_over(self, active: np.ndarray, rows: np.ndarray | None) -> int:
        return self.next_width(int(active.sum()), self.slots if rows is None else len(rows))

    def dispatch(self, active, sampling, steps, stochastic, penalty=None, width: int | None = None):
        """`Backend.dispatch` at `width` (None: `round_width` chooses). Across hosts process 0 chooses and every
        other process runs its width (`runtime.multihost`): a follower never collects, so its chooser never
        learns, and a width of its own would launch another program than process 0's."""
        active = np.asarray(active, bool)
        rows = self.step_rows(active)
        if width is None:
            w = self._width_over(active, rows)
        elif (w := int(width)) not in self.widths:
            raise ValueError(f"width {w} is not one of this backend's {sorted(self.widths)}")
        self.history.append(w)
        self.width_counts[w] += 1
        self.rounds += 1
        return self._run(w, active, sampling, steps, stochastic, penalty, rows)

    def _run(self, w, active, sampling, steps, stochastic, penalty=None, rows=None):
        shape = self.widths[w][bool(stochastic)]
        host_out = self._round(shape, self.user_capacity or self.slots * w, active, sampling, steps, penalty, rows)
        return host_out, w, active.copy(), len(shape.gain_widths), rows

    def collect(self, handle) -> StepResult:
        host_out, w, active, G, rows = handle
        out = RoundOutput.unpack(spread_rows(np.asarray(host_out), rows, self.slots), G, self.logprobs)
        if self.chooser is not None and G:
            self.chooser.observe(w, out.gains, out.accepted, active, self.slots if rows is None else len(rows))
        return StepResult(tokens=out.tokens, count=out.count, accepted=out.accepted, drafted=w - 1,
                          logprobs=out.logprobs)


CALIBRATION_CACHE_FILE = "width_times.json"


def calibration_cache_path() -> Path:
    """Where a server keeps the round times its start-up calibration measured (`save_round_times`), so that its
    next start on this machine chooses from them instead of timing every width again: <hyspec cache>/width_times.json."""
    from hyspec_jax.paths import cache_dir
    return cache_dir() / CALIBRATION_CACHE_FILE


@dataclasses.dataclass(frozen=True)
class CalibrationCache:
    """Where an engine's start-up calibration keeps its round times (`save_round_times`) and whether it first looks
    up what an earlier start kept there (`cached_round_times`; reuse False: `--recalibrate`, time them again)."""
    path: Path
    reuse: bool = True


@dataclasses.dataclass(frozen=True)
class RoundTimesKey:
    """What a start-up calibration's kept round times are valid for, but the decoding bucket's rows: the table file,
    the device kind, the model, the KV length, the draft depth and the round signature, timed by `source` (the
    package's `compilation.source_digest`) with `repeats` rounds a width."""
    path: Path
    device_kind: str
    model: str
    kv_len: int
    depth: int
    signature: str
    repeats: int
    source: str


def cached_round_times(key: RoundTimesKey, rows: int, widths: Sequence[int]) -> dict[int, float] | None:
    """{width: seconds} an earlier start-up calibration saved at `key.path` for exactly this bucket (`key`'s device
    kind, model, KV length and draft depth, and `rows`) and round signature, timed by the same code with at least
    `key.repeats` rounds a width; else None. A missing or unreadable file holds nothing."""
    try:
        e = BudgetTable.load(key.path).entries.get(bucket_key(key.device_kind, key.model, rows, key.kv_len,
                                                               key.depth))
        if not isinstance(e, dict) or e.get("source") != key.source:
            return None
        if int((e.get("round_repeats") or {}).get(key.signature, 0)) < key.repeats:
            return None
        return round_seconds(e, key.signature, widths)
    except (OSError, ValueError, TypeError, AttributeError):      # a file edited or torn by hand: time again
        return None


def save_round_times(key: RoundTimesKey, times: Mapping[int, Mapping[int, float]]) -> None:
    """Add a start-up calibration's {rows: {width: seconds}} to the table at `key.path` (one budget-table entry per
    rows, `t_round_ms` by round signature; an entry timed by other code is replaced whole; `BudgetTable.save`
    writes atomically)."""
    import datetime
    path, device_kind, model, kv_len, depth = key.path, key.device_kind, key.model, key.kv_len, key.depth
    signature, repeats, source = key.signature, key.repeats, key.source
    try:
        table = BudgetTable.load(path)
    except (OSError, ValueError):
        table = BudgetTable()
    for rows, seconds in times.items():
        key = bucket_key(device_kind, model, rows, kv_len, depth)
        old = table.entries.get(key)
        same = isinstance(old, dict) and old.get("source") == source
        rounds = dict(old.get("t_round_ms") or {}) if same else {}
        reps = dict(old.get("round_repeats") or {}) if same else {}
        rounds[signature] = {str(w): round(1e3 * t, 4) for w, t in sorted(seconds.items())}
        reps[signature] = int(repeats)
        table.entries[key] = dict(device_kind=device_kind, model=model, batch=int(rows), kv_len=int(kv_len),
                                  max_depth=int(depth), t_round_ms=rounds, round_repeats=reps, source=source,
                                  measured=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    path.parent.mkdir(parents=True, exist_ok=True)
    table.save(path)


def time_widths(backend: WidthBackend, active: np.ndarray, repeats: int,
                before_repeat: Callable[[], None] | None = None) -> dict[int, float]:
    """{width: seconds} of one greedy round of `backend` at each of its widths over the `active` slots: the median
    of `repeats` rounds after one untimed, each dispatched and read back. The widths are interleaved, in an order
    rotated by the repeat, so a drift of the machine's speed (another process, clocks) moves every width alike;
    before_repeat() runs untimed before each repeat (a fresh prefill, fresh slots). One home for `hyspec
    calibrate` and a server's start-up calibration (`WidthBackend.calibrate`)."""
    import statistics
    import time
    B, widths = backend.slots, sorted(backend.widths)
    z = np.zeros(B, np.float32)
    samp = backend.sampling(z, np.ones(B, np.float32), z.astype(np.int32), z.astype(np.uint32))
    steps = np.zeros(B, np.int32)
    active = np.asarray(active, bool)
    rows = backend.step_rows(active)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for r in range(repeats + 1):                          # r = 0: the warm-up, untimed
        if before_repeat is not None:
            before_repeat()
        for w in widths[r % len(widths):] + widths[:r % len(widths)]:
            steps += 1
            t0 = time.perf_counter()
            backend.collect(backend._run(w, active, samp, steps, False, None, rows))
            if r:
                times[w].append(time.perf_counter() - t0)
    return {w: statistics.median(times[w]) for w in widths}


__all__ = ["width_buckets", "round_signature", "round_seconds", "choose_width", "kept_widths", "WidthChooser",
           "WidthBackend", "time_widths", "calibration_cache_path", "cached_round_times", "save_round_times",
           "CalibrationCache", "RoundTimesKey", "WidthOptions"]
