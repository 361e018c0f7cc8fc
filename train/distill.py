"""Distillation data for the drafter (`hyspec build-distill`): corpus prompts, target-generated continuations.

DSpark and ReaDy train the drafter on what the *target* writes, not on human text: at inference the drafter
always continues the target's own output. Two steps, so the second can run where the corpus is absent (the
GPU machine receives only code + checkpoints + this small prompt pack):

1. `sample_prompts`: `per_domain` windows of `prompt_len` tokens from each domain's train shard, starts drawn
   from a PRNG keyed on the seed (deterministic), saved as `prompts.npz` (tokens [N, P] in the corpus's token
   type, domain ids, window starts). With `exclude` no window overlaps another pack's: data disjoint from
   what a drafter was trained on (`--exclude-prompts`).
2. `generate_continuations`: the frozen target continues every prompt for `gen_len` tokens with our
   `Engine` (plain decoding, greedy by default — the decoding the drafter must match at inference), in batches; writes
   `sequences.npy` [N·V, P + G] (uint16, or uint32 for a vocabulary over 65,536 ids: `corpus.token_dtype`),
   `domains.npy`, `manifest.json` (target, config, counts, throughput).
   With `variants` V > 1 every prompt is continued V times: variant 0 as above, variant v ≥ 1 samples its first
   `sample_prefix` tokens at `prefix_temperature` (seeded by v) and continues greedily from there. The greedy
   part is what the drafter must match; the sampled fork sends it down a different path, so V variants give
   V times the distinct training text from the same prompt pack (the pack must be small: it travels to the
   GPU machine with the code). The first 9,216-prompt drafter saw its 2M tokens ~50 times in 190 s and
   reached first-slot accuracy 0.83 on them against 0.62 acceptance on held-out prompts — it was data-bound.

What the drafter trains on besides the tokens — the tapped target features, the final hidden states (logits)
and the committed GDN states of the reader's source layers at each anchor — is NOT stored: it is a
deterministic function of (frozen target, tokens) and `train.drafter` recomputes it inside the step with one
no-grad target forward. For this 28M target that forward is cheaper than reading the features back (per
sequence of 256 tokens: 4 taps × 512 × 256 bf16 = 1 MiB of features and 2 × 8 × 64 × 64 fp32 × 32 anchors =
4 MiB of states, against 2 × 28M × 256 FLOPs ≈ 14 GFLOP ≈ 20 µs on an H200), and the data stays 512 bytes a
sequence instead of megabytes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from hyspec_jax.train.corpus import load_shard, shard_domains, token_dtype


def sample_prompts(corpus_dir: str | Path, out_file: str | Path, *, per_domain: int = 1024, prompt_len: int = 32,
                   seed: int = 0, split: str = "train", exclude: str | Path | None = None) -> dict:
    """Write `prompts.npz` (tokens [N, P] as the corpus stores them, domain [N] int32, domains names, starts [N]
    int64: each window's position in its shard); returns a summary. exclude: another pack of the same split
    (with starts) whose windows no new window may overlap — a pack disjoint from the one a drafter was trained
    on, for training or probing what reads that drafter."""
    if per_domain <= 0 or prompt_len <= 0:
        raise ValueError("per_domain and prompt_len must be positive")
    domains = shard_domains(corpus_dir, split)
    taken = _excluded_windows(exclude, domains) if exclude is not None else {}
    rows, dom, all_starts = [], [], []
    for di, d in enumerate(domains):
        s = load_shard(corpus_dir, split, d)
        if s.size < prompt_len + 1:
            raise ValueError(f"{d}: {split} shard of {s.size} tokens is shorter than prompt_len {prompt_len}")
        rng = np.random.default_rng([seed, di])
        starts = _disjoint_starts(rng, s.size - prompt_len, per_domain, taken.get(d), prompt_len, d)
        rows.append(np.stack([np.asarray(s[a:a + prompt_len]) for a in starts]))
        dom.append(np.full(per_domain, di, np.int32))
        all_starts.append(starts.astype(np.int64))
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate(rows)
    np.savez_compressed(out_file, tokens=tokens, domain=np.concatenate(dom), domains=np.asarray(domains),
                        starts=np.concatenate(all_starts))
    return {"prompts": int(tokens.shape[0]), "prompt_len": prompt_len, "domains": domains, "file": str(out_file),
            "excluded": sum(len(v[0]) for v in taken.values())}


def _excluded_windows(path: str | Path, domains: list[str]) -> dict[str, tuple[np.ndarray, int]]:
    """{domain: (sorted starts, window length)} of an existing pack's windows."""
    z = np.load(Path(path))
    if "starts" not in z.files:
        raise ValueError(f"{path}: the pack has no window starts (made before they were stored): rebuild it with "
                         f"`hyspec-train build-distill --prompts-only` and the same options")
    names = [str(x) for x in z["domains"]]
    unknown = sorted(set(names) - set(domains))
    if unknown:
        raise ValueError(f"{path}: domains {unknown} are not in this split's shards")
    length = int(z["tokens"].shape[1])
    dom, starts = z["domain"], z["starts"]
    return {name: (np.sort(starts[dom == i]), length) for i, name in enumerate(names)}


def _disjoint_starts(rng: np.random.Generator, high: int, n: int, taken: tuple[np.ndarray, int] | None,
                     prompt_len: int, domain: str) -> np.ndarray:
    """n window starts in [0, high) from rng; with `taken` (sorted starts, their length), none whose window
    overlaps a taken one (drawn again, in order, until n are found)."""
    if taken is None:
        return rng.integers(0, high, n)
    ex, ex_len = taken
    out: list[int] = []
    for _ in range(64):
        cand = rng.integers(0, high, max(n, 64))
        # a window [a, a + P) overlaps [e, e + L) iff e - P < a < e + L: the nearest taken start at or below
        # a + P - 1 decides
        j = np.searchsorted(ex, cand + prompt_len, side="left") - 1
        ok = (j < 0) | (ex[np.maximum(j, 0)] + ex_len <= cand)
        out.extend(int(a) for a in cand[ok][: n - len(out)])
        if len(out) == n:
            return np.asarray(out)
    raise ValueError(f"{domain}: cannot find {n} windows clear of the excluded pack's")


def load_prompts(path: str | Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no prompt pack (run `hyspec build-distill --prompts-only`)")
    z = np.load(path)
    return z["tokens"].astype(np.int32), z["domain"].astype(np.int32), [str(x) for x in z["domains"]]


def generate_continuations(target_dir: str | Path, prompts_file: str | Path, out_dir: str | Path, *,
                           gen_len: int = 224, batch_size: int = 512, temperature: float = 0.0, seed: int = 0,
                           dtype: str = "float32", variants: int = 1, first_variant: int = 0,
                           sample_prefix: int = 4, prefix_temperature: float = 1.0,
                           progress: bool | None = None) -> dict:
    """Continue every prompt with the frozen target; write the sequences + manifest; return the manifest.

    Variants `first_variant .. first_variant + variants - 1` are written (rows variant-major), so two machines
    can each build a slice of one set and `merge_distill` joins them."""
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from hyspec_jax.runtime.engine import Engine
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.sampling import SamplingParams

    if gen_len <= 0 or batch_size <= 0 or variants <= 0 or first_variant < 0:
        raise ValueError("gen_len, batch_size and variants must be positive, first_variant non-negative")
    if not 0 < sample_prefix < gen_len and (first_variant + variants > 1):
        raise ValueError(f"sample_prefix must be in [1, gen_len) for variants beyond 0, got {sample_prefix}")
    tokens, domain, names = load_prompts(prompts_file)
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    cfg, target = load_pretrained(target_dir, dtype=dt)
    if tokens.max() >= cfg.vocab_size:
        raise ValueError(f"prompt ids reach {tokens.max()} but the target's vocabulary is {cfg.vocab_size}")
    gen = Engine(target)
    N, P = tokens.shape
    vids = list(range(first_variant, first_variant + variants))
    seqs = np.zeros((N * variants, P + gen_len), token_dtype(cfg.vocab_size))
    t0 = time.perf_counter()
    bar = tqdm(total=N * variants, desc="build-distill", unit="seq", disable=progress is False)
    for k, v in enumerate(vids):
        block = seqs[k * N:(k + 1) * N]
        block[:, :P] = tokens
        for i in range(0, N, batch_size):
            chunk = [list(map(int, c)) for c in tokens[i:i + batch_size]]
            rows = range(i, i + len(chunk))
            fork, live = [[] for _ in chunk], list(range(len(chunk)))
            if v > 0:        # the sampled fork: seeds differ per variant and per prompt
                params = [SamplingParams(max_tokens=sample_prefix, temperature=prefix_temperature,
                                         seed=(seed * 1_000_003 + v) * 1_000_003 + r) for r in rows]
                res = gen.generate(chunk, params)
                fork = [r.token_ids for r in res]
                live = [j for j, r in enumerate(res) if r.finish_reason == "length"]   # not stopped in the fork
            params = [SamplingParams(max_tokens=gen_len - len(fork[j]), temperature=temperature,
                                     seed=seed * 1_000_003 + i + j) for j in live]
            rest = dict(zip(live, gen.generate([chunk[j] + fork[j] for j in live], params))) if live else {}
            for j in range(len(chunk)):
                got = fork[j] + (rest[j].token_ids if j in rest else [])
                block[i + j, P:P + len(got)] = got
            bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - t0
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "sequences.npy", seqs)
    np.save(out_dir / "domains.npy", np.tile(domain, variants))
    manifest = {"target": str(target_dir), "target_config": cfg.to_hf_dict(), "prompts": str(prompts_file),
                "sequences": N * variants, "prompt_len": P, "gen_len": gen_len, "temperature": temperature,
                "seed": seed, "variants": vids, "sample_prefix": sample_prefix if vids != [0] else 0,
                "prefix_temperature": prefix_temperature, "dtype": dtype, "domains": names,
                "per_domain": {d: int((domain == k).sum()) * variants for k, d in enumerate(names)},
                "device": jax.devices()[0].device_kind, "seconds": round(seconds, 2),
                "generated_tokens_per_s": round(N * variants * gen_len / max(seconds, 1e-9), 1)}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def merge_distill(parts: list[str | Path], out_dir: str | Path) -> dict:
    """Join distillation slices built from one prompt pack (e.g. variants 0-1 and 2-3 on two GPUs)."""
    parts = [Path(p) for p in parts]
    mans = [json.loads((p / "manifest.json").read_text()) for p in parts]
    keys = ("target", "prompts", "prompt_len", "gen_len", "temperature", "seed", "dtype", "domains")
    for m in mans[1:]:
        bad = [k for k in keys if m[k] != mans[0][k]]
        if bad:
            raise ValueError(f"distillation slices differ in {', '.join(bad)}: not one set")
    vids = [v for m in mans for v in m.get("variants", [0])]
    if len(set(vids)) != len(vids):
        raise ValueError(f"variants repeat across the slices: {vids}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "sequences.npy", np.concatenate([np.load(p / "sequences.npy") for p in parts]))
    np.save(out_dir / "domains.npy", np.concatenate([np.load(p / "domains.npy") for p in parts]))
    merged = dict(mans[0], sequences=sum(m["sequences"] for m in mans), variants=vids,
                  sample_prefix=max(m.get("sample_prefix", 0) for m in mans),
                  per_domain={d: sum(m["per_domain"][d] for m in mans) for d in mans[0]["per_domain"]},
                  seconds=[m["seconds"] for m in mans],
                  generated_tokens_per_s=sum(m["generated_tokens_per_s"] for m in mans), parts=[str(p) for p in parts])
    (out_dir / "manifest.json").write_text(json.dumps(merged, indent=1) + "\n")
    return merged


class DistillSampler:
    """Batches [B, T] of target-generated sequences; batch(step) is a pure function of (seed, step).

    Rows are drawn uniformly; when the stored sequences are longer than T a random offset is taken (the same
    interface as `train.target.WindowSampler`, so the drafter trainer takes either)."""

    def __init__(self, data_dir: str | Path, seq_len: int, seed: int):
        path = Path(data_dir) / "sequences.npy"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no distillation data (run `hyspec build-distill`)")
        self.seqs = np.load(path, mmap_mode="r")
        self.seq_len, self.seed = seq_len, seed
        if self.seqs.shape[1] < seq_len:
            raise ValueError(f"{path}: sequences of {self.seqs.shape[1]} tokens are shorter than the "
                             f"training window {seq_len}")

    @property
    def tokens(self) -> int:
        return int(self.seqs.size)

    def batch(self, step: int, batch_size: int, rows: slice = slice(None)) -> np.ndarray:
        """Rows `rows` of the global batch (`WindowSampler.batch`: a process reads only its own rows)."""
        rng = np.random.default_rng([self.seed, step, 31])
        seqs = rng.integers(0, self.seqs.shape[0], batch_size)[rows]
        offs = rng.integers(0, self.seqs.shape[1] - self.seq_len + 1, batch_size)[rows]
        return np.stack([np.asarray(self.seqs[r, o:o + self.seq_len]) for r, o in zip(seqs, offs)]).astype(np.int32)

def student_windows(cfg) -> tuple["DistillSampler | WindowSampler", dict[str, np.ndarray]]:
    """A drafter's or MTP head's training and validation windows: (the sampler — distilled targets with
    cfg.data, else windows of cfg.seq_len - 1 corpus tokens — and {domain: validation windows [n, seq_len]})."""
    from hyspec_jax.train.target import WindowSampler, validation_windows
    sampler = (DistillSampler(cfg.data, cfg.seq_len, cfg.seed) if cfg.data
               else WindowSampler(cfg.corpus, cfg.seq_len - 1, cfg.seed))
    val = {d: w[:, :cfg.seq_len] for d, w in validation_windows(cfg.corpus, cfg.seq_len, cfg.eval_windows).items()}
    return sampler, val


__all__ = ["sample_prompts", "load_prompts", "generate_continuations", "merge_distill", "DistillSampler",
           "student_windows"]
