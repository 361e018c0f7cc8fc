"""What the commands share (`hyspec generate`, `serve`, `calibrate`, `bench`, the trainers): the user-facing error,
the model directory a --model option names, and the speculative engine the options ask for. A leaf under the
command modules: they import it, it imports none of them."""

from __future__ import annotations

from pathlib import Path


class UsageError(Exception):
    """An error whose message is the whole story for the user."""


def resolve_model_dir(arg: str | None) -> tuple[Path, str | None]:
    """(model directory, label to show) for a --model option: the given directory, else the embedded default
    model (`hyspec_jax.embedded.default_model_dir`: repository checkout or installed wheel), else a labelled
    random demo model. Used by `generate`, `serve` and `calibrate`."""
    if arg is not None:
        path = Path(arg)
        if not path.is_dir():
            raise UsageError(f"--model {path}: no such directory")
        return path, None
    from hyspec_jax.embedded import default_model_dir
    default = default_model_dir()
    if default is not None:
        return default, None
    from hyspec_jax.demo import RANDOM_LABEL, random_demo_model_dir
    return random_demo_model_dir(), RANDOM_LABEL


def engine_from_args(args, model, model_dir, dtype, batch: int | None = None, new_tokens: int | None = None,
                     note=None, server: bool = False):
    """The speculative engine `hyspec generate` / `hyspec serve` asked for, or None for plain autoregressive
    decoding (whose engine is `plain_engine`).

    With the embedded model (no --model) and no --drafter, its shipped drafter is used, and every option the
    user left unset takes the drafter's recommended value for this backend (explicit options always win).
    Without --spec-mode, the recommendation's bounds (`spec.options.plain_decoding_reason`) can pick plain
    decoding instead, before the drafter loads: batch, the number of requests decoded together (`--slots`
    wins), beyond `max_slots` (e.g. on a 2-core CPU, verification is nearly free for one request but not for
    eight); new_tokens, the new tokens a one-shot call asks for in all, below `min_new_tokens` (its start-up
    would cost more than speculation saves); server: a `hyspec serve`, whose slots are bounded by the
    recommendation's serve_max_slots where it has one. note(reason): told why plain decoding was picked."""
    import jax

    from hyspec_jax.io.drafter_io import load_drafter
    from hyspec_jax.spec.budget import BudgetTable, model_id
    from hyspec_jax.runtime.engine import Engine, SpecConfig
    from hyspec_jax.spec.options import MTP_MODES, plain_decoding_reason, recommended_settings
    from hyspec_jax.tree import TreeExpansion
    if getattr(args, "spec_mode", None) in MTP_MODES:
        return _mtp_engine(args, model, model_dir, dtype)
    drafter_dir = getattr(args, "drafter", None)
    rec: dict = {}
    table_path = getattr(args, "budget_table", None)
    if drafter_dir is None and getattr(args, "model", None) is None and getattr(args, "spec_mode", None) != "ar":
        from hyspec_jax.embedded import default_budget_table, default_drafter_dir, default_model_dir
        shipped = default_drafter_dir()
        if shipped is not None and default_model_dir() == Path(model_dir):
            drafter_dir = shipped
            table_path = table_path or default_budget_table()   # the embedded model's own calibration
            rec = recommended_settings(shipped, jax.default_backend())
            reason = plain_decoding_reason(rec, getattr(args, "slots", None) or batch, new_tokens, server)
            if getattr(args, "spec_mode", None) is None and reason is not None:
                if note is not None:
                    note(reason)
                return None     # measured slower than ar here (or not measured): the drafter never loads
    opt = lambda name, fallback=None: (getattr(args, name, None) if getattr(args, name, None) is not None  # noqa: E731
                                        else rec.get(name, fallback))
    mode = opt("spec_mode") or ("chain" if drafter_dir else "ar")
    if mode == "ar":
        return None
    if drafter_dir is None:
        raise ValueError(f"--spec-mode {mode} needs --drafter DIR")
    if getattr(args, "slots", None) is not None and args.slots < 1:
        raise ValueError(f"--slots must be >= 1, got {args.slots}")
    if not Path(drafter_dir).is_dir():
        raise ValueError(f"--drafter {drafter_dir}: no such directory")
    spec_kw = dict(mode=mode, chain_length=opt("chain_length"), verify_nodes=opt("verify_nodes"),
                   capacity=getattr(args, "budget", None), confidence_threshold=getattr(args, "confidence_threshold",
                                                                                        None),
                   kernels=getattr(args, "kernels", None) or "auto",
                   deferred_rows=getattr(args, "deferred_rows", None) or 0,
                   packed_widths=bool(getattr(args, "packed_widths", None)),
                   width_margin=opt("width_margin", SpecConfig.width_margin),
                   calibrate_repeats=opt("startup_calibration", 0))
    if mode in ("tree", "tree-ready"):
        spec_kw["tree"] = TreeExpansion(depth=opt("tree_depth", 4), top_k=opt("tree_topk", 2), beam=opt("tree_beam", 4))
    spec = SpecConfig(**spec_kw)
    drafter = load_drafter(drafter_dir, dtype=dtype, with_reader=spec.uses_reader)
    if spec.uses_reader and drafter.reader is None:
        raise ValueError(f"--spec-mode {mode} needs a drafter with a ReaDy reader ({drafter_dir}/reader/ is missing)")
    table = BudgetTable.load(table_path) if table_path else None
    name = model_id(model.config, Path(model_dir).name)
    return Engine(model, drafter, spec, slots=getattr(args, "slots", None), budget_table=table, model_name=name,
                  **_calibration_cache(args, spec))


