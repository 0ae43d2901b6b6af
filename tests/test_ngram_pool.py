"""The lookahead n-gram pool (harvest, LRU eviction) and prompt lookup over the history."""

from hf_specdec.ngram_pool import HistoryIndex, NgramPool


def test_pool_keeps_most_recent_continuations_per_key():
    pool = NgramPool(max_per_key=2)
    pool.add_all([(5, 6, 7), (5, 8, 9), (4, 1, 1)])
    assert pool.lookup(5) == [(8, 9), (6, 7)]
    pool.add((5, 6, 7))  # a repeat refreshes, it does not duplicate
    assert pool.lookup(5) == [(6, 7), (8, 9)]
    pool.add((5, 1, 2))  # evicts the least recently used: (8, 9)
    assert pool.lookup(5) == [(1, 2), (6, 7)]
    assert pool.lookup(5, limit=1) == [(1, 2)]
    assert pool.lookup(4) == [(1, 1)] and pool.lookup(99) == []
    assert len(pool) == 3
    pool.add((3,))  # too short to be an n-gram
    assert pool.lookup(3) == []


def test_history_prefers_longer_then_more_recent_matches():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 2, 3]
    index = HistoryIndex(tokens, max_match=2)
    # "2 3" occurs ending at 6 (then 8 7 ...) and at 3 (then 9 2 ...): most recent first
    # the 1-gram "3" ends at the same places, so it adds nothing new
    assert index.continuations(max_len=3, limit=5) == [(8, 7, 2), (9, 2, 3)]
    assert index.continuations(max_len=2, limit=1) == [(8, 7)]


def test_history_ranks_the_most_frequent_continuation_first():
    # after "5": 1 once (most recent), 2 twice; the text's own estimate puts 2 first, recency breaks the 1-1 tie
    index = HistoryIndex([5, 2, 0, 5, 2, 3, 5, 1, 4, 5], max_match=1)
    assert index.continuations(max_len=2, limit=3) == [(2, 3), (2, 0), (1, 4)]
    assert index.continuations(max_len=2, limit=3, max_scan=1) == [(1, 4)]  # only the most recent occurrence


def test_history_grows_and_skips_prefixes_of_found_candidates():
    index = HistoryIndex([4, 5, 6, 4, 5], max_match=3)
    assert index.continuations(max_len=4, limit=4) == [(6, 4, 5)]
    index.extend([6])
    assert index.continuations(max_len=2, limit=4) == [(4, 5)]
    assert HistoryIndex([], max_match=2).continuations(max_len=3, limit=3) == []
    assert HistoryIndex([1, 2, 3], max_match=2).continuations(max_len=3, limit=3) == []
