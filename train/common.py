"""Shared training machinery: device mesh and sharding rules (data parallel + FSDP of parameters), mixed
precision casts, optax schedules, orbax checkpoints with the data position, JSONL metrics + progress bar.

Multi-host (`jax.distributed`, `launch.init_distributed`): the mesh spans every process's devices; every process
runs the same steps, places parameters and optimizer state from identical host values (`put_global`) and reads
only its own rows of each global batch (`global_batch`); orbax writes a checkpoint from all of them, process 0
alone the metrics, progress bar and exported files."""

from __future__ import annotations

import abc

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

F32 = jnp.float32
DATA = "data"


# ------------------------------------------------------------------------------------------------
# Devices, mesh, sharding
# ------------------------------------------------------------------------------------------------
def make_mesh(num_devices: int | None = None) -> Mesh:
    """A data mesh over the first `num_devices` of every process's devices (0 / None: all of them)."""
    devs = jax.devices()
    n = len(devs) if num_devices in (None, 0) else num_devices
    if n > len(devs):
        raise ValueError(f"asked for {n} devices, only {len(devs)} present")
    if jax.process_count() > 1 and n != len(devs):
        # a process without a device in the mesh would hold no rows of the batch and no shard of the state
        raise ValueError(f"across {jax.process_count()} processes the mesh takes all {len(devs)} devices "
                         f"(--devices 0), not {n}")
    return Mesh(np.asarray(devs[:n]), (DATA,))


def fsdp_spec(shape: tuple[int, ...], n: int, fsdp: bool, min_size: int = 1 << 12) -> P:
    """Shard the largest dimension divisible by the mesh size (FSDP); small or indivisible leaves replicate."""
    if not fsdp or n == 1 or not shape or math.prod(shape) < min_size:
        return P()
    dims = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in dims:
        if shape[i] % n == 0:
            spec = [None] * len(shape)
            spec[i] = DATA
            return P(*spec)
    return P()


def tree_shardings(tree: Any, mesh: Mesh, fsdp: bool) -> Any:
    n = mesh.devices.size
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), n, fsdp)), tree)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, P(DATA, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def is_primary() -> bool:
    """The process that writes metrics, progress and exported files (every process when there is one)."""
    return jax.process_index() == 0


def put_global(tree: Any, shardings: Any) -> Any:
    """A tree placed on (possibly multi-process) shardings from values equal on every process."""
    from hyspec_jax.sharding import _global_source
    return jax.device_put(_global_source(tree), shardings)


def process_rows(sharding: NamedSharding, rows: int) -> tuple[int, int]:
    """[lo, hi): the rows of a global batch of `rows` split over the data axis that this process's devices hold
    (all of them with one process)."""
    shape = (rows,) + (1,) * max(len(sharding.spec) - 1, 0)
    spans = sorted({(s[0].start or 0, rows if s[0].stop is None else s[0].stop)
                    for s in sharding.addressable_devices_indices_map(shape).values()})
    lo, hi = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != hi - lo:
        raise ValueError(f"this process's rows of the batch are not contiguous: {spans}")
    return lo, hi


def global_batch(read: Callable[[int, int], np.ndarray], rows: int, sharding: NamedSharding) -> jax.Array:
    """The global batch [rows, ...] split over the data axis, each process reading only its own rows:
    read(lo, hi) -> rows [lo, hi) of the batch every process names alike (e.g. a pure function of the step)."""
    lo, hi = process_rows(sharding, rows)
    local = np.asarray(read(lo, hi))
    return jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))


def batch_from_host(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """`global_batch` of an array every process holds whole (validation windows): each places its own rows."""
    return global_batch(lambda lo, hi: x[lo:hi], len(x), sharding)


def cast_compute(params: Any, dtype) -> Any:
    """Mixed precision: matrices (ndim >= 2) in the compute dtype; vectors (norms, gates, biases) stay fp32.
    The fp32 master copy is what the optimizer updates."""
    if dtype == F32:
        return params
    return jax.tree.map(lambda x: x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


# ------------------------------------------------------------------------------------------------
# Optimizer
# ------------------------------------------------------------------------------------------------
def lr_schedule(peak: float, steps: int, warmup: int, min_ratio: float = 0.1) -> optax.Schedule:
    warmup = max(1, min(warmup, steps - 1)) if steps > 1 else 1
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), peak * min_ratio)


