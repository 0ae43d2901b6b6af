"""The lookahead step layout: one target forward = [last token] + Jacobi window + candidate trie.

Terms
-----
last token
    The newest committed token. Its KV is not in the cache yet; it is the first input of the step, at position
    ``p`` (= cache length), and the root of both branches.
Jacobi window (lookahead branch)
    ``rows``: a ``[N-1, W]`` grid of guesses (Fu et al. 2024, Fig. "mask"). ``rows[l, j]`` sits at position
    ``p + l + j``; ``rows[0, 0]`` *is* the last token. Token ``rows[l, j]`` attends to ``rows[0, 0..j]`` and to
    ``rows[1..l, j]`` (its own column above it): a path over consecutive positions. The logits of the bottom row
    ``rows[N-2, :]`` give ``out``, the next guess of every column; column ``j`` then yields the n-gram
    ``(rows[0, j], ..., rows[N-2, j], out[j])``. With ``N = 2`` the window is a plain causal Jacobi row.
candidate trie (verification branch)
    Candidates (token sequences that continue the last token) merged on shared prefixes. Node ``i`` sits at
    ``p + depth[i]`` and attends to the last token, its ancestors and itself, never to the window.

The two branches never see each other, so one forward does a Jacobi iteration and verifies every candidate.
Everything here is a pure function of token ids; ``drafters/lookahead.py`` keeps the state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from .round import Candidate, ExtraInputs, Proposal, Source


# ----------------------------------------------------------------------------------------------------------------
# Candidate trie
# ----------------------------------------------------------------------------------------------------------------

def merge_candidates(candidates: Sequence[Candidate], max_nodes: int, **fields) -> Proposal:
    """Merge ``candidates`` (in priority order) into a trie proposal of at most ``max_nodes`` nodes.

    A node shared by several candidates is one input, and records the source of every candidate that offered it
    (at its depth; two candidates of one source, two entries: each is judged, as before the redesign);
    a candidate that does not fit is truncated, so the budget goes to the highest-priority candidates first.
    ``fields`` go to the ``Proposal`` (draft time, extra inputs, ...).

    >>> trie = merge_candidates([Candidate((7, 8, 9), ("history", 2)), Candidate((7, 8, 5), ("pool", 0)),
    ...                          Candidate((3,), ("pool", 0))], max_nodes=4)
    >>> trie.tokens, trie.parents, trie.depths
    ((7, 8, 9, 5), (-1, 0, 1, 1), (1, 2, 3, 3))
    >>> [[(s.kind, s.position) for s in node] for node in trie.sources]
    [[('history', 1), ('pool', 1)], [('history', 2), ('pool', 2)], [('history', 3)], [('pool', 3)]]
    """
    tokens: list[int] = []
    parents: list[int] = []
    sources: list[list[Source]] = []
    children: dict[tuple[int, int], int] = {}
    for candidate in candidates:
        node = -1
        for depth, token in enumerate(candidate.tokens, start=1):
            key = (node, int(token))
            if key not in children:
                if len(tokens) >= max_nodes:
                    break
                children[key] = len(tokens)
                tokens.append(int(token))
                parents.append(node)
                sources.append([])
            node = children[key]
            sources[node].append(Source(candidate.source[0], candidate.source[1], depth))  # once per candidate
    return Proposal(tokens=tuple(tokens), parents=tuple(parents), sources=tuple(tuple(s) for s in sources),
                    **fields)


# ----------------------------------------------------------------------------------------------------------------
# Jacobi window
# ----------------------------------------------------------------------------------------------------------------


def window_size(window: int, ngram: int) -> int:
    """Tokens the window puts in the forward, the last token included: ``(N-1) * W``."""
    return (ngram - 1) * window


def harvest_ngrams(rows: torch.Tensor, out: torch.Tensor, age: torch.Tensor) -> list[tuple[int, ...]]:
    """Column n-grams ``(rows[0, j], ..., rows[N-2, j], out[j])`` of the columns whose guesses are all real.

    rows: [N-1, W] window tokens; out: [W] the target's choice after ``rows[N-2, j]``; age: [W] steps since column
    ``j`` was filled with placeholders (a column is harvested once ``age >= N-2``: every row below the key is a
    model prediction).
    """
    ngram_minus_one, _ = rows.shape
    columns = torch.cat([rows, out[None, :]], dim=0).T  # [W, N]
    ready = (age >= ngram_minus_one - 1).tolist()
    return [tuple(column) for column, ok in zip(columns.tolist(), ready) if ok]


def advance_window(
    rows: torch.Tensor, out: torch.Tensor, age: torch.Tensor, num_emitted: int, next_last: int, fill: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-align the window to the new last token after ``num_emitted`` tokens were committed this step.

    One Jacobi iteration moves every column one level up (``rows[l] <- rows[l+1]``, bottom row <- ``out``: each
    column stays a chain of successive predictions); committing ``a = num_emitted`` tokens moves the origin by
    ``a`` positions, so columns shift left by ``a - 1`` (LADE always shifts by one, whatever was accepted). The
    ``a - 1`` columns that enter on the right get ``fill`` tokens and age 0.

    rows: [N-1, W]; out: [W]; age: [W]; fill: [N-1, W] placeholder tokens (only the needed columns are used).
    Returns ``(new_rows [N-1, W], new_age [W])``; ``new_rows[0, 0] = next_last``.
    """
    assert num_emitted >= 1
    ngram_minus_one, window = rows.shape
    stacked = torch.cat([rows[1:], out[None, :]], dim=0)  # [N-1, W], one level up
    shift = min(num_emitted - 1, window)
    new_rows = torch.cat([stacked[:, shift:], fill[:, :shift]], dim=1)
    new_age = torch.cat([age[shift:] + 1, torch.zeros(shift, dtype=age.dtype)])
    new_rows[0, 0] = next_last
    return new_rows, new_age


