"""Prompt-lookup index: matches the longest suffix n-gram and proposes what followed it."""
from specdecode.speculation.proposers.ngram import _NgramIndex


def brute_force_first_match(tokens, n):
    suffix = tokens[-n:]
    for end in range(n, len(tokens)):
        if tokens[end - n:end] == suffix:
            return end
    return None


def test_longest_suffix_wins_and_recent_match_is_preferred():
    tokens = [5, 1, 2, 3, 4, 9, 1, 2, 3, 4, 1, 2, 3]
    index = _NgramIndex(range(1, 4))
    index.update(tokens)
    assert index.lookup(tokens, 4) == ([4, 1, 2, 3], 3)  # after the latest earlier [1, 2, 3]
    assert index.lookup(tokens, 2) == ([4, 1], 3)
    assert index.lookup(tokens + [7], 2) == ([], 0)


def test_repetition_loop_falls_back_to_the_first_match():
    tokens = [7, 8, 1, 2, 1, 2, 1, 2]
    index = _NgramIndex(range(1, 3))
    index.update(tokens)
    # The latest [1, 2] (ending at 6) leaves only two tokens to copy; the first one leaves four.
    assert index.lookup(tokens, 5) == (tokens[brute_force_first_match(tokens, 2):][:5], 2)


def test_no_match_and_incremental_updates():
    index = _NgramIndex(range(2, 3))
    tokens = [1, 2, 3]
    index.update(tokens)
    assert index.lookup(tokens, 3) == ([], 0)
    tokens += [1, 2]
    index.update(tokens)
    assert index.lookup(tokens, 3) == ([3, 1, 2], 2)
