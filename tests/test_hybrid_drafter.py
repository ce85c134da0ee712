"""z-lab-style Qwen3.5 / Qwen3.6 drafters, and bench / make-data / train on a hybrid target.

Drafter configs: the published Qwen3.6-27B drafters are 5 Qwen3 layers (4 sliding-window, 1 full)
tapping 5 of the target's 64 layers; some write block_size at the top level beside a
`dflash_config` holding mask_token_id and target_layer_ids, others put all three in
`dflash_config`. What each config means is checked against dflash 0.1.0's `DFlashDraftModel`
built from the same dict. The tools run on a tiny random hybrid saved with transformers'
`save_pretrained` (CPU, float32).
"""
from __future__ import annotations

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest
from transformers import Qwen3Config

from convert.dflash_drafter import export_drafter, load_drafter
from dflash_jax import cli
from dflash_jax.bench.common import SHAPES, dense_shape
from dflash_jax.config import ConfigError
from dflash_jax.drafter import DraftConfig, draft_config_from_dict, init_draft_params, validate_pair
from dflash_jax.qwen3_5 import load_qwen35_config
from dflash_jax.train_data import TokenData
from tests.test_convert_qwen3_5 import TEXT, VOCAB, build_causal

dflash_model = pytest.importorskip("dflash.model")

SLIDING, FULL = "sliding_attention", "full_attention"
TAPS_64 = [1, 16, 31, 46, 61]
# A Qwen3.6-27B drafter's config, narrowed (hidden 64, vocab 128) so the reference builds fast.
ZLAB = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
    "layer_types": [SLIDING] * 4 + [FULL], "use_sliding_window": True, "sliding_window": 2048,
    "max_window_layers": 5, "num_target_layers": 64, "tie_word_embeddings": False,
}
SCHEMAS = {
    "block_size_top_level": {**ZLAB, "block_size": 16,
                             "dflash_config": {"mask_token_id": 120, "target_layer_ids": TAPS_64}},
    "all_in_dflash_config": {**ZLAB, "dflash_config": {"block_size": 16, "mask_token_id": 120,
                                                       "target_layer_ids": TAPS_64}},
}


def reference_view(raw: dict) -> dict:
    """What dflash 0.1.0 makes of a drafter config dict: block size, mask, taps, per-layer window
    and causality."""
    model = dflash_model.DFlashDraftModel(Qwen3Config(**copy.deepcopy(raw)))
    attn = [layer.self_attn for layer in model.layers]
    return {"block_size": model.block_size, "mask_token_id": model.mask_token_id,
            "target_layer_ids": tuple(model.target_layer_ids),
            "windows": [a.sliding_window for a in attn], "causal": [a.is_causal for a in attn]}


def our_view(dcfg: DraftConfig) -> dict:
    return {"block_size": dcfg.block_size, "mask_token_id": dcfg.mask_token_id,
            "target_layer_ids": dcfg.target_layer_ids,
            "windows": [dcfg.layer_window(i) for i in range(dcfg.num_layers)],
            "causal": [dcfg.layer_causal(i) for i in range(dcfg.num_layers)]}


def hybrid_64(hidden: int = 64, vocab: int = 128):
    """The qwen3.6-27b shape with the drafter's width, so validate_pair sees 64 hybrid layers."""
    return dataclasses.replace(SHAPES["qwen3.6-27b"], hidden_size=hidden, vocab_size=vocab)


# ----------------------------------------------------------------------------- configs

@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_zlab_qwen36_drafter_config_loads_as_the_reference_reads_it(schema):
    raw = SCHEMAS[schema]
    dcfg = draft_config_from_dict(raw)
    want = reference_view(raw)
    assert our_view(dcfg) == want
    assert want["windows"] == [2048] * 4 + [None] and want["target_layer_ids"] == tuple(TAPS_64)
    assert dcfg.num_target_layers == 64
    validate_pair(dcfg, hybrid_64())


def test_both_schemas_give_the_same_drafter():
    a, b = (draft_config_from_dict(SCHEMAS[s]) for s in sorted(SCHEMAS))
    assert a == b


def test_sliding_layers_without_use_sliding_window_follow_transformers():
    """Qwen3Config drops the window unless use_sliding_window is set: the sliding layers are then
    causal with no window, in the reference and here."""
    raw = {k: v for k, v in SCHEMAS["block_size_top_level"].items() if k != "use_sliding_window"}
    want = reference_view(raw)
    assert want["windows"] == [None] * 5 and want["causal"] == [True] * 4 + [False]
    assert our_view(draft_config_from_dict(raw)) == want


