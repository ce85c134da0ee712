"""Training data (dflash_jax.train_data): evaluation sets refused, token files, rows, data order."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import ModelConfig
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import checkpoint_specs, forward, param_layout
from dflash_jax.params import assemble, is_spec
from dflash_jax.train_data import (EvaluationDataError, TokenData, batch_indices, build_sequences,
                                   check_training_source, default_sources, make_token_data, read_prompts,
                                   split_by_prompt)

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
VOCAB = 40


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_refuses_evaluation_sets(tmp_path):
    for bad in (tmp_path / "spec_bench" / "question.jsonl", tmp_path / "gsm8k" / "test.jsonl",
                tmp_path / "Spec-Bench" / "q.jsonl", tmp_path / "mt_bench" / "train.jsonl"):
        write_jsonl(bad, [{"question": "q"}])
        with pytest.raises(EvaluationDataError, match="evaluation|test split"):
            read_prompts(bad)
    # spec_bench rows under another name are refused by content.
    renamed = write_jsonl(tmp_path / "prompts.jsonl", [{"question_id": 1, "category": "writing", "turns": ["a", "b"]}])
    with pytest.raises(EvaluationDataError, match="spec_bench"):
        read_prompts(renamed)
    # Refused before any model work (no params needed).
    with pytest.raises(EvaluationDataError):
        make_token_data(None, None, None, [tmp_path / "gsm8k" / "train.jsonl", tmp_path / "gsm8k" / "test.jsonl"])
    # make-prompts' held-out code set, by name (even as FILE:N) and, renamed, by its rows.
    for bad in (tmp_path / "code_heldout.jsonl", tmp_path / "more" / "Held-Out.jsonl"):
        write_jsonl(bad, [{"instruction": "i", "category": "code", "module": "textwrap"}])
        with pytest.raises(EvaluationDataError, match="held-out set"):
            read_prompts(bad)
    with pytest.raises(EvaluationDataError, match="held-out set"):
        make_token_data(None, None, None, [f"{tmp_path / 'code_heldout.jsonl'}:5"])
    renamed = write_jsonl(tmp_path / "code.jsonl", [{"instruction": "i", "category": "code", "module": "x"},
                                                    {"instruction": "j", "category": "code", "module": "shlex",
                                                     "source": "shlex.split"}])
    with pytest.raises(EvaluationDataError, match=r"code.jsonl:2: shlex.split is in the held-out code set"):
        read_prompts(renamed)
    assert read_prompts(renamed, limit=1) == ["i"]
    if SHARED.is_dir():
        for bad in (SHARED / "spec_bench" / "question.jsonl", SHARED / "gsm8k" / "test.jsonl"):
            with pytest.raises(EvaluationDataError):
                check_training_source(bad)


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data is not present")
def test_reads_the_training_prompt_sets():
    gsm, alpaca = default_sources(SHARED)
    questions, instructions = read_prompts(gsm, limit=3), read_prompts(alpaca, limit=2)
    assert len(questions) == 3 and questions[0].startswith("Natalia sold clips")
    assert len(instructions) == 2 and all(isinstance(t, str) and t for t in instructions)


def test_token_file_round_trip_and_rows(tmp_path):
    prompts = [[1, 2, 3], [4, 5], list(range(10, 30)), [6]]
    responses = [[7, 8, 9, 2], [3], [5, 5, 5], list(range(1, 40))]
    data = TokenData.from_lists(prompts, responses, [0.0, 1.0, 0.0, 1.0], [0, 1, 0, 1], {"sources": ["a", "b"]})
    loaded = TokenData.load(data.save(tmp_path / "tokens.npz"))
    assert len(loaded) == 4 and loaded.meta["sources"] == ["a", "b"]
    for i in range(4):
        assert loaded.prompt(i).tolist() == prompts[i] and loaded.response(i).tolist() == responses[i]
    np.testing.assert_array_equal(loaded.temperature, [0, 1, 0, 1])

    rows = build_sequences(loaded, seq_len=16, pad_id=0)
    # Row 1 (1-token response) and row 2 (20-token prompt) are dropped; row 3 is cut at 16 tokens.
    assert len(rows) == 2
    np.testing.assert_array_equal(rows.prompt_lens, [3, 1])
    np.testing.assert_array_equal(rows.total_lens, [7, 16])
    assert rows.tokens[0, :7].tolist() == [1, 2, 3, 7, 8, 9, 2] and (rows.tokens[0, 7:] == 0).all()
    assert rows.tokens[1].tolist() == [6] + list(range(1, 16))
    with pytest.raises(FileNotFoundError, match="make-data"):
        TokenData.load(tmp_path / "missing.npz")


def test_batch_indices_are_a_pure_function_of_seed_and_step():
    n, b = 10, 4
    order = np.concatenate([batch_indices(n, b, s, seed=7) for s in range(5)])  # 20 rows = 2 epochs
    for epoch in range(2):
        assert sorted(order[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))
    assert order[:n].tolist() != order[n:].tolist()  # a fresh permutation per epoch
    np.testing.assert_array_equal(batch_indices(n, b, 3, seed=7), order[12:16])  # no state carried
    assert batch_indices(n, b, 0, seed=8).tolist() != batch_indices(n, b, 0, seed=7).tolist()


class ToyTokenizer:
    """Characters -> ids; a 'chat template' that brackets the prompt with ids 1 and 2."""

    chat_template = "toy"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1] + [3 + ord(c) % (VOCAB - 3) for c in messages[0]["content"]] + [2]

    def get_vocab(self):
        return {"<|im_end|>": 0}


@pytest.fixture(scope="module")
def toy_target():
    """A tiny random Qwen3-shaped target (numpy-drawn weights) -> (cfg, params)."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=256)
    rng = np.random.default_rng(0)

    def draw(spec):
        if spec.init == "ones":
            return jnp.ones(spec.shape, jnp.float32)
        return jnp.asarray(2.0 * rng.standard_normal(spec.shape) * spec.fan_in ** -0.5, jnp.float32)

    # Drawn as checkpoints store the weights, then laid out for decoding as the loaders do.
    return cfg, assemble(param_layout(cfg), jax.tree.map(draw, checkpoint_specs(cfg), is_leaf=is_spec))


