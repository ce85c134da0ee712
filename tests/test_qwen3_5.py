"""The Qwen3.5 / Qwen3.6 hybrid target (dflash_jax.qwen3_5) against transformers' Qwen3_5ForCausalLM.

Tiny random configs, CPU, float32. transformers' random weights are saved with `save_pretrained`
and loaded through the checkpoint converter (convert/qwen3_5.py); logits are compared for the
prefill and 20 cached decode steps, our chunked form against our recurrent form through the whole
model, and greedy AR tokens against transformers' `generate`.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from convert.qwen3_5 import load_qwen35
from dflash_jax import qwen3_5 as q35
from dflash_jax.config import ConfigError
from dflash_jax.params import EMBED, check_against_specs, is_spec
from dflash_jax.sampling import SamplingParams

L, F = "linear_attention", "full_attention"
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True})
# Two layer patterns: Qwen3.5's 3 GDN then 1 attention (twice), and an irregular one that starts
# with attention and ends with GDN.
PATTERNS = {
    "interval4": dict(num_hidden_layers=8),
    "aperiodic": dict(num_hidden_layers=5, layer_types=[F, L, F, L, L], tie_word_embeddings=True),
}
REL = 1e-4


def tiny_hf(pattern: str, seed: int = 0) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    hf_cfg = Qwen3_5TextConfig(**{**TINY, **PATTERNS[pattern]})
    hf_cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(hf_cfg).eval()
    perturb_hf_weights(model)
    return model


def perturb_hf_weights(model: torch.nn.Module) -> None:
    """transformers starts norms at 0 or 1 and A_log / dt_bias at fixed values: random ones (from
    torch's current seed) make a misplaced tensor change the logits; the rest is scaled up for
    peakier distributions. A vision tower's weights are left as they are."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if "norm" in name or "dt_bias" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif "A_log" in name:
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.mul_(3.0)


def our_config(model: Qwen3_5ForCausalLM) -> q35.Qwen35Config:
    return q35.qwen35_config_from_dict(json.loads(model.config.to_json_string()), "tiny config")


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def tiny(request, tmp_path_factory):
    """transformers' model, saved with save_pretrained and loaded through our converter."""
    model = tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, params = load_qwen35(path)
    assert cfg == our_config(model)
    return model, cfg, params


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


def hf_logits_stepwise(model, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    """transformers' prefill logits [P, V], then each cached one-token step's [V]."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        logs = [out.logits[0].numpy()]
        cache = out.past_key_values
        for tok in steps:
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logs.append(out.logits[0, -1].numpy())
    return logs


# ----------------------------------------------------------------------------- numerics


def test_prefill_and_20_steps_match_transformers_ragged_batch(tiny):
    """Batch 2, right-padded prompts of 11 and 6 tokens, then 20 cached one-token steps each."""
    model, cfg, params = tiny
    rng = np.random.default_rng(1)
    lens = [11, 6]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    steps = [rng.integers(0, cfg.vocab_size, 20).tolist() for _ in lens]
    refs = [hf_logits_stepwise(model, p, s) for p, s in zip(prompts, steps)]

    width = max(lens)
    padded = np.zeros((2, width), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    cache = q35.HybridCache.create(cfg, 2, 40)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (2, width))
    out = q35.forward_jit(params, cfg, jnp.asarray(padded), positions, cache, jnp.asarray(lens, jnp.int32))
    for b, n in enumerate(lens):
        assert rel_err(out.logits[b, :n], refs[b][0]) < REL, f"prefill, sequence {b}"
    assert out.cache.lengths.tolist() == lens
    cache = out.cache
    for t in range(20):
        tok = jnp.asarray([[s[t]] for s in steps], jnp.int32)
        out = q35.forward_jit(params, cfg, tok, cache.lengths[:, None], cache)
        cache = out.cache
        for b in range(2):
            assert rel_err(out.logits[b, 0], refs[b][1 + t]) < REL, f"step {t}, sequence {b}"


def test_chunked_prefill_equals_token_by_token(tiny):
    """70 tokens at once (gdn.chunked, two chunks of 64) against 70 one-token steps (gdn.recurrent):
    logits, taps and every cached state; and against the same prefill in two pieces."""
    _, cfg, params = tiny
    rng = np.random.default_rng(2)
    n = 70
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, n)), jnp.int32)
    taps = (0, cfg.num_layers - 2, cfg.num_layers - 1)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (2, n))
    whole = q35.forward_jit(params, cfg, tokens, positions, q35.HybridCache.create(cfg, 2, 80), tap_layers=taps)
    cache = q35.HybridCache.create(cfg, 2, 80)
    logits, tap_rows = [], []
    for t in range(n):
        step = q35.forward_jit(params, cfg, tokens[:, t:t + 1], positions[:, t:t + 1], cache, tap_layers=taps)
        cache = step.cache
        logits.append(step.logits)
        tap_rows.append(step.taps)
    np.testing.assert_allclose(whole.logits, jnp.concatenate(logits, 1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(whole.taps, jnp.concatenate(tap_rows, 1), rtol=1e-4, atol=1e-4)
    for name in ("k", "v", "conv", "state"):
        np.testing.assert_allclose(getattr(whole.cache, name), getattr(cache, name), rtol=1e-4, atol=1e-4,
                                   err_msg=name)
    assert whole.cache.lengths.tolist() == cache.lengths.tolist() == [n, n]

    # A prefill in two pieces (30, then 40 tokens from the cached states) equals the whole.
    first = q35.forward_jit(params, cfg, tokens[:, :30], positions[:, :30], q35.HybridCache.create(cfg, 2, 80))
    second = q35.forward_jit(params, cfg, tokens[:, 30:], positions[:, 30:], first.cache)
    np.testing.assert_allclose(whole.logits[:, 30:], second.logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(whole.cache.state, second.cache.state, rtol=1e-4, atol=1e-4)


def test_taps_are_transformers_hidden_states(tiny):
    model, cfg, params = tiny
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens), output_hidden_states=True).hidden_states
    taps = tuple(range(cfg.num_layers))
    positions = jnp.arange(9, dtype=jnp.int32)[None]
    out = q35.forward_jit(params, cfg, jnp.asarray(tokens, jnp.int32), positions, q35.HybridCache.create(cfg, 1, 9),
                          tap_layers=taps, compute_logits=False)
    got = np.asarray(out.taps).reshape(1, 9, len(taps), cfg.hidden_size)
    for i in taps:
        assert rel_err(got[:, :, i], ref[i + 1].numpy()) < REL, f"layer {i}"


def test_greedy_generate_matches_transformers(tiny):
    model, cfg, params = tiny
    rng = np.random.default_rng(4)
    lens = [5, 9, 3]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    new = 12
    refs = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                 eos_token_id=None, pad_token_id=0)
            refs.append(seq[0, len(p):].tolist())
    padded = np.zeros((3, max(lens)), np.int32)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    toks, count = q35.generate(params, cfg, jnp.asarray(padded), jnp.asarray(lens, jnp.int32), jax.random.key(0),
                               max_new_tokens=new, max_len=32)
    assert count.tolist() == [new] * 3
    assert np.asarray(toks).tolist() == refs

    # A stop token ends one sequence there (kept, PAD after) and leaves the others running.
    stop = refs[1][4]
    others = [r.index(stop) + 1 if stop in r else new for r in refs]
    toks, count = q35.generate(params, cfg, jnp.asarray(padded), jnp.asarray(lens, jnp.int32), jax.random.key(0),
                               max_new_tokens=new, max_len=32, stop_tokens=(stop,))
    assert count.tolist() == others
    for b, n in enumerate(others):
        assert np.asarray(toks[b]).tolist() == refs[b][:n] + [q35.PAD] * (new - n)


def test_top_k_one_sampling_is_greedy(tiny):
    _, cfg, params = tiny
    prompts = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    lens = jnp.asarray([5], jnp.int32)
    kw = dict(max_new_tokens=6, max_len=12)
    greedy, _ = q35.generate(params, cfg, prompts, lens, jax.random.key(0), **kw)
    sampled, _ = q35.generate(params, cfg, prompts, lens, jax.random.key(7),
                              sampling=SamplingParams(temperature=1.3, top_k=1), **kw)
    assert np.asarray(sampled).tolist() == np.asarray(greedy).tolist()


def test_text_positions_make_mrope_plain_rope():
    """With text-only positions (the same id on the t, h and w rows) transformers' interleaved
    mRoPE equals 1-D RoPE over the rotary dims, which is what `forward` uses."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from dflash_jax.rope import rope_tables

    hf_cfg = Qwen3_5TextConfig(**{**TINY, "head_dim": 64, "num_hidden_layers": 4,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                      "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                                      "mrope_interleaved": True}})
    cfg = q35.qwen35_config_from_dict(hf_cfg.to_dict(), "mrope config")
    assert cfg.rotary_dim == 16 and cfg.rope.theta == 1e7
    pos = np.array([[0, 1, 7, 100, 4095]])
    emb = Qwen3_5TextRotaryEmbedding(hf_cfg)
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), torch.tensor(pos)[None].expand(3, 1, -1))
    our_cos, our_sin = rope_tables(jnp.asarray(pos), cfg.rope, cfg.rotary_dim)
    np.testing.assert_allclose(our_cos, cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(our_sin, sin.numpy(), atol=1e-6)
    # Different h / w rows (an image) would differ: the check above can fail.
    mixed = torch.tensor(np.stack([pos, pos + 3, pos + 5]))
    cos_img, _ = emb(torch.zeros(1, dtype=torch.float32), mixed)
    assert not np.allclose(our_cos, cos_img.numpy(), atol=1e-3)


# ----------------------------------------------------------------------------- config


def text_config(**over) -> dict:
    d = Qwen3_5TextConfig(**{**TINY, "num_hidden_layers": 8}).to_dict()
    d.update(over)
    return d


def test_config_text_and_wrapper():
    text = text_config()
    cfg = q35.qwen35_config_from_dict(text)
    assert cfg.layer_types == (L, L, L, F) * 2
    assert cfg.attn_layers == (3, 7) and cfg.gdn_layers == (0, 1, 2, 4, 5, 6)
    assert (cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim) == (2, 4, 8, 6)
    assert cfg.rotary_dim == 4 and cfg.conv_channels == 2 * (2 * 8 + 2 * 6)
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": text,
               "vision_config": {"depth": 2}}
    assert q35.qwen35_config_from_dict(wrapped) == cfg
    # full_attention_interval when layer_types is absent.
    no_types = {k: v for k, v in text.items() if k != "layer_types"}
    cfg3 = q35.qwen35_config_from_dict({**no_types, "full_attention_interval": 2})
    assert cfg3.layer_types == (L, F) * 4
    assert q35.qwen35_config_from_dict(no_types).layer_types == cfg.layer_types
    hash(cfg)


def test_config_file_and_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_5", "text_config": text_config()}))
    assert q35.load_qwen35_config(tmp_path).num_layers == 8

    def error(d: dict) -> str:
        path.write_text(json.dumps(d))
        with pytest.raises(ConfigError) as e:
            q35.load_qwen35_config(path)
        assert str(path) in str(e.value)
        return str(e.value)

    no_heads = {k: v for k, v in text_config().items() if k != "linear_num_value_heads"}
    assert "'text_config.linear_num_value_heads'" in error({"model_type": "qwen3_5", "text_config": no_heads})
    assert "'layer_types'" in error(text_config(layer_types=[L, F, "sliding_attention"] + [L] * 5))
    assert "'layer_types'" in error(text_config(layer_types=[L, F]))
    msg = error({**text_config(), "model_type": "qwen3_5_moe"})
    assert "not supported yet" in msg and "model_type" in msg
    msg = error({"model_type": "qwen3_5", "text_config": text_config(num_experts=8)})
    assert "not supported yet" in msg and "'text_config.num_experts'" in msg
    assert "model_type" in error({**text_config(), "model_type": "qwen3"})
    assert "linear_num_value_heads" in error(text_config(linear_num_value_heads=3))


def test_init_params_follow_the_declarations():
    """Random bfloat16 weights as declared, one pytree per layer; the forward keeps the cache's
    dtypes (the recurrent state float32, the rest the activations')."""
    cfg = q35.qwen35_config_from_dict(text_config())
    params = q35.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    specs = q35.model_specs(cfg)
    check_against_specs(params, specs)
    assert (len(params.layers), len(params.attn), len(params.gdn)) == (8, 2, 6)
    assert params.attn[1].q.shape == (32, 4, 2, 16) and params.gdn[5].qkv.shape == (32, 2, 28)
    axes = {s.axes for s in jax.tree.leaves(specs, is_leaf=is_spec)}
    assert (EMBED, q35.GDN_K_HEADS, None) in axes
    assert (q35.GDN_V_HEADS, None, EMBED) in axes
    out = q35.forward_jit(params, cfg, jnp.ones((1, 3), jnp.int32), jnp.arange(3)[None],
                          q35.HybridCache.create(cfg, 1, 4, jnp.bfloat16))
    assert out.logits.shape == (1, 3, cfg.vocab_size) and bool(jnp.isfinite(out.logits).all())
    assert (len(out.cache.k), len(out.cache.conv), len(out.cache.state)) == (2, 6, 6)
    assert {x.dtype for x in out.cache.k + out.cache.v + out.cache.conv} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in out.cache.state} == {jnp.dtype(jnp.float32)}
    assert out.cache.lengths.tolist() == [3]


def test_qwen36_27b_shape_declares_every_weight():
    """At Qwen3.6-27B's shape (64 layers, 3 GDN : 1 attention) our declarations hold exactly the
    weights transformers builds, group by group (counted on torch's meta device: no memory)."""
    d = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
             num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             full_attention_interval=4, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                              "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    cfg = q35.qwen35_config_from_dict({"model_type": "qwen3_5", "text_config": d}, "qwen3.6-27b config")
    assert (len(cfg.attn_layers), len(cfg.gdn_layers), cfg.rotary_dim) == (16, 48, 64)
    assert cfg.rope.theta == 1e7
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**d))
    hf = {"attn": 0, "gdn": 0, "rest": 0}
    for name, p in model.named_parameters():
        hf["attn" if ".self_attn." in name else "gdn" if ".linear_attn." in name else "rest"] += p.numel()
    specs = q35.model_specs(cfg)

    def count(tree: Any) -> int:
        return sum(int(np.prod(s.shape)) for s in jax.tree.leaves(tree, is_leaf=is_spec))

    assert count(specs.attn) == hf["attn"]
    assert count(specs.gdn) == hf["gdn"]
    assert count(specs) - count(specs.attn) - count(specs.gdn) == hf["rest"]


