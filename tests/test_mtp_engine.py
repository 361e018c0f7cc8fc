"""The MTP modes (`mtp`: a chain of recursive head steps; `mtp-tree`: the head expanded as a tree) against plain
decoding: greedy outputs equal AR exactly, sampled outputs follow the AR distribution (chi-square against the
exact distribution of `tests/test_engine.py`), and `hyspec generate --spec-mode mtp|mtp-tree` runs on a model
directory with `mtp.*` tensors and fails in one line on one without.

A random head rarely agrees with the target, so the greedy test's head reads only the token embedding
(fc = [I | 0]): with the tiny random layers both the target and the head are then close to the same bigram map of
the token's embedding, so the head's draft for t_{p+2} from t_{p+1} is often the target's choice — drafts are
accepted at every depth and rejected too, and a wrong commit of the head's cache or of the target's state would
change the output."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from hyspec_jax import cli
from hyspec_jax.io.hf import flat_params, hf_tensors, save_pretrained
from hyspec_jax.io.mtp_io import load_mtp
from hyspec_jax.models.mtp import create_mtp
from hyspec_jax.models.target import create_model
from hyspec_jax.sampling import SamplingParams
from hyspec_jax.runtime.engine import Engine, SpecConfig
from hyspec_jax.tokenizer import byte_level_tokenizer
from hyspec_jax.tree import TreeExpansion
from tests.test_engine import SAMPLES, SETTINGS, SV, _chisq_pvalue, _tcfg, small  # noqa: F401 (fixture)

TREE = TreeExpansion(depth=3, top_k=2, beam=4)


def _with_mtp(cfg):
    return dataclasses.replace(cfg, mtp_num_hidden_layers=1)


def _spec(mode: str, **kw) -> SpecConfig:
    if mode == "mtp-tree":
        return SpecConfig(mode=mode, tree=TREE, verify_nodes=8, **kw)
    return SpecConfig(mode=mode, chain_length=3, **kw)


@pytest.fixture(scope="module")
def greedy_setup():
    cfg = _with_mtp(_tcfg(SV))
    target = create_model(cfg, seed=7)
    head = create_mtp(cfg, seed=8)
    H = cfg.hidden_size
    head.fc.weight.set_value(jnp.concatenate([jnp.eye(H), jnp.zeros((H, H))], axis=1))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, SV, n)] for n in (3, 9, 5, 12, 6)]
    params = [SamplingParams(max_tokens=m) for m in (30, 24, 33, 20, 28)]
    ref = [r.token_ids for r in Engine(target).generate(prompts, params)]
    return target, head, prompts, params, ref


@pytest.mark.parametrize("mode", ["mtp", "mtp-tree"])
def test_greedy_equals_autoregressive(mode, greedy_setup):
    target, head, prompts, params, ref = greedy_setup
    eng = Engine(target, head, _spec(mode), slots=4, kv_len=128)     # 5 requests, 4 slots: one admitted later
    out = eng.generate(prompts, params)
    assert [r.token_ids for r in out] == ref
    apos = eng.last_stats.accepted_per_position
    # acceptances at every depth, and rejections
    assert len(apos) == 3 and 0.5 < apos[0] < 1.0 and apos[2] > 0.05, eng.last_stats
    one = eng.generate([prompts[3]], [params[3]])                        # a batch of one, same bucket
    assert one[0].token_ids == ref[3]


@pytest.mark.parametrize("mode", ["mtp", "mtp-tree"])
def test_greedy_with_penalties_equals_autoregressive(mode, greedy_setup):
    """The MTP rounds penalize the target at every node as the DSpark rounds do: different penalties per request
    (one without) give exactly AR decoding with the same penalties."""
    target, head, prompts, params, ref = greedy_setup
    pens = (dict(repetition_penalty=1.4), dict(frequency_penalty=0.7), {}, dict(presence_penalty=1.0),
            dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=0.4))
    params = [dataclasses.replace(p, **kw) for p, kw in zip(params, pens)]
    want = [r.token_ids for r in Engine(target).generate(prompts, params)]
    assert [i for i in range(len(want)) if want[i] != ref[i]] == [0, 1, 3, 4]
    eng = Engine(target, head, _spec(mode), slots=4, kv_len=128)
    assert [r.token_ids for r in eng.generate(prompts, params)] == want
    assert eng.last_stats.accepted_per_position[0] > 0.3, eng.last_stats


@pytest.mark.parametrize("mode", ["mtp", "mtp-tree"])
def test_deferred_commit_greedy_equals_autoregressive(mode, greedy_setup):
    """[batch]'s deferred GDN commit under the MTP modes: a ring of 5 rows holds one round's accepted path (up to
    4 rows) but rarely two, so the state folds inside every generation; outputs stay AR's."""
    target, head, prompts, params, ref = greedy_setup
    eng = Engine(target, head, _spec(mode, deferred_rows=5), slots=4, kv_len=128)
    assert [r.token_ids for r in eng.generate(prompts, params)] == ref


