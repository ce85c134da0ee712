"""The real SmolLM2-135M-Instruct (GGUF, Q4_1) against transformers loading the same file."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from convert.gguf_file import gguf_tokenizer, load_gguf, smollm2_gguf_path
from dflash_jax.generate import generate_ar
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import forward_jit as forward
from dflash_jax.pipeline import encode_prompts, pad_prompts, stop_tokens_for

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
NEW_TOKENS = 64


def shared_prompts() -> list[str]:
    """Five prompts: three gsm8k test questions and two spec_bench first turns."""
    gsm = [json.loads(l)["question"] for l in (DATA / "gsm8k" / "test.jsonl").open()][:3]
    spec = [json.loads(l)["turns"][0] for l in (DATA / "spec_bench" / "question.jsonl").open()]
    return gsm + [spec[0], spec[100]]


@pytest.fixture(scope="module")
def smollm2(smollm2_hf):
    path = smollm2_gguf_path()
    cfg, params = load_gguf(path, dtype=jnp.float32)
    return cfg, params, gguf_tokenizer(path), smollm2_hf


def test_float32_logits_match_transformers_on_the_same_gguf(smollm2):
    cfg, params, tok, hf = smollm2
    ids = tok("The capital of France is a city where", return_tensors="np")["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    n = ids.shape[1]
    out = forward(params, cfg, jnp.asarray(ids), jnp.arange(n)[None],
                  KVCache.create(cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim))
    err = np.abs(np.asarray(out.logits) - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, err
    assert (np.asarray(out.logits).argmax(-1) == ref.argmax(-1)).all()


def test_greedy_chat_completions_equal_transformers_generate(smollm2):
    """Five chat prompts from ../shared/data, batched together, 64 greedy tokens each."""
    cfg, params, tok, hf = smollm2
    prompts = shared_prompts()
    token_lists = encode_prompts(tok, prompts)
    arr, lens = pad_prompts(token_lists)
    stop = stop_tokens_for(tok, cfg)
    gen = generate_ar(params, cfg, jnp.asarray(arr), jnp.asarray(lens), jax.random.key(0),
                      max_new_tokens=NEW_TOKENS, max_len=arr.shape[1] + NEW_TOKENS + 8, stop_tokens=stop)
    for b, ids in enumerate(token_lists):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=list(stop), pad_token_id=tok.pad_token_id or 0)[0, len(ids):].tolist()
        n = int(gen.num_tokens[b])
        assert np.asarray(gen.tokens[b, :n]).tolist() == ref, f"prompt {b}: {prompts[b][:60]!r}"
