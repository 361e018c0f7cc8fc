"""The native small-M CPU kernel (`hyspec_jax.cpu_kernels`) equals XLA's dot, and the models route through it
(via the dispatcher, `hyspec_jax.kernels.dense`).

Skipped where the kernel cannot be built (not x86-64 Linux with AVX2 + FMA, no C++ compiler, or
HYSPEC_CPU_KERNELS=0): then `dense` is XLA's dot and there is nothing native to compare.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax import cpu_kernels as ck
from hyspec_jax.models import layers

pytestmark = pytest.mark.skipif(not ck.available(), reason=f"native CPU kernel unavailable: {ck.status()}")


def _rand(rng, shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("lead,out,inp", [((2,), 7, 5), ((3, 4), 96, 64), ((8,), 300, 512), ((1, 9), 64, 33),
                                          ((ck.MAX_ROWS,), 130, 40), ((5,), 3, 16)])
def test_dense_equals_xla_dot(lead, out, inp):
    """Every row-block size (8, 7..1), the scalar tail (in % 8), output chunks split over threads."""
    rng = np.random.default_rng(sum(lead) + out + inp)
    x, w = _rand(rng, lead + (inp,)), _rand(rng, (out, inp))
    assert ck.eligible(x, w)
    y = jax.jit(ck.dense)(x, w)
    ref = ck.reference(x, w)
    assert y.shape == ref.shape == lead + (out,) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5 * np.sqrt(inp))
    assert ck.TARGET in jax.jit(ck.dense).lower(x, w).as_text()


def test_rows_do_not_depend_on_the_batch():
    """A row's result is bitwise the same whatever rows share the call (the verify / draft consistency)."""
    rng = np.random.default_rng(0)
    x, w = _rand(rng, (11, 256)), _rand(rng, (200, 256))
    full = np.asarray(jax.jit(ck.dense)(x, w))
    for sl in (slice(0, 2), slice(3, 11), slice(5, 6 + 4)):
        assert np.array_equal(np.asarray(jax.jit(ck.dense)(x[sl], w)), full[sl])


def test_eligibility_and_fallbacks():
    rng = np.random.default_rng(1)
    w = _rand(rng, (16, 8))
    assert not ck.eligible(_rand(rng, (1, 8)), w)                         # one row: XLA's matrix-vector product
    assert not ck.eligible(_rand(rng, (ck.MAX_ROWS + 1, 8)), w)          # large M: XLA's GEMM
    assert not ck.eligible(_rand(rng, (4, 8)).astype(jnp.bfloat16), w)   # float32 only
    x = _rand(rng, (4, 8))
    np.testing.assert_allclose(np.asarray(layers.dense(x, w)), np.asarray(ck.reference(x, w)), rtol=1e-6, atol=1e-6)


def test_models_reach_the_kernel_through_the_dispatcher():
    """`layers.dense` (every Linear and LM head) goes through `hyspec_jax.kernels.dense`, which runs the native kernel
    where eligible: an eligible product lowers to its custom call, an ineligible one (one row) does not."""
    from hyspec_jax import kernels

    rng = np.random.default_rng(5)
    w = _rand(rng, (16, 8))
    for fn in (layers.dense, kernels.dense):
        assert ck.TARGET in jax.jit(fn).lower(_rand(rng, (4, 8)), w).as_text()
        assert ck.TARGET not in jax.jit(fn).lower(_rand(rng, (1, 8)), w).as_text()
    lin = layers.Linear(8, 16, rngs=nnx.Rngs(0))
    assert ck.TARGET in jax.jit(lambda x: lin(x)).lower(_rand(rng, (2, 3, 8))).as_text()


def test_not_in_gpu_programs():
    """`platform_dependent`: a program lowered for CUDA never contains the CPU custom call."""
    rng = np.random.default_rng(2)
    x, w = _rand(rng, (4, 8)), _rand(rng, (16, 8))
    exported = jax.export.export(jax.jit(ck.dense), platforms=["cuda"])(x, w)
    assert ck.TARGET not in exported.mlir_module()


def test_autodiff_and_vmap():
    rng = np.random.default_rng(3)
    x, w = _rand(rng, (4, 64)), _rand(rng, (96, 64))
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    g = jax.grad(loss(ck.dense), argnums=(0, 1))(x, w)
    gr = jax.grad(loss(ck.reference), argnums=(0, 1))(x, w)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    jv = jax.jvp(ck.dense, (x, w), (x, w))[1]
    np.testing.assert_allclose(np.asarray(jv), np.asarray(2 * ck.reference(x, w)), rtol=1e-4, atol=1e-4)
    xs = _rand(rng, (3, 4, 64))
    np.testing.assert_allclose(np.asarray(jax.vmap(ck.dense, in_axes=(0, None))(xs, w)),
                               np.asarray(ck.reference(xs, w)), rtol=1e-5, atol=1e-4)


def test_single_thread_lapack_is_bitwise_neutral():
    """Pinning scipy's OpenBLAS (XLA:CPU's LAPACK calls) to one thread changes no bit of a triangular solve."""
    rng = np.random.default_rng(4)
    a = jnp.asarray(np.tril(rng.standard_normal((2, 8, 32, 32))).astype(np.float32) + 4 * np.eye(32, dtype=np.float32))
    b = _rand(rng, (2, 8, 32, 32))
    solve = jax.jit(lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=True, lower=True))
    try:
        assert ck.lapack_threads(2)
        before = np.asarray(solve(a, b))
    finally:
        assert ck.single_thread_lapack()
    assert np.array_equal(np.asarray(solve(a, b)), before)
