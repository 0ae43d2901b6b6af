"""The drafter seam: who proposes tokens for the target to verify.

A drafter is shaped like transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``),
with one step more, because sizing belongs to the policy and the policy must see what there is to size. It
works on the rows of a batch (one row for one prompt), each seen as a ``round.RowView``:

``prefill(views)``           new sequences start (their ids include the first new token);
``offer(views)``             per row, what it could propose without running a model (``round.Offer``);
``propose(views, plans)``    per row, the guesses the policy's ``RoundPlan`` asks for (``round.Proposal``);
``update(outcomes)``         per row, the round's ``RoundOutcome``, so it keeps its state in step (a row whose
                             outcome is ``finished`` is gone from the next round);
``attach(cache)``            optional: the target's ``cache.KVStore``, once it has read the prompts (before
                             ``prefill``), for a drafter that reads the target's own keys and values (an early-exit
                             draft borrows its first layers: ``drafters/early_exit.py``); the loop calls it only on
                             drafters that have it;
``cache_bytes()``            bytes its own caches hold now (a draft model's KV cache; 0 without one), reported in
                             the stats at the end of a call;
``release()``                drop all state (caches) to free memory; it is not used again.

Drafters never decide acceptance (``verify.py``) nor sizes (``policy.py``): a plan is a value they follow. A
drafter that serves one row at a time (``RowDrafter``: the same methods over one view / plan / outcome) is
run per row by ``PerRow``; ``ChainDrafter`` puts prompt lookup after a draft model.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol, Sequence

import torch

from ..round import Offer, Proposal, RoundOutcome, RoundPlan, RowView, Source, SourceKind


class Drafter(Protocol):
    def prefill(self, views: Sequence[RowView]) -> None: ...

    def offer(self, views: Sequence[RowView]) -> list[Offer]: ...

    def propose(self, views: Sequence[RowView], plans: Sequence[RoundPlan]) -> list[Proposal]: ...

    def update(self, outcomes: Sequence[RoundOutcome]) -> None: ...

    def cache_bytes(self) -> int: ...

    def release(self) -> None: ...


class RowDrafter(Protocol):
    def prefill(self, view: RowView) -> None: ...

    def offer(self, view: RowView) -> Offer: ...

    def propose(self, view: RowView, plan: RoundPlan) -> Proposal: ...

    def update(self, outcome: RoundOutcome) -> None: ...

    def release(self) -> None: ...


class NoDrafter:
    """Proposes nothing: every round is a plain step (after a drafter ran out of memory, say)."""

    def prefill(self, views: Sequence[RowView]) -> None:
        pass

    def offer(self, views: Sequence[RowView]) -> list[Offer]:
        return [Offer() for _ in views]

    def propose(self, views: Sequence[RowView], plans: Sequence[RoundPlan]) -> list[Proposal]:
        return [Proposal() for _ in views]

    def update(self, outcomes: Sequence[RoundOutcome]) -> None:
        pass

    def cache_bytes(self) -> int:
        return 0

    def release(self) -> None:
        pass


class PerRow:
    """One ``RowDrafter`` per row, made by ``make()`` when the row starts and released when it finishes."""

    def __init__(self, make: Callable[[], RowDrafter]) -> None:
        self.make = make
        self.drafters: dict[int, RowDrafter] = {}

    def prefill(self, views: Sequence[RowView]) -> None:
        for view in views:
            self.drafters[view.row] = drafter = self.make()
            drafter.prefill(view)

    def offer(self, views: Sequence[RowView]) -> list[Offer]:
        return [self.drafters[view.row].offer(view) for view in views]

    def propose(self, views: Sequence[RowView], plans: Sequence[RoundPlan]) -> list[Proposal]:
        return [self.drafters[view.row].propose(view, plan) for view, plan in zip(views, plans)]

    def update(self, outcomes: Sequence[RoundOutcome]) -> None:
        for outcome in outcomes:
            drafter = self.drafters[outcome.row]
            drafter.update(outcome)
            if outcome.finished:
                drafter.release()
                del self.drafters[outcome.row]

    def cache_bytes(self) -> int:
        return 0  # row drafters (prompt lookup, lookahead) keep token tables, no model cache

    def release(self) -> None:
        for drafter in self.drafters.values():
            drafter.release()
        self.drafters.clear()


class ChainDrafter:
    """A draft model's chain, then prompt lookup: the tokens that followed the chain's end earlier in the text.

    ``lookup`` (a ``PerRow`` of ``PromptLookupDrafter``) offers its continuation of each row's committed tokens
    (the policy may verify it alone, without a draft forward); after the model's tokens it appends as many
    tokens of the continuation of committed + drafted as the plan's rule allows. Lookup tokens are
    deterministic drafts: one-hot rows when the model's tokens were sampled.
    """

    def __init__(self, model: Drafter, lookup: PerRow | None = None) -> None:
        self.model, self.lookup = model, lookup
        self.parts = tuple(part for part in (model, lookup) if part is not None)

    def attach(self, cache) -> None:
        for part in self.parts:
            if hasattr(part, "attach"):
                part.attach(cache)

    def prefill(self, views: Sequence[RowView]) -> None:
        for part in self.parts:
            part.prefill(views)

    def offer(self, views: Sequence[RowView]) -> list[Offer]:
        model = self.model.offer(views)
        if self.lookup is None:
            return model
        return [dataclasses.replace(offer, candidates=leading.candidates)
                for offer, leading in zip(model, self.lookup.offer(views))]

    def propose(self, views: Sequence[RowView], plans: Sequence[RoundPlan]) -> list[Proposal]:
        drafted = self.model.propose(views, plans)
        return [self._with_lookup(view, plan, chain) for view, plan, chain in zip(views, plans, drafted)]

    def _with_lookup(self, view: RowView, plan: RoundPlan, drafted: Proposal) -> Proposal:
        if self.lookup is None:
            return drafted
        lookup = self.lookup.drafters[view.row]
        if plan.model_tokens == 0:  # a lookup-only round (or a plain step)
            return lookup.propose(view, plan) if plan.candidates else drafted
        room = plan.max_tokens - drafted.num_tokens
        if plan.rule is None or room <= 0 or not drafted.num_tokens:
            return drafted
        start = time.perf_counter()
        limit = min(room, plan.rule.lookup_tokens(drafted.confidences))
        tail = lookup.continuation(drafted.tokens, limit) if limit > 0 else ()
        seconds = drafted.draft_time + time.perf_counter() - start
        if not tail:
            return dataclasses.replace(drafted, draft_time=seconds)
        draft_probs = drafted.draft_probs
        if draft_probs is not None:
            one_hot = torch.nn.functional.one_hot(torch.tensor(tail), draft_probs.shape[1])
            draft_probs = torch.cat([draft_probs, one_hot.to(draft_probs)])
        return Proposal.chain(
            drafted.tokens + tail,
            [sources[0] for sources in drafted.sources] + [Source(SourceKind.LOOKUP, 0, j) for j in range(1, len(tail) + 1)],
            draft_probs, confidences=drafted.confidences, draft_time=seconds,
            draft_forwards=drafted.draft_forwards, setup_time=drafted.setup_time, setup_tokens=drafted.setup_tokens)

    def update(self, outcomes: Sequence[RoundOutcome]) -> None:
        for part in self.parts:
            part.update(outcomes)

    def cache_bytes(self) -> int:
        return sum(part.cache_bytes() for part in self.parts)

    def release(self) -> None:
        for part in self.parts:
            part.release()
