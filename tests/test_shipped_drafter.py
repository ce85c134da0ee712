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

from convert.dflash_drafter import WEIGHTS_FILE, load_drafter
from convert.layout import ConversionError
from convert.shipped import DFLASH, MTP, SHIPPED, resolve_shipped
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
    weights = resolve_shipped("smollm2", DFLASH) / WEIGHTS_FILE
    assert weights.stat().st_size <= 40e6
    validate_pair(dcfg, cfg)  # hidden size, vocabulary, mask id, taps
    assert dcfg.block_size == 16


def reference_to_ours(name: str, w: np.ndarray, dcfg) -> tuple[str, np.ndarray]:
    """A PyTorch-layout tensor of `DFlashDraftModel` -> (our parameter path, the array in our
    layout). Written from the two layouts' definitions, not from our converter's table."""
    e, h, kv, d = dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim
    top = {"fc.weight": ("fc", lambda w: w.T), "hidden_norm.weight": ("hidden_norm", lambda w: w),
           "norm.weight": ("final_norm", lambda w: w)}
    if name in top:
        path, f = top[name]
        return path, f(w)
    _, i, *rest = name.split(".")
    part = ".".join(rest)
    per_layer = {
        "input_layernorm.weight": ("attn_norm", lambda w: w),
        "post_attention_layernorm.weight": ("mlp_norm", lambda w: w),
        "self_attn.q_proj.weight": ("attn.q", lambda w: w.T.reshape(e, h, d)),  # [h*d, e] -> [e, h, d]
        "self_attn.k_proj.weight": ("attn.k", lambda w: w.T.reshape(e, kv, d)),
        "self_attn.v_proj.weight": ("attn.v", lambda w: w.T.reshape(e, kv, d)),
        "self_attn.o_proj.weight": ("attn.o", lambda w: w.T.reshape(h, d, e)),  # [e, h*d] -> [h, d, e]
        "self_attn.q_norm.weight": ("attn.q_norm", lambda w: w),
        "self_attn.k_norm.weight": ("attn.k_norm", lambda w: w),
        "mlp.gate_proj.weight": ("mlp.gate", lambda w: w.T),  # [f, e] -> [e, f]
        "mlp.up_proj.weight": ("mlp.up", lambda w: w.T),
        "mlp.down_proj.weight": ("mlp.down", lambda w: w.T),  # [e, f] -> [f, e]
    }
    path, f = per_layer[part]
    return f"layers.{i}.{path}", f(w)


def test_dflash_reference_loads_the_same_weights(smollm2_and_drafter):
    """Every tensor dflash 0.1.0 loads equals, element for element, the one our loader put at
    its place: a transposed, swapped or misplaced tensor fails here."""
    from dflash_jax.params import path_str

    dflash_model = pytest.importorskip("dflash.model")
    *_, dcfg, _ = smollm2_and_drafter
    _, dparams = load_drafter("smollm2", jnp.float32, training=True)  # one array per checkpoint tensor
    model = dflash_model.DFlashDraftModel.from_pretrained(resolve_shipped("smollm2", DFLASH)).float()
    ours = {path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(dparams)[0]}
    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    seen = set()
    for name, w in theirs.items():
        path, expected = reference_to_ours(name, w, dcfg)
        assert path in ours, (name, path, sorted(ours))
        assert ours[path].shape == expected.shape, (name, ours[path].shape, expected.shape)
        np.testing.assert_array_equal(ours[path], expected, err_msg=f"{name} -> {path}")
        seen.add(path)
    assert seen == set(ours), sorted(set(ours) - seen)


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


def test_shipped_mtp_head_is_small_lossless_and_accepts(smollm2_and_drafter):
    """The MTP head shipped beside the drafter: at most 30 MB, read by its short name, and a
    greedy MTP chain and MTP tree with it give AR's tokens with drafts accepted."""
    from convert.mtp import FILE, hidden_source_of, load_mtp
    from dflash_jax.mtp import MTPConfig

    cfg, params, tok, _, _ = smollm2_and_drafter
    assert (resolve_shipped("smollm2", MTP) / FILE).stat().st_size <= 30e6
    mcfg = MTPConfig(cfg, hidden_source=hidden_source_of("smollm2"))
    mparams = load_mtp("smollm2", cfg, jnp.float32)
    questions = [json.loads(l)["question"] for l in (DATA / "gsm8k" / "test.jsonl").open()][2:4]
    prompts, lens = pad_prompts(encode_prompts(tok, questions))
    stop = stop_tokens_for(tok, cfg)
    ar = run_ar(params, cfg, prompts, lens, max_new_tokens=NEW, sampling=SamplingParams(), stop_tokens=stop)
    for steps, budget in ((2, 0), (3, 8)):
        s = SpecSettings(method="mtp", mtp_steps=steps, budget=budget, max_new_tokens=NEW, stop_tokens=stop)
        run = run_speculative(params, cfg, mparams, mcfg, prompts, lens, s)
        assert run.token_lists() == ar.token_lists(), (steps, budget)
        # Trained: more than one token a round on math prompts (a random head gives about 1.0).
        assert run.acceptance()["tau"] > 1.3, (steps, budget, run.acceptance()["tau"])


def test_every_shipped_name_resolves_to_its_artifact_and_a_path_to_itself(tmp_path):
    """One table for both kinds: each short name is a directory holding its kind's files; a path
    that exists is returned as given, whatever its name."""
    files = {DFLASH: ("config.json", WEIGHTS_FILE), MTP: ("mtp.safetensors",)}
    assert set(SHIPPED) == set(files)
    for kind, names in SHIPPED.items():
        for name in names:
            where = resolve_shipped(name, kind, "--draft")
            assert where.parent.name == "drafters" and where.parent.parent.name == "dflash_jax", where
            assert all((where / f).is_file() for f in files[kind]), (kind, name)
    assert resolve_shipped("smollm2", DFLASH) != resolve_shipped("smollm2", MTP)
    assert resolve_shipped(tmp_path, MTP) == tmp_path
    assert resolve_shipped(str(tmp_path), DFLASH, "--init") == tmp_path


def test_an_unknown_name_is_one_error_naming_the_argument_and_the_known_names(tmp_path):
    with pytest.raises(ConversionError, match=r"^--init smollm3: no such file or directory, and not the name of "
                                              r"a shipped DFlash drafter \(known: smollm2\)$"):
        resolve_shipped("smollm3", DFLASH, "--init")
    with pytest.raises(ConversionError, match=r"^--mtp-head .*nowhere: .*shipped MTP head \(known: smollm2\)$"):
        resolve_shipped(str(tmp_path / "nowhere"), MTP, "--mtp-head")
    with pytest.raises(ValueError, match="kind must be one of"):
        resolve_shipped("smollm2", "eagle")
    with pytest.raises(ConversionError, match="^path smollm3: "):  # the loaders' own argument
        load_drafter("smollm3")
