"""Target pretraining: a Qwen3.5-format hybrid (3 GDN : 1 attention) trained with next-token loss on the
offline corpus (`hyspec train-target`).

- Model: `hyspec_jax.models.target` (the serving model itself); forward = `train.forward.train_forward`, the
  cache-free specialisation of `TargetModel.extend` (same modules, same closed form; tested against
  `forward_full` and `transformers`).
- Optimizer: optax AdamW (decay on matrices), linear warm-up + cosine, global-norm clipping; fp32 master
  weights, bf16 compute on GPU (matrices cast inside the loss), fp32 on CPU.
- Parallelism: one `Mesh` axis `data`; the batch is split over it (data parallel) and every large parameter
  and its Adam moments are sharded over it too (FSDP); XLA inserts the gathers / reduce-scatters.
- Data: windows of seq_len + 1 tokens drawn from the train shards by a PRNG keyed on (seed, step) — the data
  position is the step, so a resumed run sees exactly the batches the uninterrupted run would have.
- Checkpoints: orbax CheckpointManager (train state, data position, train + model config); a run whose
  output directory has a checkpoint resumes from it. Metrics: JSONL always, tqdm on a terminal.
- Validation: loss / perplexity per domain on fixed windows of the validation shards.
- Export: Hugging Face layout (`io.hf.save_pretrained`, sharded safetensors) + tokenizer files +
  generation_config.json, loadable by our loader and by `transformers`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hyspec_jax.config import FULL, LINEAR, TargetConfig, resolve_dtype
from hyspec_jax.models.target import abstract_model, create_model
from hyspec_jax.train import common
from hyspec_jax.train.corpus import corpus_tokenizer_dir, load_shard, shard_domains
from hyspec_jax.train.forward import train_forward

F32 = jnp.float32


# ------------------------------------------------------------------------------------------------
# Model presets
# ------------------------------------------------------------------------------------------------
def hybrid_config(vocab_size: int, *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                  intermediate: int, gdn_k_heads: int, gdn_v_heads: int, gdn_head_dim: int,
                  eos_token_id: tuple[int, ...] = (), tie: bool = True) -> TargetConfig:
    """Qwen3.5 text layout: every 4th layer full attention (3 GDN : 1 attention)."""
    return TargetConfig(
        model_type="qwen3_5_text", vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        linear_num_key_heads=gdn_k_heads, linear_num_value_heads=gdn_v_heads, linear_key_head_dim=gdn_head_dim,
        linear_value_head_dim=gdn_head_dim, rope_theta=10000.0, partial_rotary_factor=0.25,
        tie_word_embeddings=tie, eos_token_id=tuple(eos_token_id))


PRESETS: dict[str, dict[str, int]] = {
    # ~0.1M + embeddings: tests and CPU smoke runs
    "tiny": dict(hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=128, gdn_k_heads=1,
                 gdn_v_heads=2, gdn_head_dim=32),
    # ~3M + embeddings: CPU runs
    "small": dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, intermediate=704, gdn_k_heads=2,
                  gdn_v_heads=4, gdn_head_dim=64),
    # the embedded default model: ~28M parameters with an 8k vocabulary (tied embeddings), 8 layers = 6 GDN + 2
    "default": dict(hidden=512, layers=8, heads=8, kv_heads=2, head_dim=64, intermediate=1280, gdn_k_heads=4,
                    gdn_v_heads=8, gdn_head_dim=64),
    # ~212M parameters: the same layout scaled (16 layers = 12 GDN + 4 attention), for what a larger target changes
    # (train/recipes/ready_large_h200.sh); not shipped
    "large": dict(hidden=1024, layers=16, heads=16, kv_heads=4, head_dim=64, intermediate=2816, gdn_k_heads=8,
                  gdn_v_heads=16, gdn_head_dim=64),
}


def preset_config(name: str, vocab_size: int, eos_token_id: tuple[int, ...] = ()) -> TargetConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return hybrid_config(vocab_size, eos_token_id=eos_token_id, **PRESETS[name])


def count_params(params: Any) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


def train_flops_per_token(cfg: TargetConfig, params: Any, seq_len: int) -> int:
    """Model FLOPs of one trained token (forward + backward = 3 forwards), PaLM's convention (model, not hardware,
    FLOPs): 6 per weight of every matrix and of the depthwise convolution — the embedding lookup not counted, the
    output projection (tied or not) once; attention's scores and mixing, 12 · heads · head_dim · seq_len a full
    layer (not halved for the causal mask); the GDN recurrence's readout, prediction and update, 18 · value heads ·
    dk · dv a linear layer (the chunked closed form's extra work not counted)."""
    weights = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        if x.ndim >= 2 and "embed_tokens" not in jax.tree_util.keystr(path):
            weights += int(x.size)
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size
    attention = sum(12 * cfg.num_attention_heads * cfg.head_dim * seq_len for t in cfg.layer_types if t == FULL)
    gdn = sum(18 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
              for t in cfg.layer_types if t == LINEAR)
    return 6 * weights + attention + gdn


# dense bf16 peak of one device, the vendor's figure (no sparsity), by device kind
_BF16_PEAK = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12))


