"""Data-parallel replicas on fake CPU devices: the target placed on a (data=2, model=T) mesh
(`launch.shard_target(model, T, 2)`), the request loop's buffers — target state, drafter state, anchors — split
by slot over "data" (`sharding.place_buffers`). Several prompts of different lengths decoded together give the
greedy tokens of one device in every mode family (ar, chain, tree, mtp), with and without tensor parallel."""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hyspec_jax import sharding as shd
from hyspec_jax.embedded import default_drafter_dir, default_model_dir
from hyspec_jax.io.drafter_io import load_drafter
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.io.mtp_io import load_mtp
from hyspec_jax.launch import shard_target
from hyspec_jax.runtime.scheduler import run_batch
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine, SpecConfig, default_slots


# lengths 5, 3, 20, 7: two prompt buckets, one prompt per slot of a 4-slot batch (2 slots per replica)
PROMPTS = [[5, 17, 230, 11, 42], [7, 99, 3], list(range(300, 320)), [400, 12, 8, 8, 31, 2, 77]]
PARAMS = [SamplingParams(max_tokens=8)] * len(PROMPTS)
SLOTS, KV = 4, 64
MODES = ("ar", "chain", "tree", "mtp")


def _target(tp: int, dp: int):
    _, target = load_pretrained(default_model_dir())
    shard_target(target, tp, dp)
    return target


def _engine(target, mode: str):
    if mode == "ar":
        return Engine(target)
    if mode == "mtp":
        return Engine(target, load_mtp(default_model_dir(), target.config), SpecConfig(mode="mtp", chain_length=3))
    drafter = load_drafter(default_drafter_dir(), with_reader=False)
    return Engine(target, drafter, SpecConfig(mode=mode))


def _decode(target, mode: str):
    """Greedy tokens of the prompts in one 4-slot batch, and the backend that decoded them."""
    backend = _engine(target, mode).backend(SLOTS, KV)
    _, outs, _ = run_batch(backend, PROMPTS, PARAMS)
    return outs, backend


@pytest.fixture(scope="module")
def targets():
    return {layout: _target(*layout) for layout in ((1, 1), (1, 2), (2, 1), (2, 2))}     # (tp, dp)


@pytest.fixture(scope="module")
def one_device(targets):
    return {mode: _decode(targets[(1, 1)], mode)[0] for mode in MODES}


def _slot_split(x: jax.Array, slot_dim: int) -> bool:
    spec = x.sharding.spec
    return len(spec) > slot_dim and spec[slot_dim] == "data" and x.sharding.mesh.shape["data"] == 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_equals_one_device(targets, one_device, mode, tp):
    assert jax.device_count() >= 4
    outs, backend = _decode(targets[(tp, 2)], mode)
    assert outs == one_device[mode]
    assert all(len(o) == 8 for o in outs)
    # after the run the buffers still hold their slots split over the replicas (the programs keep the layout)
    assert _slot_split(backend.state.ssm, 1) and _slot_split(backend.state.keys, 1)
    assert _slot_split(backend.anchor, 0)
    if mode != "ar":
        assert _slot_split(backend.dstate.keys, 1) and _slot_split(backend.dstate.lengths, 0)
    if mode == "mtp":
        assert _slot_split(backend.dstate.hidden, 0)
    if tp == 2:       # the target's heads stay sharded over "model"
        assert backend.state.ssm.sharding.spec[2] == "model" and backend.state.ssm.sharding.mesh.shape["model"] == 2


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_penalties_on_a_mesh_equal_one_device(targets, mode):
    """The penalized programs over (tp 2, dp 2): the per-slot penalty history is split by slot like the other
    buffers, and the tokens are one device's with the same penalties."""
    params = [SamplingParams(max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5), PARAMS[1],
              SamplingParams(max_tokens=8, presence_penalty=1.5), SamplingParams(max_tokens=8, repetition_penalty=0.8)]
    want = run_batch(_engine(targets[(1, 1)], mode).backend(SLOTS, KV), PROMPTS, params)[1]
    backend = _engine(targets[(2, 2)], mode).backend(SLOTS, KV)
    assert run_batch(backend, PROMPTS, params)[1] == want
    assert _slot_split(backend.penalty_hist().counts, 0) and _slot_split(backend.penalty_hist().seen, 0)