def warmup_cosine(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up from 0 over `warmup` steps, then cosine to peak·min_ratio at `total` (host side: the
    total may be fixed after a throughput measurement, see `time_budget_s`)."""
    if step < warmup:
        return peak * step / max(warmup, 1)
    frac = min(1.0, (step - warmup) / max(total - warmup, 1))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def adamw_direction(*, weight_decay: float, clip: float, b1: float = 0.9, b2: float = 0.95
                    ) -> optax.GradientTransformation:
    """AdamW without its learning rate (clip by global norm → Adam → decoupled decay on matrices); the
    update is −lr · direction, with lr passed to the step (optax.adamw = this + scale_by_learning_rate)."""
    mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(clip), optax.scale_by_adam(b1=b1, b2=b2),
                       optax.add_decayed_weights(weight_decay, mask))


def apply_lr(params: Any, direction: Any, lr: jax.Array) -> Any:
    return jax.tree.map(lambda p, d: (p - lr * d).astype(p.dtype), params, direction)


# ------------------------------------------------------------------------------------------------
# Checkpoints (orbax): train state + JSON metadata (data position, configs)
# ------------------------------------------------------------------------------------------------
class Checkpoints:
    def __init__(self, directory: str | Path, keep: int = 2):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self.dir = Path(directory).absolute()
        self.mngr = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                                                         create=True))

    def latest(self) -> int | None:
        return self.mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        ocp = self._ocp
        self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
        self.mngr.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        ocp = self._ocp
        out = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                              meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def close(self) -> None:
        self.mngr.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class ResumableTrainer(abc.ABC):
    """Save and resume of a trainer (target, drafter, MTP head): its state with JSON metadata — the data position,
    the run's config and the configs that identify what is trained. A subclass sets `ckpt`, `state`, `state_sh`,
    `cfg`, `out`, `total_steps` and returns `identity()`: {meta key: JSON-able config} that a resumed run must
    match; `data_meta` / `extra_meta` / `check_resume` add to it."""

    @abc.abstractmethod
    def identity(self) -> dict:
        """{checkpoint metadata key: JSON-able config} identifying what is trained."""

    def extra_meta(self) -> dict:
        return {}

    def data_meta(self, step: int) -> dict:
        return {"seed": self.cfg.seed, "next_step": step, "seq_len": self.cfg.seq_len}

    def check_resume(self, meta: dict) -> None:
        """Raise ValueError when the checkpoint's data position cannot continue under this run's settings."""

    def _start_run(self, cfg, *batch_fields: str) -> None:
        """The run's config, its output folder (made) and device mesh; every `batch_fields` size of cfg
        (default batch_size) must split evenly over the mesh's devices."""
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.mesh = make_mesh(cfg.devices)
        n = self.mesh.devices.size
        fields = batch_fields or ("batch_size",)
        if any(getattr(cfg, f) % n for f in fields):
            sizes = " and ".join(f"{f} {getattr(cfg, f)}" for f in fields)
            raise ValueError(f"{sizes} must be divisible by the {n} devices")

    def _resume_latest(self) -> None:
        """Open the run's checkpoints and continue from the latest one there, if any (else start at step 0)."""
        self.ckpt = Checkpoints(self.out / "ckpt", keep=self.cfg.keep)
        self.start_step = 0
        latest = self.ckpt.latest()
        if latest is not None:
            self._restore(latest)

    def _start_student(self, trainable: Any, frozen: dict, weight_decay: float) -> None:
        """The drafter's and MTP head's common set-up after their models and data (`distill.student_windows`):
        the optimizer and sharded state over `trainable`, the replicated frozen parts, the compiled step (the
        subclass's `_build`, once the state is placed), and a resume from the latest checkpoint."""
        cfg = self.cfg
        self.num_trainable = int(sum(x.size for x in jax.tree.leaves(trainable)))
        self.tx = adamw_direction(weight_decay=weight_decay, clip=cfg.clip)
        state = {"train": trainable, "opt": self.tx.init(trainable), "step": jnp.zeros((), jnp.int32)}
        self.state_sh = tree_shardings(state, self.mesh, True)
        self.state = put_global(state, self.state_sh)
        self.frozen = put_global(frozen, replicated(self.mesh))
        self.batch_sh = batch_sharding(self.mesh)
        self._build()
        self.total_steps = cfg.steps
        self._resume_latest()

    def _meta(self, step: int) -> dict:
        return {"step": step, "total_steps": self.total_steps, "data": self.data_meta(step),
                "train_config": self.cfg.to_dict(), **self.identity(), **self.extra_meta()}

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.state, self._meta(step))

    def _restore(self, step: int) -> None:
        state, meta = self.ckpt.restore(step, abstract_with_shardings(self.state, self.state_sh))
        for key, value in self.identity().items():
            if meta.get(key) != json.loads(json.dumps(value)):
                raise ValueError(f"{self.out / 'ckpt'}: checkpoint of another {key.replace('_', ' ')}; "
                                 "use a fresh --out")
        self.check_resume(meta)
        self.state = state
        self.start_step = int(meta["data"]["next_step"])
        self.total_steps = int(meta.get("total_steps", self.cfg.steps))

    def run_steps(self, desc: str, start_fields: dict, stop_after: int | None = None) -> dict:
        """The loop of the trainers whose step is `lr_at` + `train_step` (drafter, MTP head): the start / resume
        record (start_fields after the step), an evaluation at step 0, `train_steps` under the time budget.
        Returns the summary (losses of this call, last validation, throughput)."""
        cfg = self.cfg
        stop = stop_after if stop_after is not None else 1 << 62
        log = MetricsLog(self.out / "metrics.jsonl", total=self.total_steps, initial=self.start_step, desc=desc,
                         progress=cfg.progress)
        log.write({"event": "start" if self.start_step == 0 else "resume", "step": self.start_step, **start_fields})
        if self.start_step == 0 and cfg.eval_every:
            log.write({"step": 0, "val": self.evaluate()})
        clock = StepClock(cfg.time_budget_s, cfg.batch_size * cfg.seq_len, resumed=self.start_step > 0,
                          calibrate_after=5)
        losses, val, step = train_steps(
            self, cfg, log, clock, stop, lambda step: (self.lr_at(step), self.train_step(step)),
            lambda lr, m: {"lr": lr, **{k: round(v, 5) for k, v in m.items()}})
        log.close()
        return {"losses": losses, "val": val, "step": step, "tokens_per_s": clock.throughput,
                "trainable_params": self.num_trainable}


