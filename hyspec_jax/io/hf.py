"""Hugging Face checkpoint I/O: `config.json` + safetensors (single file or sharded with an index).

Parameter paths of `TargetModel` equal HF keys up to prefixes and the fused parameters:
- `model.language_model.` (Qwen3.5 saved as ConditionalGeneration) → `model.`; `mtp.*`, `model.visual.*` ignored;
- the fused parameters (an MLP's gate/up, a GDN layer's in-projection, the routed experts) are assembled from
  their on-disk tensors as those stream in and split back on save: `hyspec_jax.io.layout`, the one home of
  that mapping (also for the MTP head and the drafter).

Loading is streamed (`stream_params`): first every shard's header is read (names, shapes, dtypes, offsets; no
data) and checked against the config, so a missing or misshapen tensor fails before any data is read; then the
shards are read one at a time, in file order, and each tensor is converted and placed straight into its final
placement — the default device, or its `hyspec_jax.sharding` layout on a mesh, where each device's slice is read
on its own (whole rows by a plain read at their offset, other slices through safetensors' lazy `get_slice`).
The host never holds more than the tensor in flight, plus the buffers of the fused parameters whose parts are
not all read yet (one MoE layer's experts, or one layer's MLP gate/up or GDN in-projection, when a parameter's
parts are stored together). `LoadStats.peak_host_bytes` counts exactly those host buffers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from hyspec_jax.config import ConfigError, TargetConfig
from hyspec_jax.io import layout
from hyspec_jax.io.layout import Fused, Part
from hyspec_jax.models.target import TargetModel, abstract_model

log = logging.getLogger(__name__)

_IGNORED = re.compile(r"^(mtp\.|model\.visual\.|visual\.)")
# safetensors dtype names -> numpy (bf16 / fp8 via ml_dtypes)
_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U32": np.uint32,
           "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F32": np.float32, "F64": np.float64, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E5M2": ml_dtypes.float8_e5m2}
PROGRESS_MIN_BYTES = 1 << 30     # a progress bar for checkpoints this large even when stderr is not a terminal


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (missing / misshapen tensors, no weight files)."""


def _canonical(key: str) -> str | None:
    if _IGNORED.match(key):
        return None
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model."):]
    elif key.startswith("language_model."):
        key = "model." + key[len("language_model."):]
    return key


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that do not exist: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no model.safetensors, no model.safetensors.index.json")
    return files