def test_make_token_data_with_the_target(tmp_path, toy_target):
    """Prompts -> chat template -> target responses (greedy and T=1 batches) -> token file."""
    cfg, params = toy_target
    gsm = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": f"q{i} " * (i + 1), "answer": "x"}
                                                            for i in range(5)])
    alpaca = write_jsonl(tmp_path / "alpaca" / "instructions.jsonl", [{"instruction": "say hi " * 3}] * 3
                         + [{"instruction": "a much longer instruction " * 9}])
    data = make_token_data(params, cfg, ToyTokenizer(), [gsm, alpaca], max_new_tokens=12, max_prompt_tokens=40,
                           batch_size=2, sample_fraction=0.5, seed=1, math_suffix="never", progress=False)
    assert len(data) == 8 and data.meta["skipped_long_prompts"] == 1
    assert data.source.tolist() == [0] * 5 + [1] * 3
    assert data.prompt(5).tolist() == ToyTokenizer().apply_chat_template([{"content": "say hi " * 3}])
    assert set(data.temperature.tolist()) == {0.0, 1.0}  # both greedy and sampled batches
    for i in range(len(data)):
        r = data.response(i).tolist()
        assert 1 <= len(r) <= 12 and (0 not in r[:-1])  # stops at the stop token (id 0), kept
    # Greedy responses are the target's argmax continuations (teacher-forced check).
    width = 64

    @jax.jit
    def argmax_next(tokens):
        cache = KVCache.create(cfg.num_layers, 1, width, cfg.num_kv_heads, cfg.head_dim)
        return jnp.argmax(forward(params, cfg, tokens, jnp.arange(width)[None], cache).logits[0], -1)

    for i in [i for i in range(len(data)) if data.temperature[i] == 0.0]:
        p, r = data.prompt(i), data.response(i)
        seq = np.zeros((1, width), np.int32)
        seq[0, :len(p) + len(r)] = np.concatenate([p, r])
        nxt = np.asarray(argmax_next(jnp.asarray(seq)))
        assert nxt[len(p) - 1:len(p) + len(r) - 1].tolist() == r.tolist()


