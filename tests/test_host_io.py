"""The host side of a round: its named inputs and outputs packed for one transfer each way (`StepInputs`,
`RoundOutput`), cached slot sampling arrays, and the state buffers made in one jitted dispatch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.sampling import SamplingParams, SlotSampling
from hyspec_jax.runtime.programs import spread_rows
from hyspec_jax.spec.round import RoundOutput, StepInputs
from hyspec_jax.state import init_state

CFG = TargetConfig(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, intermediate_size=64, layer_types=(LINEAR, FULL, LINEAR),
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)


def test_step_inputs_pack_and_names():
    active = np.array([True, False, True])
    steps = np.array([3, 0, 7])
    host = StepInputs.pack(active, steps, 24)
    assert host.dtype == np.int32 and host.shape == (3, 3)
    inputs = StepInputs(jnp.asarray(host), SlotSampling.of([0.0] * 3, [1.0] * 3, [0] * 3, [0] * 3))
    np.testing.assert_array_equal(np.asarray(inputs.active), active)
    np.testing.assert_array_equal(np.asarray(inputs.steps), steps)
    assert int(inputs.capacity) == 24 and inputs.rows is None
    # over rows 2 and a padding row (index B = 3): the padding row never steps
    host = StepInputs.pack(active, steps, 24, np.array([2, 3], np.int32))
    sub = StepInputs(jnp.asarray(host), inputs.sampling)
    np.testing.assert_array_equal(np.asarray(sub.rows), [2, 3])
    np.testing.assert_array_equal(np.asarray(sub.active), [True, False])
    np.testing.assert_array_equal(np.asarray(sub.steps), [7, 7])
    assert sub.over_rows(inputs.sampling, None).rows is None


def test_round_output_round_trip():
    """Tokens, count, accepted and the float gains (bits, not scaled: exact) through one int32 array."""
    gains = np.array([[0.25, 1.0 / 3.0], [-1.0, 2.5e-4]], np.float32)
    out = RoundOutput(tokens=jnp.asarray([[5, 6, 7], [8, 0, 0]]), count=jnp.asarray([3, 1]),
                      accepted=jnp.asarray([2, 0]), gains=jnp.asarray(gains))
    host = np.asarray(out.pack())
    assert host.dtype == np.int32 and host.shape == (2, 3 + 2 + 2)
    back = RoundOutput.unpack(host, gains=2)
    np.testing.assert_array_equal(back.tokens, [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(back.count, [3, 1])
    np.testing.assert_array_equal(back.accepted, [2, 0])
    np.testing.assert_array_equal(back.gains, gains)
    plain = RoundOutput.unpack(np.asarray(out.replace(gains=None).pack()))
    assert plain.gains is None and plain.tokens.shape == (2, 3)
    # a round over rows [1, padding]: spread over 3 slots, the others inactive (zeros)
    full = spread_rows(host, np.array([1, 3]), 3)
    np.testing.assert_array_equal(full[1], host[0])
    assert not full[[0, 2]].any()


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