# ------------------------------------------------------------------------------------------------
# Streamed loading
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoadStats:
    """What one load did (pass one to `load_pretrained(stats=)` / `stream_params`; filled in place).

    peak_host_bytes: the most bytes of host tensors the loader held at once — arrays read from the files (and
    their dtype conversions) not yet placed, and fused parameter buffers not yet complete; largest_file_bytes:
    the tensor bytes of the largest weight file, the bound a streamed load stays under (plus the fused
    parameters' buffers)."""
    files: int = 0
    tensors: int = 0
    bytes_read: int = 0
    largest_file_bytes: int = 0
    peak_host_bytes: int = 0
    seconds: float = 0.0
    held_bytes: int = 0          # host bytes held now (0 after a load)

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.held_bytes)

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One tensor of a checkpoint, known from its file's header (nothing read): canonical name, name on disk,
    shape, dtype, and its file and data offset (file None: the in-memory `array`)."""
    key: str
    raw_key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    file: Path | None = None
    offset: int = 0                         # where its bytes start in the file
    array: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _dtype(name: str, raw_key: str, path: Path) -> np.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"tensor {raw_key!r} in {path} has dtype {name}, which this loader does not read")
    return np.dtype(_DTYPES[name])


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and the file offset its data starts at:
    an 8-byte little-endian length, then that many bytes of JSON."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} past the end of the file")
            header = json.loads(fh.read(n))
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _scan(files: list[Path], rename: Callable[[str], str | None]) -> list[tuple[Path | None, list[_Tensor]]]:
    """Every file's tensors from its header alone (no tensor data is read), under canonical names, in the order
    of their bytes in the file; names that `rename` maps to None are left out. A name present twice is an
    error (which one would load is arbitrary)."""
    out, seen = [], {}
    for path in files:
        header, base = _header(path)
        tensors = []
        for raw_key, info in header.items():
            key = rename(raw_key)
            if key is None:
                continue
            if key in seen:
                raise CheckpointError(f"tensor {key!r} is stored twice: as {seen[key][0]!r} in {seen[key][1]} "
                                      f"and as {raw_key!r} in {path}")
            seen[key] = (raw_key, path)
            start, stop = info["data_offsets"]
            t = _Tensor(key, raw_key, tuple(int(d) for d in info["shape"]), _dtype(info["dtype"], raw_key, path),
                        file=path, offset=base + int(start))
            if stop - start != t.nbytes or base + stop > path.stat().st_size:
                raise CheckpointError(f"tensor {raw_key!r} in {path}: its byte range does not fit its shape "
                                      f"{t.shape} / dtype or the file")
            tensors.append(t)
        out.append((path, sorted(tensors, key=lambda t: t.offset)))
    return out


def _in_memory(tensors: Mapping[str, np.ndarray]) -> list[tuple[Path | None, list[_Tensor]]]:
    return [(None, [_Tensor(k, k, tuple(a.shape), a.dtype, array=np.asarray(a)) for k, a in tensors.items()])]


def _plan(expected: Mapping[str, nnx.Variable], groups: list[tuple[Path | None, list[_Tensor]]],
          where: str | Path, fused: Mapping[str, Fused]) -> tuple[dict[str, tuple[Fused, Part]], set[str]]:
    """Check the checkpoint against the model before any data is read: every fused parameter's parts (or, where
    allowed, the parameter itself) present with their shapes, every other expected tensor present with its
    shape. Returns the on-disk tensors that are parts of a fused parameter (by name: the parameter and the part)
    and the names of the tensors to skip (unexpected ones, logged)."""
    direct: dict[str, _Tensor] = {t.key: t for _, tensors in groups for t in tensors}

    def check(name: str, shape: tuple[int, ...]) -> None:
        if name not in direct:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {shape}) in {where}")
        if direct[name].shape != shape:
            raise CheckpointError(f"tensor {name!r} has shape {direct[name].shape} in {where}, "
                                  f"expected {shape} from the config")
    parts: dict[str, tuple[Fused, Part]] = {}
    for name, var in expected.items():
        f = fused.get(name)
        if f is None or (f.stored_whole and name in direct):
            if f is not None and any(p.key in direct for p in f.parts):
                raise CheckpointError(f"{name}: both the fused tensor and its parts in {where}")
            check(name, tuple(var.shape))
            continue
        for p in f.parts:
            check(p.key, p.shape)
            parts[p.key] = (f, p)
    unexpected = sorted(set(direct) - set(expected) - set(parts))
    for f in fused.values():        # a routed expert the config does not have: the config does not fit the weights
        if f.stored_whole and f.name in expected:
            stray = [n for n in unexpected if n.startswith(f.name.rsplit(".", 1)[0] + ".")]
            if stray:
                raise CheckpointError(f"{stray[0]!r} in {where} is not one of config.json's {f.shape[0]} experts")
    if unexpected:
        log.warning("%s: ignoring %d unexpected tensors, e.g. %s", where, len(unexpected), unexpected[:3])
    return parts, set(unexpected)


Reader = Callable[[tuple[slice, ...] | None], np.ndarray]     # index (None: all) -> host array


class _Placer:
    """Places one tensor at a time into its final placement, converting on the host to the model dtype; the
    host arrays it reads are counted in `stats` until placed."""

    def __init__(self, dtype, sharding_of: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None],
                 stats: LoadStats):
        self.dtype, self.sharding_of, self.stats = np.dtype(dtype), sharding_of, stats

    def _read(self, read: Reader, index, counted: bool) -> tuple[np.ndarray, int]:
        """(the slice `index` of a tensor in the model dtype, the host bytes this read added to the count);
        `counted`: the source is a host buffer already counted (a fused parameter)."""
        arr = read(index)
        if not counted:
            self.stats._hold(arr.nbytes)
        if arr.dtype == self.dtype:
            return arr, 0 if counted else arr.nbytes
        out = arr.astype(self.dtype)
        self.stats._hold(out.nbytes)
        if not counted:
            self.stats._release(arr.nbytes)
        return out, out.nbytes

    def place(self, name: str, shape: tuple[int, ...], read: Reader, counted: bool = False) -> jax.Array:
        sharding = self.sharding_of(name, shape)
        if sharding is None:                      # the default device (jax.default_device honoured)
            arr, held = self._read(read, None, counted)
            try:
                return jax.device_put(arr)
            finally:
                self.stats._release(held)
        slices: dict[tuple, np.ndarray] = {}      # each distinct slice read once (replicated dims: one read)
        held = 0

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            nonlocal held
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in slices:
                slices[key], n = self._read(read, index, counted)
                held += n
            return slices[key]
        try:
            return jax.make_array_from_callback(shape, sharding, shard)
        finally:
            slices.clear()
            self.stats._release(held)


def _row_range(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(start, stop) rows when `index` selects whole rows of a C-ordered tensor (all of every later dimension,
    contiguous bytes), else None."""
    if not shape:
        return (0, 1) if not index else None
    index = tuple(index or ())
    dims = index + (slice(None),) * (len(shape) - len(index))
    for sl, dim in zip(dims[1:], shape[1:]):
        if sl.indices(dim) != (0, dim, 1):
            return None
    start, stop, step = dims[0].indices(shape[0])
    return (start, max(start, stop)) if step == 1 else None


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """np.empty on a 64-byte boundary: XLA's CPU client then adopts the buffer as the device array without a
    copy (on a GPU it is copied to the device either way)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    off = -raw.ctypes.data % 64
    return raw[off:off + nbytes].view(dtype).reshape(shape)


class _ShardReader:
    """Reads the tensors of one safetensors file: whole tensors and whole-row ranges (the usual tensor-parallel
    split) by plain reads at their byte offsets, straight into the result (faster than faulting in a memory
    map), other slices through safetensors' lazy `get_slice`, which reads only the slice."""

    def __init__(self, path: Path):
        self.path, self.fh, self._lazy = path, open(path, "rb", buffering=0), None

    def close(self) -> None:
        self.fh.close()
        if self._lazy is not None:
            self._lazy.__exit__(None, None, None)

    def read(self, t: _Tensor, index: tuple[slice, ...] | None) -> np.ndarray:
        rows = _row_range(index, t.shape)
        if rows is None:
            if self._lazy is None:
                self._lazy = safe_open(str(self.path), framework="numpy")
                self._lazy.__enter__()
            return self._lazy.get_slice(t.raw_key)[index]
        start, stop = rows
        out = _aligned_empty((stop - start, *t.shape[1:]) if t.shape else (), t.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        row_bytes = t.nbytes // t.shape[0] if t.shape else t.nbytes
        self.fh.seek(t.offset + start * row_bytes)
        got = 0
        while got < len(buf):
            n = self.fh.readinto(buf[got:])
            if not n:
                raise CheckpointError(f"{self.path}: the file ends inside tensor {t.raw_key!r}")
            got += n
        return out


def _reader(shard: _ShardReader | None, t: _Tensor) -> Reader:
    if t.array is not None:
        return lambda index: t.array if index is None else t.array[index]
    return lambda index: shard.read(t, index)


def stream_params(expected: Mapping[str, nnx.Variable], files: list[Path] | Mapping[str, np.ndarray], *,
                  where: str | Path, dtype, rename: Callable[[str], str | None] = lambda k: k,
                  sharding_of: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] = lambda n, s: None,
                  stats: LoadStats | None = None, progress: bool | None = None,
                  fused: Mapping[str, Fused] | None = None) -> LoadStats:
    """Set every expected variable (dotted name -> `nnx.Variable`, e.g. `flat_params` of an abstract model)
    from the weight files, one file at a time, each tensor placed as soon as it is read (`sharding_of(name,
    shape)`: its sharding, or None for the default device); `fused` (`layout.fused_params` of the module) the
    parameters assembled from several tensors, each placed once its parts are all read. `files` may also be
    in-memory tensors by name. `rename` maps on-disk names to parameter names (None: skip). Missing / misshapen
    tensors raise
    `CheckpointError` before any data is read; unexpected ones are logged. `progress`: a bar over the bytes
    (None: when stderr is a terminal or the checkpoint is at least `PROGRESS_MIN_BYTES`)."""
    t0 = time.perf_counter()
    stats = LoadStats() if stats is None else stats
    groups = _in_memory(files) if isinstance(files, Mapping) else _scan(list(files), rename)
    parts, skip = _plan(expected, groups, where, fused or {})
    load = [(path, [t for t in ts if t.key not in skip]) for path, ts in groups]
    sizes = [sum(t.nbytes for t in ts) for _, ts in load]
    total = sum(sizes)
    stats.files += len(files) if not isinstance(files, Mapping) else 0
    stats.largest_file_bytes = max([stats.largest_file_bytes, *sizes])
    if progress is None:
        progress = total >= PROGRESS_MIN_BYTES or sys.stderr.isatty()
    placer = _Placer(dtype, sharding_of, stats)
    pending: dict[str, tuple[np.ndarray, set[str]]] = {}     # fused parameter -> its buffer, its parts left
    placed: set[str] = set()

    def put(name: str, read: Reader, counted: bool = False) -> None:
        expected[name].set_value(placer.place(name, tuple(expected[name].shape), read, counted))
        placed.add(name)

    from tqdm import tqdm
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {Path(str(where)).name}", disable=not progress,
              file=sys.stderr, leave=False) as bar:
        for path, tensors in load:
            shard = _ShardReader(path) if path is not None and tensors else None
            try:
                for t in tensors:
                    if t.key in parts:
                        _fill_part(*parts[t.key], _reader(shard, t), pending, placer, put)
                    else:
                        put(t.key, _reader(shard, t))
                    stats.tensors += 1
                    stats.bytes_read += t.nbytes
                    bar.update(t.nbytes)
            finally:
                if shard is not None:
                    shard.close()
    missing = sorted(set(expected) - placed)
    if missing or pending:                  # _plan checked completeness: this would be a bug here, not on disk
        raise AssertionError(f"streamed load left {missing[:3]} unset, {sorted(pending)[:3]} unassembled")
    stats.seconds += time.perf_counter() - t0
    return stats


