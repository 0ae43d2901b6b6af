"""The drafter seam: who proposes tokens for the target to verify.

A drafter is shaped like transformers' ``CandidateGenerator``: ``propose`` hands the loop a ``Proposal``,
``rollback`` tells it how much of what it proposed the target kept. Drafters never decide acceptance
(``verify.py`` does) nor draft length (``policy.py`` does); they only propose, and keep their own state
(a KV cache, an n-gram pool) in step with the committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..layout import TreeProposal

KeepDrafting = Callable[[int, float], bool]  # (num_drafted, confidence of the last draft token) -> continue?


@dataclass
class Proposal:
    token_ids: torch.LongTensor  # [k] draft tokens, in order
    draft_probs: torch.Tensor | None = None  # [k, vocab] the distribution each token was sampled from; None = deterministic
    draft_time: float = 0.0  # seconds spent proposing (draft forwards, lookups)
    draft_forwards: int = 0  # draft-model forwards run for this proposal
    num_lookup_tokens: int = 0  # trailing tokens appended from prompt lookup (not chosen by the draft-length policy)
    # lookahead: a candidate trie plus Jacobi-window tokens, with their 4-D mask and position ids
    # (layout.py). The loop then verifies the trie instead of the chain ``token_ids``, and calls the
    # drafter's ``observe_forward(window_tokens [W], num_tokens, seconds, inputs [R], top_next [R, K])`` after
    # the forward (K = the drafter's ``recycle_width``: the target's top choices after each input it computed).
    tree: TreeProposal | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class Drafter(Protocol):
    def prefill(self, prompt_ids: torch.LongTensor) -> float:
        """Prepare for a new sequence (``prompt_ids``: [1, L]); return the seconds it took."""

    def propose(self, committed_ids: torch.LongTensor, max_tokens: int, keep_drafting: KeepDrafting) -> Proposal:
        """Propose up to ``max_tokens`` tokens to follow ``committed_ids`` ([1, L])."""

    def rollback(self, num_valid: int) -> None:
        """The first ``num_valid`` tokens of (committed + proposal) are now committed: forget the rest."""

    def release(self) -> None:
        """Drop all state (caches) to free memory; the drafter is not used again."""
