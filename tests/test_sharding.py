"""Tensor / data parallelism on fake CPU devices (tests/conftest.py asks jax for 4).

Sharded programs must give the single-device numbers: logits to float32 rounding, greedy
tokens exactly. Weights are placed by the loaders (`mesh=`), straight into the decoding layout,
so these tests also check that every device holds only its own shard.
"""
import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from convert.dflash_drafter import load_drafter
from convert.hf_safetensors import load_hf
from dflash_jax import sharding as sh
from dflash_jax.generate import generate_ar
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import forward
from dflash_jax.pipeline import pad_prompts
from dflash_jax.sampling import SamplingParams
from dflash_jax.speculative import SpecSettings, generate_speculative
from pallas_kernels.tree_attention import tree_attention
from tests.hf_models import TINY
from tests.spec_models import drafter_model, target_model

MESHES = [(1, 2), (2, 2)]  # (dp, tp)

# The hf_models qwen3 has 5 q heads (no tp > 1 divides them): the same model with 4 q / 2 kv
# heads and a vocabulary divisible by 4, so vocab-parallel embedding and head are exercised.
MODELS = {
    "qwen3_tp": dict(TINY["qwen3"], num_attention_heads=4, num_key_value_heads=2, vocab_size=132),
    "llama": TINY["llama"],  # 6 q / 2 kv heads, tied embeddings, vocab 127: replicated vocab
}  # (TINY["llama_yarn"]'s 1 KV head at tp=2 is the same rule as test_kv_heads_replicated_at_tp4)


def spec(arr) -> tuple:
    """An array's PartitionSpec as a tuple with one entry per dimension."""
    entries = tuple(arr.sharding.spec)
    return entries + (None,) * (arr.ndim - len(entries))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def hf_model(spec: dict, seed: int = 0):
    spec = dict(spec)
    config_cls, model_cls = spec.pop("cls")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**spec)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p)) if "norm" in name else p.mul_(3.0)
    return model


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model(MODELS[request.param]).save_pretrained(directory)
    cfg, params = load_hf(directory)
    return request.param, directory, cfg, params


def prefill_then_tree(params, cfg, tokens, visible):
    """Prefill 12 tokens of 4 sequences (own lengths), then a 5-node tree step; both logits."""
    batch = tokens.shape[0]
    lens = jnp.asarray([7, 12, 4, 9], jnp.int32)
    cache = KVCache.create(cfg.num_layers, batch, 32, cfg.num_kv_heads, cfg.head_dim)
    pre = forward(params, cfg, tokens[:, :12], jnp.broadcast_to(jnp.arange(12), (batch, 12)), cache)
    cache = dataclasses.replace(pre.cache, lengths=lens)
    depth = jnp.asarray([0, 1, 1, 2, 2], jnp.int32)
    step = forward(params, cfg, tokens[:, 12:17], lens[:, None] + depth[None], cache, visible)
    return pre.logits, step.logits, step.cache


def tree_inputs(vocab: int):
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(0, vocab, (4, 17)))
    vis = np.eye(5, dtype=bool)
    vis[:, 0] = True
    vis[3, 1] = vis[4, 2] = True  # nodes 3, 4 are children of 1 and 2
    return tokens, jnp.asarray(np.broadcast_to(vis, (4, 5, 5)))


# ----------------------------------------------------------------------------- logits

def test_sharded_logits_equal_single_device(saved):
    kind, directory, cfg, params = saved
    tokens, visible = tree_inputs(cfg.vocab_size)
    run = jax.jit(prefill_then_tree, static_argnums=1)
    ref_pre, ref_step, _ = run(params, cfg, tokens, visible)
    for dp, tp in MESHES:
        mesh = sh.make_mesh(dp, tp)
        _, sharded = load_hf(directory, mesh=mesh)
        with sh.use_mesh(mesh):
            pre, step, cache = run(sharded, cfg, tokens, visible)
        assert rel_err(pre, ref_pre) <= 1e-5, (kind, dp, tp)
        assert rel_err(step, ref_step) <= 1e-5, (kind, dp, tp)
        # The cache stays split: batch over dp, KV heads over tp (replicated when kv_heads < tp).
        kv_axis = sh.TP if cfg.num_kv_heads % tp == 0 else None
        assert spec(cache.k[0]) == (sh.DP if dp > 1 else None, None, kv_axis, None)


