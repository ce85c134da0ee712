"""The DFlash drafter against z-lab's dflash 0.1.0 (`DFlashDraftModel`), on CPU in float32.

The reference is driven the way `dflash.model.dflash_generate` drives it: a DynamicCache built
from the drafter config (sliding layers get a sliding-window cache), one forward per round over
(new context features + the noise block), then a crop back to the committed length.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from convert.dflash_drafter import export_drafter, load_drafter
from convert.hf_safetensors import load_hf
from convert.layout import ConversionError
from dflash_jax.config import ConfigError, default_tap_layers
from dflash_jax.drafter import (DraftCache, append_context, draft, draft_config_from_dict,
                                draft_checkpoint_specs, draft_logits, draft_param_layout, load_draft_config, make_block,
                                validate_pair)
from dflash_jax.params import Spec, assemble, cast_floating, is_spec

dflash_model = pytest.importorskip("dflash.model")

HIDDEN, VOCAB, TARGET_LAYERS, MASK = 64, 128, 5, 127
TAPS = (0, 2)
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention"]
MAX_LEN = 40


def _draft_hf_config(block_size: int = 8, **overrides) -> Qwen3Config:
    fields = dict(
        hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, vocab_size=VOCAB, layer_types=LAYER_TYPES,
        use_sliding_window=True, sliding_window=4, max_position_embeddings=256,
        num_target_layers=TARGET_LAYERS,
        dflash_config={"target_layer_ids": list(TAPS), "mask_token_id": MASK, "block_size": block_size},
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Weights big enough that attention is far from uniform; norms away from 1 so they matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Qwen3 target, converted by `convert`; the drafter uses its embedding and head."""
    cfg = Qwen3Config(hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=VOCAB,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    _randomise(model, seed=1)
    directory = tmp_path_factory.mktemp("target")
    model.save_pretrained(directory)
    tcfg, tparams = load_hf(directory)
    return model, tcfg, tparams


def _make_drafter(tmp_path, seed: int = 2, **cfg_overrides):
    torch.manual_seed(seed)
    model = dflash_model.DFlashDraftModel(_draft_hf_config(**cfg_overrides)).eval()
    _randomise(model, seed)
    model.save_pretrained(tmp_path)
    dcfg, dparams = load_drafter(tmp_path)
    return model, dcfg, dparams


class ReferenceDrafter:
    """One sequence of the reference drafter, used exactly as dflash_generate uses it."""

    def __init__(self, model, target):
        self.model, self.target = model, target
        self.cache = dflash_model._make_cache(model.config)

    @torch.no_grad()
    def round(self, taps: np.ndarray, start: int, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """taps [n, taps*hidden] for positions start-n .. start-1; block [width] tokens.

        Returns (hidden [width, hidden], logits [width-1, vocab])."""
        width = block.shape[0]
        scale = float(dflash_model._draft_value(self.model.config, "input_embedding_scale", 1.0))
        noise = dflash_model._raw_input_embeddings(self.target, torch.tensor(block)[None], scale)
        positions = torch.arange(start - taps.shape[0], start + width)[None]
        hidden = self.model(target_hidden=torch.tensor(taps)[None], noise_embedding=noise,
                            position_ids=positions, past_key_values=self.cache, use_cache=True)
        dflash_model._crop_to(self.cache, start)
        logits = self.model.compute_logits(hidden[:, 1:], dflash_model._output_head(self.target))
        return hidden[0].numpy(), logits[0].numpy()


def _rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


_append = jax.jit(append_context, static_argnums=(1,))
_draft = jax.jit(draft, static_argnums=(1,), static_argnames=("attn_impl",))
_logits = jax.jit(draft_logits, static_argnums=(1,))


# name -> drafter config overrides; block sizes 8 > window 4 and 4 == window.
VARIANTS = {
    "default": dict(block_size=8),
    # The same through the Pallas tree-attention kernel, interpreted on CPU.
    "pallas_interpret": dict(block_size=8),
    "yarn": dict(block_size=4, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 64}),
    # Causal full layers, biases, and every dflash_config scalar away from its default.
    "causal_extras": dict(block_size=8, is_causal=True, attention_bias=True, dflash_config={
        "target_layer_ids": list(TAPS), "mask_token_id": MASK, "block_size": 8,
        "input_embedding_scale": 1.5, "output_multiplier": 0.7, "final_logit_softcapping": 3.0}),
    # is_causal False: the sliding layer becomes a bidirectional window.
    "bidirectional_window": dict(block_size=8, is_causal=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_over_rounds(tmp_path, target, variant):
    """Two sequences of different lengths, three rounds (the last with a shortened block)."""
    t_model, tcfg, tparams = target
    model, dcfg, dparams = _make_drafter(tmp_path, **VARIANTS[variant])
    attn_impl = "interpret" if variant == "pallas_interpret" else "reference"
    validate_pair(dcfg, tcfg)
    bs = dcfg.block_size
    rng = np.random.default_rng(3)
    feat = lambda n: rng.standard_normal((n, len(TAPS) * HIDDEN)).astype(np.float32)  # noqa: E731
    # Per sequence: context lengths appended per round, and the block length of each round.
    appended = [(10, 3, 2), (7, 5, 4)]
    block_lens = [(bs, bs, 3), (bs, bs, bs)]
    refs = [ReferenceDrafter(model, t_model) for _ in range(2)]
    cache = DraftCache.create(dcfg, batch=2, max_len=MAX_LEN)
    lengths = np.zeros(2, np.int64)
    for rnd in range(3):
        counts = np.array([appended[b][rnd] for b in range(2)])
        # Scratch rows (NaN) past every count, reaching beyond the block's slots too.
        width = int(counts.max()) + bs + 1
        taps = np.full((2, width, len(TAPS) * HIDDEN), np.nan, np.float32)
        seq_taps = [feat(int(c)) for c in counts]
        for b in range(2):
            taps[b, :counts[b]] = seq_taps[b]
        positions = lengths[:, None] + np.arange(width)
        cache = _append(dparams, dcfg, cache, jnp.asarray(taps), jnp.asarray(positions, jnp.int32),
                        jnp.asarray(counts, jnp.int32))
        lengths = lengths + counts
        np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)

        roots = rng.integers(0, VOCAB - 1, size=2)
        block = np.asarray(make_block(dcfg, jnp.asarray(roots, jnp.int32)))
        block_len = np.array([block_lens[b][rnd] for b in range(2)])
        hidden = _draft(dparams, dcfg, tparams, cache, jnp.asarray(block),
                        jnp.asarray(lengths, jnp.int32), jnp.asarray(block_len, jnp.int32),
                        attn_impl=attn_impl)
        logits = np.asarray(_logits(dparams, dcfg, tparams, hidden))
        hidden = np.asarray(hidden)
        assert hidden.shape == (2, bs, HIDDEN) and logits.shape == (2, bs - 1, VOCAB)
        for b in range(2):
            n = int(block_len[b])
            ref_hidden, ref_logits = refs[b].round(seq_taps[b], int(lengths[b]), block[b, :n])
            assert _rel_err(hidden[b, :n], ref_hidden) <= 1e-5, (variant, rnd, b)
            assert _rel_err(logits[b, :n - 1], ref_logits) <= 1e-5, (variant, rnd, b)


def test_block_len_none_equals_full_block(tmp_path, target):
    _, _, tparams = target
    _, dcfg, dparams = _make_drafter(tmp_path)
    cache = DraftCache.create(dcfg, batch=1, max_len=MAX_LEN)
    taps = jax.random.normal(jax.random.key(0), (1, 6, len(TAPS) * HIDDEN))
    cache = _append(dparams, dcfg, cache, taps, jnp.arange(6)[None], jnp.array([6]))
    block = make_block(dcfg, jnp.array([5]))
    full = _draft(dparams, dcfg, tparams, cache, block, cache.lengths, jnp.array([dcfg.block_size]))
    plain = _draft(dparams, dcfg, tparams, cache, block, cache.lengths)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(full), rtol=1e-6, atol=1e-6)


def test_bfloat16_runs_close_to_float32(tmp_path, target):
    """The GPU dtype: bf16 weights, context cache and activations; float32 softmax and logits."""
    _, _, tparams = target
    _make_drafter(tmp_path)
    taps = np.random.default_rng(0).standard_normal((1, 9, len(TAPS) * HIDDEN)).astype(np.float32)
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        dcfg, dparams = load_drafter(tmp_path, dtype=dtype)
        tp = cast_floating(tparams, dtype)
        cache = DraftCache.create(dcfg, batch=1, max_len=MAX_LEN, dtype=dtype)
        cache = _append(dparams, dcfg, cache, jnp.asarray(taps, dtype), jnp.arange(9)[None], jnp.array([9]))
        hidden = _draft(dparams, dcfg, tp, cache, make_block(dcfg, jnp.array([5])), cache.lengths)
        assert hidden.dtype == dtype
        out[dtype] = np.asarray(_logits(dparams, dcfg, tp, hidden))
    assert out[jnp.bfloat16].dtype == np.float32 and np.isfinite(out[jnp.bfloat16]).all()
    assert _rel_err(out[jnp.bfloat16], out[jnp.float32]) < 0.05


# ----------------------------------------------------------------------------- config


def test_config_fields_and_precedence():
    raw = _draft_hf_config(block_size=8).to_dict()
    raw["block_size"] = 4  # dflash_config wins over the top level
    raw["mask_token_id"] = 3
    dcfg = draft_config_from_dict(raw)
    assert (dcfg.block_size, dcfg.mask_token_id, dcfg.target_layer_ids) == (8, MASK, TAPS)
    assert dcfg.layer_causal(0) is False and dcfg.layer_window(0) is None
    assert dcfg.layer_causal(1) is True and dcfg.layer_window(1) == 4
    hash(dcfg)

    raw = _draft_hf_config(dflash_config={"mask_token_id": MASK}, num_target_layers=36).to_dict()
    dcfg = draft_config_from_dict(raw)
    model = dflash_model.DFlashDraftModel(Qwen3Config(**raw))
    # One tap per DRAFT layer by default, as the reference does.
    assert dcfg.target_layer_ids == tuple(model.target_layer_ids) == default_tap_layers(36, 3)
    assert dcfg.block_size == model.block_size == 16


@pytest.mark.parametrize("field", ["num_target_layers", "hidden_size", "mask_token_id"])
def test_config_missing_field(tmp_path, field):
    raw = _draft_hf_config().to_dict()
    raw.pop(field, None)
    raw["dflash_config"].pop(field, None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"{field}.*missing") as err:
        load_draft_config(tmp_path)
    assert "config.json" in str(err.value)


def test_validate_pair_errors(tmp_path, target):
    _, tcfg, _ = target
    dcfg = draft_config_from_dict(_draft_hf_config().to_dict())
    validate_pair(dcfg, tcfg)
    with pytest.raises(ValueError, match="hidden_size 64 != target hidden_size 32"):
        validate_pair(dcfg, dataclasses.replace(tcfg, hidden_size=32))
    with pytest.raises(ValueError, match="vocab_size 128 != target vocab_size 256"):
        validate_pair(dcfg, dataclasses.replace(tcfg, vocab_size=256))
    with pytest.raises(ValueError, match="mask_token_id 200 is outside"):
        validate_pair(dataclasses.replace(dcfg, mask_token_id=200), tcfg)
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 2\] include \[2\].*2 layers"):
        validate_pair(dcfg, dataclasses.replace(tcfg, num_layers=2))


