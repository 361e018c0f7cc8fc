"""Autoregressive generation and the `hyspec generate` CLI against transformers (greedy) and HF's warpers."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from hyspec_jax import cli
from hyspec_jax.runtime.engine import Engine
from hyspec_jax.runtime.programs import ar_prefill_jit, ar_step_jit
from hyspec_jax.spec.round import SlotState, StepInputs
from hyspec_jax.io.hf import load_pretrained
from hyspec_jax.sampling import SamplingParams, SlotSampling, sample, warp
from hyspec_jax.tokenizer import byte_level_tokenizer
from tests import hf_oracle

PROMPTS = ["Hello there", "A much longer prompt, to make the batch ragged.", "x"]


def _make_dir(tmp_path_factory, name, config):
    model = hf_oracle.build(config, seed=7)
    model.generation_config.eos_token_id = 3
    path = hf_oracle.save(model, tmp_path_factory.mktemp(name))
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return model, path


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    if request.param == "qwen3_5":
        cfg = hf_oracle.qwen3_5_config(vocab=300, hidden=40, hv=6, hk=2, dk=8, dv=4, head_dim=8, heads=2,
                                       kv_heads=1, layers=5,
                                       layer_types=["linear_attention", "full_attention", "linear_attention",
                                                    "linear_attention", "full_attention"])
    else:
        cfg = hf_oracle.qwen3_next_config(vocab=300, hidden=32, layers=4, num_experts=6, top_k=3,
                                          mlp_only_layers=(2,), norm_topk_prob=False)
    cfg.eos_token_id = 3
    return _make_dir(tmp_path_factory, request.param, cfg)


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=3,
                             pad_token_id=0)
    new = out[0, len(ids):].tolist()
    if 3 in new:
        new = new[:new.index(3) + 1]
    return new


def _hf_greedy_penalized(model, ids: list[int], n: int, repetition: float) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=3,
                             pad_token_id=0, repetition_penalty=repetition)
    new = out[0, len(ids):].tolist()
    return new[:new.index(3) + 1] if 3 in new else new


def _numpy_penalized_greedy(model, ids: list[int], n: int, presence: float, frequency: float,
                            repetition: float) -> list[int]:
    """The vLLM formula written out in numpy over transformers' logits of the whole sequence at every step."""
    out: list[int] = []
    for _ in range(n):
        x = hf_oracle.logits(model, np.asarray([ids + out]))[0, -1].astype(np.float64)
        seen = np.zeros(x.shape, bool)
        seen[ids + out] = True
        x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
        counts = np.bincount(np.asarray(out, np.int64), minlength=x.size)
        x = x - frequency * counts - presence * (counts > 0)
        out.append(int(np.argmax(x)))
        if out[-1] == 3:
            break
    return out


def _run_cli(capsys, argv) -> list[dict]:
    assert cli.main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_cli_greedy_equals_transformers(checkpoint, capsys):
    model, path = checkpoint
    [res] = _run_cli(capsys, ["generate", "--model", str(path), "--temperature", "0", "--max-tokens", "32",
                              "--json", PROMPTS[0]])
    assert res["prompt_token_ids"] == byte_level_tokenizer().encode(PROMPTS[0]).ids
    assert res["token_ids"] == _hf_greedy(model, res["prompt_token_ids"], 32)
    assert res["stats"]["new_tokens"] == len(res["token_ids"])
    assert {"seconds", "tokens_per_second"} <= set(res["stats"])


def test_repetition_penalty_equals_transformers(checkpoint):
    """Greedy AR with repetition_penalty (above and below 1) against transformers' `generate(repetition_penalty=)`,
    in one ragged batch with an unpenalized request (which must stay transformers' plain greedy)."""
    model, path = checkpoint
    _, ours = load_pretrained(path)
    tok = byte_level_tokenizer()
    prompts = [tok.encode(p).ids for p in PROMPTS]
    reps = (1.5, 0.7, 1.0)
    params = [SamplingParams(max_tokens=24, stop_token_ids=(3,), repetition_penalty=r) for r in reps]
    got = [r.token_ids for r in Engine(ours).generate(prompts, params)]
    want = [_hf_greedy_penalized(model, ids, 24, r) for ids, r in zip(prompts, reps)]
    assert got == want
    assert got[0] != _hf_greedy(model, prompts[0], 24)     # the penalty changed something