def test_kv_heads_replicated_at_tp4(tmp_path):
    """2 KV heads at tp=4: KV projections and cache replicated, every device uses its q heads' one."""
    hf_model(MODELS["qwen3_tp"]).save_pretrained(tmp_path)
    cfg, params = load_hf(tmp_path)
    mesh = sh.make_mesh(1, 4)
    _, sharded = load_hf(tmp_path, mesh=mesh)
    assert sharded.layers[0].attn.qkv is None  # q is split, k and v are not: apart
    assert spec(sharded.layers[0].attn.k) == (None, None, None)
    assert sharded.layers[0].attn.q.addressable_shards[0].data.shape == (cfg.hidden_size, 1, cfg.head_dim)
    tokens, visible = tree_inputs(cfg.vocab_size)
    run = jax.jit(prefill_then_tree, static_argnums=1)
    ref = run(params, cfg, tokens, visible)
    with sh.use_mesh(mesh):
        got = run(sharded, cfg, tokens, visible)
    assert rel_err(got[0], ref[0]) <= 1e-5 and rel_err(got[1], ref[1]) <= 1e-5


# ----------------------------------------------------------------------------- placement

def expected_local_shape(path: str, shape: tuple, cfg, dp: int, tp: int) -> tuple:
    """What one device must hold of each weight (written out, not derived from the rules)."""
    v, e, m = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    qh, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    vocab = v // tp if v % tp == 0 else v
    kv = kvh // tp if kvh % tp == 0 else kvh
    leaf = path.split(".")[-1]
    table = {
        "embed": (vocab, e), "lm_head": (e, vocab), "q": (e, qh // tp, hd), "k": (e, kv, hd),
        "v": (e, kv, hd), "qkv": (e, kv, qh // kvh + 2, hd), "o": (qh // tp, hd, e),
        "gate_up": (e, 2, m // tp), "down": (m // tp, e),
    }
    return table.get(leaf, shape)  # norms: replicated


def test_each_device_holds_only_its_shard(saved):
    kind, directory, cfg, params = saved
    dp, tp = 2, 2
    mesh = sh.make_mesh(dp, tp)
    _, sharded = load_hf(directory, mesh=mesh)
    full = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, arr in jax.tree_util.tree_flatten_with_path(sharded)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        want = expected_local_shape(name, arr.shape, cfg, dp, tp)
        shards = arr.addressable_shards
        assert len(shards) == dp * tp, name
        host = np.asarray(full[path])
        for shard in shards:
            assert shard.data.shape == want, (kind, name, shard.data.shape, want)
            # ... and it is the right slice of the weight.
            np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index], err_msg=name)


def tp2_prefill(directory, cfg):
    """A tp = 2 mesh, the model loaded onto it, 4 x 17 tokens, and a 17-token prefill's logits."""
    mesh = sh.make_mesh(1, 2)
    _, sharded = load_hf(directory, mesh=mesh)
    tokens, _ = tree_inputs(cfg.vocab_size)

    def fwd(params, tokens):
        cache = KVCache.create(cfg.num_layers, 4, 32, cfg.num_kv_heads, cfg.head_dim)
        return forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(17), (4, 17)), cache).logits

    return mesh, sharded, tokens, fwd


def test_one_all_reduce_per_attention_block_and_mlp(saved):
    """Row-parallel o_proj and down_proj: one all-reduce each per layer, plus one for the
    vocab-parallel embedding; nothing gathered."""
    kind, directory, cfg, _ = saved
    mesh, sharded, tokens, fwd = tp2_prefill(directory, cfg)
    with sh.use_mesh(mesh):
        hlo = jax.jit(fwd).lower(sharded, tokens).compile().as_text()
    counts = sh.collectives(hlo)
    embed_reduce = 1 if cfg.vocab_size % 2 == 0 else 0
    assert counts["all-reduce"] == 2 * cfg.num_layers + embed_reduce, (kind, counts)
    assert sum(counts.values()) == counts["all-reduce"], (kind, counts)


