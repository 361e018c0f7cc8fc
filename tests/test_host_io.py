"""The host side of a round: packed per-round inputs/outputs (spec_round_io), cached slot sampling arrays, and the
state buffers made in one jitted dispatch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.sampling import SamplingParams, SlotSampling
from hyspec_jax.spec.round import pack_round_inputs, unpack_round_outputs
from hyspec_jax.state import init_state

CFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL, LINEAR),
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


def test_pack_round_inputs_layout():
    active = np.array([True, False, True])
    steps = np.array([3, 0, 7])
    host = pack_round_inputs(active, steps, 24)
    assert host.dtype == np.int32 and host.shape == (3, 3)
    np.testing.assert_array_equal(host[:, 0], [1, 0, 1])
    np.testing.assert_array_equal(host[:, 1], steps)
    assert (host[:, 2] == 24).all()


def test_unpack_round_outputs():
    out = np.arange(2 * 6).reshape(2, 6)                                  # D + 1 = 4 tokens, count, accepted
    toks, count, acc = unpack_round_outputs(out)
    np.testing.assert_array_equal(toks, out[:, :4])
    np.testing.assert_array_equal(count, out[:, 4])
    np.testing.assert_array_equal(acc, out[:, 5])


def test_slot_sampling_is_made_once_per_parameter_set():
    a = SlotSampling.from_params([SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=-1)], 3)
    b = SlotSampling.from_params([SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=-1)], 3)
    c = SlotSampling.from_params([SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=2)], 3)
    assert a is b and a is not c
    np.testing.assert_allclose(np.asarray(a.temperature), [0.7, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(a.top_p), [0.9, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(a.top_k), [5, 0, 0])
    assert a.seed.dtype == jnp.uint32 and int(a.seed[0]) == (1 << 32) - 1 and int(c.seed[0]) == 2


def test_init_state_is_zero_and_shaped():
    st = init_state(CFG, 2, 32, jnp.float32)
    assert st.ssm.shape == (2, 2, 2, 8, 8) and st.keys.shape == (1, 2, 32, 1, 16) and st.lengths.shape == (2,)
    assert all(float(jnp.abs(x).sum()) == 0 for x in (st.ssm, st.conv, st.keys, st.values, st.lengths))
    assert st.conv.dtype == jnp.float32 and init_state(CFG, 2, 32, jnp.bfloat16).keys.dtype == jnp.bfloat16
