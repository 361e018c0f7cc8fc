"""The README's examples run as written (documentation that cannot rot silently)."""

import re
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from hyspec_jax.config import FULL, LINEAR, TargetConfig
from hyspec_jax.models.target import create_model, extend_jit
from hyspec_jax.state import init_state

pytestmark = pytest.mark.slow_module   # scheduled first by bin/test (tests/conftest.py)

README = Path(__file__).resolve().parent.parent / "README.md"


def _block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_tree_verification_example_runs():
    cfg = TargetConfig(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                       layer_types=(LINEAR, LINEAR, LINEAR, FULL), linear_num_key_heads=1,
                       linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    graphdef, params = nnx.split(create_model(cfg, seed=0))
    tokens = jnp.asarray([[1, 2, 3, 4]])
    _, state = extend_jit(graphdef, params, init_state(cfg, 1, 32), tokens, jnp.ones_like(tokens, bool))
    ns = {"graphdef": graphdef, "params": params, "state": state}
    exec(compile(_block_after("### Tree verification"), "README.md", "exec"), ns)
    assert ns["logits"].shape == (1, 6, 64)
    assert int(ns["state"].lengths[0]) == 4 + 3        # anchor, node 1, node 3
    assert any(float(jnp.abs(g).max()) > 0 for g in __import__("jax").tree.leaves(ns["grads"]))


def test_prefill_and_decoding_example_runs(capsys):
    from hyspec_jax.embedded import default_model_dir
    if default_model_dir() is None:
        pytest.skip("no embedded model shipped")
    ns: dict = {}
    exec(compile(_block_after("### Prefill and decoding"), "README.md", "exec"), ns)
    assert len(ns["out"]) == 8 and all(isinstance(t, int) for t in ns["out"])
    assert int(ns["state"].lengths[0]) == len(ns["prompt"]) + 8
    assert capsys.readouterr().out.strip()                 # the decoded text was printed
