"""MTP drafting under tensor parallelism on fake CPU devices (float32).

The head's weights are laid out by the target layers' own rules (its attention and MLP split over
tp, fc and the norms whole), its KV cache by kv head like the target's; greedy MTP chains and trees
at tp = 2 give single-device AR's tokens on a tiny dense and a tiny hybrid target, and
`generate` / `bench --method mtp --tp 2` run the checkpoint's own head sharded.
"""
from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from convert.hf_safetensors import load_hf
from convert.mtp import load_mtp
from dflash_jax import cli, mtp
from dflash_jax import qwen3_5 as q35
from dflash_jax import sharding as sh
from dflash_jax import speculative
from dflash_jax.speculative import SpecSettings, generate_speculative
from tests.spec_models import target_model
from tests.test_convert_mtp import hybrid_with_head  # noqa: F401 (a fixture)
from tests.test_mtp import NEW, PROMPTS, VOCAB, ar_tokens, batches
from tests.test_qwen3_5_speculative import target as hybrid_target

TP = sh.TP


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dense")
    target_model(vocab=VOCAB).save_pretrained(directory)
    return directory


@functools.lru_cache(maxsize=None)
def _ar(kind: str, directory=None) -> list:
    cfg, params = load_hf(directory) if kind == "dense" else hybrid_target("interval4")
    return ar_tokens(kind, cfg, params, PROMPTS)


def sharded_target(kind: str, directory, mesh):
    """(cfg, params) with every weight on its tp shards, as the loaders place them."""
    if kind == "dense":
        return load_hf(directory, mesh=mesh)
    cfg, params = hybrid_target("interval4")
    return cfg, jax.device_put(params, sh.specs_shardings(q35.model_specs(cfg), mesh))


def check_head_is_sharded(mparams: mtp.MTPParams, cfg, tp: int) -> None:
    """The head's attention and MLP are split like a target layer's; fc and the norms are whole."""
    split_kv = cfg.num_kv_heads % tp == 0
    if mtp.is_hybrid(cfg):
        common, attn = mparams.layer
        assert attn.q.sharding.spec == P(None, TP, None, None)  # [embed, q_heads, 2, head_dim]
        assert attn.k.sharding.spec == P(None, TP if split_kv else None, None)
        assert attn.o.sharding.spec == P(TP, None, None)
        assert common.gate_up.sharding.spec == P(None, None, TP)
        assert common.down.sharding.spec == P(TP, None)
        assert {s.data.shape for s in common.down.addressable_shards} == {(cfg.intermediate_size // tp,
                                                                           cfg.hidden_size)}
    else:
        lp = mparams.layer
        assert lp.attn.q.sharding.spec == P(None, TP, None)
        assert lp.attn.k.sharding.spec == P(None, TP if split_kv else None, None)
        assert lp.attn.o.sharding.spec == P(TP, None, None)
        assert lp.mlp.gate.sharding.spec == lp.mlp.up.sharding.spec == P(None, TP)
        assert lp.mlp.down.sharding.spec == P(TP, None)
        assert {s.data.shape for s in lp.mlp.down.addressable_shards} == {(cfg.intermediate_size // tp,
                                                                           cfg.hidden_size)}
    for whole in (mparams.fc, mparams.norm_embed, mparams.norm_hidden, mparams.final_norm):
        assert whole.sharding.is_fully_replicated


