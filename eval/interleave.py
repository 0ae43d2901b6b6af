"""The order the modes of a comparison run in, prompt by prompt: rows of a balanced Latin square.

A timed call is not independent of its place in the order: on the 2-core CPUs here, swapping two modes in a
before/after run, and nothing else, moved their ratio from 0.967x to 1.001x (docs/benchmarks.md, stop 33; the
order rotated by one per prompt had put the old code right after plain ``generate`` on 3 of 5 prompts). Rotating
the order by one each prompt puts every mode in every position, but each mode always behind the same neighbour;
a fixed order does neither.

Williams' design (Williams 1949, "Experimental designs balanced for the estimation of residual effects of
treatments") fixes both: over every ``len(williams_rows(n))`` consecutive prompts each mode runs once in every
position and right after every other mode once. For even n that is n orders; for odd n the n orders and their
mirror images. Run a multiple of that many prompts for a balanced comparison (``balanced``).

Worked example, modes a b c d (n = 4). Williams' first order is 0, 1, n-1, 2, n-2, ... (a b d c), each next one
shifted by one (b c a d, c d b a, d a c b); renaming the modes so that the first order is the one given:

    prompt 0: a b c d
    prompt 1: b d a c
    prompt 2: d c b a
    prompt 3: c a d b

a follows b, c and d once each, and so does every other mode; each mode is once first, once second, ...; prompt 4
starts the square again. The first prompt runs the modes in the order given, so a script whose first mode makes
the process's first call keeps it.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

Mode = TypeVar("Mode")


def williams_rows(n: int) -> list[list[int]]:
    """The orders of n modes (as indices) that balance position and predecessor.

    >>> williams_rows(4)
    [[0, 1, 2, 3], [1, 3, 0, 2], [3, 2, 1, 0], [2, 0, 3, 1]]
    >>> williams_rows(3)  # odd: the 3 orders and their mirror images
    [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1], [1, 0, 2]]
    >>> williams_rows(1)
    [[0]]
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first, low = first + [low], low + 1
        else:
            first, high = first + [high], high - 1
    rows = [[(x + shift) % n for x in first] for shift in range(n)]
    rows = rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows
    name = {mode: i for i, mode in enumerate(first)}  # renamed so that the first order is 0, 1, ..., n-1
    return [[name[x] for x in row] for row in rows]


def order(modes: Sequence[Mode], index: int) -> list[Mode]:
    """The modes in the order the ``index``-th prompt (or repeat of one) runs them.

    >>> [''.join(order("abcd", i)) for i in range(5)]
    ['abcd', 'bdac', 'dcba', 'cadb', 'abcd']
    """
    rows = williams_rows(len(modes))
    return [modes[i] for i in rows[index % len(rows)]]


def balanced(modes: Sequence[Mode], prompts: int) -> bool:
    """Whether ``prompts`` orders of ``modes`` are whole squares (every position and predecessor equally often).

    >>> balanced("abcd", 8), balanced("abcd", 5), balanced("abc", 3), balanced("abc", 6)
    (True, False, False, True)
    """
    return prompts % len(williams_rows(len(modes))) == 0
