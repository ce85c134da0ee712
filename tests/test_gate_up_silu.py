"""The MLP's gated activation kernel (Mosaic GPU, Hopper).

On CPU: its tiling of the rows, its argument checks, and its lowering for cuda. On an H100/H200:
the kernel against `gate_up_silu_reference` (what XLA computes for the model's MLP).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gate_up_silu as gus

ON_HOPPER = gus.available()


@pytest.mark.parametrize("rows,tokens,tiles", [(257, 136, 2), (272, 136, 2), (136, 136, 1), (17, 24, 1),
                                               (1, 8, 1), (513, 136, 4), (300, 104, 3)])
def test_rows_split_into_the_fewest_tiles_of_at_most_136(rows, tokens, tiles):
    t = gus.token_tiles(rows)
    assert t.tokens == tokens and t.tokens % 8 == 0 and t.tokens <= gus.MAX_TOKENS
    assert -(-rows // t.tokens) == tiles and tiles * t.tokens - rows < 8 * tiles
    assert t.smem_bytes() <= gus._SMEM_BYTES


@pytest.mark.parametrize("pdl,pair,programs,pingpong", [
    (False, False, 0, False), (True, False, 0, False), (False, True, 0, False), (True, True, 132, False),
    (False, False, 132, False), (False, True, 5, False), (False, False, 132, True), (True, False, 0, True),
    (True, False, 132, "s6")])
@pytest.mark.parametrize("rows,embed,mlp", [(272, 4096, 12288), (264, 4096, 12288), (48, 512, 256)])
def test_kernel_lowers_for_cuda(rows, embed, mlp, pdl, pair, programs, pingpong):
    tokens = gus.token_tiles(rows).tokens
    t = gus.Tiles(tokens=tokens if not pair or -(-rows // tokens) % 2 == 0 else rows // 2, pdl=pdl, pair=pair,
                  programs=programs, pingpong=bool(pingpong), stages=6 if pingpong == "s6" else 5)
    assert t.smem_bytes() <= gus._SMEM_BYTES
    x = jax.ShapeDtypeStruct((rows, embed), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, mlp, embed), jnp.bfloat16)
    text = jax.jit(lambda x, w: gus.gate_up_silu_kernel(x, w, tiles=t)).trace(x, w).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1


@pytest.mark.parametrize("x_shape,w_shape,dtype,tiles,match", [
    ((272, 512), (256, 512), jnp.bfloat16, gus.Tiles(136), "w .* must be \\[2, mlp, embed=512\\]"),
    ((272, 512), (2, 256, 256), jnp.bfloat16, gus.Tiles(136), "w .* must be \\[2, mlp, embed=512\\]"),
    ((272, 512), (2, 256, 512), jnp.float32, gus.Tiles(136), "bf16 or f16"),
    ((120, 512), (2, 256, 512), jnp.bfloat16, gus.Tiles(136), "rows=120 must be a multiple of 8 and at least tiles.tokens=136"),
    ((272, 512), (2, 256, 512), jnp.bfloat16, gus.Tiles(100), "multiple of 8"),
    ((257, 512), (2, 256, 512), jnp.bfloat16, gus.Tiles(136), "rows=257 must be a multiple of 8"),
    ((408, 512), (2, 256, 512), jnp.bfloat16, gus.Tiles(136, pair=True), "pair needs an even number of row tiles"),
    ((272, 520), (2, 256, 520), jnp.bfloat16, gus.Tiles(136), "embed=520 must be a multiple of block_k"),
    ((272, 512), (2, 200, 512), jnp.bfloat16, gus.Tiles(136), "mlp=200 must be a multiple of 64"),
    ((272, 512), (2, 256, 512), jnp.bfloat16, gus.Tiles(136, stages=8), "bytes of shared memory"),
    ((272, 512), (2, 256, 512), jnp.bfloat16, gus.Tiles(136, pair=True, pingpong=True), "pingpong does not take pair"),
])
def test_bad_arguments_get_one_clear_error(x_shape, w_shape, dtype, tiles, match):
    x = jax.ShapeDtypeStruct(x_shape, dtype)
    w = jax.ShapeDtypeStruct(w_shape, dtype)
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda x, w: gus.gate_up_silu_kernel(x, w, tiles=tiles)).trace(x, w)


def test_reference_is_the_models_mlp_activation():
    """The reference is what `model.mlp_activation` computes from the fused [embed, 2, mlp] weight."""
    from dflash_jax.model import MLPParams, mlp_activation
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 20, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 128, 64)) * 0.1, jnp.bfloat16)
    ours = gus.gate_up_silu_reference(x[0], w)
    model = mlp_activation(MLPParams(gate_up=jnp.transpose(w, (2, 0, 1))), x)[0]
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(model, np.float32))


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rows,embed,mlp,pdl,pair,pad,programs,pingpong", [
    (257, 4096, 12288, False, False, True, 0, False), (257, 4096, 12288, False, False, False, 0, False),
    (257, 4096, 12288, True, True, False, 0, False), (272, 4096, 12288, False, True, True, 0, False),
    (17, 512, 256, False, False, False, 0, False), (136, 1024, 640, False, False, False, 0, False),
    (513, 512, 128, False, True, False, 0, False), (300, 512, 192, False, False, False, 0, False),
    (264, 4096, 12288, False, True, False, 0, False),
    (257, 4096, 12288, False, False, False, 132, False), (257, 4096, 12288, True, True, False, 132, False),
    (300, 1024, 640, False, False, False, 4, False), (272, 1024, 640, False, True, False, 3, False),
    # Both warpgroups taking jobs in turn: odd and even job counts per program, partial tiles.
    (257, 4096, 12288, False, False, False, 132, True), (257, 4096, 12288, True, False, True, 132, True),
    (300, 1024, 640, False, False, False, 4, True), (300, 1024, 640, False, False, False, 3, True),
    (17, 512, 256, False, False, False, 0, True), (513, 512, 128, False, False, False, 0, True),
    (257, 4096, 12288, True, False, False, 132, "s6"), (300, 1024, 640, False, False, False, 3, "s6")])
def test_gpu_kernel_matches_reference(rows, embed, mlp, pdl, pair, pad, programs, pingpong):
    rng = np.random.default_rng(rows + programs + bool(pingpong))
    x = jnp.asarray(rng.standard_normal((rows, embed)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, mlp, embed)) / np.sqrt(embed), jnp.bfloat16)
    t = gus.Tiles(tokens=gus.token_tiles(rows).tokens, pdl=pdl, pair=pair, programs=programs,
                  pingpong=bool(pingpong), stages=6 if pingpong == "s6" else 5)
    out = np.asarray(jax.jit(lambda x, w: gus.gate_up_silu(x, w, t, pad=pad))(x, w), np.float64)
    ref = np.asarray(gus.gate_up_silu_reference(x, w), np.float64)
    assert out.shape == (rows, mlp) and np.all(np.isfinite(out))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err < 2e-2, err
    # Every tile and column block lands where it belongs: the mean error is far below the max.
    assert np.mean(np.abs(out - ref)) < 1e-2 * np.mean(np.abs(ref))


def _tree_case(width: int):
    """A tiny fused target, a batch of 2 trees of `width` tokens, and its cache."""
    import dataclasses

    from dflash_jax import model as model_lib
    from dflash_jax.kv_cache import KVCache
    from tests.test_qkv_epilogue import tiny_config
    cfg = tiny_config(num_layers=3)
    params = model_lib.init_params(cfg, jax.random.key(7), jnp.float32, fused=True)
    leaves, tree = jax.tree.flatten(params)  # every weight scaled apart
    keys = jax.random.split(jax.random.key(8), len(leaves))
    params = jax.tree.unflatten(tree, [x * jax.random.uniform(k, x.shape, x.dtype, 0.5, 2.0)
                                       for x, k in zip(leaves, keys)])
    rng = np.random.default_rng(11)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, width)), jnp.int32)
    lengths = jnp.asarray([3, 20], jnp.int32)
    positions = lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
    cache = dataclasses.replace(KVCache.create(cfg.num_layers, 2, 48, cfg.num_kv_heads, cfg.head_dim),
                                lengths=lengths)
    return model_lib, cfg, params, tokens, positions, cache


def test_kernel_layout_is_the_fused_weights_turned():
    model_lib, cfg, params, *_ = _tree_case(4)
    turned = model_lib.kernel_mlp_layout(params)
    for a, b in zip(params.layers, turned.layers):
        assert b.mlp.gate_up is None and b.mlp.gate_up_t.shape == (2, cfg.intermediate_size, cfg.hidden_size)
        np.testing.assert_array_equal(np.asarray(b.mlp.gate_up_t), np.transpose(np.asarray(a.mlp.gate_up), (1, 2, 0)))
    assert model_lib.kernel_mlp_layout(turned) is turned
    with pytest.raises(ValueError, match="fused layout"):
        model_lib.kernel_mlp_layout(model_lib.init_params(cfg, jax.random.key(0), jnp.float32))


@pytest.mark.parametrize("forced", [False, True])
def test_forward_in_the_kernel_layout(forced, monkeypatch):
    """The kernel layout's forward against the fused layout's. On CPU XLA takes the [2, mlp,
    embed] weight; `forced` drives the verify's kernel path (the junction's zero-padded norm, the
    kernel on padded rows, the down product over them, the junction reading only the real rows)
    with the kernel replaced by its reference, which also checks the rows it is given."""
    model_lib, cfg, params, tokens, positions, cache = _tree_case(13)  # 26 rows -> 32
    turned = model_lib.kernel_mlp_layout(params)
    run = lambda p: model_lib.forward(p, cfg, tokens, positions, cache, tap_layers=(0, 2), return_hidden=True,  # noqa: E731
                                      attn_impl="reference", residual="kernel")
    monkeypatch.setattr(model_lib, "residual_splits", lambda *a, **kw: 2)
    want = run(params)
    seen = []
    if forced:
        def fake_kernel(h, w, *, tiles):
            assert h.shape == (32, cfg.hidden_size) and tiles == gus.decode_tiles(32)
            assert not np.any(np.asarray(h[26:]))  # the junction wrote zero rows past the real ones
            seen.append(1)
            return gus.gate_up_silu_reference(h, w)
        monkeypatch.setattr(gus, "applies", lambda rows, w: True)
        monkeypatch.setattr(gus, "gate_up_silu_kernel", fake_kernel)
    got = run(turned)
    assert len(seen) == (cfg.num_layers if forced else 0)
    scale = lambda a: 1e-5 * float(np.abs(np.asarray(a)).max())  # noqa: E731
    for name in ("logits", "hidden", "taps"):
        g, w = getattr(got, name), getattr(want, name)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=scale(w), err_msg=name)
    for a, b in zip(got.cache.k + got.cache.v, want.cache.k + want.cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=scale(b))