def plain_engine(args, model):
    """The engine of plain decoding (`ar`) for these options: `--deferred-rows`, and `--slots` as its bucket's
    slots (unset: the slots of the request batch)."""
    from hyspec_jax.runtime.engine import Engine, SpecConfig
    slots = getattr(args, "slots", None)
    if slots is not None and slots < 1:
        raise ValueError(f"--slots must be >= 1, got {slots}")
    return Engine(model, None, SpecConfig(mode="ar", deferred_rows=getattr(args, "deferred_rows", None) or 0),
                  slots=slots)


def _calibration_cache(args, spec) -> dict:
    """A server that times its widths at start-up keeps the times for its next start (`--recalibrate`: times
    them again, replacing them)."""
    if spec.calibrate_repeats < 1:
        return {}
    from hyspec_jax.runtime.width import CalibrationCache, calibration_cache_path
    return dict(calibration_cache=CalibrationCache(calibration_cache_path(),
                                                   reuse=not getattr(args, "recalibrate", False)))


def _mtp_engine(args, model, model_dir, dtype):
    """`--spec-mode mtp|mtp-tree`: drafted by the model directory's own MTP head (`mtp.*` tensors; the loader's
    `NoMTPHead` — a ValueError — says in one line when there is none)."""
    from hyspec_jax.io.mtp_io import load_mtp
    from hyspec_jax.spec.budget import BudgetTable, model_id
    from hyspec_jax.runtime.engine import Engine, SpecConfig
    from hyspec_jax.tree import TreeExpansion
    if getattr(args, "drafter", None) is not None:
        raise ValueError(f"--spec-mode {args.spec_mode} drafts with the model's own MTP head: drop --drafter")
    if getattr(args, "slots", None) is not None and args.slots < 1:
        raise ValueError(f"--slots must be >= 1, got {args.slots}")
    opt = lambda name, fallback=None: getattr(args, name, None) if getattr(args, name, None) is not None else fallback  # noqa: E731
    spec_kw = dict(mode=args.spec_mode, chain_length=opt("chain_length"), verify_nodes=opt("verify_nodes"),
                   capacity=opt("budget"), kernels=opt("kernels", "auto"), deferred_rows=opt("deferred_rows", 0),
                   packed_widths=bool(opt("packed_widths", False)),
                   width_margin=opt("width_margin", SpecConfig.width_margin),
                   calibrate_repeats=opt("startup_calibration", 0))
    if args.spec_mode == "mtp-tree":
        spec_kw["tree"] = TreeExpansion(depth=opt("tree_depth", 4), top_k=opt("tree_topk", 2),
                                        beam=opt("tree_beam", 4))
    spec = SpecConfig(**spec_kw)
    head = load_mtp(model_dir, model.config, dtype=dtype)
    table_path = getattr(args, "budget_table", None)
    table = BudgetTable.load(table_path) if table_path else None
    return Engine(model, head, spec, slots=getattr(args, "slots", None), budget_table=table,
                  model_name=model_id(model.config, Path(model_dir).name), **_calibration_cache(args, spec))


