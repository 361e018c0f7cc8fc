"""Drafter training on a frozen target (`hyspec train-drafter`): DSpark, then ReaDy stages 1 and 2.

Data. Windows of the corpus train split, or (`data`, the DSpark / ReaDy recipe) target-generated continuations
from `hyspec build-distill` (`train.distill.DistillSampler`); either way the frozen target runs `train.forward.train_forward` over each window
inside the step, giving the tapped layer outputs (drafter context), its logits (the distillation target
p^t_k = softmax(target logits at a + k), docs/reference/drafters.md §3.5) and, for ReaDy, the committed GDN states of
the reader's source layers at every `state_stride` boundary. A block anchored at a reads the state after
tokens 0 .. a − 1, so ReaDy anchors are multiples of the stride; DSpark anchors are any position in [1, T−2].
Anchors are drawn per sequence from a PRNG keyed on (seed, step) — the data position is the step.

Objective (all weights configurable), per block slot k with w_k = exp(−k/decay) and the valid-slot mask
(label inside the window; the supervised span is contiguous by construction):
    L = ce·Σw·CE(p^d_k, x*) / Σw + l1·Σw·‖p^d_k − p^t_k‖₁ / Σw + conf·Σw·BCE(c_k, c*_k) / Σw,
    c*_k = clamp(1 − ½‖p^d_k − p^t_k‖₁, 0, 1) (no gradient); p^d_k the Markov-corrected draft distribution.
Stages:
    dspark  all drafter parameters (fc, hidden_norm, layers, norm, Markov, confidence), ce 0.1 l1 0.9 conf 1.0,
            lr 6e-4;
    ready1  the reader only, drafter frozen, ce 1.0 l1 0.1 conf 0, lr 1e-4 (an untrained reader is exactly
            DSpark: its output projection starts at zero);
    ready2  the reader + LoRA (rank r, zero-initialised B) on every linear layer of the drafter, lr 5e-5;
            `no_state` drops the reader (the fine-tune-without-state control of the paper's Table 2).
Metrics: loss terms, and the teacher-forced acceptance estimate τ̂ = 1 + Σ_k Π_{i≤k} [argmax p^d_i = argmax
p^t_i] (greedy; previous tokens are the corpus tokens, not the target's own continuation).
The drafter is written in the DeepSpec layout (`io.drafter_io.save_drafter`); a stage-2 LoRA is stored unmerged
next to the reader (merged on load with the reader), the no-state control's LoRA merged into the weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hyspec_jax.config import DrafterConfig, resolve_dtype
from hyspec_jax.io.drafter_io import load_drafter, save_drafter
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.models.drafter import create_drafter, forward_train, target_heads
from hyspec_jax.models.reader import ReaderConfig
from hyspec_jax.train import common
from hyspec_jax.train.distill import student_windows
from hyspec_jax.train.forward import train_forward

F32 = jnp.float32
STAGES = ("dspark", "ready1", "ready2")
STAGE_DEFAULTS = {  # lr, ce, l1, conf
    "dspark": (6e-4, 0.1, 0.9, 1.0),
    "ready1": (1e-4, 1.0, 0.1, 0.0),
    "ready2": (5e-5, 1.0, 0.1, 0.0),
}


@dataclasses.dataclass
class DrafterTrainConfig:
    target: str
    corpus: str
    out: str
    stage: str = "dspark"
    init: str | None = None            # drafter dir (ready1: a DSpark drafter; ready2: a ready1 output)
    data: str | None = None            # distillation data dir (build-distill); None = corpus windows
    num_layers: int = 2
    block_size: int = 7
    markov_rank: int = 256
    tap_layers: tuple[int, ...] | None = None   # target layers the drafter reads (default: the z-lab rule)
    intermediate_size: int | None = None        # draft MLP width (default: the target's)
    seq_len: int = 256
    batch_size: int = 16
    anchors: int = 32
    state_stride: int = 8               # GDN chunk of the target forward = ReaDy anchor stride
    steps: int = 1000
    lr: float | None = None
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"
    devices: int = 0
    source_layers: tuple[int, ...] | None = None
    reader_rank: int = 8
    no_state: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    ce_weight: float | None = None
    l1_weight: float | None = None
    conf_weight: float | None = None
    decay: float = 4.0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 64                      # validation windows per domain (all of them evaluated, once each)
    eval_batch: int = 32                        # windows per evaluation batch (rounded down to the devices)
    ckpt_every: int = 200
    keep: int = 2
    time_budget_s: float = 0.0
    export_dtype: str = "float32"               # drafter files (bfloat16 for shipping)
    progress: bool | None = None
    compiler_options: dict | None = None

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {self.stage!r}")
        if self.stage != "dspark" and not self.init:
            raise ValueError(f"stage {self.stage} trains on top of a drafter: pass init (a drafter directory)")
        if self.no_state and self.stage != "ready2":
            raise ValueError("no_state is the stage-2 control (LoRA without the reader)")
        lr, ce, l1, conf = STAGE_DEFAULTS[self.stage]
        self.lr = lr if self.lr is None else self.lr
        self.ce_weight = ce if self.ce_weight is None else self.ce_weight
        self.l1_weight = l1 if self.l1_weight is None else self.l1_weight
        self.conf_weight = conf if self.conf_weight is None else self.conf_weight
        if self.source_layers is not None:
            self.source_layers = tuple(int(i) for i in self.source_layers)
        if self.tap_layers is not None:
            self.tap_layers = tuple(int(i) for i in self.tap_layers)

    @property
    def uses_reader(self) -> bool:
        return self.stage in ("ready1", "ready2") and not self.no_state

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------------
def gather_positions(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B,T,...], idx [B,A,G] -> [B,A,G,...] (indices clipped into the window)."""
    B, T = x.shape[:2]
    flat = jnp.clip(idx, 0, T - 1).reshape(B, -1)
    out = jnp.take_along_axis(x, flat.reshape(B, -1, *([1] * (x.ndim - 2))), axis=1)
    return out.reshape(idx.shape + x.shape[2:])


