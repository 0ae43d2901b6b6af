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


# ----------------------------------------------------------------------------------------------------------------
# Candidate trie
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trie:
    """Candidates merged on shared prefixes. Node ids follow insertion order, so a parent precedes its children.

    tokens[i]: token of node i; parents[i]: parent node id, ``-1`` for children of the last token (the root);
    depths[i]: 1 for the root's children.
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    depths: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[tuple[int, int], int]:
        """(parent node id, token) -> child node id."""
        return {(parent, token): node for node, (parent, token) in enumerate(zip(self.parents, self.tokens))}

    def path(self, node: int) -> list[int]:
        """Node ids from the root's child down to ``node``."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def build_trie(candidates: Sequence[Sequence[int]], max_nodes: int) -> Trie:
    """Merge ``candidates`` (in priority order) into a trie of at most ``max_nodes`` nodes.

    A candidate that does not fit is truncated, so the budget goes to the highest-priority candidates first.

    >>> build_trie([[7, 8, 9], [7, 8, 5], [3]], max_nodes=4)
    Trie(tokens=(7, 8, 9, 5), parents=(-1, 0, 1, 1), depths=(1, 2, 3, 3))
    """
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for candidate in candidates:
        node = -1
        for depth, token in enumerate(candidate, start=1):
            key = (node, int(token))
            if key not in children:
                if len(tokens) >= max_nodes:
                    break
                children[key] = len(tokens)
                tokens.append(int(token))
                parents.append(node)
                depths.append(depth)
            node = children[key]
    return Trie(tuple(tokens), tuple(parents), tuple(depths))


def verify_tree(trie: Trie, target_tokens: Sequence[int]) -> tuple[list[int], int]:
    """Walk the trie along the target's own choices.

    target_tokens: ``1 + len(trie)`` tokens; ``target_tokens[0]`` is the target's choice after the last token,
        ``target_tokens[1 + i]`` its choice after node ``i`` (argmax for greedy; one sample per node when sampling).
    Returns ``(accepted_nodes, next_token)``: the node ids of the accepted path (root's child first) and the
    token that follows it (the bonus token if the path ends at a leaf, else the recovered token).

    Lossless when sampling: every candidate is deterministic, so following the child that equals an independent
    sample of the target at each node (SpecInfer with one-hot drafts) emits exactly target samples.

    >>> trie = build_trie([[7, 8, 9], [7, 8, 5], [3]], max_nodes=8)
    >>> verify_tree(trie, [7, 8, 5, 0, 1, 2])   # root->7 (node 0) ->8 (node 1) ->5 (node 3), then 1
    ([0, 1, 3], 1)
    >>> verify_tree(trie, [4, 8, 5, 0, 1, 2])   # target wants 4: nothing accepted
    ([], 4)
    """
    assert len(target_tokens) == 1 + len(trie), (len(target_tokens), len(trie))
    children = trie.children()
    accepted: list[int] = []
    node = -1
    while True:
        wanted = int(target_tokens[node + 1])
        child = children.get((node, wanted))
        if child is None:
            return accepted, wanted
        accepted.append(child)
        node = child


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


@dataclass(frozen=True)
class StepLayout:
    """Inputs of one lookahead forward over ``L = (N-1)*W + len(trie)`` new tokens.

    input_ids: [1, L]; position_ids: [1, L]; attention_mask: [1, 1, L, past + L] bool, True = attend.
    window_out_index: [W] inputs whose logits continue the window columns (the bottom row).
    trie_index: [1 + T] inputs whose logits verify the trie: the last token (index 0), then node i.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    window_out_index: torch.Tensor
    trie_index: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


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


def build_layout(rows: torch.Tensor, trie: Trie, past_length: int, device: torch.device | str = "cpu") -> StepLayout:
    """Input ids, position ids and the 4-D attention mask of one lookahead step.

    rows: [N-1, W] window tokens with ``rows[0, 0]`` = the last token; trie: the candidates; past_length: tokens
    already in the KV cache (so the last token sits at ``p = past_length``).
    """
    ngram_minus_one, window = rows.shape
    window_len = ngram_minus_one * window
    num_nodes = len(trie)
    total = window_len + num_nodes
    block, window_offsets = _window_block(window, ngram_minus_one + 1)

    inner = torch.zeros(total, total, dtype=torch.bool)
    inner[:window_len, :window_len] = block
    if num_nodes:
        # ancestors-or-self of node i, as [T, T] bool, built parent-first (node ids are topologically sorted)
        ancestry = torch.eye(num_nodes, dtype=torch.bool)
        for node, parent in enumerate(trie.parents):
            if parent >= 0:
                ancestry[node] |= ancestry[parent]
        inner[window_len:, window_len:] = ancestry
        inner[window_len:, 0] = True  # every node sees the last token
        node_offsets = torch.tensor(trie.depths, dtype=torch.long)
    else:
        node_offsets = torch.zeros(0, dtype=torch.long)

    input_ids = torch.cat([rows.reshape(-1), torch.tensor(trie.tokens, dtype=torch.long)])
    position_ids = past_length + torch.cat([window_offsets, node_offsets])
    mask = torch.cat([torch.ones(total, past_length, dtype=torch.bool), inner], dim=1)
    window_out_index = torch.arange((ngram_minus_one - 1) * window, window_len)
    trie_index = torch.cat([torch.zeros(1, dtype=torch.long), window_len + torch.arange(num_nodes)])
    return StepLayout(
        input_ids=input_ids[None].to(device),
        position_ids=position_ids[None].to(device),
        attention_mask=mask[None, None].to(device),
        window_out_index=window_out_index.to(device),
        trie_index=trie_index.to(device),
    )


@dataclass(frozen=True)
class TreeProposal:
    """What a tree drafter hands the loop: the candidate trie, the step layout, and the layout's mask already in
    the form the model's attention implementation takes (``to_model_mask``)."""

    trie: Trie
    layout: StepLayout
    attention_mask: torch.Tensor  # [1, 1, L, past + L]

    @property
    def depth(self) -> int:
        """Length of the longest candidate (the "draft length" of the round)."""
        return max(self.trie.depths, default=0)


def accepted_input_index(trie: Trie, accepted_nodes: Sequence[int], num_window_tokens: int) -> list[int]:
    """Indices, within the step's inputs, of the tokens whose KV is kept: the last token and the accepted nodes."""
    return [0] + [num_window_tokens + node for node in accepted_nodes]


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
