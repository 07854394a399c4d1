"""The pass budget: how many rows one forward pass may hold, by hand."""
from prune_heads.models.batching import PassBudget, longest_first


def test_cached_rows_fit_copies_of_the_prefix_cache_in_the_budget():
    budget = PassBudget(bytes=1000, token_bytes=2, cache_token_bytes=1, logits_token_bytes=0)
    assert budget.cached_rows(100, most=8) == 8  # 100 B per row: 10 fit, capped at 8
    assert budget.cached_rows(300, most=8) == 3
    assert budget.cached_rows(5000, most=8) == 1  # never under one row
    assert budget.tokens() == 500 and budget.tokens(full_logits=True) == 500


def test_text_batches_go_longest_first_within_rows_and_tokens():
    seqs = [[0] * n for n in (3, 10, 7, 7, 2)]
    assert longest_first(seqs, batch_size=2) == [[1, 2], [3, 0], [4]]
    assert longest_first(seqs, batch_size=8, max_tokens=20) == [[1, 2], [3, 0], [4]]  # 3 rows x 7 = 21 > 20
    assert longest_first(seqs, batch_size=8, max_tokens=21) == [[1, 2], [3, 0, 4]]
