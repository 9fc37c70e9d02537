import numpy as np
import pytest

from zephon.core.keys import draw, fold_in, permutation, permute, permute_np, randbelow, seed_key


def test_fold_in_is_deterministic_and_sensitive_to_every_part():
    base = fold_in(seed_key(0), "shuffle", 3)
    assert base == fold_in(seed_key(0), "shuffle", 3)
    assert len({base, fold_in(seed_key(1), "shuffle", 3), fold_in(seed_key(0), "shufflf", 3), fold_in(seed_key(0), "shuffle", 4)}) == 4


def test_fold_in_rejects_floats_and_bools():
    with pytest.raises(TypeError, match="ints, strings or bytes"):
        fold_in(0, 1.5)
    with pytest.raises(TypeError):
        seed_key(True)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_permute_is_a_permutation_and_vector_form_agrees(n):
    key = fold_in(seed_key(5), "p")
    scalar = [permute(i, n, key) for i in range(n)]
    assert sorted(scalar) == list(range(n))
    assert permute_np(np.arange(n), n, key).tolist() == scalar
    assert permutation(n, key).tolist() == scalar


def test_permute_rejects_out_of_range():
    with pytest.raises(IndexError):
        permute(5, 5, 0)


def test_randbelow_covers_range_roughly_uniformly():
    key = seed_key(1)
    counts = np.bincount([randbelow(key, c, 10) for c in range(20000)], minlength=10)
    assert counts.min() > 1800 and counts.max() < 2200


def test_draws_differ_per_counter():
    key = seed_key(2)
    assert len({draw(key, c) for c in range(1000)}) == 1000


def test_golden_permutation_seed_42():
    # Pinned: changing the permutation changes every shuffled order (a breaking change).
    assert permutation(10, fold_in(seed_key(42), "golden")).tolist() == GOLDEN_PERM


# Known-answer value (like JAX's PRNG known-answer tests); update only with a breaking-change note.
GOLDEN_PERM = [6, 8, 0, 4, 7, 5, 2, 3, 9, 1]