def test_presence_frequency_penalties_equal_numpy_formula(checkpoint):
    """presence / frequency (no transformers equivalent) and all three together: vLLM's formula in numpy over
    transformers' step-by-step logits."""
    model, path = checkpoint
    _, ours = load_pretrained(path)
    tok = byte_level_tokenizer()
    prompts = [tok.encode(p).ids for p in PROMPTS]
    settings = ((0.0, 2.0, 1.0), (2.0, 0.0, 1.0), (-1.0, 1.5, 1.5))        # (presence, frequency, repetition)
    cases = [(ids, st) for st in settings for ids in prompts]
    params = [SamplingParams(max_tokens=20, stop_token_ids=(3,), presence_penalty=p, frequency_penalty=f,
                             repetition_penalty=r) for _, (p, f, r) in cases]
    got = [r.token_ids for r in Engine(ours).generate([c[0] for c in cases], params)]
    assert got == [_numpy_penalized_greedy(model, ids, 20, *st) for ids, st in cases]
    plain = [_hf_greedy(model, ids, 20) for ids in prompts]
    changed = np.array([g != plain[i % len(prompts)] for i, g in enumerate(got)]).reshape(len(settings), -1)
    assert changed.any(axis=1).all(), changed          # every setting changed some output


def test_penalty_params_are_validated():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
                dict(repetition_penalty=float("nan"))):
        with pytest.raises(ValueError, match="penalty"):
            SamplingParams(**bad)
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.1).penalized


