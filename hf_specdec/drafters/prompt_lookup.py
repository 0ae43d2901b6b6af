"""Prompt lookup as a drafter: the continuation that followed the same tokens earlier in the prompt or output.

Code repeats itself (edits copy their input, tests repeat names), so the text already seen predicts the next
tokens without any model. The drafter keeps a ``HistoryIndex`` over prompt + everything committed, fed from
each round's outcome, and offers the continuation of the last tokens (a match of at least ``min_match``).
Its tokens are deterministic drafts, learned by the policy as source ``(SourceKind.LOOKUP, 0)``.

    >>> import torch
    >>> view = RowView(row=0, ids=torch.tensor([1, 2, 3, 4, 1, 2]), budget=3)
    >>> drafter = PromptLookupDrafter()
    >>> drafter.prefill(view)
    >>> drafter.offer(view).candidates
    (Candidate(tokens=(3, 4, 1), source=(<SourceKind.LOOKUP: 'lookup'>, 0)),)
    >>> drafter.continuation((3,), max_len=2)    # after "... 1 2" + a drafted 3
    (4, 1)
"""

from __future__ import annotations

import dataclasses
import time

from ..layout import merge_candidates
from ..ngram_pool import HistoryIndex
from ..round import Candidate, Offer, Proposal, RoundOutcome, RoundPlan, RowView, SourceKind

SOURCE = (SourceKind.LOOKUP, 0)


class PromptLookupDrafter:
    """A ``RowDrafter`` (one row); ``base.PerRow`` runs one per row."""

    def __init__(self, max_match: int = 3, min_match: int = 2) -> None:
        self.history = HistoryIndex(max_match=max_match)
        self.min_match = min_match

    def prefill(self, view: RowView) -> None:
        self.history.extend(view.ids.tolist())

    def continuation(self, suffix: tuple[int, ...], max_len: int) -> tuple[int, ...]:
        """What followed the committed tokens + ``suffix`` (draft tokens not committed yet), up to ``max_len``."""
        found = self.history.continuations(max_len=max_len, limit=1, suffix=suffix, min_match=self.min_match)
        return found[0] if found else ()

    def offer(self, view: RowView) -> Offer:
        tokens = self.continuation((), view.budget) if view.budget > 0 else ()
        return Offer(candidates=(Candidate(tokens, SOURCE),) if tokens else ())

    def propose(self, view: RowView, plan: RoundPlan) -> Proposal:
        start = time.perf_counter()
        proposal = merge_candidates(plan.candidates, plan.max_tokens)
        return dataclasses.replace(proposal, draft_time=time.perf_counter() - start)

    def update(self, outcome: RoundOutcome) -> None:
        self.history.extend(outcome.emitted)

    def release(self) -> None:
        pass
