"""Logits processors called as plain ``generate`` calls them: over its batch, a row's prefix at that row's index.

``generate`` builds its logits processors (and warpers) for its batch, and some keep a value per batch row:
``RepetitionPenaltyLogitsProcessor`` the padding length of each row (its ``prompt_ignore_length``, [B]: the
columns it does not penalize), ``PrefixConstrainedLogitsProcessor`` hands its function the row's index. Plain
calls them once per step with every row ([B, L] ids, [B, V] scores). hf_specdec scores many prefixes per row per
round (the last token and every guess, each with its own path; rows of different lengths), so ``process_rows``
lays them into calls of the caller's B rows, each prefix at its own row's index: prefixes of one length, of
different rows, share a call (B rows at one step: plain's own call), and an index no prefix fills repeats another
prefix, its output dropped. Every processor that treats its rows independently, as plain's batch needs, gives each
prefix what plain gives it.

Worked example: a processor that adds each row's index to its scores (as a per-row value would act); the prefixes
of rows 1 and 0, of one length, share one call of B = 2, and row 1's second prefix (another length) gets a call of
its own, in which index 0 repeats it:

>>> import torch
>>> from transformers import LogitsProcessorList
>>> calls = []
>>> def by_row(ids, scores):
...     calls.append(ids.shape)
...     return scores + torch.arange(ids.shape[0])[:, None]
>>> out = process_rows(LogitsProcessorList([by_row]), 2, [
...     (1, torch.tensor([5, 6]), torch.zeros(3)), (0, torch.tensor([7, 8]), torch.zeros(3)),
...     (1, torch.tensor([5, 6, 9]), torch.zeros(3))])
>>> [row.tolist() for row in out], calls
([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], [torch.Size([2, 2]), torch.Size([2, 3])])
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import LogitsProcessorList


def process_rows(processors: LogitsProcessorList, batch: int,
                 entries: Sequence[tuple[int, torch.LongTensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The processed scores [V] of each entry (``row``: its index in the caller's batch of ``batch`` rows,
    ``ids`` [L]: its prefix as plain's processors would see it, padding included; ``scores`` [V]), from calls of
    ``batch`` rows (module docstring). Entries come back in their order; without processors, unchanged."""
    if not processors:
        return [scores for _, _, scores in entries]
    calls: dict[int, list[dict[int, int]]] = {}  # prefix length -> its calls, each: batch index -> entry
    for k, (row, ids, _) in enumerate(entries):
        same_length = calls.setdefault(int(ids.shape[-1]), [])
        call = next((call for call in same_length if row not in call), None)
        if call is None:
            call = {}
            same_length.append(call)
        call[row] = k
    out: list[torch.Tensor | None] = [None] * len(entries)
    for same_length in calls.values():
        for call in same_length:
            filler = next(iter(call.values()))
            laid = [entries[call.get(b, filler)] for b in range(batch)]
            device = laid[0][2].device
            ids = torch.stack([entry[1].reshape(-1).to(device) for entry in laid])  # [B, L]
            scores = processors(ids, torch.stack([entry[2] for entry in laid]))  # [B, V]
            for b, k in call.items():
                out[k] = scores[b]
    return out
