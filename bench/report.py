"""What every benchmark JSON carries: device, versions, commit, time."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path


def git_commit() -> str:
    env = os.environ.get("HYSPEC_GIT_COMMIT")
    if env:
        return env
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=here)
        commit = out.stdout.strip()
        if not commit:
            return "unknown"
        # a tree that differs from its HEAD (local edits, or a copied tree over an older .git) says so
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=10, cwd=here)
        return commit + ("-dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def short_commit(commit: str) -> str:
    """10 hex digits, keeping a "-dirty" mark."""
    base, dirty, _ = commit.partition("-dirty")
    return base[:10] + ("-dirty" if dirty else "")


def portable_path(path) -> str | None:
    """A path as results should record it: relative to the project root (the folder holding `hyspec_jax`:
    the repository, or site-packages for a wheel) when inside it, so a JSON names no machine's directories."""
    if path is None:
        return None
    import hyspec_jax
    p, root = Path(path).resolve(), Path(hyspec_jax.__file__).resolve().parent.parent
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(path)


def portable_args(argv) -> list[str]:
    """Command-line arguments as a result records them: every absolute path (also in --opt=PATH) relative to the
    project root when inside it, else cut to its file name (the folder was one machine's, e.g. the GPU machine's
    output directory), so a committed JSON names no machine's directories."""
    def arg(a: str) -> str:
        opt, eq, val = a.partition("=") if a.startswith("--") else ("", "", a)
        if not os.path.isabs(val):
            return a
        rel = portable_path(val)
        return opt + eq + (rel if not os.path.isabs(rel) else os.path.basename(rel.rstrip("/")))
    return [arg(str(a)) for a in argv]


def portable_command(prog: str, argv) -> str:
    """`prog` and its arguments (`portable_args`), as one line."""
    return " ".join([prog, *portable_args(argv)])


def run_metadata() -> dict:
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {"device_kind": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
            "device_count": jax.device_count(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "commit": git_commit(),
            "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def profile_trace(run):
    """Run `run()` under `jax.profiler` and return the trace (`jax.profiler.ProfileData`)."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError("the profiler wrote no trace")
        return ProfileData.from_file(files[0])


def gpu_stream_events(data) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of every GPU stream event of a trace (kernels, memcpy, memset), in time
    order; the "XLA Ops" / "XLA Modules" lines repeat the same time and are skipped. [] without GPU planes."""
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                out += [(ev.start_ns, ev.duration_ns, ev.name) for ev in line.events]
    return sorted(out)


def busy_time_ns(events: list[tuple[int, int, str]]) -> int:
    """Length of the union of the events' intervals: overlapping events (other streams, or a kernel launched
    before the one it depends on has ended) count once."""
    busy, end = 0, None
    for s, d, _ in sorted(events):
        if end is None or s >= end:
            busy += d
            end = s + d
        elif s + d > end:
            busy += s + d - end
            end = s + d
    return busy


def save_png(fig, path, dpi: int = 120) -> None:
    """Save a matplotlib figure as a 128-colour palette PNG: plots are flat colours, so this looks the same at a
    third of the size (the whole repository travels to the GPU machine under a size limit)."""
    import io

    from PIL import Image
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    img = Image.open(buf).convert("RGB")
    img.quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def publish_report(report: dict, prog: str, argv, json_path, markdown) -> int:
    """The end of a report command: `report["meta"]` (run_metadata and the portable command line of `prog` with
    argv, or sys.argv's), the JSON + .md at json_path (`write_report`), the markdown on stdout. Returns 0."""
    import sys
    report["meta"] = {**run_metadata(), "command": portable_command(prog, argv if argv is not None else sys.argv[1:])}
    write_report(report, json_path, markdown)
    print(markdown(report))
    return 0


def write_report(report: dict, json_path, markdown) -> Path | None:
    """`report` as JSON at json_path (written whole or not at all: a run cut short keeps its last complete
    file) and `markdown(report)` beside it as .md; None without a path. Returns the JSON's path."""
    import json
    if not json_path:
        return None
    p = Path(json_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, p)
    p.with_suffix(".md").write_text(markdown(report))
    return p