def _fill_part(f: Fused, part: Part, read: Reader, pending, placer: _Placer, put) -> None:
    """Copy one on-disk tensor into its fused parameter's buffer (allocated in the model dtype at the parameter's
    first part; the copy converts); place the parameter once every part is there, and free the buffer."""
    arr = read(None)
    placer.stats._hold(arr.nbytes)
    if f.name not in pending:
        buf = np.empty(f.shape, placer.dtype)
        placer.stats._hold(buf.nbytes)
        pending[f.name] = (buf, {p.key for p in f.parts})
    buf, left = pending[f.name]
    layout.scatter(part, arr, buf)
    placer.stats._release(arr.nbytes)
    del arr
    left.discard(part.key)
    if not left:
        del pending[f.name]
        put(f.name, lambda index: buf if index is None else buf[index], counted=True)
        placer.stats._release(buf.nbytes)


def flat_params(module: nnx.Module) -> dict[str, nnx.Variable]:
    """A module's parameters by dotted path (`layers.0.mlp.gate_proj.weight`): the checkpoint key names of the
    target (HF) and the drafter (DeepSpec) layouts."""
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def fill_params(module: nnx.Module, tensors: dict[str, np.ndarray], where: str | Path, dtype) -> None:
    """Set a module's parameters from in-memory tensors in their on-disk names, checking presence and shape
    (`stream_params`'s rules); leftover tensors are logged, not loaded."""
    stream_params(flat_params(module), tensors, where=where, dtype=dtype, progress=False,
                  fused=layout.fused_params(module))


