"""The drafter shipped for SmolLM2-135M-Instruct: loadable by us and by dflash 0.1.0, and useful.

Runs the real 135M target (float32, CPU): the committed artifact is what `make demo` uses, so
this is where the real model proves something: DDTree and DFlash with it are token-identical
to AR, and the drafter gets more than one token accepted per round.
"""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.dflash_drafter import WEIGHTS_FILE, load_drafter, shipped_drafter_path
from convert.gguf_file import gguf_tokenizer, load_gguf, smollm2_gguf_path
from dflash_jax.drafter import validate_pair
from dflash_jax.pipeline import encode_prompts, pad_prompts, run_ar, run_speculative, stop_tokens_for
from dflash_jax.sampling import SamplingParams
from dflash_jax.speculative import SpecSettings

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
NEW = 48


@pytest.fixture(scope="module")
def smollm2_and_drafter():
    path = smollm2_gguf_path()
    cfg, params = load_gguf(path, dtype=jnp.float32)
    dcfg, dparams = load_drafter("smollm2", jnp.float32)
    return cfg, params, gguf_tokenizer(path), dcfg, dparams


def test_artifact_is_small_and_matches_the_target(smollm2_and_drafter):
    cfg, _, _, dcfg, _ = smollm2_and_drafter
    weights = shipped_drafter_path("smollm2") / WEIGHTS_FILE
    assert weights.stat().st_size <= 40e6
    validate_pair(dcfg, cfg)  # hidden size, vocabulary, mask id, taps
    assert dcfg.block_size == 16


def test_dflash_reference_loads_the_same_weights(smollm2_and_drafter):
    dflash_model = pytest.importorskip("dflash.model")
    _, dparams = load_drafter("smollm2", jnp.float32, training=True)  # one array per checkpoint tensor
    model = dflash_model.DFlashDraftModel.from_pretrained(shipped_drafter_path("smollm2")).float()
    theirs = sorted(float(np.abs(t.detach().numpy()).sum()) for t in model.state_dict().values())
    ours = sorted(float(np.abs(np.asarray(a)).sum()) for a in jax.tree.leaves(dparams))
    assert len(theirs) == len(ours)
    np.testing.assert_allclose(theirs, ours, rtol=1e-6)


def test_speculative_with_the_shipped_drafter_is_lossless_and_accepts(smollm2_and_drafter):
    cfg, params, tok, dcfg, dparams = smollm2_and_drafter
    questions = [json.loads(l)["question"] for l in (DATA / "gsm8k" / "test.jsonl").open()][:2]
    prompts, lens = pad_prompts(encode_prompts(tok, questions))
    stop = stop_tokens_for(tok, cfg)
    ar = run_ar(params, cfg, prompts, lens, max_new_tokens=NEW, sampling=SamplingParams(), stop_tokens=stop)
    for method, budget in (("dflash", 0), ("ddtree", 16)):
        s = SpecSettings(method=method, block_size=dcfg.block_size, budget=max(budget, 1),
                         max_new_tokens=NEW, stop_tokens=stop)
        run = run_speculative(params, cfg, dparams, dcfg, prompts, lens, s)
        assert run.token_lists() == ar.token_lists(), method
        # A trained drafter: well over one token per round on math prompts (random weights give 1.0).
        assert run.acceptance()["tau"] > 1.5, (method, run.acceptance()["tau"])
