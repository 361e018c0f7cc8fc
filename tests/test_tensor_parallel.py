"""Tensor-parallel generation on fake CPU devices: with the target's weights sharded over a (1, 2) mesh
(`sharding.shard_params`), the request loop places its buffers like the weights (`sharding.place_buffers`) and
every program runs over the mesh; the greedy tokens equal one device's, in plain and speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hyspec_jax import sharding as shd
from hyspec_jax.embedded import default_drafter_dir, default_model_dir
from hyspec_jax.io.drafter_io import load_drafter
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine, SpecConfig

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)

PROMPTS = [[5, 17, 230, 11, 42], [7, 99, 3], [400, 12, 8, 8, 31, 2, 77]]


def _models(tp: int):
    _, target = load_pretrained(default_model_dir())
    if tp > 1:
        nnx.update(target, shd.shard_params(target, shd.make_mesh(1, tp)))
    return target


@pytest.fixture(scope="module")
def reference():
    target = _models(1)
    params = SamplingParams(max_tokens=8)
    drafter = load_drafter(default_drafter_dir(), with_reader=False)
    ar = [r.token_ids for r in Engine(target).generate(PROMPTS, params)]
    chain = [r.token_ids for r in Engine(target, drafter, SpecConfig(mode="chain")).generate(PROMPTS, params)]
    return ar, chain, drafter


def test_tensor_parallel_equals_one_device(reference):
    assert jax.device_count() >= 2
    ar, chain, drafter = reference
    assert ar == chain
    target = _models(2)
    mesh = shd.params_mesh(nnx.state(target))
    assert mesh is not None and mesh.shape["model"] == 2
    params = SamplingParams(max_tokens=8)
    gen = Engine(target)
    assert [r.token_ids for r in gen.generate(PROMPTS, params)] == ar
    backend = gen.backend(4, 64)
    assert backend.state.ssm.sharding.mesh.shape["model"] == 2       # the buffers follow the weights
    engine = Engine(target, drafter, SpecConfig(mode="chain"))
    assert [r.token_ids for r in engine.generate(PROMPTS, params)] == chain


def test_one_device_weights_commit_buffers_to_their_device():
    """Weights on one device (not the default one): the buffers go to that device, committed, as every program's
    outputs are (`sharding.place_buffers`); no mesh."""
    device = jax.devices()[1]
    weights = {"w": jax.device_put(jnp.ones((4, 4)), device)}
    assert shd.params_mesh(weights) is None and shd.params_device(weights) == device
    state, anchors = jnp.arange(2.0), np.arange(3)
    placed = shd.place_buffers(None, weights, state, anchors)
    assert [x.devices() for x in placed] == [{device}, {device}]
    assert all(x.committed for x in placed)
    np.testing.assert_array_equal(placed[0], state)
    np.testing.assert_array_equal(placed[1], anchors)


def test_generate_cli_tensor_parallel(capsys):
    """`hyspec generate -tp 2` prints the same greedy text as one device; too many devices is one clear line."""
    from hyspec_jax import cli
    argv = ["generate", "--max-tokens", "6", "--temperature", "0", "--spec-mode", "ar", "--json", "In the beginning"]
    import json
    assert cli.main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert cli.main(argv[:1] + ["--tensor-parallel-size", "2"] + argv[1:]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["token_ids"] == one["token_ids"] and two["text"] == one["text"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv[:1] + ["--tensor-parallel-size", "64"] + argv[1:])
    assert exit_info.value.code != 0
    assert "--tensor-parallel-size 64 but only" in capsys.readouterr().err


def test_server_backend_tensor_parallel(reference):
    """The server's engine over a tensor-parallel target (`hyspec serve -tp 2` shards before building it): the
    request loop gives the same greedy tokens as one device."""
    import argparse

    from hyspec_jax.runtime.scheduler import run_batch
    from hyspec_jax.serve import server
    ar, chain, _ = reference
    p = argparse.ArgumentParser()
    server.add_arguments(p)
    args = p.parse_args(["--spec-mode", "chain", "--max-batch", "4", "--max-model-len", "64"])
    target = _models(2)
    backend = server.build_backend(args, target, default_model_dir(), 64)
    assert backend.state.ssm.sharding.mesh.shape["model"] == 2
    _, outs, _ = run_batch(backend, PROMPTS, [SamplingParams(max_tokens=8)] * len(PROMPTS))
    assert outs == chain