# ----------------------------------------------------------------------------------------------------------------
# One forward: input ids, position ids, 4-D mask
# ----------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _window_block(window: int, ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention block [S, S] (S = (N-1)*W, row-major over rows[l, j]) and position offsets [S] of the window.

    Cached: the same for every step with this (W, N). Callers must not modify the returned tensors.
    """
    levels = torch.arange(ngram - 1).repeat_interleave(window)  # [S] level l of each input
    columns = torch.arange(window).repeat(ngram - 1)  # [S] column j
    q_level, k_level = levels[:, None], levels[None, :]
    q_col, k_col = columns[:, None], columns[None, :]
    # rows[l, j] sees rows[0, 0..j] and rows[1..l, j]
    sees_row0 = (k_level == 0) & (k_col <= q_col)
    sees_column = (k_level >= 1) & (k_level <= q_level) & (k_col == q_col)
    block = sees_row0 | sees_column
    block[:, 0] = True  # the last token (rows[0, 0]) is seen by everybody
    return block, levels + columns


def window_inputs(rows: torch.Tensor) -> ExtraInputs:
    """The Jacobi window ``rows`` [N-1, W] (``rows[0, 0]`` = the last token) as extra inputs of a forward: every
    window token but the last token itself, with its position offset and mask, reading the bottom row (for the
    empty window W=1, N=2 that is the last token itself: no extra inputs, one read).

    >>> extra = window_inputs(torch.tensor([[42, 10], [11, 12]]))
    >>> extra.token_ids.tolist(), extra.offsets.tolist(), extra.read.tolist()
    ([10, 11, 12], [1, 1, 2], [2, 3])
    >>> window_inputs(torch.tensor([[42]])).read.tolist()
    [0]
    """
    ngram_minus_one, window = rows.shape
    block, offsets = _window_block(window, ngram_minus_one + 1)
    bottom = torch.arange((ngram_minus_one - 1) * window, ngram_minus_one * window)  # [W] the bottom row
    return ExtraInputs(token_ids=rows.reshape(-1)[1:].clone(), offsets=offsets[1:].clone(),
                       mask=block[1:, 1:].clone(), read=bottom)


@dataclass(frozen=True)
class RoundLayout:
    """One row's inputs of a round, ``n = 1 + w + T``: [last token] + extra inputs + trie nodes, relative to the
    row's next position p (the last token sits at p, extra input i at p + its offset, node i at p + its depth).

    input_ids: [n]; offsets: [n] positions after p; inner: [n, n] bool, which of the round's inputs each input
    sees (True = attend; everybody also sees the row's cache), or None for a plain chain (causal);
    logits_index: [R] the inputs whose logits are needed: the last token, each node, then the read inputs;
    read_rows: [r] where the read inputs' logits sit among those R; num_extra: w.
    """

    input_ids: torch.Tensor
    offsets: torch.Tensor
    inner: torch.Tensor | None
    logits_index: torch.Tensor
    read_rows: torch.Tensor
    num_extra: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def kept_inputs(self, accepted: Sequence[int]) -> list[int]:
        """Indices of the inputs whose KV the cache keeps: the last token and the accepted nodes."""
        return [0] + [1 + self.num_extra + node for node in accepted]


def is_plain_chain(proposal: Proposal) -> bool:
    """A chain with no extra inputs: the one layout a model needs no mask for."""
    no_extra = proposal.extra is None or proposal.extra.num_tokens == 0
    return no_extra and all(parent == node - 1 for node, parent in enumerate(proposal.parents))


@lru_cache(maxsize=64)
def positions(n: int) -> torch.LongTensor:
    """``torch.arange(n)``, made once per n: the offsets and logits rows of a chain of n inputs. Shared: callers
    must not modify it."""
    return torch.arange(n)


NOTHING_READ = torch.zeros(0, dtype=torch.long)  # no inputs read: shared, never modified


def round_layout(proposal: Proposal, last_token: int) -> RoundLayout:
    """The inputs, position offsets and visibility of one row's round. Node i sees the last token, its ancestors
    and itself; extras see the last token and what their own mask says; the two never see each other.

    >>> from hf_specdec.round import Proposal, Source
    >>> trie = Proposal(tokens=(5, 6, 7), parents=(-1, 0, 0), sources=((Source("pool", 0, 1),),) * 3)
    >>> step = round_layout(trie, last_token=42)
    >>> step.input_ids.tolist(), step.offsets.tolist(), step.logits_index.tolist()
    ([42, 5, 6, 7], [0, 1, 2, 2], [0, 1, 2, 3])
    >>> step.inner.int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    """
    extra = proposal.extra
    read = extra.read if extra is not None else NOTHING_READ
    if proposal.device_tokens is not None:  # a chain still on the device: its inputs are put together there
        assert extra is None, "a chain on the device has no extra inputs"
        nodes = proposal.device_tokens
        n = 1 + nodes.shape[0]
        return RoundLayout(torch.cat([nodes.new_full((1,), last_token), nodes]), positions(n), None, positions(n),
                           read, 0)
    if is_plain_chain(proposal):
        n = 1 + len(proposal.tokens)
        return RoundLayout(torch.tensor((last_token, *proposal.tokens), dtype=torch.long), positions(n), None,
                           positions(n), read, 0)
    nodes = torch.tensor(proposal.tokens, dtype=torch.long)
    num_nodes = nodes.shape[0]
    extra_ids = extra.token_ids if extra is not None else torch.zeros(0, dtype=torch.long)
    num_extra = int(extra_ids.shape[0])
    total = 1 + num_extra + num_nodes
    inner = torch.zeros(total, total, dtype=torch.bool)
    inner[:, 0] = True  # everybody sees the last token
    if extra is not None:
        inner[1: 1 + num_extra, 1: 1 + num_extra] = extra.mask
    if num_nodes:
        # ancestors-or-self of node i, as [T, T] bool, built parent-first (node ids are topologically sorted)
        ancestry = torch.eye(num_nodes, dtype=torch.bool)
        for node, parent in enumerate(proposal.parents):
            if parent >= 0:
                ancestry[node] |= ancestry[parent]
        inner[1 + num_extra:, 1 + num_extra:] = ancestry
    offsets = torch.cat([torch.zeros(1, dtype=torch.long),
                         extra.offsets if extra is not None else torch.zeros(0, dtype=torch.long),
                         torch.tensor(proposal.depths, dtype=torch.long)])
    logits_index = torch.cat([torch.zeros(1, dtype=torch.long), 1 + num_extra + torch.arange(num_nodes), read])
    return RoundLayout(torch.cat([torch.tensor([last_token]), extra_ids, nodes]), offsets, inner, logits_index,
                       1 + num_nodes + torch.arange(read.shape[0]), num_extra)


@dataclass(frozen=True)
class BatchInputs:
    """The rows' layouts stacked into one forward, each row padded to the longest with inputs nobody sees.

    input_ids / offsets / valid: [B, n] (valid: False for padding); inner: [B, n, n] bool or None when every
    row is a plain chain (the model's own causal mask then applies).
    """

    input_ids: torch.Tensor
    offsets: torch.Tensor
    valid: torch.Tensor | None
    inner: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def stack_layouts(layouts: Sequence[RoundLayout], pad_token: int = 0) -> BatchInputs:
    """Stack rows for one forward. A padding input sits after its row's inputs and sees only itself.

    >>> chain = round_layout(Proposal.chain([5, 6], [Source("draft", 0, 1), Source("draft", 0, 2)]), 4)
    >>> plain = round_layout(Proposal(), 9)
    >>> batch = stack_layouts([chain, plain])
    >>> batch.input_ids.tolist(), batch.valid.tolist(), batch.inner is None
    ([[4, 5, 6], [9, 0, 0]], [[True, True, True], [True, False, False]], True)
    """
    if len(layouts) == 1:  # one row: its layout as it is, no padding
        layout = layouts[0]
        return BatchInputs(layout.input_ids[None], layout.offsets[None], None,
                           None if layout.inner is None else layout.inner[None])
    n = max(layout.num_tokens for layout in layouts)
    rows = len(layouts)
    # the tokens where they are (a drafter's may still be on the device), padded there; the rest on the host
    input_ids = torch.stack([torch.nn.functional.pad(layout.input_ids, (0, n - layout.num_tokens), value=pad_token)
                             for layout in layouts])
    offsets = torch.arange(n).repeat(rows, 1)
    valid = torch.zeros(rows, n, dtype=torch.bool)
    trees = any(layout.inner is not None for layout in layouts)
    inner = torch.eye(n, dtype=torch.bool).repeat(rows, 1, 1) if trees else None
    for row, layout in enumerate(layouts):
        m = layout.num_tokens
        offsets[row, :m] = layout.offsets
        valid[row, :m] = True
        if inner is not None:
            inner[row, :m, :m] = layout.inner if layout.inner is not None else torch.ones(m, m).tril().bool()
    return BatchInputs(input_ids, offsets, None if bool(valid.all()) else valid, inner)


def to_model_mask(mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask (True = attend) in the form the attention implementation takes.

    SDPA takes the bool mask as is; eager adds the mask to the scores, so it gets 0 / dtype-min floats.
    """
    if attn_implementation == "sdpa":
        return mask
    if attn_implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    raise ValueError(
        f"lookahead decoding needs a custom 4-D attention mask, which attn_implementation={attn_implementation!r} "
        "cannot take; load the model with attn_implementation='sdpa' or 'eager'."
    )