def test_mtp_mode_rejects_a_dspark_drafter_and_vice_versa(small, greedy_setup):
    target, drafter = small[0], small[1]
    with pytest.raises(ValueError, match="MTP head"):
        Engine(target, drafter, SpecConfig(mode="mtp"))
    with pytest.raises(ValueError, match="DSpark drafter"):
        Engine(greedy_setup[0], greedy_setup[1], SpecConfig(mode="chain"))
    with pytest.raises(ValueError, match="needs the model's MTP head"):
        Engine(target, None, SpecConfig(mode="mtp-tree"))


@pytest.mark.parametrize("mode", ["mtp", "mtp-tree"])
def test_sampling_matches_autoregressive_distribution(mode, small):
    target, _, prompt, exact, greedy = small
    head = create_mtp(_with_mtp(target.config), seed=9)
    spec = (SpecConfig(mode="mtp-tree", tree=TreeExpansion(depth=2, top_k=3, beam=3), verify_nodes=5)
            if mode == "mtp-tree" else SpecConfig(mode="mtp", chain_length=2))
    eng = Engine(target, head, spec, slots=256, kv_len=128)
    # requests i % 3 == 0 are greedy (the greedy rows of a sampling batch), the others use SETTINGS
    params = [SamplingParams(max_tokens=3, seed=i, **(SETTINGS[i % 3 - 1] if i % 3 else {}))
              for i in range(SAMPLES)]
    out = eng.generate([prompt] * SAMPLES, params)
    seqs = np.array([r.token_ids for r in out])
    assert seqs.shape == (SAMPLES, 3)
    apos = eng.last_stats.accepted_per_position
    assert apos[0] > 0.05 and apos[-1] < 0.95, eng.last_stats      # acceptances and rejections both happen
    assert (seqs[0::3] == np.array(greedy)).all()
    for j in range(2):
        s = seqs[j + 1::3]
        code = s[:, 0] * SV * SV + s[:, 1] * SV + s[:, 2]
        assert _chisq_pvalue(code, exact[j]) > 1e-3, (mode, SETTINGS[j])


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The same tiny target saved twice: with `mtp.*` tensors (config declaring the head) and without."""
    cfg = _with_mtp(_tcfg(300))                 # >= the byte-level tokenizer's 257 ids
    target = create_model(cfg, seed=0)
    head = create_mtp(cfg, seed=1)
    root = tmp_path_factory.mktemp("mtp_cli")
    for name in ("with", "without"):
        save_pretrained(target, root / name)
        byte_level_tokenizer().save(str(root / name / "tokenizer.json"))
    mtp = {"mtp." + k: v for k, v in hf_tensors(head).items()}
    save_file(mtp, str(root / "with" / "mtp.safetensors"), metadata={"format": "pt"})
    with safe_open(str(root / "with" / "model.safetensors"), "np") as f:
        base = {k: "model.safetensors" for k in f.keys()}
    (root / "with" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": base | {k: "mtp.safetensors" for k in mtp}}))
    raw = json.loads((root / "without" / "config.json").read_text())
    raw.pop("mtp_num_hidden_layers")
    (root / "without" / "config.json").write_text(json.dumps(raw))
    (root / "prompts.txt").write_text("Hi\nSpeculate!\nabc\n")
    return root, head


def _cli(capsys, argv) -> list[dict]:
    assert cli.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_loaded_head_is_the_saved_one(model_dirs):
    root, head = model_dirs
    got = flat_params(load_mtp(root / "with"))
    for k, v in flat_params(head).items():
        np.testing.assert_array_equal(np.asarray(got[k][...]), np.asarray(v[...]), err_msg=k)


def test_cli_generate_mtp_modes_equal_ar(model_dirs, capsys):
    root, _ = model_dirs
    base = ["generate", "--model", str(root / "with"), "--prompts-file", str(root / "prompts.txt"),
            "--max-tokens", "10", "--json"]
    ar = _cli(capsys, base)
    for mode, extra in (("mtp", ["--chain-length", "3"]), ("mtp-tree", ["--tree-depth", "3", "--verify-nodes", "6"])):
        out = _cli(capsys, base + ["--spec-mode", mode, "--slots", "4"] + extra)
        assert [r["token_ids"] for r in out] == [r["token_ids"] for r in ar]
        assert all(r["stats"]["mode"] == mode and r["stats"]["rounds"] >= 1 for r in out)


def test_cli_mtp_mode_without_head_fails_in_one_line(model_dirs, capsys):
    root, _ = model_dirs
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", str(root / "without"), "--spec-mode", "mtp", "--max-tokens", "4", "Hi"])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no MTP head" in err[0] and "Traceback" not in err[0]


def test_vllm_speculative_config_maps_onto_the_mtp_modes():
    """The server's vLLM form `{"method": "mtp", "num_speculative_tokens": k}`: k recursive steps (chain length);
    for mtp-tree, the tree depth."""
    import argparse

    from hyspec_jax.serve.server import apply_speculative_config
    for method, dest in (("mtp", "chain_length"), ("mtp-tree", "tree_depth")):
        args = argparse.Namespace(speculative_config=json.dumps({"method": method, "num_speculative_tokens": 3}),
                                  spec_mode=None, drafter=None, chain_length=None, tree_depth=None)
        apply_speculative_config(args)
        assert args.spec_mode == method and getattr(args, dest) == 3
        assert (args.chain_length, args.tree_depth).count(None) == 1


def test_server_mtp_modes_equal_ar(model_dirs, tmp_path):
    """`hyspec serve DIR --spec-mode mtp|mtp-tree` on a directory with `mtp.*` tensors: greedy completions through
    the official openai client, streamed and not, equal `hyspec generate`'s plain decoding."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    import openai
    root, _ = model_dirs
    prompts = (root / "prompts.txt").read_text().splitlines()
    ar = subprocess.run([sys.executable, "-m", "hyspec_jax.cli", "generate", "--model", str(root / "with"),
                         "--prompts-file", str(root / "prompts.txt"), "--max-tokens", "10", "--json"],
                        capture_output=True, text=True, check=True)
    want = [json.loads(line)["text"] for line in ar.stdout.splitlines() if line.strip()]
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
    for mode, extra in (("mtp", ["--chain-length", "3"]), ("mtp-tree", ["--tree-depth", "3", "--verify-nodes", "6"])):
        log = tmp_path / f"{mode}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "hyspec_jax.serve", str(root / "with"), "--port", "0",
                                     "--spec-mode", mode, "--max-batch", "4", "--max-model-len", "128",
                                     "--prefill-chunk", "16", "--served-model-name", "m"] + extra,
                                    stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            deadline, port = time.monotonic() + 300, None
            while port is None and time.monotonic() < deadline:
                m = re.search(r"on http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
                port = int(m.group(1)) if m else None
                assert proc.poll() is None, log.read_text(errors="replace")
                time.sleep(0.2)
            assert port is not None, log.read_text(errors="replace")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            got = [client.completions.create(model="m", prompt=p, max_tokens=10, temperature=0).choices[0].text
                   for p in prompts]
            assert got == want, mode
            stream = client.completions.create(model="m", prompt=prompts[1], max_tokens=10, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == want[1], mode
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
