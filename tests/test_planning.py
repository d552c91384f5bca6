import numpy as np

from hsx.defaults import DEFAULT_MAX_BATCH_ROWS, DEFAULT_PAD_MULTIPLE, DEFAULT_TOKEN_BUDGET, DEFAULT_WINDOW_ROWS
from hsx.prep.planning import cut_batches, padding_fraction


def _lognormal_lengths(n: int) -> np.ndarray:
    """A realistic length mix: lognormal, median ~600, capped at 4096 tokens."""
    rng = np.random.default_rng(11)
    return np.clip(rng.lognormal(np.log(600), 0.8, n).astype(np.int64), 8, 4096)


def test_windowed_plan_of_a_million_rows_pads_at_most_one_percent():
    lengths = _lognormal_lengths(1_000_000)
    batches = []
    for start in range(0, len(lengths), DEFAULT_WINDOW_ROWS):
        batches += cut_batches(lengths[start:start + DEFAULT_WINDOW_ROWS], DEFAULT_TOKEN_BUDGET,
                               DEFAULT_MAX_BATCH_ROWS, DEFAULT_PAD_MULTIPLE)
    assert sum(b.tokens for b in batches) == int(lengths.sum())
    assert sum(len(b.members) for b in batches) == len(lengths)
    assert padding_fraction(batches) <= 0.01
    assert all(b.padded <= DEFAULT_TOKEN_BUDGET and len(b.members) <= DEFAULT_MAX_BATCH_ROWS for b in batches)


def test_cut_is_longest_first_greedy_and_stable():
    batches = cut_batches([5, 9, 9, 3, 9, 1], token_budget=20, max_rows=3, pad_multiple=2)
    assert [b.members for b in batches] == [[1, 2], [4, 0], [3, 5]]
    assert [(b.padded_len, b.tokens, b.padded) for b in batches] == [(10, 18, 20), (10, 14, 20), (4, 4, 8)]
    assert cut_batches([], 10, 2) == []