def test_chunked_all_reduce_splits_large_row_parallel_results(saved):
    """Under all_reduce_max_bytes a row-parallel result over the limit is all-reduced in row
    chunks: the same logits (each element is still one sum over the same shards), more
    all-reduces in the compiled program, and none when no mesh is active."""
    kind, directory, cfg, _ = saved
    mesh, sharded, tokens, fwd = tp2_prefill(directory, cfg)
    # A [4, 17, hidden] float32 result on 1 dp shard: 17 rows of 4 * hidden * 4 bytes; a limit of
    # 6 rows' bytes gives chunks of 6, 6, 5 rows.
    limit = 6 * 4 * cfg.hidden_size * 4
    with sh.use_mesh(mesh):
        plain = jax.jit(fwd).lower(sharded, tokens).compile()
        with sh.all_reduce_max_bytes(limit):
            assert sh.row_parallel_chunks(17, 4, cfg.hidden_size * 4) == [6, 6, 5]
            # A new function object: jax reuses a traced program per function, whatever the limit.
            chunked = jax.jit(functools.partial(fwd)).lower(sharded, tokens).compile(
                compiler_options={"xla_gpu_all_reduce_combine_threshold_bytes": 0})
    # The all-reduced arrays, one entry per array (the CPU backend's combiner joins independent
    # all-reduces into tuples, which XLA:GPU does not do with the combine threshold at 0).
    from dflash_jax.bench.tensor_parallel import hlo_collectives
    shapes = lambda exe: sorted(s for kind, _, s in hlo_collectives(exe.as_text()) if s[-1] == cfg.hidden_size)  # noqa: E731
    layers, h = 2 * cfg.num_layers, cfg.hidden_size
    embed = [(4, 17, h)] * (cfg.vocab_size % 2 == 0)  # the vocab-parallel lookup's own all-reduce
    assert shapes(plain) == [(4, 17, h)] * layers + embed, kind
    assert shapes(chunked) == sorted([(4, 5, h)] * layers + [(4, 6, h)] * 2 * layers + embed), kind
    assert rel_err(chunked(sharded, tokens), plain(sharded, tokens)) <= 1e-6, kind
    with sh.all_reduce_max_bytes(limit):
        assert sh.row_parallel_chunks(17, 4, cfg.hidden_size * 4) == [17]  # no mesh: nothing to reduce
    with pytest.raises(ValueError, match="limit must be >= 1"):
        with sh.all_reduce_max_bytes(0):
            pass


def test_row_groups_split_the_post_attention_all_reduces(saved):
    """Under overlap_row_groups(2) each layer's o_proj and MLP run on two row groups, each with
    its own all-reduce: the same logits, twice the layer all-reduces on half the rows each, and
    one group when no mesh is active or there are fewer rows than groups."""
    kind, directory, cfg, _ = saved
    mesh, sharded, tokens, fwd = tp2_prefill(directory, cfg)
    with sh.use_mesh(mesh):
        plain = jax.jit(fwd).lower(sharded, tokens).compile()
        with sh.overlap_row_groups(2):
            assert sh.row_groups(17) == [(0, 8), (8, 17)]
            assert sh.row_groups(1) == [(0, 1)]  # an AR step: nothing to overlap
            grouped = jax.jit(functools.partial(fwd)).lower(sharded, tokens).compile(
                compiler_options={"xla_gpu_all_reduce_combine_threshold_bytes": 0})
    from dflash_jax.bench.tensor_parallel import hlo_collectives
    shapes = lambda exe: sorted(s for kind, _, s in hlo_collectives(exe.as_text()) if s[-1] == cfg.hidden_size)  # noqa: E731
    layers, h = 2 * cfg.num_layers, cfg.hidden_size
    embed = [(4, 17, h)] * (cfg.vocab_size % 2 == 0)
    assert shapes(grouped) == sorted([(4, 8, h)] * layers + [(4, 9, h)] * layers + embed), kind
    assert rel_err(grouped(sharded, tokens), plain(sharded, tokens)) <= 1e-6, kind
    with sh.overlap_row_groups(2):
        assert sh.row_groups(17) == [(0, 17)]  # no mesh
    with pytest.raises(ValueError, match="groups must be >= 1"):
        with sh.overlap_row_groups(0):
            pass


# ----------------------------------------------------------------------------- rules