# ----------------------------------------------------------------------------- converter


def test_converter_errors(tmp_path):
    torch.manual_seed(0)
    dflash_model.DFlashDraftModel(_draft_hf_config()).save_pretrained(tmp_path)
    base = load_file(str(tmp_path / "model.safetensors"))
    cases = [
        ({k: v for k, v in base.items() if k != "layers.1.self_attn.k_norm.weight"},
         r"model\.safetensors: missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"),
        ({**base, "fc.weight": np.zeros((HIDDEN, 3 * HIDDEN), np.float32)},
         r"model\.safetensors: 'fc\.weight': tensor has shape \(64, 192\), expected \(64, 128\)"),
        ({**base, "embed_tokens.weight": np.zeros((VOCAB, HIDDEN), np.float32)},
         r"'embed_tokens\.weight': unexpected tensor"),
        # A bias the config (attention_bias false) does not declare.
        ({**base, "layers.0.self_attn.q_proj.bias": np.zeros((64,), np.float32)},
         r"'layers\.0\.self_attn\.q_proj\.bias': unexpected tensor"),
        ({**base, "model.norm.weight": base["norm.weight"]},
         r"'(model\.)?norm\.weight': duplicate tensor; final_norm was already loaded"),
    ]
    for tensors, message in cases:
        save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ConversionError, match=message):
            load_drafter(tmp_path)