def test_cli_prompts_file_batch_matches_single(checkpoint, capsys, tmp_path):
    model, path = checkpoint
    pf = tmp_path / "prompts.jsonl"
    pf.write_text(json.dumps({"prompt": PROMPTS[1]}) + "\n" + PROMPTS[2] + "\n\n" + json.dumps({"prompt": PROMPTS[0]}) + "\n")
    results = _run_cli(capsys, ["generate", "--model", str(path), "--max-tokens", "12", "--json",
                                "--prompts-file", str(pf)])
    assert [r["prompt"] for r in results] == [PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    for r in results:
        assert r["token_ids"] == _hf_greedy(model, r["prompt_token_ids"], 12)


def test_cli_stats_to_stderr(checkpoint, capsys):
    _, path = checkpoint
    base = ["generate", "--model", str(path), "--max-tokens", "32", "--stats", PROMPTS[0]]
    assert cli.main(base) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith(PROMPTS[0])                      # the streamed text is unchanged
    err = cap.err.strip().splitlines()
    assert all(line.startswith("[hyspec] ") for line in err)
    assert "mode ar:" in err[0] and "tau 1.00" in err[0]
    assert any("tok/s" in line for line in err)
    assert re.search(r"compilations after start-up: \d+", cap.err)
    [res] = _run_cli(capsys, base + ["--json"])                # --json keeps its stats object on stdout
    assert res["stats"]["new_tokens"] == len(res["token_ids"]) and res["stats"]["mode"] == "ar"


def test_format_stats_speculative():
    st = {"prompts": 2, "new_tokens": 40, "seconds": 2.0, "tokens_per_second": 20.0, "prefill_seconds": 0.1,
          "decode_steps_per_second": 9.5, "mode": "chain", "rounds": 12, "tau": 2.5,
          "accepted_per_position": [0.8, 0.5, 0.25], "verify_nodes": 4, "compilations_after_startup": 0}
    text = cli.format_stats(st)
    assert "mode chain: 12 rounds, tau 2.50" in text and "4 verified nodes" in text
    assert "1: 0.80  2: 0.50  3: 0.25" in text and "20.0 tok/s" in text and "9.5 rounds/s" in text
    assert "compilations after start-up: 0" in text


def test_no_recompilation_within_bucket(checkpoint):
    """A bucket has two programs of each kind, greedy and sampling (`sample`'s static flag); other prompts and
    sampling parameters of the bucket reuse them."""
    _, path = checkpoint
    cfg, model = load_pretrained(path)
    gen = Engine(model)
    gen.generate([[5, 6, 7]], SamplingParams(max_tokens=5))
    gen.generate([[1, 2]], SamplingParams(max_tokens=5, temperature=0.9, seed=1))
    sizes = (ar_prefill_jit._cache_size(), ar_step_jit._cache_size())
    gen.generate([[9, 8, 7, 6, 5, 4]], SamplingParams(max_tokens=6, temperature=0.7, top_p=0.8, top_k=4, seed=3))
    gen.generate([[4, 4, 4, 4]], SamplingParams(max_tokens=6))
    assert (ar_prefill_jit._cache_size(), ar_step_jit._cache_size()) == sizes


@pytest.mark.parametrize("temperature", [[0.0, 0.0, 0.0], [0.0, 0.8, 1.3]])
def test_sample_flavours_agree(temperature):
    """The static flavours draw what the run-time branch draws: greedy = argmax, sampling = the warped draw (its
    greedy slots still their argmax)."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 11)) * 2, jnp.float32)
    sampling = SlotSampling(temperature=jnp.asarray(temperature, jnp.float32), top_p=jnp.full(3, 0.9),
                            top_k=jnp.zeros(3, jnp.int32), seed=jnp.arange(3, dtype=jnp.uint32))
    branch = np.asarray(sample(logits, sampling, jnp.asarray(4)))
    drawn = np.asarray(sample(logits, sampling, jnp.asarray(4), stochastic=True))
    np.testing.assert_array_equal(drawn, branch)
    if max(temperature) == 0:
        np.testing.assert_array_equal(np.asarray(sample(logits, sampling, jnp.asarray(4), stochastic=False)),
                                      np.argmax(np.asarray(logits), axis=-1))


def test_sampling_seeded_and_independent_of_batch(checkpoint):
    _, path = checkpoint
    _, model = load_pretrained(path)
    gen = Engine(model)
    p = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=11)
    alone = gen.generate([[5, 6, 7]], p)[0].token_ids
    batched = gen.generate([[1, 2], [5, 6, 7]], [SamplingParams(max_tokens=10, temperature=1.0, seed=1), p])
    assert batched[1].token_ids == alone
    other = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=12))
    assert other[0].token_ids != alone


def test_stop_token_and_max_tokens(checkpoint):
    _, path = checkpoint
    _, model = load_pretrained(path)
    gen = Engine(model)
    free = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=8))[0]
    assert len(free.token_ids) == 8 and free.finish_reason == "length"
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = gen.generate([[5, 6, 7]], SamplingParams(max_tokens=8, stop_token_ids=(stop_at,)))[0]
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.6), (1.0, 7, 0.35)])
def test_warp_equals_hf_warpers(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
    t = torch.tensor(logits)
    t = TemperatureLogitsWarper(temperature)(None, t)
    if top_k:
        t = TopKLogitsWarper(top_k)(None, t)
    t = TopPLogitsWarper(top_p)(None, t)
    ref = torch.log_softmax(t, -1).numpy()
    ours = np.asarray(warp(jnp.asarray(logits), jnp.full(4, temperature), jnp.full(4, top_p),
                           jnp.full(4, top_k, jnp.int32)))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    finite = ~np.isinf(ref)
    np.testing.assert_allclose(ours[finite], ref[finite], atol=1e-5)


def test_greedy_warp_is_argmax_one_hot():
    logits = jnp.asarray([[0.1, 2.0, -1.0], [5.0, 0.0, 4.9]])
    lp = warp(logits, jnp.zeros(2), jnp.ones(2), jnp.zeros(2, jnp.int32))
    np.testing.assert_array_equal(np.asarray(jnp.exp(lp)), [[0, 1, 0], [1, 0, 0]])


def test_sample_frequencies_follow_warped_distribution():
    logits = jnp.log(jnp.asarray([0.4, 0.3, 0.15, 0.1, 0.05]))
    n = 4000
    sampling = SlotSampling(temperature=jnp.full(n, 1.0), top_p=jnp.full(n, 0.8), top_k=jnp.zeros(n, jnp.int32),
                            seed=jnp.arange(n, dtype=jnp.uint32))
    toks = np.asarray(sample(jnp.broadcast_to(logits, (n, 5)), sampling, jnp.asarray(0)))
    freq = np.bincount(toks, minlength=5) / n
    want = np.asarray(jnp.exp(warp(logits[None], jnp.ones(1), jnp.full(1, 0.8), jnp.zeros(1, jnp.int32))))[0]
    np.testing.assert_allclose(want, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], atol=1e-6)
    assert np.abs(freq - want).max() < 0.03


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "/definitely/not/here", "x"], "no such directory"),
    (["generate", "--top-p", "1.5", "x"], "top_p"),
    (["generate"], "PROMPT"),
])
def test_cli_errors_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hyspec: error:") and needle in err[0]


def test_cli_error_for_directory_without_config(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(tmp_path), "x"])
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err


def test_greedy_decode_step_has_no_run_time_branch(checkpoint):
    """A greedy batch's decode program holds no conditional: on a GPU, XLA copies a conditional's predicate to
    the host and blocks until it is there, once per token. The run-time-branch flavour does hold one."""
    _, path = checkpoint
    cfg, model = load_pretrained(path)
    gen = Engine(model)
    state = gen.new_state(2, 32)
    sampling = SlotSampling.from_params([SamplingParams()], 2)

    def conditionals(stochastic):       # in the compiled HLO (the platform switch of a kernel is folded there)
        inputs = StepInputs(StepInputs.pack(np.ones(2, bool), np.ones(2, np.int32)), sampling)
        hlo = ar_step_jit.lower(gen.tgraph, gen.tparams, SlotState(state), np.zeros(2, np.int32), inputs,
                                stochastic=stochastic).compile().as_text()
        return len(re.findall(r"\bconditional\(", hlo))
    assert conditionals(False) == 0
    assert conditionals(None) == 1


def test_unpenalized_decode_step_takes_no_penalty_inputs(checkpoint):
    """The penalty history [B, V] and its parameters are inputs of the penalized flavour only: the decode program
    without them has the unpenalized signature (and the penalized one holds the history)."""
    from hyspec_jax.sampling import PenaltyCounts, SlotPenalty
    _, path = checkpoint
    cfg, model = load_pretrained(path)
    gen = Engine(model)
    state = gen.new_state(2, 32)
    sampling = SlotSampling.from_params([SamplingParams()], 2)
    host = StepInputs.pack(np.ones(2, bool), np.ones(2, np.int32))

    def signature(hist=None, penalty=None) -> str:      # the entry function's line: its inputs
        text = ar_step_jit.lower(gen.tgraph, gen.tparams, SlotState(state, hist=hist), np.zeros(2, np.int32),
                                 StepInputs(host, sampling, penalty), stochastic=False).as_text()
        return next(line for line in text.splitlines() if "func.func public @main" in line)
    plain = signature()
    hist = PenaltyCounts(np.zeros((2, cfg.vocab_size), np.int32), np.zeros((2, cfg.vocab_size), bool))
    penalized = signature(hist=hist, penalty=SlotPenalty.of([0, 0], [1, 0], [1, 1]))
    hist_type = f"tensor<2x{cfg.vocab_size}xi32>"
    assert hist_type not in plain and hist_type in penalized