def test_heads_that_do_not_divide_are_errors(tmp_path):
    from dflash_jax.config import ModelConfig
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                      num_layers=1, num_heads=6, num_kv_heads=3, head_dim=8)
    with pytest.raises(sh.ShardingError, match="kv_heads=3 .*tp=2"):
        sh.check_model(cfg, 2)
    with pytest.raises(sh.ShardingError, match="num_heads=6 .*tp=4"):
        sh.check_model(cfg, 4)
    # Through a loader: the hf_models qwen3 (5 q heads) at tp=2 names the numbers.
    hf_model(TINY["qwen3"]).save_pretrained(tmp_path)
    with pytest.raises(sh.ShardingError, match=r"num_heads=5 \(query heads\) is not divisible by tp=2"):
        load_hf(tmp_path, mesh=sh.make_mesh(1, 2))
    with pytest.raises(sh.ShardingError, match="needs 8 devices"):
        sh.make_mesh(2, 4)


def test_no_mesh_is_a_no_op():
    x = jnp.ones((4, 3, 2, 8))
    assert sh.active_mesh() is None and sh.constrain(x, (sh.BATCH, None, "kv_heads", None)) is x
    with sh.use_mesh(sh.make_mesh(2, 2)):
        cache = KVCache.create(1, 4, 8, 2, 8)
    assert spec(cache.k[0]) == (sh.DP, None, sh.TP, None)
    assert cache.k[0].addressable_shards[0].data.shape == (2, 8, 1, 8)