def bf16_peak_flops(device_kind: str) -> float | None:
    """The vendor's dense bf16 peak of a device kind (FLOP/s), None where not known."""
    return next((peak for name, peak in _BF16_PEAK if name in device_kind), None)


def model_flops_utilization(tokens_per_s: float | None, flops_per_token: int, devices: int, device_kind: str,
                            compute_dtype: str) -> float | None:
    """MFU: model FLOPs per second over the devices' dense bf16 peak; None for another compute dtype or an unknown
    device."""
    peak = bf16_peak_flops(device_kind)
    if not tokens_per_s or peak is None or compute_dtype != "bfloat16":
        return None
    return tokens_per_s * flops_per_token / (peak * devices)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
class WindowSampler:
    """Random windows [B, T+1] from the train shards; batch(step) is a pure function of (seed, step).

    Domains are drawn with probability proportional to `weights` (default: their token counts, i.e. uniform
    over the concatenated train stream), then a uniform start inside that domain's shard.
    """

    def __init__(self, corpus_dir: str | Path, seq_len: int, seed: int, weights: dict[str, float] | None = None,
                 split: str = "train"):
        self.domains = shard_domains(corpus_dir, split)
        self.shards = [np.asarray(load_shard(corpus_dir, split, d)) for d in self.domains]
        self.seq_len, self.seed = seq_len, seed
        short = [d for d, s in zip(self.domains, self.shards) if s.size < seq_len + 2]
        if short:
            raise ValueError(f"train shards shorter than seq_len + 2 = {seq_len + 2}: {short}")
        w = np.asarray([weights.get(d, 0.0) if weights else s.size for d, s in zip(self.domains, self.shards)],
                       np.float64)
        if not w.sum() > 0:
            raise ValueError(f"domain weights {weights} give no train domain of {self.domains} a positive weight")
        self.probs = w / w.sum()

    @property
    def tokens(self) -> int:
        return int(sum(s.size for s in self.shards))

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        """Rows `rows` of the global batch of `batch_size` windows (a process reads only its own rows; the
        draws, cheap, are made for all of them so every process sees the same batch)."""
        rng = np.random.default_rng([self.seed, step])
        which = rng.choice(len(self.shards), size=batch_size, p=self.probs)
        starts = [int(rng.integers(0, self.shards[d].size - self.seq_len - 1 + 1)) for d in which]
        picked = range(batch_size)[rows]
        out = np.empty((len(picked), self.seq_len + 1), np.int32)
        for i, r in enumerate(picked):
            out[i] = self.shards[which[r]][starts[r]:starts[r] + self.seq_len + 1]
        return out


