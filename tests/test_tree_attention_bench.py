"""The kernel benchmark's shapes."""

from dflash_jax.bench.tree_attention_bench import Shape


def test_cache_slots_are_a_multiple_of_8_and_bytes_count_the_used_slots():
    """W 257 at ctx 4096 needs 4353 slots; the cache has 4360 (the Hopper kernel's TMA tiling
    refuses other lengths), and the bytes read stay those of the 4353 used slots."""
    s = Shape(batch=1, ctx=4096, width=257, q_heads=32, kv_heads=8, head_dim=128)
    assert s.max_len == 4360
    assert s.kv_bytes(2) == 2 * 4353 * 8 * 128 * 2
    assert Shape(batch=2, ctx=4096, width=272, q_heads=32, kv_heads=8, head_dim=128).max_len == 4368