def check_parallel(tensor_parallel: int, data_parallel: int = 1, slots: int | None = None,
                   slots_flag: str = "--slots") -> None:
    """`--tensor-parallel-size T` / `--data-parallel-size D` against the visible devices (D·T of them), and the
    slots against D (each data-parallel replica decodes an equal share). Before anything loads."""
    import jax
    for flag, n in (("--tensor-parallel-size", tensor_parallel), ("--data-parallel-size", data_parallel)):
        if n < 1:
            raise UsageError(f"{flag} must be >= 1, got {n}")
    need, have = tensor_parallel * data_parallel, jax.device_count()
    if need > have:
        asked = (f"--tensor-parallel-size {tensor_parallel}" if data_parallel == 1 else
                 f"--data-parallel-size {data_parallel} x --tensor-parallel-size {tensor_parallel} = {need} devices")
        raise UsageError(f"{asked} but only {have} {jax.default_backend()} device(s) are visible")
    if slots is not None and slots % data_parallel:
        raise UsageError(f"{slots_flag} {slots} is not a multiple of --data-parallel-size {data_parallel}")


def shard_target(model, tensor_parallel: int, data_parallel: int = 1) -> None:
    """`--tensor-parallel-size T` / `--data-parallel-size D` (D·T > 1): the target's weights placed in place on a
    (D, T) mesh of the first D·T devices — sharded over "model" by `sharding.PARAM_RULES`, replicated over
    "data". The request loop's buffers and a drafter follow the weights (`sharding.place_buffers`): slots split
    over "data", so every program runs over the mesh and each replica decodes its own slots."""
    from flax import nnx

    from hyspec_jax import sharding as shd
    check_parallel(tensor_parallel, data_parallel)
    if tensor_parallel * data_parallel > 1:
        nnx.update(model, shd.shard_params(model, shd.make_mesh(data_parallel, tensor_parallel)))


def add_distributed_arguments(parser) -> None:
    """The multi-host flags of a command that runs under `init_distributed` (argparse parser or group)."""
    parser.add_argument("--coordinator-address", metavar="HOST:PORT",
                        help="multi-host: JAX's coordinator (process 0's address); every process runs the same "
                             "command with its --process-id (env HYSPEC_COORDINATOR / HYSPEC_NUM_PROCESSES / "
                             "HYSPEC_PROCESS_ID)")
    parser.add_argument("--num-processes", type=int, metavar="N", help="multi-host: processes in all")
    parser.add_argument("--process-id", type=int, metavar="I",
                        help="multi-host: this process (0 prints, writes the logs and, for a server, serves HTTP)")


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """JAX's multi-controller runtime (one process per host, a global mesh over every process's devices) from the
    flags, else from HYSPEC_COORDINATOR / HYSPEC_NUM_PROCESSES / HYSPEC_PROCESS_ID; nothing when neither names a
    coordinator. Every process then runs the same command on the same inputs (the programs are SPMD); CPU
    processes talk over gloo. Must run before JAX starts its backend."""
    import os
    coordinator = coordinator or os.environ.get("HYSPEC_COORDINATOR")
    if not coordinator:
        return
    n = num_processes if num_processes is not None else os.environ.get("HYSPEC_NUM_PROCESSES")
    pid = process_id if process_id is not None else os.environ.get("HYSPEC_PROCESS_ID")
    if n is None or pid is None:
        raise UsageError("a coordinator address needs --num-processes and --process-id "
                         "(or HYSPEC_NUM_PROCESSES / HYSPEC_PROCESS_ID)")
    n, pid = int(n), int(pid)
    if not 0 <= pid < n:
        raise UsageError(f"--process-id {pid} is not in [0, {n})")
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU processes: collectives over TCP
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid)
