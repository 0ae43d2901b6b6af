"""The drafter seam: who proposes tokens for the target to verify.

A drafter is shaped like transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``),
with one step more, because sizing belongs to the policy and the policy must see what there is to size:

``prefill(prompt_ids)``        a new sequence starts (``prompt_ids``: [1, L], the first new token included);
``offer(committed_ids, d)``    what it could propose without running a model, candidates at most ``d`` deep
                               (``round.Offer``), and how many tokens its model could draft;
``propose(committed_ids, plan)`` the guesses the policy's ``RoundPlan`` asks for (``round.Proposal``);
``update(outcome)``            the round's ``RoundOutcome``: what was kept, so it can keep its state in step;
``release()``                  drop all state (caches) to free memory; it is not used again.

Drafters never decide acceptance (``verify.py``) nor sizes (``policy.py``): a plan is a value they follow. A
composite (``ChainDrafter``) puts prompt lookup after a draft model.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import torch

from ..round import Offer, Proposal, RoundOutcome, RoundPlan, Source


class Drafter(Protocol):
    def prefill(self, prompt_ids: torch.LongTensor) -> None: ...

    def offer(self, committed_ids: torch.LongTensor, max_depth: int) -> Offer: ...

    def propose(self, committed_ids: torch.LongTensor, plan: RoundPlan) -> Proposal: ...

    def update(self, outcome: RoundOutcome) -> None: ...

    def release(self) -> None: ...


class NoDrafter:
    """Proposes nothing: every round is a plain step (after a drafter ran out of memory, say)."""

    def prefill(self, prompt_ids: torch.LongTensor) -> None:
        pass

    def offer(self, committed_ids: torch.LongTensor, max_depth: int) -> Offer:
        return Offer()

    def propose(self, committed_ids: torch.LongTensor, plan: RoundPlan) -> Proposal:
        return Proposal()

    def update(self, outcome: RoundOutcome) -> None:
        pass

    def release(self) -> None:
        pass


class ChainDrafter:
    """A draft model's chain, then prompt lookup: the tokens that followed the chain's end earlier in the text.

    ``lookup`` offers its continuation of the committed tokens (the policy may verify it alone, without a draft
    forward); after the model's tokens it appends as many tokens of the continuation of committed + drafted as
    the plan's rule allows. Both are deterministic drafts: one-hot rows when the model's tokens were sampled.
    """

    def __init__(self, model, lookup=None) -> None:
        self.model, self.lookup = model, lookup
        self.parts = tuple(part for part in (model, lookup) if part is not None)

    def prefill(self, prompt_ids: torch.LongTensor) -> None:
        for part in self.parts:
            part.prefill(prompt_ids)

    def offer(self, committed_ids: torch.LongTensor, max_depth: int) -> Offer:
        leading = self.lookup.offer(committed_ids, max_depth).candidates if self.lookup is not None else ()
        return Offer(candidates=leading, model_tokens=self.model.offer(committed_ids, max_depth).model_tokens)

    def propose(self, committed_ids: torch.LongTensor, plan: RoundPlan) -> Proposal:
        if plan.model_tokens == 0:
            return self.lookup.propose(committed_ids, plan) if plan.candidates and self.lookup else Proposal()
        drafted = self.model.propose(committed_ids, plan)
        room = plan.max_tokens - drafted.num_tokens
        if self.lookup is None or plan.rule is None or room <= 0:
            return drafted
        start = time.perf_counter()
        limit = min(room, plan.rule.lookup_tokens(drafted.confidences))
        tail = self.lookup.continuation(drafted.tokens, limit) if limit > 0 else ()
        seconds = drafted.draft_time + time.perf_counter() - start
        if not tail:
            return dataclasses.replace(drafted, draft_time=seconds)
        draft_probs = drafted.draft_probs
        if draft_probs is not None:
            one_hot = torch.nn.functional.one_hot(torch.tensor(tail), draft_probs.shape[1])
            draft_probs = torch.cat([draft_probs, one_hot.to(draft_probs)])
        return Proposal.chain(
            drafted.tokens + tail,
            [sources[0] for sources in drafted.sources] + [Source("lookup", 0, j) for j in range(1, len(tail) + 1)],
            draft_probs, confidences=drafted.confidences, draft_time=seconds,
            draft_forwards=drafted.draft_forwards)

    def update(self, outcome: RoundOutcome) -> None:
        for part in self.parts:
            part.update(outcome)

    def release(self) -> None:
        for part in self.parts:
            part.release()
