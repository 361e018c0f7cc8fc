"""The on-disk program cache (`compilation.DiskCachedJit`): outputs bitwise those of the plain jit, a new
process (a fresh instance) runs the stored program without tracing the function, keys follow static arguments
and shapes, donation is kept, and `hyspec generate` with the cache gives the same tokens as without."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyspec_jax import compilation as C
from hyspec_jax.state import TargetState

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the program cache is CPU-only")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "xla"))
    monkeypatch.delenv(C.PROGRAM_CACHE_ENV, raising=False)
    with C.program_cache() as on:
        if not on:
            pytest.skip("program cache unavailable (flatbuffers missing?)")
        yield tmp_path / "programs"


TRACES = []


def step(scale, x, state, *, power):
    """A pure function of a pytree (a flax struct dataclass), with a static argument."""
    TRACES.append(power)
    ssm = state.ssm * scale + x.sum() ** power
    return jnp.tanh(ssm).sum(), TargetState(ssm=ssm, conv=state.conv, keys=state.keys, values=state.values,
                                             lengths=state.lengths + 1)


def _state(n=3):
    rng = np.random.default_rng(n)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return TargetState(ssm=f(2, 1, 2, n, n), conv=f(2, 1, 4, 5), keys=f(1, 1, 8, 1, 4), values=f(1, 1, 8, 1, 4),
                       lengths=jnp.zeros((1,), jnp.int32))


def _same(a, b):
    return all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_stored_program_runs_without_tracing(cache):
    TRACES.clear()
    x = jnp.arange(4, dtype=jnp.float32) / 7
    plain = jax.jit(step, static_argnames=("power",))(jnp.float32(0.5), x, _state(), power=2)
    first = C.DiskCachedJit(step, name="t_step", static_argnames=("power",))
    out = first(jnp.float32(0.5), x, _state(), power=2)
    assert _same(out, plain) and isinstance(out[1], TargetState)
    assert len(list(cache.glob("t_step-*.bin"))) == 1
    traces = len(TRACES)
    fresh = C.DiskCachedJit(step, name="t_step", static_argnames=("power",))     # as in a new process
    again = fresh(jnp.float32(0.5), x, _state(), power=2)
    assert len(TRACES) == traces            # loaded, not traced
    assert _same(again, plain)
    # another static value or another shape: another program
    fresh(jnp.float32(0.5), x, _state(), power=3)
    fresh(jnp.float32(0.5), x, _state(4), power=2)
    assert len(list(cache.glob("t_step-*.bin"))) == 3


def test_donation_is_kept(cache):
    f = C.DiskCachedJit(step, name="t_donate", static_argnames=("power",), donate_argnames=("state",))
    s = _state()
    f(jnp.float32(1.0), jnp.ones(4), s, power=1)
    g = C.DiskCachedJit(step, name="t_donate", static_argnames=("power",), donate_argnames=("state",))
    s2 = _state()
    out = g(jnp.float32(1.0), jnp.ones(4), s2, power=1)
    assert out[1].ssm.shape == (2, 1, 2, 3, 3)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(s2))   # donated, as the plain jit donates them


def test_off_is_the_plain_jit(tmp_path, monkeypatch):
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "xla"))
    monkeypatch.setenv(C.PROGRAM_CACHE_ENV, "0")
    with C.program_cache() as on:
        assert not on
        f = C.DiskCachedJit(step, name="t_off", static_argnames=("power",))
        f(jnp.float32(1.0), jnp.ones(4), _state(), power=1)
    assert not (tmp_path / "programs").exists()
    assert f._cache_size() >= 1             # the plain jit's attributes pass through


def test_generate_cli_same_tokens_with_and_without(cache, monkeypatch, capsys):
    """`hyspec generate` with the embedded model in its default mode for this backend returns the same token
    ids plainly traced, exported and stored, and loaded from the stored programs."""
    from hyspec_jax import cli
    from hyspec_jax.embedded import default_model_dir
    if default_model_dir() is None:
        pytest.skip("no embedded model")
    argv = ["generate", "--json", "--max-tokens", "12", "And God said"]
    runs = []
    for env in ("0", "1", "1"):             # plain; export + store; load the stored programs
        monkeypatch.setenv(C.PROGRAM_CACHE_ENV, env)
        assert cli.main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert runs[0] == runs[1] == runs[2]
    assert list(cache.glob("*.bin"))


def test_unusable_stored_program_falls_back(cache):
    """A stored program that cannot be read (truncated file) is not run: one warning, the plain jit's result."""
    x = jnp.arange(4, dtype=jnp.float32)
    plain = jax.jit(step, static_argnames=("power",))(jnp.float32(2.0), x, _state(), power=1)
    C.DiskCachedJit(step, name="t_bad", static_argnames=("power",))(jnp.float32(2.0), x, _state(), power=1)
    (stored,) = cache.glob("t_bad-*.bin")
    stored.write_bytes(stored.read_bytes()[:64])
    fresh = C.DiskCachedJit(step, name="t_bad", static_argnames=("power",))
    with pytest.warns(RuntimeWarning, match="program cache unused for t_bad"):
        out = fresh(jnp.float32(2.0), x, _state(), power=1)
    assert _same(out, plain)


def test_a_sharded_call_does_not_turn_the_cache_off_for_one_device(cache):
    """The same shapes on a 2-device mesh (never stored: one warning) and then on one device: the single-device
    call is still exported and stored."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    fn = C.DiskCachedJit(step, name="t_placement", static_argnames=("power",))
    st = _state()
    x = jnp.arange(4, dtype=jnp.float32)
    sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
    with pytest.warns(RuntimeWarning, match="sharded inputs"):
        fn(jnp.float32(2.0), sharded, st, power=1)
    assert not list(cache.glob("t_placement-*.bin"))
    out = fn(jnp.float32(2.0), x, st, power=1)
    assert list(cache.glob("t_placement-*.bin"))
    assert _same(out, jax.jit(step, static_argnames=("power",))(jnp.float32(2.0), x, st, power=1))


def test_compiled_ahead_the_call_compiles_nothing(cache):
    """`precompile` (the start-up compile side by side) of a call with the cache on exports, stores and compiles the
    program the call then runs: the call traces and compiles nothing; a fresh instance (a new process) compiles the
    stored program ahead without tracing the function. Outputs are those of the plain jit."""
    x = jnp.arange(4, dtype=jnp.float32) / 3
    plain = jax.jit(step, static_argnames=("power",))(jnp.float32(0.5), x, _state(), power=2)
    for instance in range(2):
        f = C.DiskCachedJit(step, name="t_ahead", static_argnames=("power",))
        TRACES.clear()
        C.precompile([(f, (jnp.float32(0.5), x, _state()), {"power": 2})], 2)
        assert len(TRACES) == (1 - instance)            # traced once to export it, then loaded
        assert len(list(cache.glob("t_ahead-*.bin"))) == 1
        watch = C.CompileWatch()
        out = f(jnp.float32(0.5), x, _state(), power=2)
        assert watch.since == 0 and len(TRACES) == (1 - instance)
        assert _same(out, plain)