def validation_windows(corpus_dir: str | Path, seq_len: int, max_windows: int) -> dict[str, np.ndarray]:
    """Per domain: the first `max_windows` non-overlapping windows [n, T+1] of its validation shard (fixed)."""
    out = {}
    for d in shard_domains(corpus_dir, "validation"):
        s = np.asarray(load_shard(corpus_dir, "validation", d)).astype(np.int32)
        n = min(max_windows, (s.size - 1) // seq_len)
        if n > 0:
            out[d] = np.stack([s[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    return out


# ------------------------------------------------------------------------------------------------
# Config and trainer
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TargetTrainConfig:
    corpus: str
    out: str
    preset: str = "default"
    seq_len: int = 512
    batch_size: int = 32               # global sequences per step (divisible by the number of devices)
    steps: int = 2000
    lr: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    dtype: str = "auto"                # auto: bf16 compute on GPU, fp32 on CPU
    devices: int = 0                   # 0 = all
    fsdp: bool = True
    log_every: int = 10
    eval_every: int = 500
    eval_windows: int = 16             # per domain
    eval_batch: int = 16
    ckpt_every: int = 500
    keep: int = 2
    time_budget_s: float = 0.0         # > 0: stop (checkpoint, evaluate, export) once training ran this long
    call_limit_s: float = 0.0          # > 0: this invocation checkpoints and stops after this long (the same
                                       # command resumes; for machines lent in calls shorter than the run)
    export_dtype: str = "bfloat16"     # HF export: bfloat16 | float32
    export_shard_mb: float = 15.0
    chunk: int = 64                    # GDN chunk of the training forward
    progress: bool | None = None       # None: tqdm when stderr is a terminal
    compiler_options: dict | None = None  # XLA options for the jitted steps (tests: fast CPU compiles)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def next_token_loss(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, compute_dtype,
                    mask: jax.Array | None = None, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """(sum of nll, number of predicted tokens) over windows tokens [B, T+1] (mask [B, T] optional)."""
    model = nnx.merge(graphdef, common.cast_compute(params, compute_dtype))
    logits = train_forward(model, tokens[:, :-1], chunk=chunk)[0]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), tokens[:, 1:])
    m = jnp.ones_like(nll) if mask is None else mask.astype(F32)
    return jnp.sum(nll * m), jnp.sum(m)


@functools.lru_cache(maxsize=16)
def _init_fn(model_cfg: TargetConfig, seed: int, tx_hyper: tuple, compiler_options: tuple):
    """jitted initial train state (params + optimizer state), on one device; shared across meshes."""
    wd, clip = tx_hyper
    tx = common.adamw_direction(weight_decay=wd, clip=clip)

    def init():
        params = nnx.state(create_model(model_cfg, seed=seed), nnx.Param)
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return jax.jit(init, compiler_options=dict(compiler_options) or None)


@functools.lru_cache(maxsize=16)
def _compiled(graphdef: nnx.GraphDef, hyper: tuple, dtype_name: str, mesh, fsdp: bool, state_struct,
              compiler_options: tuple) -> dict:
    """jitted train / eval functions, shared by trainers of one configuration (tests build several)."""
    wd, clip, chunk = hyper
    opts = dict(compiler_options) or None
    dt = jnp.dtype(dtype_name)
    tx = common.adamw_direction(weight_decay=wd, clip=clip)
    state_sh = jax.tree.unflatten(state_struct[0], [
        jax.sharding.NamedSharding(mesh, common.fsdp_spec(shape, mesh.devices.size, fsdp))
        for shape in state_struct[1]])
    batch_sh, rep = common.batch_sharding(mesh), common.replicated(mesh)

    def train_step(state, tokens, lr):
        def loss_fn(p):
            s, n = next_token_loss(graphdef, p, tokens, dt, chunk=chunk)
            return s / n
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        direction, opt = tx.update(grads, state["opt"], state["params"])
        params = common.apply_lr(state["params"], direction, lr)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
        return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

    def eval_step(params, tokens, mask):
        return next_token_loss(graphdef, params, tokens, dt, mask, chunk=chunk)

    return {
        "tx": tx, "state_sh": state_sh,
        "train": jax.jit(train_step, in_shardings=(state_sh, batch_sh, rep), out_shardings=(state_sh, rep),
                         donate_argnums=(0,), compiler_options=opts),
        "eval": jax.jit(eval_step, in_shardings=(state_sh["params"], batch_sh, batch_sh), out_shardings=(rep, rep),
                        compiler_options=opts),
    }


class TargetTrainer(common.ResumableTrainer):
    def __init__(self, cfg: TargetTrainConfig, model_cfg: TargetConfig | None = None):
        from tokenizers import Tokenizer
        from hyspec_jax.train.tokenizer_train import EOS, IM_END

        self._start_run(cfg, "batch_size", "eval_batch")
        self.tok_dir = corpus_tokenizer_dir(cfg.corpus)
        tok = Tokenizer.from_file(str(self.tok_dir / "tokenizer.json"))
        eos = tuple(i for i in (tok.token_to_id(EOS), tok.token_to_id(IM_END)) if i is not None)
        self.model_cfg = model_cfg or preset_config(cfg.preset, tok.get_vocab_size(), eos)
        if self.model_cfg.vocab_size < tok.get_vocab_size():
            raise ValueError(f"model vocab {self.model_cfg.vocab_size} < tokenizer vocab {tok.get_vocab_size()}")
        self.compute_dtype = resolve_dtype(cfg.dtype)
        self.sampler = WindowSampler(cfg.corpus, cfg.seq_len, cfg.seed)
        self.val = validation_windows(cfg.corpus, cfg.seq_len, cfg.eval_windows)

        self.graphdef, abs_params = nnx.split(abstract_model(self.model_cfg))
        self.num_params = count_params(abs_params)
        hyper = (cfg.weight_decay, cfg.clip, cfg.chunk)
        tx = common.adamw_direction(weight_decay=cfg.weight_decay, clip=cfg.clip)
        abs_state = {"params": abs_params, "opt": jax.eval_shape(tx.init, abs_params),
                     "step": jax.ShapeDtypeStruct((), jnp.int32)}
        leaves, treedef = jax.tree.flatten(abs_state)
        opts = tuple(sorted((cfg.compiler_options or {}).items()))
        fns = _compiled(self.graphdef, hyper, jnp.dtype(self.compute_dtype).name, self.mesh, cfg.fsdp,
                        (treedef, tuple(tuple(x.shape) for x in leaves)), opts)
        self.tx, self.state_sh = fns["tx"], fns["state_sh"]
        self._train_fn, self._eval_fn = fns["train"], fns["eval"]
        self.total_steps = cfg.steps     # may shrink once, under a time budget (then saved with the checkpoint)
        self.batch_sh = common.batch_sharding(self.mesh)
        self.state = common.put_global(_init_fn(self.model_cfg, cfg.seed, hyper[:2], opts)(), self.state_sh)
        self._resume_latest()

    # --- checkpoints ----------------------------------------------------------------------------
    def identity(self) -> dict:
        return {"model_config": self.model_cfg.to_hf_dict()}

    def data_meta(self, step: int) -> dict:
        return {"sampler": "WindowSampler", "seed": self.cfg.seed, "next_step": step, "seq_len": self.cfg.seq_len,
                "batch_size": self.cfg.batch_size}

    def check_resume(self, meta: dict) -> None:
        for k in ("seq_len", "batch_size", "seed"):
            if meta["data"][k] != getattr(self.cfg, k):
                raise ValueError(f"cannot resume: checkpoint has {k}={meta['data'][k]}, run asks "
                                 f"{getattr(self.cfg, k)}")

    # --- loop -----------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        c = self.cfg
        return common.warmup_cosine(step, c.lr, c.warmup_steps, self.total_steps, c.min_lr_ratio)

    def train_step(self, state, batch, step: int):
        return self._train_fn(state, batch, jnp.float32(self.lr_at(step)))

    def batch(self, step: int) -> jax.Array:
        b = self.cfg.batch_size
        return common.global_batch(lambda lo, hi: self.sampler.batch(step, b, slice(lo, hi)), b, self.batch_sh)

    def evaluate(self) -> dict[str, dict[str, float]]:
        out = {}
        eb = self.cfg.eval_batch
        for d, windows in self.val.items():
            total, count = 0.0, 0.0
            for i in range(0, len(windows), eb):
                chunk = windows[i:i + eb]
                pad = eb - len(chunk)
                mask = np.ones((eb, self.cfg.seq_len), np.float32)
                if pad:  # keep one compiled shape: pad with copies, masked out
                    chunk = np.concatenate([chunk, np.repeat(chunk[:1], pad, 0)])
                    mask[eb - pad:] = 0
                s, n = self._eval_masked(chunk, mask)
                total += float(s)
                count += float(n)
            loss = total / max(count, 1.0)
            out[d] = {"loss": round(loss, 5), "ppl": round(math.exp(min(loss, 50.0)), 3), "tokens": int(count)}
        return out

    def _eval_masked(self, chunk: np.ndarray, mask: np.ndarray):
        return self._eval_fn(self.state["params"], common.batch_from_host(chunk, self.batch_sh),
                             common.batch_from_host(mask, self.batch_sh))

    def run(self, stop_after: int | None = None) -> dict:
        """Train from the current step to the total (cfg.steps, or fewer under a time budget), or only up to
        stop_after (e.g. to simulate a kill after k steps).

        Checkpoints every ckpt_every steps and where it stops; evaluates every eval_every steps and at the end.
        With time_budget_s, the step time measured after compilation fixes the total steps once (the cosine
        then ends where the budget does; warm-up is unaffected), and a hard stop guards the budget.
        Returns a summary (losses per step of this call, last validation, throughput)."""
        cfg = self.cfg
        stop = stop_after if stop_after is not None else 1 << 62
        log = common.MetricsLog(self.out / "metrics.jsonl", total=self.total_steps, initial=self.start_step,
                                progress=cfg.progress)
        if self.start_step == 0:
            log.write({"event": "start", "num_params": self.num_params, "devices": int(self.mesh.devices.size),
                       "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
                       "compute_dtype": jnp.dtype(self.compute_dtype).name, "train_tokens": self.sampler.tokens,
                       "model_config": self.model_cfg.to_hf_dict(), "train_config": cfg.to_dict()})
        else:
            log.write({"event": "resume", "step": self.start_step})
        clock = common.StepClock(cfg.time_budget_s, cfg.batch_size * cfg.seq_len, resumed=self.start_step > 0,
                                 call_limit_s=cfg.call_limit_s)

        def step_fn(step: int) -> tuple[float, dict]:
            lr = self.lr_at(step)
            self.state, metrics = self._train_fn(self.state, self.batch(step), jnp.float32(lr))
            return lr, metrics

        losses, val, step = common.train_steps(
            self, cfg, log, clock, stop, step_fn,
            lambda lr, m: {"loss": round(m["loss"], 5), "grad_norm": round(m["grad_norm"], 4), "lr": lr})
        log.close()
        fpt = train_flops_per_token(self.model_cfg, self.state["params"], cfg.seq_len)
        mfu = model_flops_utilization(clock.throughput, fpt, int(self.mesh.devices.size),
                                      jax.devices()[0].device_kind, jnp.dtype(self.compute_dtype).name)
        return {"losses": losses, "val": val, "step": step, "total_steps": self.total_steps,
                "finished": step >= self.total_steps,
                "tokens_per_s": clock.throughput, "train_seconds": clock.elapsed(),
                "num_params": self.num_params, "flops_per_token": fpt,
                "mfu": None if mfu is None else round(mfu, 4)}

    # --- export ---------------------------------------------------------------------------------
    def model(self):
        params = common.to_host(self.state["params"])
        return nnx.merge(self.graphdef, jax.tree.map(jnp.asarray, params))

    def export(self, out_dir: str | Path | None = None) -> Path:
        """The Hugging Face directory (every process gathers the weights; process 0 writes)."""
        from hyspec_jax.io.hf import save_pretrained
        from tokenizers import Tokenizer
        from hyspec_jax.train.tokenizer_train import generation_config

        out_dir = Path(out_dir) if out_dir is not None else self.out / "hf"
        dtype = {"bfloat16": jnp.bfloat16, "float32": F32}[self.cfg.export_dtype]
        model = self.model()
        if not common.is_primary():
            return out_dir
        save_pretrained(model, out_dir, max_shard_bytes=int(self.cfg.export_shard_mb * (1 << 20)), dtype=dtype)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(self.tok_dir / f, out_dir / f)
        tok = Tokenizer.from_file(str(self.tok_dir / "tokenizer.json"))
        (out_dir / "generation_config.json").write_text(json.dumps(generation_config(tok), indent=2) + "\n")
        return out_dir


def train_target(cfg: TargetTrainConfig, export: bool = True) -> dict:
    trainer = TargetTrainer(cfg)
    summary = trainer.run()
    if export and summary["finished"]:
        summary["export"] = str(trainer.export())
    trainer.ckpt.close()
    summary.pop("losses")
    if common.is_primary():
        (Path(cfg.out) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


__all__ = ["TargetTrainConfig", "TargetTrainer", "WindowSampler", "PRESETS", "preset_config", "hybrid_config",
           "train_flops_per_token", "bf16_peak_flops", "model_flops_utilization",
           "next_token_loss", "validation_windows", "train_target", "count_params"]
