"""Where lookahead candidates come from: an n-gram pool and an index over the text seen so far.

Two sources, both plain Python over token ids (no model, no tensors):

``NgramPool``
    The lookahead pool of Fu et al. (2024): n-grams harvested from the Jacobi window every step, keyed by their
    first token, at most ``max_per_key`` continuations per key, least recently used evicted first.

``HistoryIndex``
    Prompt lookup over the prompt plus everything generated so far (code repeats itself a lot): the most recent
    earlier occurrences of the last 1..``max_match`` tokens, and what followed them. Longer matches rank first,
    then the continuation that followed most often.
    This replaces LADE's ``POOL_FROM_PROMPT`` (which only stores fixed-length n-grams keyed by one token) with
    variable-length continuations, so one candidate can run past N tokens.

Example::

    >>> pool = NgramPool(max_per_key=2)
    >>> pool.add((5, 6, 7)); pool.add((5, 8, 9)); pool.add((5, 6, 7)); pool.add((5, 1, 2))
    >>> pool.lookup(5)          # most recent first; (5, 8, 9) was the least recently used and is gone
    [(1, 2), (6, 7)]
    >>> index = HistoryIndex([1, 2, 3, 4, 1, 2], max_match=2)
    >>> index.continuations(max_len=3, limit=2)    # "1 2" was followed by "3 4 1"
    [(3, 4, 1)]
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable, Sequence


class NgramPool:
    """n-grams keyed by their first token; each key keeps its ``max_per_key`` most recently used continuations."""

    def __init__(self, max_per_key: int) -> None:
        if max_per_key < 1:
            raise ValueError(f"max_per_key={max_per_key!r} is invalid: use an int >= 1.")
        self.max_per_key = max_per_key
        self._by_key: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def __len__(self) -> int:
        return sum(len(conts) for conts in self._by_key.values())

    def add(self, ngram: Sequence[int]) -> None:
        """Store ``ngram[1:]`` under ``ngram[0]``; a repeat only refreshes its recency."""
        if len(ngram) < 2:
            return
        key, continuation = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        conts = self._by_key.setdefault(key, OrderedDict())
        if continuation in conts:
            conts.move_to_end(continuation)
            return
        conts[continuation] = None
        if len(conts) > self.max_per_key:
            conts.popitem(last=False)  # least recently used

    def add_all(self, ngrams: Iterable[Sequence[int]]) -> None:
        for ngram in ngrams:
            self.add(ngram)

    def lookup(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """Continuations stored under ``key``, most recently used first."""
        conts = self._by_key.get(int(key))
        if not conts:
            return []
        found = list(reversed(conts))
        return found if limit is None else found[:limit]


class HistoryIndex:
    """Prompt lookup over a growing token history, with an incremental index of every 1..max_match-gram."""

    def __init__(self, tokens: Sequence[int] = (), max_match: int = 3) -> None:
        if max_match < 1:
            raise ValueError(f"max_match={max_match!r} is invalid: use an int >= 1.")
        self.max_match = max_match
        self.tokens: list[int] = []
        # n-gram -> end positions (index just past the n-gram), in increasing order
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for n in range(1, min(self.max_match, end) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def continuations(
        self, max_len: int, limit: int, suffix: Sequence[int] = (), max_scan: int = 8, min_match: int = 1
    ) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations (each at most ``max_len`` tokens) of ``history + suffix``.

        Matches of the last ``max_match`` tokens come first, then shorter ones; within a length, the most frequent
        next token first, then the most recent occurrence. At most ``max_scan`` occurrences (the newest) are
        examined per match length.
        """
        return [continuation for continuation, _ in self.matches(max_len, limit, suffix, max_scan, min_match)]

    def matches(
        self, max_len: int, limit: int, suffix: Sequence[int] = (), max_scan: int = 16, min_match: int = 1,
        suffix_only: bool = False,
    ) -> list[tuple[tuple[int, ...], int]]:
        """``continuations`` with, for each, the length of the match it came from (how much context agreed).

        Within one match length, the continuation whose first token followed the context most often among the
        ``max_scan`` most recent occurrences comes first (the text's own estimate of what comes next; REST and
        SuffixDecoding rank by frequency too), ties to the most recent.
        ``suffix_only``: the context is ``suffix`` alone (look up text from elsewhere in this history)."""
        context = ([] if suffix_only else self.tokens[-self.max_match:]) + [int(t) for t in suffix]
        context = context[-self.max_match:]  # only this much can match
        if max_len < 1 or limit < 1 or not context:
            return []
        found: list[tuple[tuple[int, ...], int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_match, len(context)), max(min_match, 1) - 1, -1):
            ends = self._ends.get(tuple(context[-n:]), [])
            last = len(ends) - 1
            if last >= 0 and ends[last] == len(self.tokens):
                last -= 1  # the end of the history matches itself, with nothing after it
            recent = [tuple(self.tokens[ends[i] : ends[i] + max_len])  # the newest occurrences first
                      for i in range(last, max(last - max_scan, -1), -1)]
            followed = Counter(continuation[0] for continuation in recent)
            for continuation in sorted(recent, key=lambda c: -followed[c[0]]):  # stable: recency breaks ties
                if continuation not in seen and not _is_prefix_of_any(continuation, found):
                    seen.add(continuation)
                    found.append((continuation, n))
                    if len(found) >= limit:
                        return found
        return found


def _is_prefix_of_any(candidate: tuple[int, ...], others: list[tuple[tuple[int, ...], int]]) -> bool:
    return any(len(other) >= len(candidate) and other[: len(candidate)] == candidate for other, _ in others)