def test_random_init_and_decode_state_shardings():
    """Benchmarks draw weights straight into shards (same values) and place decode state by rule."""
    from dflash_jax.config import ModelConfig
    from dflash_jax.model import init_params
    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    mesh = sh.make_mesh(2, 2)
    sharded = init_params(cfg, jax.random.key(0), mesh=mesh)
    assert sharded.layers[0].attn.qkv.addressable_shards[0].data.shape == (32, 1, 4, 8)
    assert sharded.layers[0].mlp.down.addressable_shards[0].data.shape == (32, 32)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(init_params(cfg, jax.random.key(0)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state = {"cache": KVCache.create(1, 4, 8, 2, 8), "out": jnp.zeros((4, 5)), "key": jax.random.key(1)}
    got = sh.state_shardings(state, mesh)
    assert got["cache"].k[0].spec == sh.P(sh.DP, None, sh.TP, None)
    assert got["cache"].lengths.spec == sh.P(sh.DP) and got["out"].spec == sh.P(sh.DP, None)
    assert got["key"].spec == sh.P()


# ----------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("kv_heads,impls", [(2, ("reference",)), (1, ("reference", "interpret"))],
                         ids=["kv_split", "kv_replicated"])
def test_attention_under_shard_map_equals_unsharded(kv_heads, impls):
    rng = np.random.RandomState(3)
    batch, width, q_heads, head_dim, max_len = 4, 8, 4, 16, 48
    q = jnp.asarray(rng.randn(batch, width, q_heads, head_dim), jnp.float32)
    k = jnp.asarray(rng.randn(batch, max_len, kv_heads, head_dim), jnp.float32)
    v = jnp.asarray(rng.randn(batch, max_len, kv_heads, head_dim), jnp.float32)
    lens = jnp.asarray([0, 17, 40, 5], jnp.int32)
    vis = np.tril(rng.rand(batch, width, width) < 0.5) | np.eye(width, dtype=bool)[None]
    vis = jnp.asarray(vis)
    ref = tree_attention(q, k, v, lens, vis, impl="reference")
    mesh = sh.make_mesh(2, 2)
    for impl in impls:
        fn = jax.jit(functools.partial(sh.attention, impl=impl))
        with sh.use_mesh(mesh):
            got = fn(q, k, v, lens, vis)
            causal = fn(q, k, v, lens)
        assert spec(got) == (sh.DP, None, sh.TP, None)
        assert rel_err(got, ref) <= 1e-5, impl
        assert rel_err(causal, tree_attention(q, k, v, lens, None, impl="reference")) <= 1e-5, impl


# ----------------------------------------------------------------------------- decoding

VOCAB = 8
NEW = 24


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tp_pair")
    target_model(vocab=VOCAB).save_pretrained(directory / "target")
    drafter_model(16, vocab=VOCAB).save_pretrained(directory / "draft")
    return directory


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(5)
    arr, lens = pad_prompts([rng.randint(0, VOCAB, rng.randint(2, 15)).tolist() for _ in range(4)], 16)
    return jnp.asarray(arr), jnp.asarray(lens)


def load_pair(directory, mesh):
    cfg, params = load_hf(directory / "target", mesh=mesh)
    dcfg, dparams = load_drafter(directory / "draft", mesh=mesh)
    return cfg, params, dcfg, dparams


def token_lists(g) -> list:
    toks, n = np.asarray(g.tokens), np.asarray(g.num_tokens)
    return [toks[b, :n[b]].tolist() for b in range(toks.shape[0])]


@pytest.fixture(scope="module")
def ar_tokens(pair_dir, prompts):
    cfg, params, _, _ = load_pair(pair_dir, None)
    return token_lists(generate_ar(params, cfg, *prompts, jax.random.key(0), max_new_tokens=NEW, max_len=128))


@pytest.mark.parametrize("dp,tp", MESHES)
def test_greedy_speculative_tp_equals_ar(pair_dir, prompts, ar_tokens, dp, tp):
    arr, lens = prompts
    ar = ar_tokens
    mesh = sh.make_mesh(dp, tp)
    cfg, params, dcfg, dparams = load_pair(pair_dir, mesh)
    assert dparams.layers[0].mlp.gate_up.addressable_shards[0].data.shape == (dcfg.hidden_size, 2,
                                                                              dcfg.intermediate_size // tp)
    # The drafter's block qkv and stacked context k/v split by kv head, like k and v.
    kvh, group = dcfg.num_kv_heads, dcfg.num_heads // dcfg.num_kv_heads
    assert {x.data.shape for x in dparams.layers[1].attn.qkv.addressable_shards} == {
        (dcfg.hidden_size, kvh // tp, group + 2, dcfg.head_dim)}
    assert {x.data.shape for x in dparams.context_kv.addressable_shards} == {
        (dcfg.hidden_size, dcfg.num_layers, kvh // tp, 2, dcfg.head_dim)}
    with sh.use_mesh(mesh):
        if dp > 1:  # (sampled AR at tp=2: test_sampling_over_a_sharded_vocabulary_is_exact)
            assert token_lists(generate_ar(params, cfg, arr, lens, jax.random.key(0), max_new_tokens=NEW,
                                           max_len=128)) == ar
        ddtree = SpecSettings(method="ddtree", block_size=16, budget=16, max_new_tokens=NEW)
        for s in (SpecSettings(method="dflash", block_size=16, max_new_tokens=NEW), ddtree):
            g = generate_speculative(params, cfg, dparams, dcfg, arr, lens, jax.random.key(0), settings=s,
                                     max_len=128)
            assert token_lists(g) == ar, s.method
            assert np.asarray(g.accepted).max() >= 2  # drafted tokens were accepted
            assert spec(g.tokens)[0] == (sh.DP if dp > 1 else None)


def test_sampling_over_a_sharded_vocabulary_is_exact(pair_dir, prompts):
    """Same key, same tokens: the sampler's random bits and reductions do not depend on tp."""
    arr, lens = prompts
    sp = SamplingParams(1.0, top_p=0.9)
    cfg, params, _, _ = load_pair(pair_dir, None)
    ref = generate_ar(params, cfg, arr, lens, jax.random.key(3), max_new_tokens=NEW, max_len=128, sampling=sp)
    mesh = sh.make_mesh(1, 2)
    cfg, params, _, _ = load_pair(pair_dir, mesh)
    assert params.embed.addressable_shards[0].data.shape == (VOCAB // 2, cfg.hidden_size)
    with sh.use_mesh(mesh):
        got = generate_ar(params, cfg, arr, lens, jax.random.key(3), max_new_tokens=NEW, max_len=128,
                          sampling=sp)
    assert token_lists(got) == token_lists(ref)


def test_cli_takes_tp_and_dp():
    from dflash_jax.cli import build_parser
    args = build_parser().parse_args(["generate", "hi", "--tp", "2", "--dp", "2"])
    assert (args.tp, args.dp) == (2, 2)


def test_row_parallel_dots_give_the_activation_dtype():
    """Under tp XLA all-reduces the o_proj / down_proj dot's own result, so that result must be
    in the activation dtype: a float32 result would double the bytes of every bf16 all-reduce
    (the CPU backend widens all-reduces to float32 anyway, so this checks the jaxpr)."""
    from dflash_jax.model import AttentionParams, MLPParams, mlp, output_projection

    def dot_out_dtypes(fn, *args):
        return [e.outvars[0].aval.dtype for e in jax.make_jaxpr(fn)(*args).eqns
                if e.primitive.name == "dot_general"]

    bf = jnp.bfloat16
    attn = AttentionParams(q=None, k=None, v=None, o=jnp.ones((4, 8, 32), bf))
    assert dot_out_dtypes(lambda a: output_projection(attn, a), jnp.ones((1, 3, 4, 8), bf)) == [bf]
    m = MLPParams(gate=jnp.ones((32, 64), bf), up=jnp.ones((32, 64), bf), down=jnp.ones((64, 32), bf))
    # gate and up stay float32 (the activation is computed in float32); down is bf16
    assert dot_out_dtypes(lambda x: mlp(m, x), jnp.ones((1, 3, 32), bf)) == [jnp.float32, jnp.float32, bf]


def test_collectives_bench_runs_on_fake_devices(tmp_path):
    from dflash_jax.bench import collectives

    args = argparse.Namespace(chain=2, rows=[1, 4], hidden=[64], dtypes=["bfloat16"], tiny=True,
                              variant_timeout=120)
    for variant in collectives.ALL_REDUCE:  # each variant's XLA flags must exist (CPU ignores them)
        res = collectives.run_variant(args, variant)
        assert "error" not in res, res
        assert [(r["rows"], r["dtype"]) for r in res["rows"]] == [(1, "bfloat16"), (4, "bfloat16")]
        assert all(r["us_per_allreduce"] >= 0 for r in res["rows"])
    with pytest.raises(ValueError, match="--variants: unknown variant 'fast'"):
        collectives.variant_env("fast")


def test_tp_bench_ar_step_under_each_all_reduce_variant():
    """The tp benchmark compiles the same step with each --all-reduce variant's options and finds
    the step's all-reduces (2 per layer + 1 for the vocab-parallel embedding) in its HLO."""
    from dflash_jax.bench import tensor_parallel as tpb
    from dflash_jax.bench.collectives import ALL_REDUCE

    cfg = tpb.TINY
    mesh = sh.make_mesh(1, 2)
    with sh.use_mesh(mesh):
        target = tpb.init_params(cfg, jax.random.key(0), jnp.bfloat16, mesh=mesh)
        for name, options in ALL_REDUCE.items():
            row = tpb.bench_ar(target, cfg, mesh, ctx=16, steps=2, max_len=64, compiler_options=options)
            assert row["ms_per_token"] > 0, name
            assert row["collectives_per_step"] >= 2 * cfg.num_layers + 1, (name, row)


def test_tp_bench_records_a_failing_variant_and_keeps_going(tmp_path, monkeypatch, capsys):
    """A tp > 1 variant after the first that fails is written down (error row, table line) and
    the run goes on; a failing baseline (the first variant) still ends the run."""
    import json

    from dflash_jax.bench import tensor_parallel as tpb
    from dflash_jax.bench.collectives import ALL_REDUCE

    def fake_ar(target, cfg, mesh, ctx, steps, max_len, options=None):
        if options == ALL_REDUCE["nccl-symmetric"]:
            raise RuntimeError("INTERNAL: symmetric window registration failed")
        return {"ms_per_token": 1.0, "collectives_per_step": 0, "collective_ms": None, "collective_share": None}

    def fake_round(target, dparams, cfg, dcfg, mesh, budget, *args, **kwargs):
        return {"budget": budget, "width": budget + 16, "round_ms": 2.0, "collectives_per_round": 0,
                "collective_ms": None, "collective_share": None}

    monkeypatch.setattr(tpb, "bench_ar", fake_ar)
    monkeypatch.setattr(tpb, "bench_round", fake_round)
    out = tmp_path / "tp.json"
    tpb.main(["--tiny", "--no-memory", "--all-reduce", "nccl", "nccl-symmetric", "nccl-sync", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["all_reduce"]) for r in rows] == [(1, None), (2, "nccl"), (2, "nccl-symmetric"),
                                                          (2, "nccl-sync")]
    assert "symmetric window registration failed" in rows[2]["error"] and "ar" not in rows[2]
    assert all("error" not in r and len(r["ddtree"]) == 2 for r in rows[:2] + rows[3:])
    assert "| tiny | 2 | nccl-symmetric | failed: RuntimeError: INTERNAL" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="symmetric window"):
        tpb.main(["--tiny", "--no-memory", "--all-reduce", "nccl-symmetric", "nccl", "--out", str(out)])