# ------------------------------------------------------------------------------------------------
# Logging
# ------------------------------------------------------------------------------------------------
class MetricsLog:
    """JSONL metrics always; a tqdm progress bar when stderr is a terminal."""

    def __init__(self, path: str | Path, total: int, initial: int = 0, desc: str = "train",
                 progress: bool | None = None):
        self.path = Path(path)
        self.t0 = time.perf_counter()
        self.f = None
        self.bar = None
        if not is_primary():        # multi-host: one process logs for all (they run the same steps)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a")
        show = sys.stderr.isatty() if progress is None else progress
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def write(self, record: dict) -> None:
        if self.f is None:
            return
        record = {"time": round(time.perf_counter() - self.t0, 3), **record}
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def progress(self, n: int, postfix: dict | None = None) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.f is not None:
            self.f.close()


class StepClock:
    """A training run's clock: throughput from the first metrics flush on (that flush includes compilation), and
    the time budget — the total steps fixed once from the measured seconds per step, and the budget spent 5%
    past it (the caller then checkpoints and stops)."""

    def __init__(self, time_budget_s: float, tokens_per_step: int, resumed: bool, calibrate_after: int = 10,
                 call_limit_s: float = 0.0):
        self.budget_s = time_budget_s
        self.call_limit_s = call_limit_s   # > 0: this invocation stops (checkpointed, resumable) after this long
        self.call_limit_hit = False
        self.tokens_per_step = tokens_per_step
        self.calibrate_after = calibrate_after
        self.t_start = time.perf_counter()
        self.t_mark, self.mark, self.warm = 0.0, 0, False
        self.calibrated = resumed          # a resumed run keeps the total it was given
        self.throughput: float | None = None
        self.budget_hit = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def flush(self, step: int, total_steps: int, max_steps: int, log: MetricsLog) -> int:
        """After the metrics flush at `step`: throughput, budget; returns the total steps (fixed once)."""
        now = time.perf_counter()
        if not self.warm:
            self.warm, self.t_mark, self.mark = True, now, step
        elif step > self.mark:
            self.throughput = (step - self.mark) * self.tokens_per_step / (now - self.t_mark)
            log.write({"step": step, "tokens_per_s": round(self.throughput, 1)})
            if self.budget_s and not self.calibrated and step - self.mark >= self.calibrate_after:
                self.calibrated = True
                per_step = (now - self.t_mark) / (step - self.mark)
                total_steps = max(step + 1, min(max_steps, step + int((self.budget_s - (now - self.t_start)) / per_step)))
                log.write({"event": "total_steps", "step": step, "total_steps": total_steps,
                           "seconds_per_step": round(per_step, 5)})
                if log.bar is not None:
                    log.bar.total = total_steps
        if self.budget_s and now - self.t_start >= self.budget_s * 1.05:
            self.budget_hit = True
        if self.call_limit_s and now - self.t_start >= self.call_limit_s:
            self.call_limit_hit = True
        if (self.budget_s or self.call_limit_s) and jax.process_count() > 1:
            # every process must take the same number of steps: process 0's clock decides for all
            from jax.experimental import multihost_utils
            total_steps, hit, cut = (int(x) for x in multihost_utils.broadcast_one_to_all(
                np.asarray([total_steps, self.budget_hit, self.call_limit_hit], np.int32)))
            self.budget_hit, self.call_limit_hit = bool(hit), bool(cut)
        return total_steps


