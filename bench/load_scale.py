"""Streamed checkpoint loading at scale (issue [scale], item 5): the load time of a sharded bf16 checkpoint of the
Qwen3.5-9B geometry, written here, onto the device(s).

    python -m hyspec_jax.bench.load_scale --dir DIR [--tiny | --config PATH] [--shard-size 5GB] [--mesh D]
                                          [--no-warm] [--keep | --reuse] [--json OUT.json]

1. Write (unless `--reuse`): a Hugging Face checkpoint in DIR (which must not exist or be empty) — config.json,
   `model-0000i-of-0000n.safetensors` shards of at most `--shard-size` (default 5GB, transformers' default)
   and model.safetensors.index.json, through `hyspec_jax.io.hf.write_safetensors`, the writer of
   `save_pretrained`: only one shard's tensors exist at a time, the model is never built. Geometry: the
   Qwen3.5 "9B-style" row of docs/reference/target_model.md §15 (`spec.memory.qwen35_9b`; `--tiny`: the small geometry
   of `verify_scale`; `--config`: any config.json). Weights: bf16 N(0, 0.02) values copied from one fixed
   random pool at random offsets (the load time does not depend on the values; drawing 9e9 normals would take
   minutes). After each shard is written it is synced to disk and dropped from the page cache
   (`posix_fadvise(DONTNEED)`), so the first load reads from the disk.
2. Cold load: `load_pretrained(DIR, dtype=bfloat16, mesh=...)` (streamed: shard by shard, each tensor placed as
   it is read) until every parameter is on the device(s) (`block_until_ready`). Reported: seconds, GB/s
   (checkpoint bytes / seconds, GB = 1e9 bytes), the fraction of the files in the page cache before it
   (`mincore`; 0 = truly cold), the process's host RSS before, at its peak during the load (Linux VmHWM,
   reset just before) and after, the loader's own count of host tensor bytes held at once (`LoadStats`), and
   the device bytes in use.
3. Warm load (unless `--no-warm`): the same again with the files now in the page cache (the loader's own speed,
   disk aside).
4. Check: for every shard, its largest directly loaded tensor (up to 256 MiB) read back from the device equals
   the file's. Then DIR is deleted unless `--keep` (or `--reuse`).

`--mesh D` places the parameters over a (data 1, model D) mesh with `hyspec_jax.sharding`'s layouts (each
device reads only its slices); without it, on the default device.

Outputs (with --json OUT.json): OUT.json (run_metadata: device, versions, commit; the command line; every
number) and OUT.md (the table). CPU smoke run: `--tiny --shard-size 200KB`.

On the GPU machine the package is not pip-installed: map bench/ into the package and run from the repository
root (bench/verify_scale.py's convention). One H200 (about 18 GB on disk and on the device; 64 GiB disk,
128 GiB RAM; run with timeout_s 600):

    ln -sfn $PWD/bench hyspec_jax/bench; HYSPEC_GIT_COMMIT=<sha> PYTHONPATH=$PWD python3 -m \\
        hyspec_jax.bench.load_scale --dir load_scale_ckpt --json $OUT/load_scale_9b_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

GB = 1e9
POOL = 1 << 24                   # random bf16 values the written tensors are copied from
VERIFY_MAX_BYTES = 256 << 20


class UsageError(Exception):
    """A bad option or folder: one line on stderr, exit status 2."""


# ------------------------------------------------------------------------------------------------
# Geometry
# ------------------------------------------------------------------------------------------------
def resolve_config(tiny: bool, config: str | None):
    from hyspec_jax.config import TargetConfig

    if tiny:
        from hyspec_jax.bench.verify_scale import tiny_config
        return tiny_config(), "tiny geometry"
    if config:
        p = Path(config)
        return (TargetConfig.from_pretrained(p) if p.is_dir() else
                TargetConfig.from_hf_dict(json.loads(p.read_text()))), str(p)
    from hyspec_jax.spec.memory import qwen35_9b
    return qwen35_9b(), "Qwen3.5-9B geometry"


def disk_layout(cfg) -> dict[str, tuple[int, ...]]:
    """On-disk tensor name -> shape of a checkpoint of `cfg` (the parameters of the abstract model, split as
    save_pretrained writes them), without allocating a tensor."""
    import ml_dtypes

    from hyspec_jax.io.hf import flat_params, hf_tensors
    from hyspec_jax.models.target import abstract_model

    zero = np.zeros((), ml_dtypes.bfloat16)
    out = {}
    for name, var in flat_params(abstract_model(cfg)).items():
        for key, view in hf_tensors(name, np.broadcast_to(zero, tuple(var.shape))):
            out[key] = tuple(view.shape)
    return out


# ------------------------------------------------------------------------------------------------
# Writing, the page cache, host memory
# ------------------------------------------------------------------------------------------------
def parse_size(s: str) -> int:
    """'5GB' / '200KB' / '4GiB' / '1000' -> bytes (decimal units as transformers' max_shard_size, binary *iB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", s, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 200KB or 4GiB, got {s!r}")
    unit = m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in scale:
        raise argparse.ArgumentTypeError(f"unknown size unit in {s!r}")
    size = int(float(m.group(1)) * scale[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {s!r}")
    return size


class RandomWeights:
    """bf16 arrays of N(0, 0.02) values copied from one pool of POOL values at random offsets (seeded)."""

    def __init__(self, seed: int, pool: int = POOL):
        import ml_dtypes

        self.rng = np.random.default_rng(seed)
        self.pool = (0.02 * self.rng.standard_normal(pool, np.float32)).astype(ml_dtypes.bfloat16)

    def __call__(self, shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        out = np.empty(n, self.pool.dtype)
        i = 0
        while i < n:
            off = int(self.rng.integers(0, len(self.pool)))
            m = min(n - i, len(self.pool) - off)
            out[i:i + m] = self.pool[off:off + m]
            i += m
        return out.reshape(shape)


def drop_from_page_cache(path: Path) -> None:
    """Sync a written file and ask the kernel to drop its pages from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore), or None where that cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            vec = np.zeros(pages, np.uint8)
            rc = libc.mincore(ctypes.c_void_p(addr), size, vec.ctypes.data_as(ctypes.c_void_p))
            libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
        if rc != 0:
            return None
        resident += int(np.count_nonzero(vec & 1))
        total += pages
    return resident / total if total else None


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux ≥ 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def filesystem(path: Path) -> str | None:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/mounts)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    p = str(path.resolve())
    best = max((m for m in mounts if p == m[0] or p.startswith(m[0].rstrip("/") + "/")), key=lambda m: len(m[0]),
               default=None)
    return None if best is None else best[1]


def write_checkpoint(cfg, out: Path, shard_bytes: int, seed: int, progress: bool) -> dict:
    from tqdm import tqdm

    from hyspec_jax.io.hf import write_safetensors

    layout = disk_layout(cfg)
    nbytes = {k: math.prod(s) * 2 for k, s in layout.items()}
    total = sum(nbytes.values())
    free = shutil.disk_usage(out.parent).free
    if free < total + (1 << 30):
        raise UsageError(f"{out.parent}: {free / GB:.1f} GB free, the checkpoint needs {total / GB:.1f} GB (+1)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    weights = RandomWeights(seed)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not progress, file=sys.stderr)

    def produce(key: str) -> np.ndarray:
        arr = weights(layout[key])
        bar.update(arr.nbytes)
        return arr
    t0 = time.perf_counter()
    files = write_safetensors(out, nbytes, produce, max_shard_bytes=shard_bytes, after_write=drop_from_page_cache)
    seconds = time.perf_counter() - t0
    bar.close()
    return {"seconds": seconds, "gbps": total / GB / seconds, "files": len(files), "tensor_bytes": total}


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------
def device_bytes_in_use() -> int | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:                               # noqa: BLE001 — backends without memory stats
        return None
    return None if not stats else sum(int((d.memory_stats() or {}).get("bytes_in_use", 0))
                                      for d in jax.local_devices())


def timed_load(ckpt: Path, files: list[Path], mesh, kind: str, progress: bool) -> tuple[dict, object]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.io.hf import LoadStats, load_pretrained

    resident = resident_fraction(files)
    reset = reset_peak_rss()
    rss_before = _status("VmRSS")
    stats = LoadStats()
    t0 = time.perf_counter()
    _, model = load_pretrained(ckpt, dtype=jnp.bfloat16, mesh=mesh, stats=stats, progress=progress)
    jax.block_until_ready(nnx.state(model, nnx.Param))
    seconds = time.perf_counter() - t0
    ckpt_bytes = sum(os.path.getsize(f) for f in files)
    row = {
        "kind": kind, "seconds": seconds, "gbps": ckpt_bytes / GB / seconds, "resident_before": resident,
        "rss_before": rss_before, "rss_peak": _status("VmHWM") if reset else None, "rss_after": _status("VmRSS"),
        "loader_peak_host_bytes": stats.peak_host_bytes, "largest_file_tensor_bytes": stats.largest_file_bytes,
        "tensors": stats.tensors, "tensor_bytes": stats.bytes_read, "device_bytes_in_use": device_bytes_in_use(),
    }
    return row, model


def verify_loaded(model, files: list[Path]) -> int:
    """For every file, its largest directly loaded tensor (≤ VERIFY_MAX_BYTES) equals the device copy."""
    from safetensors import safe_open

    from hyspec_jax.io.hf import _canonical, flat_params

    params = flat_params(model)
    checked = 0
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            best = None
            for raw in f.keys():
                key = _canonical(raw)
                if key not in params:
                    continue
                n = math.prod(f.get_slice(raw).get_shape()) * 2
                if n <= VERIFY_MAX_BYTES and (best is None or n > best[0]):
                    best = (n, raw, key)
            if best is None:
                continue
            disk, dev = f.get_tensor(best[1]), np.asarray(params[best[2]][...])
            if disk.shape != dev.shape or not np.array_equal(disk.view(np.uint16), dev.view(np.uint16)):
                raise AssertionError(f"{best[2]}: the loaded tensor differs from {path.name}")
            checked += 1
    return checked


def run(args, argv: list[str]) -> dict:
    import jax

    from hyspec_jax.bench.report import portable_command, run_metadata
    from hyspec_jax.io.hf import _weight_files, flat_params

    cfg, name = resolve_config(args.tiny, args.config)
    ckpt = Path(args.dir)
    mesh = None
    if args.mesh:
        from hyspec_jax import sharding as shd
        try:
            mesh = shd.make_mesh(1, args.mesh)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.reuse:
        if not (ckpt / "config.json").is_file():
            raise UsageError(f"--reuse: {ckpt} holds no checkpoint (no config.json)")
        from hyspec_jax.config import TargetConfig
        cfg, name, written = TargetConfig.from_pretrained(ckpt), str(ckpt), None
    else:
        if ckpt.exists() and (not ckpt.is_dir() or any(ckpt.iterdir())):
            raise UsageError(f"--dir {ckpt} exists and is not empty (give a new folder, or --reuse it)")
        written = write_checkpoint(cfg, ckpt, args.shard_size, args.seed, progress=not args.no_progress)
    files = _weight_files(ckpt)
    checkpoint = {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files),
                  "largest_file_bytes": max(os.path.getsize(f) for f in files), "filesystem": filesystem(ckpt)}
    loads = []
    try:
        for kind in ("cold", "warm")[: 1 if args.no_warm else 2]:
            row, model = timed_load(ckpt, files, mesh, kind, progress=not args.no_progress)
            if kind == "cold":
                row["verified_tensors"] = verify_loaded(model, files)
                param_count = sum(math.prod(v.shape) for v in flat_params(model).values())
            del model
            loads.append(row)
            print(f"[load-scale] {kind}: {row['seconds']:.2f} s, {row['gbps']:.3g} GB/s", file=sys.stderr)
    finally:
        if not (args.keep or args.reuse):
            shutil.rmtree(ckpt, ignore_errors=True)
    return {
        "meta": run_metadata(), "command": portable_command("python -m hyspec_jax.bench.load_scale", argv),
        "model": {"name": name, "param_count": param_count, "config": cfg.to_hf_dict()},
        "settings": {"shard_size": args.shard_size, "mesh": args.mesh, "dtype": "bfloat16", "seed": args.seed,
                     "devices": jax.device_count()},
        "checkpoint": checkpoint, "write": written, "loads": loads,
    }


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def _size(x) -> str:
    if x is None:
        return "—"
    return f"{x / GB:.2f} GB" if x >= 0.1 * GB else f"{x / 1e6:.2f} MB"


def table(report: dict) -> str:
    out = ["| load | seconds | GB/s | in page cache before | host RSS before | peak | after | "
           "loader host peak | device in use |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["loads"]:
        res = "—" if r["resident_before"] is None else f"{100 * r['resident_before']:.0f}%"
        out.append(f"| {r['kind']} | {r['seconds']:.2f} | {r['gbps']:.3g} | {res} | {_size(r['rss_before'])} | "
                   f"{_size(r['rss_peak'])} | {_size(r['rss_after'])} | {_size(r['loader_peak_host_bytes'])} | "
                   f"{_size(r['device_bytes_in_use'])} |")
    return "\n".join(out)


def markdown(report: dict) -> str:
    from hyspec_jax.bench.verify_scale import _count

    meta, s, c, w = report["meta"], report["settings"], report["checkpoint"], report["write"]
    where = f"a (1, {s['mesh']}) mesh" if s["mesh"] else "the default device"
    lines = [
        f"# Streamed checkpoint loading — {report['model']['name']}, {meta['device_kind']}", "",
        f"`{report['command']}`", "",
        f"commit {meta['commit']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}, {meta['device_count']} "
        f"{meta['platform']} device(s), {meta['time_utc']}", "",
        f"{_count(report['model']['param_count'])} parameters, bf16: {c['files']} shard files, "
        f"{_size(c['bytes'])} (largest {_size(c['largest_file_bytes'])}) on {c['filesystem'] or '?'}; "
        f"loaded onto {where}.",
        "" if w is None else (f"Written in {w['seconds']:.1f} s ({w['gbps']:.3g} GB/s, synced, then dropped from "
                              "the page cache)."), "",
        table(report), "",
        "GB = 1e9 bytes. Host RSS: the process's resident set (its peak: Linux VmHWM, reset before each load; "
        "it includes the pages of the shard file mapped while it is read). Loader host peak: the most bytes "
        "of host tensors the loader held at once (`LoadStats.peak_host_bytes`).",
        f"Checked: {report['loads'][0].get('verified_tensors', 0)} tensors (the largest of each shard, up to "
        f"{VERIFY_MAX_BYTES >> 20} MiB) read back from the device equal the files.", "",
    ]
    return "\n".join(lines)


def write_outputs(report: dict, json_path: str | None) -> None:
    if not json_path:
        return
    p = Path(json_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=1, default=str) + "\n")
    p.with_suffix(".md").write_text(markdown(report))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hyspec_jax.bench.load_scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, metavar="DIR",
                    help="where the checkpoint is written (must not exist or be empty; deleted at the end "
                         "unless --keep)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tiny", action="store_true", help="a small geometry (CPU smoke run, tests)")
    g.add_argument("--config", metavar="PATH", help="a config.json or model directory (default: Qwen3.5-9B)")
    ap.add_argument("--shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                    help="largest shard file, e.g. 5GB (default), 200KB, 4GiB")
    ap.add_argument("--mesh", type=int, default=0, metavar="D",
                    help="place over a (data 1, model D) mesh with hyspec_jax.sharding's layouts (default: no "
                         "mesh, the default device)")
    ap.add_argument("--no-warm", action="store_true", help="only the cold load")
    k = ap.add_mutually_exclusive_group()
    k.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    k.add_argument("--reuse", action="store_true", help="load the checkpoint already in DIR (no write, kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT.json", help="write OUT.json and OUT.md")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.mesh < 0:
        print("load-scale: error: --mesh must be ≥ 0", file=sys.stderr)
        return 2
    from hyspec_jax.config import ConfigError
    from hyspec_jax.io.hf import CheckpointError

    try:
        report = run(args, argv)
    except UsageError as e:
        print(f"load-scale: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError, OSError, AssertionError) as e:
        print(f"load-scale: error: {e}", file=sys.stderr)
        return 1
    write_outputs(report, args.json)
    print(table(report))
    if args.json:
        print(f"[load-scale] wrote {args.json} and its .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