@pytest.mark.parametrize("change,field", [
    ({"dflash_config": {"mask_token_id": 120, "target_layer_ids": "1,16,31"}}, "target_layer_ids"),
    ({"dflash_config": {"mask_token_id": 120, "target_layer_ids": [1, -16]}}, "target_layer_ids"),
    ({"layer_types": [SLIDING] * 4}, "layer_types"),
    ({"layer_types": [SLIDING] * 4 + ["linear_attention"]}, "layer_types"),
    ({"layer_types": "sliding_attention"}, "layer_types"),
    ({"block_size": 0}, "block_size"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"dflash_config": {"target_layer_ids": TAPS_64}}, "mask_token_id"),
])
def test_bad_drafter_config_names_the_field(change, field):
    raw = {**SCHEMAS["block_size_top_level"], **change}
    with pytest.raises(ConfigError, match=field):
        draft_config_from_dict(raw, source="drafter/config.json")


def test_a_tap_past_the_64_layers_is_refused():
    raw = copy.deepcopy(SCHEMAS["all_in_dflash_config"])
    raw["dflash_config"]["target_layer_ids"] = [1, 16, 31, 46, 64]
    dcfg = draft_config_from_dict(raw)
    with pytest.raises(ValueError, match=r"target_layer_ids .* include \[64\], outside the target's 64 layers"):
        validate_pair(dcfg, hybrid_64())