class Trainer(Protocol):
    """What `train_steps` needs of a trainer (train.target.TargetTrainer, train.drafter.DrafterTrainer)."""
    start_step: int
    total_steps: int

    def save(self, step: int) -> None: ...

    def evaluate(self) -> dict: ...


def train_steps(trainer: Trainer, cfg: Any, log: MetricsLog, clock: StepClock, stop: int,
                step_fn: Callable[[int], tuple[float, dict]],
                record: Callable[[float, dict[str, float]], dict]) -> tuple[dict[int, float], dict, int]:
    """The step loop of every trainer: from trainer.start_step to min(trainer.total_steps, stop).

    step_fn(step) runs one optimiser step and returns (its learning rate, its metrics as device arrays, with
    a "loss"); those are read back only at a log flush (every cfg.log_every steps, the first step and the last),
    so the host never waits on a step it has just launched; record(lr, metrics) -> the fields of its metrics
    line. After a flush the clock may fix the total steps (time budget), end the run, or end this invocation
    (its call limit: checkpointed, no evaluation, the run resumes from there). Checkpoints every cfg.ckpt_every
    steps and where it stops; evaluates every cfg.eval_every steps and once at the end (a run cut by the budget
    evaluates once, at the end). Returns (loss per step, the last validation, the step reached) and advances
    trainer.start_step to it."""
    losses: dict[int, float] = {}
    val: dict = {}
    step = trainer.start_step
    pending: list[tuple[int, float, dict]] = []
    budget_hit = False
    while step < min(trainer.total_steps, stop):
        lr, metrics = step_fn(step)
        pending.append((step, lr, metrics))
        step += 1
        end = min(trainer.total_steps, stop)
        if step % cfg.log_every == 0 or step == end or step == trainer.start_step + 1:
            for s, lr_s, m in pending:
                m = {k: float(v) for k, v in m.items()}
                losses[s] = m["loss"]
                log.write({"step": s + 1, **record(lr_s, m)})
            log.progress(len(pending), {"loss": f"{losses[step - 1]:.3f}"})
            pending = []
            trainer.total_steps = clock.flush(step, trainer.total_steps, cfg.steps, log)
        budget_hit = clock.budget_hit
        end = min(trainer.total_steps, stop)
        cut = clock.call_limit_hit and step < end and not budget_hit
        if step % cfg.ckpt_every == 0 or step == end or budget_hit or cut:
            trainer.save(step)
        if cfg.eval_every and step % cfg.eval_every == 0 and step != end and not budget_hit and not cut:
            val = trainer.evaluate()
            log.write({"step": step, "val": val})
        if budget_hit:
            log.write({"event": "time_budget", "step": step, "seconds": round(clock.elapsed(), 1)})
            break
        if cut:
            log.write({"event": "call_limit", "step": step, "seconds": round(clock.elapsed(), 1)})
            break
    if step == trainer.total_steps or budget_hit:
        val = trainer.evaluate()
        log.write({"step": step, "val": val})
    trainer.start_step = step
    return losses, val, step


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def to_host(tree: Any) -> Any:
    """Host copies of a tree's arrays; arrays sharded across processes are gathered (a collective: every process
    calls it at the same point)."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(one, tree)