# HLO ops that only move data, and the views XLA looks through to find what they read.
_MOVES = ("slice", "dynamic-slice", "copy")
_VIEWS = ("bitcast", "transpose", "reshape", "copy")
_INSTR = re.compile(r"^(ROOT )?%?([\w.-]+) = (\w+\[[\d,]*\])\S* ([\w-]+)\((%?[\w.-]+)?")
_CALLS = re.compile(r" fusion\(.*calls=%?([\w.-]+)")


def moved_buffers(hlo: str, weights: set[str], caches: set[str]) -> list[str]:
    """Lines of compiled HLO text where a slice, dynamic-slice or copy materialises (outside a
    fusion, or as a fusion's result) an array read, through bitcasts, transposes and reshapes,
    from a weight or cache buffer: one of the shapes `weights` / `caches` (as HLO prints them,
    "f32[3,32,2,16]"), passed in, loop-carried, or a fusion parameter bound to one.

    A cache copied through a transpose is left out: the attention core's reference form on CPU
    reads K/V in another layout (the GPU kernels read the buffer as it is); a plain copy of a
    cache buffer (an update that could not happen in place) counts.
    """
    fused = set(_CALLS.findall(hlo))
    found = []
    name, defs, root, moves = None, {}, None, []

    def close() -> None:
        chain, node = set(), root
        while node is not None and node in defs and node not in chain:
            chain.add(node)
            node = defs[node][2] if defs[node][1] in _VIEWS else None
        for move, line in moves:
            if name in fused and move not in chain:
                continue  # a slice read inside a fusion, not materialised
            src, turned = defs[move][2], False
            while src in defs and defs[src][1] in _VIEWS and defs[src][2] in defs:
                turned |= defs[src][1] == "transpose"
                src = defs[src][2]
            shape = defs[src][0] if src in defs else None
            if shape in weights or (shape in caches and not (defs[move][1] == "copy" and turned)):
                found.append(line[:200])

    for line in hlo.splitlines():
        head = line.strip()
        if head.endswith("{"):
            close()
            name, defs, root, moves = head.split()[0].lstrip("%"), {}, None, []
            continue
        m = _INSTR.match(head)
        if m is None:
            continue
        is_root, ident, shape, op, operand = m.groups()
        defs[ident] = (shape, op, operand.lstrip("%") if operand else None)
        root = ident if is_root else root
        if op in _MOVES and defs[ident][2] in defs:
            moves.append((ident, head))
    close()
    return found