# The hybrid's chain at batch 1 runs through `bench --tp 2` below (against AR at tp = 2).
@pytest.mark.parametrize("kind,steps,budget,batch", [("dense", 3, 0, 3), ("dense", 2, 5, 1), ("hybrid", 3, 6, 3)])
def test_greedy_mtp_at_tp2_equals_greedy_ar(dense_dir, kind, steps, budget, batch):
    tp = 2
    want = _ar(kind, dense_dir if kind == "dense" else None)
    mesh = sh.make_mesh(1, tp)
    cfg, params = sharded_target(kind, dense_dir, mesh)
    mcfg = mtp.MTPConfig(cfg)
    mparams = mtp.init_mtp_params(cfg, jax.random.key(3), mesh=mesh)
    check_head_is_sharded(mparams, cfg, tp)
    # The same values as the head drawn on one device: only the layout differs.
    for a, b in zip(jax.tree.leaves(mparams), jax.tree.leaves(mtp.init_mtp_params(cfg, jax.random.key(3)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    s = SpecSettings(method="mtp", mtp_steps=steps, budget=budget, max_new_tokens=NEW)
    got, accepted = [], []
    with sh.use_mesh(mesh):
        for n, arr, lens in batches(PROMPTS, batch):
            g = generate_speculative(params, cfg, mparams, mcfg, arr, lens, jax.random.key(0), settings=s,
                                     max_len=128)
            toks, count = np.asarray(g.tokens), np.asarray(g.num_tokens)
            got += [toks[b, :count[b]].tolist() for b in range(n)]
            accepted.append(np.asarray(g.accepted)[:n])
    assert got == want
    assert np.concatenate(accepted, None).max() >= 2  # drafted tokens were accepted


def test_head_cache_is_split_like_the_targets(dense_dir):
    """The head's K/V after prefill sit on the devices as the target's KV cache: kv heads over
    tp, sequences over dp."""
    dp, tp = 2, 2
    mesh = sh.make_mesh(dp, tp)
    cfg, params = sharded_target("dense", dense_dir, mesh)
    mcfg, mparams = mtp.MTPConfig(cfg), mtp.init_mtp_params(cfg, jax.random.key(3), mesh=mesh)
    s = SpecSettings(method="mtp", mtp_steps=2, max_new_tokens=NEW)
    _, arr, lens = next(batches(PROMPTS, 4))
    start = jax.jit(lambda arr, lens: speculative.start_state(params, cfg, mparams, mcfg, arr, lens,
                                                              jax.random.key(0), 128, s))
    with sh.use_mesh(mesh):
        state = start(arr, lens)
    target_k, cache = state.cache.k[0], state.draft_cache
    for buf in (cache.k, cache.v):
        assert buf.sharding.is_equivalent_to(target_k.sharding, buf.ndim)
        assert buf.sharding.is_equivalent_to(sh.cache_sharding(mesh, 4, cfg.num_kv_heads), buf.ndim)
        assert {x.data.shape for x in buf.addressable_shards} == {(4 // dp, 128, cfg.num_kv_heads // tp,
                                                                   cfg.head_dim)}


def test_heads_that_do_not_divide_tp_are_one_error(hybrid_with_head):  # noqa: F811
    path, cfg, _ = hybrid_with_head
    mesh = sh.make_mesh(1, 3)  # 4 q heads
    with pytest.raises(sh.ShardingError, match=r"MTP head at tp=3: .*num_heads=4 .* not divisible by tp=3"):
        mtp.init_mtp_params(cfg, jax.random.key(0), mesh=mesh)
    with pytest.raises(sh.ShardingError, match=r"MTP head at tp=3"):
        load_mtp(path, cfg, mesh=mesh)


def test_cli_generate_and_bench_mtp_at_tp2(hybrid_with_head, tmp_path, capsys, monkeypatch):  # noqa: F811
    """The checkpoint's own head, loaded onto its shards by both commands: bench's MTP chain
    matches AR's answers (both at tp = 2); generate's tree gives the tokens asked for."""
    import convert.mtp

    path, cfg, _ = hybrid_with_head
    loaded, real = [], convert.mtp.load_mtp

    def spy(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(convert.mtp, "load_mtp", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t], "category": "c"}) + "\n" for t in ("hi", "w1 w2", "hi w3")))
    code = cli.main(["bench", "--model", str(path), "--method", "mtp", "--mtp-steps", "2", "--tp", "2",
                     "--prompts", str(prompts), "--max-new-tokens", "8", "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["tp"] == 2 and list(report["methods"]) == ["ar", "mtp(k=2)"]
    assert report["methods"]["mtp(k=2)"]["matches_ar"] == 1.0
    code = cli.main(["generate", "--model", str(path), "--method", "mtp", "--mtp-steps", "2", "--mtp-budget", "4",
                     "--tp", "2", "--max-new-tokens", "8", "--json", "--quiet", "hi"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["tokens"] == 8
    assert len(loaded) == 2
    for head in loaded:
        check_head_is_sharded(head, cfg, 2)