def load_pretrained(model_dir: str | Path, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None, *,
                    stats: LoadStats | None = None, progress: bool | None = None) -> tuple[TargetConfig, TargetModel]:
    """Read a HF model directory into a `TargetModel` with parameters in `dtype`, streamed shard by shard: on
    the default device, or with `mesh` each parameter in its `hyspec_jax.sharding.param_spec` layout (each
    device reading only its slice). `stats` (a `LoadStats`) is filled in; `progress` as in `stream_params`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory does not exist")
    cfg = TargetConfig.from_pretrained(model_dir)
    files = _weight_files(model_dir)
    model = abstract_model(cfg, dtype)
    if mesh is not None:
        from hyspec_jax.sharding import param_spec     # sharding imports the models; only a mesh load needs it

    def sharding_of(name: str, shape: tuple[int, ...]) -> jax.sharding.Sharding | None:
        return None if mesh is None else jax.sharding.NamedSharding(mesh, param_spec(name, shape, cfg, mesh))
    tied = cfg.tie_word_embeddings

    def rename(raw_key: str) -> str | None:
        key = _canonical(raw_key)
        return None if tied and key == "lm_head.weight" else key
    stream_params(flat_params(model), files, where=model_dir, dtype=dtype, rename=rename, sharding_of=sharding_of,
                  stats=stats, progress=progress, fused=layout.fused_params(model))
    return cfg, model


# ------------------------------------------------------------------------------------------------
# Saving
# ------------------------------------------------------------------------------------------------
def hf_tensors(module: nnx.Module, dtype=None) -> dict[str, np.ndarray]:
    """The on-disk tensors of a module's parameters (in `dtype`, default their own), by on-disk name: the fused
    ones split into their parts (`layout.disk_tensors`; routed experts per expert, as transformers'
    save_pretrained writes them), every other parameter as it is."""
    arrays = {name: np.asarray(var[...] if dtype is None else var[...].astype(dtype))
              for name, var in flat_params(module).items()}
    return dict(layout.disk_tensors(module, arrays))


def shard_plan(nbytes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names (sorted) in shard files of at most max_shard_bytes each (a larger tensor alone in its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(nbytes):
        if shards[-1] and size + nbytes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def write_safetensors(model_dir: Path, nbytes: Mapping[str, int], produce: Callable[[str], np.ndarray], *,
                      max_shard_bytes: int, after_write: Callable[[Path], None] | None = None) -> list[Path]:
    """Write tensors (name -> byte size; `produce(name)` makes each when its shard is written) as
    model.safetensors, or as `shard_plan` shards with model.safetensors.index.json. Only one shard's tensors
    are made at a time; `after_write(path)` runs after each file. Returns the files written."""
    plan = shard_plan(nbytes, max_shard_bytes)
    names = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    paths = []
    for fname, keys in zip(names, plan):
        path = model_dir / fname
        save_file({k: np.ascontiguousarray(produce(k)) for k in keys}, str(path), metadata={"format": "pt"})
        paths.append(path)
        if after_write is not None:
            after_write(path)
    if len(plan) > 1:
        weight_map = {k: fname for fname, keys in zip(names, plan) for k in keys}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}, indent=2) + "\n")
    return paths


def save_pretrained(model: TargetModel, model_dir: str | Path, *, max_shard_bytes: int = 2 << 30,
                    dtype=None) -> None:
    """Write config.json + safetensors (sharded with an index when larger than max_shard_bytes)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg: TargetConfig = model.config
    out = hf_tensors(model, dtype)
    (model_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    write_safetensors(model_dir, {k: a.nbytes for k, a in out.items()}, out.__getitem__,
                      max_shard_bytes=max_shard_bytes)


__all__ = ["CheckpointError", "ConfigError", "LoadStats", "PROGRESS_MIN_BYTES", "load_pretrained", "save_pretrained",
           "stream_params", "hf_tensors", "shard_plan", "write_safetensors"]
