"""Test configuration: CPU-friendly defaults, fake host devices for mesh code, hypothesis profile."""

import os

# Fake devices for mesh tests on CPU (must be set before jax initialises its backends).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("USE_HUB_KERNELS", "NO")  # keep transformers' torch reference path as the oracle
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Pin scipy's OpenBLAS to one thread now, before any test computes (cpu_kernels does it at its first eligibility
# check, i.e. while tracing, which in a library process precedes its first LAPACK call; in a test worker
# earlier tests may still be running XLA's LAPACK kernels asynchronously then, and OpenBLAS must not change
# its thread count while a call is in flight).
from hyspec_jax import cpu_kernels  # noqa: E402

cpu_kernels._tune_once()

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.fixture(scope="module")
def quick_compiles():
    """Tiny models and shapes: XLA's optimisation passes cost more time than they save (compiles take about half
    as long). Module-scoped; a module opts in with `pytestmark = pytest.mark.usefixtures("quick_compiles")`."""
    prev = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", prev)