def test_samples_per_prompt(tmp_path, toy_target):
    """N = 3: every prompt answered 3 times; copy 0 is the N = 1 data, copies 1-2 sampled, distinct."""
    from dflash_jax.generate import generate_ar

    cfg, params = toy_target
    gsm = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": f"p{i} " * (i + 2)} for i in range(3)])
    alpaca = write_jsonl(tmp_path / "alpaca" / "instructions.jsonl",
                         [{"instruction": f"do {i} " * 4} for i in range(2)])
    kw = dict(max_new_tokens=8, max_prompt_tokens=40, batch_size=2, sample_fraction=0.5, temperature=0.7,
              seed=2, math_suffix="never", progress=False)
    compiled = generate_ar._cache_size()
    data = make_token_data(params, cfg, ToyTokenizer(), [gsm, alpaca], samples_per_prompt=3, **kw)
    # One program per sampling mode (greedy, T=0.7) for all 9 batches: every batch has one shape.
    assert generate_ar._cache_size() - compiled <= 2
    single = make_token_data(params, cfg, ToyTokenizer(), [gsm, alpaca], **kw)
    P = 5
    assert len(data) == 3 * P and data.meta["samples_per_prompt"] == 3 and data.meta["prompts"] == P
    assert single.meta["samples_per_prompt"] == 1 and single.prompt_id.tolist() == list(range(P))
    assert data.prompt_id.tolist() == list(range(P)) * 3
    for i in range(P):
        rows = np.flatnonzero(data.prompt_id == i)
        assert rows.tolist() == [i, P + i, 2 * P + i]  # copy-major
        for r in rows:  # the same prompt and source in every copy
            assert data.prompt(r).tolist() == single.prompt(i).tolist() and data.source[r] == single.source[i]
    # Copy 0 is the greedy / sampled mix of samples_per_prompt=1, response for response.
    for i in range(P):
        assert data.response(i).tolist() == single.response(i).tolist()
    np.testing.assert_array_equal(data.temperature[:P], single.temperature)
    assert set(single.temperature.tolist()) == {0.0, float(np.float32(0.7))}  # both kinds of batch
    # Copies 1 and 2 are sampled at --gen-temperature, with their own streams.
    assert (data.temperature[P:] == np.float32(0.7)).all()
    copy1 = [data.response(P + i).tolist() for i in range(P)]
    copy2 = [data.response(2 * P + i).tolist() for i in range(P)]
    assert sum(a != b for a, b in zip(copy1, copy2)) >= 3, (copy1, copy2)
    assert copy1 != [single.response(i).tolist() for i in range(P)]
    # The token file keeps the prompt ids and the meta.
    loaded = TokenData.load(data.save(tmp_path / "tokens.npz"))
    np.testing.assert_array_equal(loaded.prompt_id, data.prompt_id)
    assert loaded.meta["samples_per_prompt"] == 3
    rows = build_sequences(loaded, seq_len=48)  # rows keep their prompt id past dropped short responses
    kept = [i for i in range(len(data)) if len(data.response(i)) >= 2]
    np.testing.assert_array_equal(rows.prompt_ids, data.prompt_id[kept])


def test_make_token_data_reads_file_row_limits(tmp_path, toy_target):
    """"FILE:N" reads N of FILE's prompts; --limit caps every file, the smaller cap winning."""
    cfg, params = toy_target
    gsm = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": f"q{i} " * 2} for i in range(6)])
    alpaca = write_jsonl(tmp_path / "alpaca" / "instructions.jsonl", [{"instruction": f"i{i} " * 2} for i in range(6)])
    data = make_token_data(params, cfg, ToyTokenizer(), [f"{gsm}:2", alpaca, f"{alpaca}:5"], limit=3,
                           max_new_tokens=4, max_prompt_tokens=40, batch_size=4, math_suffix="never",
                           progress=False)
    assert data.source.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert data.meta["sources"] == [f"{gsm}:2", str(alpaca), f"{alpaca}:5"]
    tok = ToyTokenizer()
    assert data.prompt(1).tolist() == tok.apply_chat_template([{"content": "q1 " * 2}])
    assert data.prompt(7).tolist() == tok.apply_chat_template([{"content": "i2 " * 2}])


def test_samples_per_prompt_refused_below_one(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match="--samples-per-prompt.*got 0"):
        make_token_data(None, None, ToyTokenizer(), [gsm], samples_per_prompt=0)