def test_default_slots_split_over_replicas(targets, one_device):
    """A library call that fixes no slots runs in a multiple of the replicas: one prompt decodes in 2 slots."""
    target = targets[(1, 2)]
    got = Engine(target).generate(PROMPTS[:1], PARAMS[0])
    assert got[0].token_ids == one_device["ar"][0]
    assert _engine(target, "chain").bucket_for(PROMPTS[:1], PARAMS[:1])[0] == 2      # the engine's rule too
    with pytest.raises(ValueError, match="3 slots do not split over 2 data-parallel replicas"):
        Engine(target).backend(3, KV)


def test_default_slots_rule():
    def on(data: int):
        mesh = shd.make_mesh(data, 1)
        return {"w": jax.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P()))}
    one = {"w": np.ones((4, 4), np.float32)}
    assert [default_slots(n, one) for n in (1, 3, 5)] == [1, 4, 8]
    assert [default_slots(n, on(2)) for n in (1, 3, 5)] == [2, 4, 8]
    assert [default_slots(n, on(3)) for n in (1, 2, 4)] == [3, 3, 6]
    assert shd.data_parallel_size(on(3)) == 3 and shd.data_parallel_size(one) == 1


def test_generate_cli_data_parallel(capsys):
    """`hyspec generate -dp 2 -tp 2` prints one device's greedy text; slots that do not split and too many
    devices are one clear line each."""
    from hyspec_jax import cli
    argv = ["generate", "--max-tokens", "6", "--temperature", "0", "--spec-mode", "ar", "--json", "In the beginning"]
    assert cli.main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert cli.main(argv[:1] + ["--data-parallel-size", "2", "-tp", "2"] + argv[1:]) == 0
    four = json.loads(capsys.readouterr().out)
    assert four["token_ids"] == one["token_ids"] and four["text"] == one["text"]
    for flags, message in ((["-dp", "2", "--slots", "3"], "--slots 3 is not a multiple of --data-parallel-size 2"),
                           (["-dp", "4", "-tp", "2"], "size 4 x --tensor-parallel-size 2 = 8 devices but only 4"),
                           (["-dp", "0"], "--data-parallel-size must be >= 1")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv[:1] + flags + argv[1:])
        assert exit_info.value.code != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_server_data_parallel(targets, one_device, capsys):
    """`hyspec serve -dp 2`: the server's backend splits its slots over the replicas and decodes one device's
    tokens; --max-batch that does not split is one line before anything loads."""
    from hyspec_jax.serve import server
    p = argparse.ArgumentParser()
    server.add_arguments(p)
    args = p.parse_args(["--spec-mode", "chain", "--max-batch", "4", "--max-model-len", "64", "-dp", "2"])
    backend = server.build_backend(args, targets[(1, 2)], default_model_dir(), 64)
    assert _slot_split(backend.state.ssm, 1) and _slot_split(backend.dstate.keys, 1)
    _, outs, _ = run_batch(backend, PROMPTS, PARAMS)
    assert outs == one_device["chain"]
    assert server.main(["--port", "0", "--data-parallel-size", "2", "--max-batch", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hyspec serve: error: --max-batch 3 is not a multiple of --data-parallel-size 2"]


@pytest.mark.parametrize("mode", ["ar", "chain"])
@pytest.mark.parametrize("layout", [(2, 1), (2, 2)])      # (tp, dp)
def test_start_up_compile_covers_the_layouts_the_programs_return(targets, one_device, mode, layout):
    """Over a mesh XLA may hand a buffer back in another layout than it was placed in (a size-1 axis dropped, the
    conv window's channels split over "model"); the start-up compile repeats its pass until nothing new compiles,
    so decoding after it compiles nothing (the server logged "compilation while serving" on the first request)."""
    from hyspec_jax.compilation import CompileWatch
    prompts = PROMPTS + PROMPTS[:2]             # 6 requests in 4 slots: prefills after decoding steps
    params = [SamplingParams(max_tokens=8)] * len(prompts)
    backend = _engine(targets[layout], mode).backend(SLOTS, KV)
    backend.compile()
    watch = CompileWatch()
    _, outs, _ = run_batch(backend, prompts, params)
    assert watch.since == 0
    assert outs == one_device[mode] + one_device[mode][:2]