def drafter_loss(out, target_logits: jax.Array, anchors: jax.Array, *, ce: float, l1: float, conf: float,
                 decay: float) -> tuple[jax.Array, dict]:
    """The weighted DSpark / ReaDy objective (module docstring) and metrics."""
    G = out.labels.shape[-1]
    k = jnp.arange(G)
    t_logits = gather_positions(target_logits, anchors[:, :, None] + k)          # [B,A,G,V]
    valid = out.label_valid.astype(F32)
    w = jnp.exp(-k / decay) * valid
    denom = jnp.maximum(jnp.sum(w), 1e-6)
    logp_d = jax.nn.log_softmax(out.logits.astype(F32), axis=-1)
    p_d = jnp.exp(logp_d)
    p_t = jax.lax.stop_gradient(jax.nn.softmax(t_logits.astype(F32), axis=-1))
    ce_k = -jnp.take_along_axis(logp_d, out.labels[..., None], axis=-1)[..., 0]
    l1_k = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    terms = {"ce": jnp.sum(w * ce_k) / denom, "l1": jnp.sum(w * l1_k) / denom}
    if out.confidence_logits is not None:
        c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1_k, 0.0, 1.0))
        bce = optax.sigmoid_binary_cross_entropy(out.confidence_logits.astype(F32), c_star)
        terms["conf"] = jnp.sum(w * bce) / denom
    else:
        terms["conf"] = jnp.zeros((), F32)
    loss = ce * terms["ce"] + l1 * terms["l1"] + conf * terms["conf"]
    match = (jnp.argmax(out.logits, -1) == jnp.argmax(t_logits, -1)).astype(F32) * valid
    run = jnp.cumprod(match, axis=-1)                                              # accepted-prefix indicator
    blocks = jnp.maximum(jnp.sum(valid[..., 0]), 1.0)
    # weight / blocks: the denominators, so that batches pool exactly (`DrafterTrainer.evaluate`)
    metrics = {"loss": loss, **terms, "tau": 1.0 + jnp.sum(run) / blocks,
               "acc0": jnp.sum(match[..., 0]) / blocks, "weight": denom, "blocks": blocks}
    return loss, metrics


# ------------------------------------------------------------------------------------------------
# LoRA over a parameter pytree
# ------------------------------------------------------------------------------------------------
def _pstr(path) -> str:
    """'layers/0/self_attn/q_proj/weight' for a key path into an nnx.State (its Variable's .value dropped)."""
    parts = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
    return "/".join(parts[:-1] if parts and parts[-1] == "value" else parts)