def test_converter_accepts_model_prefix(tmp_path):
    torch.manual_seed(0)
    dflash_model.DFlashDraftModel(_draft_hf_config()).save_pretrained(tmp_path)
    _, plain = load_drafter(tmp_path)
    file = str(tmp_path / "model.safetensors")
    save_file({"model." + k: v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
    _, prefixed = load_drafter(tmp_path)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(prefixed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_round_trip(tmp_path, target):
    """Random JAX weights -> export -> DFlashDraftModel.from_pretrained == our forward; the export
    of the same weights in the decoding layout writes the same tensors, and loading the export
    gives them back bitwise in either layout."""
    t_model, _, tparams = target
    dcfg = draft_config_from_dict(_draft_hf_config(
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 5000.0,
                         "original_max_position_embeddings": 32},
        dflash_config={"target_layer_ids": list(TAPS), "mask_token_id": MASK, "block_size": 8,
                       "output_multiplier": 0.5}).to_dict())
    rng = np.random.default_rng(8)  # numpy, not jax.random: drawing 36 tensors compiles slowly

    def draw(spec: Spec) -> jax.Array:
        noise = rng.standard_normal(spec.shape).astype(np.float32)
        return jnp.asarray(1.0 + 0.3 * noise if spec.init == "ones" else noise * spec.fan_in ** -0.5)

    params = jax.tree.map(draw, draft_checkpoint_specs(dcfg), is_leaf=is_spec)
    export_drafter(dcfg, params, tmp_path / "export")
    assert load_draft_config(tmp_path / "export") == dcfg
    decoding = assemble(draft_param_layout(dcfg), params)
    export_drafter(dcfg, decoding, tmp_path / "from_decoding")
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "numpy") as a, \
            safe_open(str(tmp_path / "from_decoding" / "model.safetensors"), "numpy") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and "layers.0.self_attn.k_proj.weight" in a.keys()
        for name in a.keys():
            np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name), err_msg=name)
    for layout, want in (("training", params), ("decoding", decoding)):
        _, back = load_drafter(tmp_path / "export", training=layout == "training")
        assert jax.tree.structure(back) == jax.tree.structure(want), layout
        for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=layout)
    model = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "export").float().eval()

    ref = ReferenceDrafter(model, t_model)
    taps = np.random.default_rng(0).standard_normal((9, len(TAPS) * HIDDEN)).astype(np.float32)
    block = np.asarray(make_block(dcfg, jnp.array([11])))
    ref_hidden, ref_logits = ref.round(taps, 9, block[0])
    cache = DraftCache.create(dcfg, batch=1, max_len=MAX_LEN)
    cache = _append(params, dcfg, cache, jnp.asarray(taps)[None], jnp.arange(9)[None], jnp.array([9]))
    hidden = _draft(params, dcfg, tparams, cache, jnp.asarray(block), cache.lengths)
    logits = _logits(params, dcfg, tparams, hidden)
    assert _rel_err(hidden[0], ref_hidden) <= 1e-5
    assert _rel_err(logits[0], ref_logits) <= 1e-5
