"""The test harness itself: a worker that dies of a fatal signal is reported with its signal and the crashing
thread's frames at the end of the run (tests/conftest.py), and the suite's memory-map guard sees this process."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import conftest


def test_worker_segfault_is_reported_in_the_summary(tmp_path):
    (tmp_path / "test_crash.py").write_text(textwrap.dedent("""
        import ctypes

        def test_fine():
            pass

        def test_dies():
            ctypes.string_at(0)   # SIGSEGV
    """))
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    r = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-n", "2", "--max-worker-restart", "0",
                        "-p", "no:cacheprovider", "--rootdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    summary = r.stdout[r.stdout.index("native crash in worker"):]
    assert "Fatal Python error: Segmentation fault" in summary
    assert "in test_dies" in summary and "Current thread" in summary
    assert "1 failed, 1 passed" in r.stdout


def test_map_count_is_read():
    assert conftest._map_count() > 0 and conftest._MAP_BUDGET > 1000
