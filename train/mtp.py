"""MTP head training on a frozen target (`hyspec train-mtp`): the head a Qwen3.5 / Qwen3-Next checkpoint ships as
`mtp.*`, trained for a target that has none (the embedded model) or further trained from the one it has.

Data: windows of the corpus train split, or target-generated continuations from `hyspec build-distill`
(`train.distill.DistillSampler`). The frozen target runs `train.forward.train_forward` over each window inside
the step, giving its final-norm hiddens h_p; the head's first step at every position p reads (t_{p+1}, h_p)
(`MTPHead.teacher_forced`, causal over the window) and is trained on the next-next token:
    L = mean_p CE(softmax(LM head(g_p)), t_{p+2}),
the target's LM head and embedding frozen. With draft_steps S > 1 the head also runs its recursive steps as
drafting does (step d reads t_{p+1+d} and step d − 1's output g) and the loss averages the S steps; with distill
w > 0 each step's CE mixes in (weight w) the target's own distribution for that token, which greedy verification
accepts by argmax. Metrics: the loss, acc (argmax = t_{p+2}) and agree (argmax = the target's own argmax at p + 1:
the greedy acceptance rate of the first draft, teacher-forced; agree_d for step d).
Optimiser, mesh and checkpoints are the other trainers' (`train.common`: AdamW, warm-up + cosine, data parallel,
orbax with the data position). The head is written into a model directory as `mtp.*` tensors
(`io.mtp_io.save_mtp`), the layout `hyspec generate --spec-mode mtp` reads from real Qwen checkpoints.
Heads of one layer only (every published head has one; a deeper head's later layers serve later draft steps).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hyspec_jax.config import resolve_dtype
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.io.mtp_io import has_mtp, load_mtp, save_mtp
from hyspec_jax.models.drafter import target_heads
from hyspec_jax.models.mtp import create_mtp
from hyspec_jax.train import common
from hyspec_jax.train.distill import student_windows
from hyspec_jax.train.forward import train_forward

F32 = jnp.float32


@dataclasses.dataclass
class MTPTrainConfig:
    target: str
    corpus: str
    out: str
    data: str | None = None            # distillation data dir (build-distill); None = corpus windows
    from_target: bool = True           # start from the target directory's own mtp.* when it has them
    draft_steps: int = 1               # recursive draft steps trained (the mode's draft length: 3)
    distill: float = 0.0               # weight of the target's distribution against the corpus token
    step_decay: float = 1.0            # step d's loss weight step_decay^d (normalised)
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1000
    lr: float = 1e-3
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 1.0
    chunk: int = 64                    # GDN chunk of the target's training forward
    seed: int = 0
    dtype: str = "auto"
    devices: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 32             # validation windows per domain (each evaluated once)
    ckpt_every: int = 200
    keep: int = 2
    time_budget_s: float = 0.0
    export_dtype: str = "float32"
    progress: bool | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def mtp_loss(logits: jax.Array, tokens: jax.Array, target_logits: jax.Array, *,
             distill: float = 0.0, step_decay: float = 1.0) -> tuple[jax.Array, dict]:
    """logits [S,B,T−1,V] of the head's S draft steps (`MTPHead.teacher_forced`), tokens [B,T], the target's logits
    [B,T,V] -> (loss, metrics). Step d at pair p predicts t_{p+d+2}, entries p < T − 2 − d: over the steps, weighted
    step_decay^d (a later step counts only where the earlier drafts were accepted) and normalised, of
    (1 − distill) · CE against that token + distill · CE against the target's own distribution there (its logits
    at p + d + 1, which greedy verification accepts by argmax). Metrics: acc and agree (argmax = the target's argmax)
    of step 0, agree_{d} of step d ≥ 1."""
    S = logits.shape[0]
    T = tokens.shape[1]
    loss, metrics = 0.0, {}
    weights = [step_decay ** d for d in range(S)]
    for d in range(S):
        n = T - 2 - d
        lg = logits[d, :, :n].astype(F32)
        labels = tokens[:, 2 + d:]
        logp = jax.nn.log_softmax(lg, axis=-1)
        t_lg = target_logits[:, 1 + d:T - 1].astype(F32)
        hard = -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
        soft = -jnp.mean(jnp.sum(jax.nn.softmax(t_lg, axis=-1) * logp, axis=-1)) if distill else 0.0
        loss = loss + weights[d] / sum(weights) * ((1.0 - distill) * hard + distill * soft)
        pred = jnp.argmax(lg, axis=-1)
        metrics["agree" if d == 0 else f"agree_{d}"] = jnp.mean((pred == jnp.argmax(t_lg, axis=-1)).astype(F32))
        if d == 0:
            metrics["acc"] = jnp.mean((pred == labels).astype(F32))
    return loss, {"loss": loss, **metrics}


class MTPTrainer(common.ResumableTrainer):
    def __init__(self, cfg: MTPTrainConfig):
        self._start_run(cfg)
        if cfg.seq_len < cfg.draft_steps + 2:
            raise ValueError(f"seq_len must be >= draft_steps + 2 = {cfg.draft_steps + 2} (a pair and the token its "
                             "last step predicts)")
        if cfg.draft_steps < 1 or not 0.0 <= cfg.distill <= 1.0 or not 0.0 < cfg.step_decay <= 1.0:
            raise ValueError("draft_steps must be >= 1, distill within [0, 1] and step_decay within (0, 1]")
        self.dt = resolve_dtype(cfg.dtype)
        tcfg, target = load_pretrained(cfg.target, dtype=F32)
        if cfg.from_target and has_mtp(cfg.target):
            head = load_mtp(cfg.target, tcfg, dtype=F32)
            self.hcfg = head.config
        else:
            self.hcfg = dataclasses.replace(tcfg, mtp_num_hidden_layers=1)
            head = create_mtp(self.hcfg, seed=cfg.seed)
        if head.num_layers != 1:
            raise ValueError(f"{cfg.target}: an MTP head of {head.num_layers} layers; train-mtp trains one-layer heads")
        self.tcfg = tcfg
        self.t_graphdef, t_params = nnx.split(target)
        self.h_graphdef, h_params = nnx.split(head)
        self.sampler, self.val = student_windows(cfg)
        self._start_student(h_params, {"target": t_params, "heads": target_heads(target)},
                            weight_decay=cfg.weight_decay)

    def _forward(self, train, frozen, tokens):
        dt = self.dt
        target = nnx.merge(self.t_graphdef, common.cast_compute(frozen["target"], dt))
        t_logits, hidden, _, _ = train_forward(target, tokens, chunk=min(self.cfg.chunk, tokens.shape[1]))
        t_logits, hidden = jax.lax.stop_gradient(t_logits), jax.lax.stop_gradient(hidden)
        heads = jax.tree.map(lambda x: x.astype(dt), frozen["heads"])
        head = nnx.merge(self.h_graphdef, common.cast_compute(train, dt))
        g = head.teacher_forced(jax.lax.stop_gradient(heads.embed), tokens, hidden, steps=self.cfg.draft_steps)
        return mtp_loss(heads.logits(g), tokens, t_logits, distill=self.cfg.distill,
                        step_decay=self.cfg.step_decay)

    def _build(self) -> None:
        tx = self.tx
        rep = common.replicated(self.mesh)
        frozen_sh = jax.tree.map(lambda _: rep, self.frozen)

        def train_step(state, frozen, tokens, lr):
            (_, metrics), grads = jax.value_and_grad(lambda t: self._forward(t, frozen, tokens),
                                                     has_aux=True)(state["train"])
            direction, opt = tx.update(grads, state["opt"], state["train"])
            metrics["grad_norm"] = optax.global_norm(grads)
            return {"train": common.apply_lr(state["train"], direction, lr), "opt": opt,
                    "step": state["step"] + 1}, metrics

        def eval_step(train, frozen, tokens):
            return self._forward(train, frozen, tokens)[1]

        self._train_fn = jax.jit(train_step, in_shardings=(self.state_sh, frozen_sh, self.batch_sh, rep),
                                 out_shardings=(self.state_sh, rep), donate_argnums=(0,))
        self._eval_fn = jax.jit(eval_step, in_shardings=(self.state_sh["train"], frozen_sh, self.batch_sh),
                                out_shardings=rep)

    def lr_at(self, step: int) -> float:
        c = self.cfg
        return common.warmup_cosine(step, c.lr, int(c.warmup_frac * self.total_steps), self.total_steps,
                                    c.min_lr_ratio)

    def train_step(self, step: int):
        b = self.cfg.batch_size
        tokens = common.global_batch(lambda lo, hi: self.sampler.batch(step, b, slice(lo, hi)).astype(np.int32), b,
                                     self.batch_sh)
        self.state, metrics = self._train_fn(self.state, self.frozen, tokens, jnp.float32(self.lr_at(step)))
        return metrics

    def evaluate(self) -> dict[str, dict[str, float]]:
        """Per domain: loss, acc and agree over its fixed validation windows, batches of one window per device
        (every window once, a remainder under the device count left out), averaged over the windows."""
        out = {}
        n = self.mesh.devices.size
        for d, w in self.val.items():
            usable = len(w) - len(w) % n
            if usable == 0:
                continue
            sums = {"loss": 0.0, "acc": 0.0, "agree": 0.0,
                    **{f"agree_{d}": 0.0 for d in range(1, self.cfg.draft_steps)}}
            for i in range(0, usable, n):
                m = jax.device_get(self._eval_fn(self.state["train"], self.frozen,
                                                 common.batch_from_host(w[i:i + n].astype(np.int32), self.batch_sh)))
                for k in sums:
                    sums[k] += float(m[k]) * n
            out[d] = {**{k: round(v / usable, 5) for k, v in sums.items()}, "windows": usable}
        return out

    def identity(self) -> dict:
        return {"target_config": self.hcfg.to_hf_dict()}

    def run(self, stop_after: int | None = None) -> dict:
        return self.run_steps("train-mtp", {"trainable_params": self.num_trainable,
                                            "train_config": self.cfg.to_dict()}, stop_after)

    def head(self):
        return nnx.merge(self.h_graphdef, jax.tree.map(jnp.asarray, common.to_host(self.state["train"])))

    def export(self, model_dir: str | Path | None = None, dtype=None) -> Path:
        """The head as `mtp.*` tensors in a model directory: `model_dir` itself when given (the target's files
        untouched, its config.json told the layer count), else OUT/model, a copy of the target directory. Every
        process gathers the head; process 0 writes."""
        head = self.head()
        if model_dir is None:
            model_dir = self.out / "model"
            if not common.is_primary():
                return model_dir
            if model_dir.exists():
                shutil.rmtree(model_dir)
            shutil.copytree(self.cfg.target, model_dir)
        if common.is_primary():
            save_mtp(head, model_dir, dtype=dtype)
        return Path(model_dir)


def train_mtp(cfg: MTPTrainConfig, install_into: str | Path | None = None) -> dict:
    tr = MTPTrainer(cfg)
    summary = tr.run()
    dtype = None if cfg.export_dtype == "float32" else jnp.dtype(cfg.export_dtype)
    summary["export"] = str(tr.export(install_into, dtype=dtype))
    tr.ckpt.close()
    summary.pop("losses")
    if common.is_primary():
        (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


__all__ = ["MTPTrainConfig", "MTPTrainer", "mtp_loss", "train_mtp"]
