"""sampling.greedy_tokens: the same token as jnp.argmax, in two reductions, on hard rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.sampling import _argmax_chunk, greedy_tokens


def _hard_rows(rng: np.random.RandomState, shape: tuple[int, ...]) -> np.ndarray:
    """Few distinct levels (many ties, often across chunks), -inf, +-0.0 and some NaN rows."""
    x = rng.choice(np.array([-np.inf, -3.0, -0.0, 0.0, 1.5, 2.0], np.float32), size=shape)
    flat = x.reshape(-1, shape[-1])
    flat[0] = -np.inf                                 # all -inf: index 0
    if flat.shape[0] > 2:
        flat[1, rng.randint(shape[-1], size=3)] = np.nan  # NaN wins, the first one
        flat[2] = rng.choice(np.array([-0.0, 0.0], np.float32), size=shape[-1])
    return x


@pytest.mark.parametrize("vocab", [7, 8191, 12288, 151936 // 8, 30011])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_tokens_equal_argmax(vocab: int, dtype) -> None:
    rng = np.random.RandomState(vocab)
    x = jnp.asarray(_hard_rows(rng, (3, 5, vocab)), dtype)
    for chunk in (None, 64, 1000):
        got = jax.jit(greedy_tokens, static_argnums=1)(x, chunk)
        assert got.dtype == jnp.int32 and got.shape == (3, 5)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, -1)))


def test_greedy_tokens_random_rows_and_one_row() -> None:
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(4, 151936 // 16), jnp.float32)
    np.testing.assert_array_equal(greedy_tokens(x, 256), jnp.argmax(x, -1))
    np.testing.assert_array_equal(greedy_tokens(x[0], 256), jnp.argmax(x[0], -1))


def test_argmax_chunk_divides_when_it_can() -> None:
    assert 151936 % _argmax_chunk(151936) == 0 and 2048 <= _argmax_chunk(151936) <= 8192
    assert _argmax_chunk(49152) == 4096
    assert _argmax_chunk(8209) == 4096  # a prime: padded


def test_greedy_tokens_chunk_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk"):
        greedy_tokens(jnp.zeros((2, 10)), 0)