def test_export_writes_both_schemas_and_loads_in_the_reference(tmp_path):
    """A sliding-window drafter over 64 target layers -> export -> our loader gives the same config
    and weights; dflash 0.1.0 loads the weights and reads the config as we do; the file carries
    block_size / mask_token_id / target_layer_ids at the top level and in dflash_config."""
    dcfg = draft_config_from_dict(SCHEMAS["block_size_top_level"])
    params = init_draft_params(dcfg, jax.random.key(0), training=True)
    out = export_drafter(dcfg, params, tmp_path / "drafter")
    written = json.loads((out / "config.json").read_text())
    for key, value in (("block_size", 16), ("mask_token_id", 120), ("target_layer_ids", TAPS_64)):
        assert written[key] == written["dflash_config"][key] == value, key
    back, back_params = load_drafter(out, training=True)
    assert back == dcfg
    for x, y in zip(jax.tree.leaves(back_params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Each schema alone (the other's keys removed) still reads the same.
    top_only = {k: v for k, v in written.items() if k != "dflash_config"}
    nested_only = {k: v for k, v in written.items() if k not in ("block_size", "mask_token_id", "target_layer_ids")}
    for raw in (top_only, nested_only):
        assert draft_config_from_dict(raw) == dcfg
        assert reference_view(raw) == our_view(dcfg)
    model = dflash_model.DFlashDraftModel.from_pretrained(out)
    assert (model.block_size, model.mask_token_id, list(model.target_layer_ids)) == (16, 120, TAPS_64)
    assert [layer.self_attn.sliding_window for layer in model.layers] == [2048] * 4 + [None]
    fc = np.asarray(params.fc)  # ours is [taps*embed, embed], the reference's Linear [embed, taps*embed]
    np.testing.assert_array_equal(model.fc.weight.detach().numpy().T, fc)


# ----------------------------------------------------------------------------- bench shapes

def test_shapes_hold_the_hybrids_and_dense_tools_refuse_them():
    big = SHAPES["qwen3.6-27b"]
    assert (big.num_layers, len(big.gdn_layers), len(big.attn_layers)) == (64, 48, 16)
    assert (big.hidden_size, big.head_dim, big.rotary_dim, big.gdn_value_heads) == (5120, 256, 64, 48)
    tiny = SHAPES["tiny-hybrid"]
    assert tiny.gdn_key_heads < tiny.gdn_value_heads and tiny.num_layers == 8
    assert dense_shape("tiny", "lowered") is SHAPES["tiny"]
    with pytest.raises(ValueError, match=r"lowered: model shape 'tiny-hybrid' is a Qwen3.5 / Qwen3.6 hybrid"):
        dense_shape("tiny-hybrid", "lowered")
    with pytest.raises(ValueError, match="unknown model shape 'nope'"):
        dense_shape("nope", "tensor_parallel")


# ----------------------------------------------------------------------------- tools on a hybrid

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny saved hybrid (3 GDN : 1 attention, twice) with a word-level tokenizer, and a random
    block-4 drafter for it exported in z-lab's layout."""
    root = tmp_path_factory.mktemp("hybrid")
    path, _ = build_causal(root, "target", num_hidden_layers=8, tie_word_embeddings=False)
    dcfg = DraftConfig(hidden_size=TEXT["hidden_size"], intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, vocab_size=VOCAB, mask_token_id=VOCAB - 1,
                       target_layer_ids=(1, 3), num_target_layers=8, block_size=4,
                       layer_types=(SLIDING, FULL), sliding_window=6)
    draft = export_drafter(dcfg, init_draft_params(dcfg, jax.random.key(3), training=True), root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi w1 w2", "w5 w6", "hi w9 w9 w3")))
    return path, draft, prompts


def test_bench_runs_ar_dflash_ddtree_on_a_hybrid(hybrid, tmp_path, capsys):
    path, draft, prompts = hybrid
    code = cli.main(["bench", "--model", str(path), "--draft", str(draft), "--prompts", str(prompts),
                     "--method", "ar", "dflash", "ddtree", "--budget", "4", "--max-new-tokens", "12",
                     "--no-progress", "--out", str(tmp_path / "bench")])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    methods = report["methods"]
    assert sorted(methods) == ["ar", "ddtree(bs=4,budget=4)", "dflash(bs=4)"]
    for name, rec in methods.items():
        assert rec["tokens"] == 3 * 12, name  # no eos in this vocabulary: every prompt runs to the end
        if name != "ar":
            # Greedy speculative decoding on the hybrid is lossless, and tau counts the bonus token.
            assert rec["matches_ar"] == 1.0 and 1.0 <= rec["tau"] <= 4.0, name
            assert rec["rounds"] >= 3 * 12 / 4, name
    assert (tmp_path / "bench" / "report.json").is_file()


def test_make_data_and_train_on_a_hybrid(hybrid, tmp_path, capsys):
    """make-data answers with the hybrid's own AR decoding; train runs steps against the hybrid's
    taps, logs finite losses, checkpoints and exports a drafter that loads for this target; with
    --dp 2 it gives the same losses and weights."""
    path, _, prompts = hybrid
    data = tmp_path / "tokens.npz"
    code = cli.main(["make-data", "--target", str(path), "--prompts", str(prompts), "--out", str(data),
                     "--gen-tokens", "24", "--gen-batch", "3", "--sample-fraction", "0", "--math-suffix", "never"])
    err = capsys.readouterr().err
    assert code == 0, err
    tokens = TokenData.load(data)
    assert len(tokens) == 3 and len(tokens.response_tokens) == 3 * 24

    def train(run, *extra: str) -> list[float]:
        code = cli.main(["train", "--target", str(path), "--out", str(run), "--data", str(data), "--steps", "6",
                         "--batch", "2", "--seq-len", "32", "--blocks", "2", "--block-size", "4", "--layers", "2",
                         "--mask-token-id", str(VOCAB - 1), "--lr", "3e-3", "--warmup", "0.0", "--log-every", "1",
                         "--save-every", "3", "--val-fraction", "0", "--compute-dtype", "float32", "--no-progress",
                         *extra])
        out = capsys.readouterr()
        assert code == 0, out.err
        log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        return [r["loss"] for r in log if "loss" in r]

    losses = train(tmp_path / "run")
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert min(losses[3:]) < losses[0]  # six steps at a high rate on 3 sequences: it learns something
    assert (tmp_path / "run" / "checkpoints").is_dir()
    dcfg, dparams = load_drafter(tmp_path / "run" / "drafter")
    assert dcfg.num_target_layers == 8 and dcfg.block_size == 4
    validate_pair(dcfg, load_qwen35_config(path))
    # The batch split over 2 (fake CPU) devices: the same run, the hybrid's taps computed per shard.
    np.testing.assert_allclose(train(tmp_path / "run_dp2", "--dp", "2"), losses, rtol=1e-4)
    _, dp2 = load_drafter(tmp_path / "run_dp2" / "drafter")
    for x, y in zip(jax.tree.leaves(dp2), jax.tree.leaves(dparams)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- ar_decode on a hybrid

def test_ar_decode_steps_the_hybrid_as_generate_does():
    """ar_decode's timed loop on a hybrid is real decoding: from a prefilled cache, its greedy
    steps reach the token `qwen3_5.generate` reaches; the tool's rows come out for tiny-hybrid."""
    import jax.numpy as jnp

    from dflash_jax import qwen3_5 as q35
    from dflash_jax.bench import ar_decode

    cfg = SHAPES["tiny-hybrid"]
    params = q35.init_params(cfg, jax.random.key(4))
    prompt = jnp.asarray([[5, 9, 2, 7, 7, 1]], jnp.int32)
    lens = jnp.asarray([6], jnp.int32)
    tokens, _ = q35.generate(params, cfg, prompt, lens, jax.random.key(0), max_new_tokens=5, max_len=32)
    cache = q35.HybridCache.create(cfg, 1, 32)
    cache = q35.forward(params, cfg, prompt, jnp.arange(6, dtype=jnp.int32)[None], cache).cache
    cache, last = ar_decode.make_decoder(cfg, 4, "reference")(params, cache, tokens[:, 0])
    assert int(last[0]) == int(tokens[0, 4]) and int(cache.lengths[0]) == 6

    rows = ar_decode.bench_model("tiny-hybrid", [16], 2, ["reference", "interpret"], 1e11)
    assert [(r["model"], r["attn"], r["ctx"]) for r in rows] == [("tiny-hybrid", "reference", 16),
                                                                  ("tiny-hybrid", "interpret", 16)]
    assert rows[0]["ms_per_token"] > 0 and rows[0]["kv_gb_read"] > 0