def test_old_token_file_without_prompt_ids_loads(tmp_path):
    """A file written before samples_per_prompt (no prompt_id array): each row its own prompt."""
    data = TokenData.from_lists([[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [1], [2, 3]], [0.0, 1.0, 0.0], [0, 0, 1],
                                {"sources": ["a", "b"]})
    path = tmp_path / "old.npz"
    np.savez(path, prompt_tokens=data.prompt_tokens, prompt_offsets=data.prompt_offsets,
             response_tokens=data.response_tokens, response_offsets=data.response_offsets,
             temperature=data.temperature, source=data.source,
             meta=np.array(json.dumps({"format": "dflash-jax/train-tokens", "version": 1, "sources": ["a", "b"]})))
    with np.load(path) as z:
        assert "prompt_id" not in z.files
    loaded = TokenData.load(path)
    assert loaded.prompt_id.tolist() == [0, 1, 2] and loaded.response(2).tolist() == [2, 3]
    rows = build_sequences(loaded, seq_len=8)  # row 1 (1-token response) dropped
    assert rows.prompt_ids.tolist() == [0, 2]
    train, val = split_by_prompt(rows.prompt_ids, 0.5, seed=0)
    assert len(train) == len(val) == 1


def test_split_by_prompt_is_disjoint_deterministic_and_sized():
    rng = np.random.default_rng(0)
    prompt_ids = rng.permutation(np.repeat(np.arange(200), 3))  # 3 samples per prompt, shuffled rows
    prompt_ids = np.delete(prompt_ids, [5, 17, 40])  # a few samples dropped (short rows)
    for fraction in (0.02, 0.1, 0.33):
        train, val = split_by_prompt(prompt_ids, fraction, seed=7)
        assert np.intersect1d(prompt_ids[train], prompt_ids[val]).size == 0  # no prompt on both sides
        assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(prompt_ids)))
        assert abs(len(np.unique(prompt_ids[val])) - fraction * 200) <= 1
        again = split_by_prompt(prompt_ids, fraction, seed=7)
        np.testing.assert_array_equal(again[1], val)
    assert split_by_prompt(prompt_ids, 0.1, seed=8)[1].tolist() != split_by_prompt(prompt_ids, 0.1, seed=7)[1].tolist()
    train, val = split_by_prompt(prompt_ids, 0.0, seed=7)
    assert len(val) == 0 and train.tolist() == list(range(len(prompt_ids)))
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"--val-fraction.*\[0, 1\)"):
            split_by_prompt(prompt_ids, bad, seed=0)
    with pytest.raises(ValueError, match="--val-fraction.*no validation rows"):
        split_by_prompt(prompt_ids, 0.001, seed=0)
    with pytest.raises(ValueError, match="--val-fraction.*no training rows"):
        split_by_prompt(np.array([0, 0, 1, 1]), 0.8, seed=0)


def test_cli_refuses_bad_sampling_and_split_flags(tmp_path, capsys):
    """One error naming the flag, before any model is loaded."""
    from dflash_jax.cli import main

    cases = [(["make-data", "--out", str(tmp_path / "t.npz"), "--samples-per-prompt", "0"], "--samples-per-prompt"),
             (["train", "--out", str(tmp_path / "r"), "--val-fraction", "1.0"], "--val-fraction"),
             (["train", "--out", str(tmp_path / "r"), "--val-fraction", "-0.5"], "--val-fraction"),
             (["train", "--out", str(tmp_path / "r"), "--val-fraction", "0", "--keep-best"], "--keep-best"),
             (["train", "--out", str(tmp_path / "r"), "--data-gen", "--samples-per-prompt", "0"],
              "--samples-per-prompt")]
    for argv, flag in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], (argv, err)


def test_math_prompts_get_the_evaluation_suffix(tmp_path):
    """Training prompts are worded as evaluation words them: "auto" suffixes gsm8k-style rows
    (question + answer) exactly as `evaluate.load_bench_prompts` does, and nothing else."""
    from dflash_jax.evaluate import MATH_SUFFIX, load_bench_prompts

    gsm = write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [{"question": "2+2?", "answer": "4"}])
    alpaca = write_jsonl(tmp_path / "alpaca" / "instructions.jsonl", [{"instruction": "say hi"}])
    bare = write_jsonl(tmp_path / "misc" / "questions.jsonl", [{"question": "why?"}])
    assert read_prompts(gsm, math_suffix="auto") == ["2+2?" + MATH_SUFFIX]
    assert read_prompts(gsm, math_suffix="auto") == [p.text for p in load_bench_prompts(gsm)]
    assert read_prompts(alpaca, math_suffix="auto") == ["say hi"]
    assert read_prompts(bare, math_suffix="auto") == ["why?"]  # no answer field: not a math set
    assert read_prompts(gsm, math_suffix="never") == ["2+2?"]
    assert read_prompts(alpaca, math_suffix="always") == ["say hi" + MATH_SUFFIX]
    with pytest.raises(ValueError, match="--math-suffix"):
        read_prompts(gsm, math_suffix="sometimes")