def buffer_shapes(tree: Any) -> set[str]:
    """HLO shape strings ("f32[3,32,2,16]") of a tree's leaves of rank >= 2."""
    out = set()
    for a in jax.tree.leaves(tree):
        if a.ndim >= 2:
            out.add(f"{jnp.dtype(a.dtype).name.replace('float', 'f')}"
                    f"[{','.join(str(d) for d in a.shape)}]")
    return out


def test_compiled_step_and_verify_move_no_weight_or_cache_buffer():
    """The compiled AR step and tree verify neither slice nor copy a whole weight or cache buffer:
    each layer's arrays go to its GEMMs and kernels as they are, and each cache buffer is updated
    in place. (Weights stacked over layers and read in a layer loop were copied out of their stacks
    on every step.) A batch of 3 keeps cache and activation shapes apart from weight shapes."""
    cfg = q35.qwen35_config_from_dict(text_config(hidden_size=40, intermediate_size=56))
    params = jax.eval_shape(lambda: q35.init_params(cfg, jax.random.key(0)))
    cache = jax.eval_shape(lambda: q35.HybridCache.create(cfg, 3, 32))
    # The GDN conv's own few rows are left out: its weight [kernel, C] (XLA's CPU layout for the
    # depthwise conv transposes it) and its state, a shift register of kernel - 1 rows whose update
    # reads the rows it overwrites (so XLA copies them first).
    weights = buffer_shapes((params.layers, params.attn, [dataclasses.replace(m, conv=None) for m in params.gdn]))
    caches = buffer_shapes((cache.k, cache.v, cache.state))
    assert {"f32[40,2,56]", "f32[4,16,40]"} <= weights and {"f32[3,32,2,16]", "f32[3,4,8,6]"} <= caches
    tok = jax.ShapeDtypeStruct((3, 1), jnp.int32)
    step = jax.jit(lambda p, t, c: q35.forward(p, cfg, t, t, c), donate_argnums=2)
    width = 4
    tree = (jax.ShapeDtypeStruct((3, width), jnp.int32), jax.ShapeDtypeStruct((3, width), jnp.int32),
            jax.ShapeDtypeStruct((3, width, width), jnp.bool_), jax.ShapeDtypeStruct((3, width), jnp.int32))
    verify = jax.jit(lambda p, t, pos, vis, par, c: q35.verify(p, cfg, t, pos, vis, par, c), donate_argnums=5)
    texts = {"AR step": step.lower(params, tok, cache).compile().as_text(),
             "verify": verify.lower(params, tree[0], tree[1], tree[2], tree[3], cache).compile().as_text()}
    # The reading finds what it looks for: weights stacked over layers and read at a traced index.
    stack, index = jax.ShapeDtypeStruct((2, 40, 56), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    stacked = jax.jit(lambda s, i, x: x @ jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False)).lower(
        stack, index, jax.ShapeDtypeStruct((3, 40), jnp.float32)).compile().as_text()
    assert moved_buffers(stacked, {"f32[2,40,56]"}, set())
    for what, text in texts.items():
        found = moved_buffers(text, weights, caches)
        assert not found, f"{what}: weight or cache buffers sliced or copied:\n" + "\n".join(found)