def lora_targets(params: Any) -> dict[str, tuple[int, int]]:
    """Every linear weight [out, in] of the drafter (path ending in .weight of a 2-D leaf; the Markov
    embedding table excluded)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        s = _pstr(path)
        if x.ndim == 2 and s.endswith("weight") and "markov_w1" not in s:
            out[s] = tuple(x.shape)
    return out


def init_lora(params: Any, rank: int, seed: int) -> dict[str, dict[str, jax.Array]]:
    key = jax.random.key(seed)
    lora = {}
    for i, (s, (o, n)) in enumerate(sorted(lora_targets(params).items())):
        r = min(rank, o, n)
        a = jax.random.normal(jax.random.fold_in(key, i), (r, n), F32) / math.sqrt(n)
        lora[s] = {"a": a, "b": jnp.zeros((o, r), F32)}
    return lora


def apply_lora(params: Any, lora: dict | None, alpha: float) -> Any:
    if not lora:
        return params

    def f(path, x):
        d = lora.get(_pstr(path))
        if d is None:
            return x
        scale = alpha / d["a"].shape[0]
        return (x.astype(F32) + scale * d["b"] @ d["a"]).astype(x.dtype)
    return jax.tree_util.tree_map_with_path(f, params)


# ------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------
class DrafterTrainer(common.ResumableTrainer):
    def __init__(self, cfg: DrafterTrainConfig, *, drafter_cfg: DrafterConfig | None = None):
        self._start_run(cfg)
        if cfg.seq_len % cfg.state_stride:
            raise ValueError(f"seq_len {cfg.seq_len} must be a multiple of state_stride {cfg.state_stride}")
        self.dt = resolve_dtype(cfg.dtype)
        tcfg, target = load_pretrained(cfg.target, dtype=F32)
        self.tcfg = tcfg
        self.t_graphdef, t_params = nnx.split(target)
        self.heads_host = target_heads(target)

        # --- drafter (+ reader) ---------------------------------------------------------------------
        if cfg.stage == "dspark":
            extra = {} if cfg.intermediate_size is None else {"intermediate_size": cfg.intermediate_size}
            dcfg = drafter_cfg or DrafterConfig.from_target(
                tcfg, num_layers=cfg.num_layers, block_size=cfg.block_size, markov_rank=cfg.markov_rank,
                target_layer_ids=cfg.tap_layers, **extra)
            base = create_drafter(dcfg, None, seed=cfg.seed)
            rcfg = None
        else:
            base = load_drafter(cfg.init, with_reader=cfg.stage == "ready2")
            dcfg = base.config
            rcfg = base.reader_config
            if cfg.stage == "ready1":
                rcfg = ReaderConfig.for_target(tcfg, hidden_size=dcfg.hidden_size, source_layers=cfg.source_layers,
                                               rank=cfg.reader_rank)
            if cfg.no_state:
                rcfg = None
            if rcfg is not None and base.reader is None:  # add a fresh reader (exactly DSpark at init)
                fresh = create_drafter(dcfg, rcfg, seed=cfg.seed + 1)
                nnx.update(fresh, nnx.state(base, nnx.Param))
                base = fresh
            elif rcfg is None and base.reader is not None:
                base = load_drafter(cfg.init, with_reader=False)
        self.dcfg, self.rcfg = dcfg, rcfg
        if rcfg is not None:
            self.d_graphdef, reader_p, base_p = nnx.split(base, nnx.PathContains("reader"), ...)
        else:
            self.d_graphdef, base_p = nnx.split(base)
            reader_p = None
        if cfg.stage == "dspark":
            trainable = {"drafter": base_p}
            frozen_d = None
        else:
            trainable = {}
            if reader_p is not None:
                trainable["reader"] = reader_p
            if cfg.stage == "ready2":
                trainable["lora"] = init_lora(base_p, cfg.lora_rank, cfg.seed)
            frozen_d = base_p

        # --- data, sharding, optimizer, compiled step, resume ------------------------------------------
        self.sampler, self.val = student_windows(cfg)
        self._start_student(trainable, {"target": t_params, "drafter": frozen_d, "heads": self.heads_host},
                            weight_decay=0.0)

    # --- the model function -------------------------------------------------------------------------
    def _params(self, train: dict, frozen: dict):
        """Effective drafter parameters (+ reader) from the trainable and frozen parts."""
        if self.cfg.stage == "dspark":
            return (train["drafter"],)
        base = apply_lora(frozen["drafter"], train.get("lora"), self.cfg.lora_alpha)
        return (train["reader"], base) if "reader" in train else (base,)

    def _forward(self, train, frozen, tokens, anchors):
        cfg, dt = self.cfg, self.dt
        target = nnx.merge(self.t_graphdef, common.cast_compute(frozen["target"], dt))
        slots = self.rcfg.source_slots if self.rcfg is not None else None
        t_logits, _, taps, states = train_forward(target, tokens, tap_layers=self.dcfg.target_layer_ids,
                                                  chunk=cfg.state_stride, state_slots=slots)
        t_logits, taps = jax.lax.stop_gradient(t_logits), jax.lax.stop_gradient(taps)
        reader_states = None
        if states is not None:  # [Ls, nC, B, HV, dk, dv] -> per anchor [B, A, Ls·HV, dk, dv]
            c = anchors // cfg.state_stride - 1                                   # state after tokens < anchor
            st = jax.lax.stop_gradient(states)
            picked = jax.vmap(lambda s_b, c_b: s_b[:, c_b], in_axes=(2, 0), out_axes=1)(st, c)  # [Ls,B,A,...]
            picked = jnp.moveaxis(picked, 0, 2)                                   # [B, A, Ls, HV, dk, dv]
            reader_states = picked.reshape(picked.shape[:2] + (-1,) + picked.shape[-2:])
        heads = jax.tree.map(lambda x: x.astype(dt), frozen["heads"])
        params = tuple(common.cast_compute(p, dt) for p in self._params(train, frozen))
        out = forward_train(self.d_graphdef, params[0] if len(params) == 1 else nnx.State.merge(*params), heads,
                            taps, tokens, anchors, reader_states=reader_states)
        return drafter_loss(out, t_logits, anchors, ce=cfg.ce_weight, l1=cfg.l1_weight, conf=cfg.conf_weight,
                            decay=cfg.decay)

    def _build(self) -> None:
        tx = self.tx
        opts = self.cfg.compiler_options or None
        rep = common.replicated(self.mesh)
        frozen_sh = jax.tree.map(lambda _: rep, self.frozen)

        def train_step(state, frozen, tokens, anchors, lr):
            (loss, metrics), grads = jax.value_and_grad(
                lambda t: self._forward(t, frozen, tokens, anchors), has_aux=True)(state["train"])
            direction, opt = tx.update(grads, state["opt"], state["train"])
            metrics["grad_norm"] = optax.global_norm(grads)
            return {"train": common.apply_lr(state["train"], direction, lr), "opt": opt,
                    "step": state["step"] + 1}, metrics

        def eval_step(train, frozen, tokens, anchors):
            return self._forward(train, frozen, tokens, anchors)[1]

        self._train_fn = jax.jit(train_step, in_shardings=(self.state_sh, frozen_sh, self.batch_sh, self.batch_sh,
                                                           rep),
                                 out_shardings=(self.state_sh, rep), donate_argnums=(0,), compiler_options=opts)
        self._eval_fn = jax.jit(eval_step, in_shardings=(self.state_sh["train"], frozen_sh, self.batch_sh,
                                                         self.batch_sh), out_shardings=rep, compiler_options=opts)

    # --- data -----------------------------------------------------------------------------------------
    def anchors_for(self, step: int, batch: int, *, aligned: bool | None = None, stream: int = 7) -> np.ndarray:
        """[B, A] sorted anchors, a pure function of (seed, step, stream); aligned (ReaDy): multiples of
        state_stride in [stride, T−2]."""
        cfg = self.cfg
        T = cfg.seq_len
        aligned = self.rcfg is not None if aligned is None else aligned
        cand = (np.arange(cfg.state_stride, T - 1, cfg.state_stride) if aligned else np.arange(1, T - 1))
        A = min(cfg.anchors, cand.size)
        rng = np.random.default_rng([cfg.seed, step, stream])
        return np.stack([np.sort(rng.choice(cand, size=A, replace=False)) for _ in range(batch)]).astype(np.int32)

    def lr_at(self, step: int) -> float:
        c = self.cfg
        return common.warmup_cosine(step, c.lr, int(c.warmup_frac * self.total_steps), self.total_steps,
                                    c.min_lr_ratio)

    def train_step(self, step: int):
        b = self.cfg.batch_size
        tokens = common.global_batch(lambda lo, hi: self.sampler.batch(step, b, slice(lo, hi)), b, self.batch_sh)
        anchors = common.global_batch(lambda lo, hi: self.anchors_for(step, b)[lo:hi], b, self.batch_sh)
        self.state, metrics = self._train_fn(self.state, self.frozen, tokens, anchors, jnp.float32(self.lr_at(step)))
        return metrics

    def evaluate(self) -> dict[str, dict[str, float]]:
        """Per domain: loss terms and τ̂ over its fixed validation windows with stride-aligned anchors (the same
        positions for every stage, so DSpark and ReaDy compare). Every window counts once: batches of
        `eval_batch` windows (a multiple of the devices; a last remainder under one per device is left out —
        no window is repeated to fill a batch), pooled by their denominators (loss weights, blocks), so the
        result does not depend on the batching. A window's anchors depend on its index alone."""
        out = {}
        n_dev = self.mesh.devices.size
        eb = max(n_dev, self.cfg.eval_batch - self.cfg.eval_batch % n_dev)
        for d, w in self.val.items():
            num = {"loss": 0.0, "ce": 0.0, "l1": 0.0, "conf": 0.0, "tau": 0.0, "acc0": 0.0}
            weight = blocks = 0.0
            i = 0
            while len(w) - i >= n_dev:
                n = min(eb, len(w) - i)
                n -= n % n_dev
                anchors = np.concatenate([self.anchors_for(i + j, 1, aligned=True, stream=11) for j in range(n)])
                m = jax.device_get(self._eval_fn(self.state["train"], self.frozen,
                                                 common.batch_from_host(w[i:i + n], self.batch_sh),
                                                 common.batch_from_host(anchors, self.batch_sh)))  # one transfer
                m = {k: float(v) for k, v in m.items()}
                for k in ("loss", "ce", "l1", "conf"):
                    num[k] += m[k] * m["weight"]
                num["tau"] += (m["tau"] - 1.0) * m["blocks"]
                num["acc0"] += m["acc0"] * m["blocks"]
                weight, blocks = weight + m["weight"], blocks + m["blocks"]
                i += n
            if i == 0:                   # fewer windows than devices
                continue
            res = {k: num[k] / max(weight, 1e-6) for k in ("loss", "ce", "l1", "conf")}
            res.update(tau=1.0 + num["tau"] / blocks, acc0=num["acc0"] / blocks, windows=i)
            out[d] = {k: round(v, 5) if isinstance(v, float) else v for k, v in res.items()}
        return out

    # --- checkpoints ----------------------------------------------------------------------------------
    def identity(self) -> dict:
        return {"drafter_config": self.dcfg.to_hf_dict()}

    def extra_meta(self) -> dict:
        return {"reader_config": None if self.rcfg is None else self.rcfg.to_dict()}

    # --- loop -----------------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None) -> dict:
        cfg = self.cfg
        return self.run_steps(f"train-drafter {cfg.stage}", {
            "stage": cfg.stage, "trainable_params": self.num_trainable, "train_config": cfg.to_dict(),
            **self.identity(), **self.extra_meta()}, stop_after)

    # --- export ---------------------------------------------------------------------------------------
    def drafter(self):
        train = common.to_host(self.state["train"])
        frozen = None if self.frozen["drafter"] is None else common.to_host(self.frozen["drafter"])
        params = self._params(jax.tree.map(jnp.asarray, train),
                              {"drafter": None if frozen is None else jax.tree.map(jnp.asarray, frozen)})
        return nnx.merge(self.d_graphdef, *params)

    def export(self, out_dir: str | Path | None = None, dtype=None) -> Path:
        """The drafter directory. Stage 2 with a reader keeps its LoRA unmerged in reader/ (loaded with the
        reader only), so the directory still holds the stage-1 DSpark drafter for chain / tree modes. Every
        process gathers the weights; process 0 writes."""
        out_dir = Path(out_dir) if out_dir is not None else self.out / "drafter"
        train = common.to_host(self.state["train"])
        if self.cfg.stage == "ready2" and "reader" in train:
            base = jax.tree.map(jnp.asarray, common.to_host(self.frozen["drafter"]))
            model = nnx.merge(self.d_graphdef, jax.tree.map(jnp.asarray, train["reader"]), base)
            if common.is_primary():
                save_drafter(model, out_dir, dtype=dtype, lora=train["lora"], lora_alpha=self.cfg.lora_alpha)
        else:
            model = self.drafter()
            if common.is_primary():
                save_drafter(model, out_dir, dtype=dtype)
        return out_dir


def train_drafter(cfg: DrafterTrainConfig) -> dict:
    tr = DrafterTrainer(cfg)
    summary = tr.run()
    dtype = None if cfg.export_dtype == "float32" else jnp.dtype(cfg.export_dtype)
    summary["export"] = str(tr.export(dtype=dtype))
    tr.ckpt.close()
    summary.pop("losses")
    if common.is_primary():
        (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


__all__ = ["DrafterTrainConfig", "DrafterTrainer", "drafter_loss", "train_drafter", "init_lora", "apply_lora",
           "lora_targets", "STAGES", "STAGE_DEFAULTS"]
