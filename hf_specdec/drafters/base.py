"""The drafter seam: who proposes tokens for the target to verify.

A drafter is shaped like transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``),
with one step more, because sizing belongs to the policy and the policy must see what there is to size. It
works on the rows of a batch (one row for one prompt), each seen as a ``round.RowView``:

``prefill(views)``           new sequences start (their ids include the first new token);
``offer(views)``             per row, what it could propose without running a model (``round.Offer``);
``propose(views, plans)``    per row, the guesses the policy's ``RoundPlan`` asks for (``round.Proposal``);
``update(outcomes)``         per row, the round's ``RoundOutcome``, so it keeps its state in step (a row whose
                             outcome is ``finished`` is gone from the next round);
``attach(cache)``            the target's ``cache.KVStore``, once it has read the prompts (before ``prefill``): a
                             drafter that reads the target's own keys and values keeps it (an early-exit draft
                             borrows its first layers: ``drafters/early_exit.py``); the others inherit the
                             protocol's default, which reads nothing;
``cache_bytes()``            bytes its own caches hold now (a draft model's KV cache; 0 without one), reported in
                             the stats at the end of a call;
``release()``                drop all state (caches) to free memory; it is not used again.

Drafters never decide acceptance (``verify.py``) nor sizes (``policy.py``): a plan is a value they follow. A
drafter that serves one row at a time (``RowDrafter``: the same methods over one view / plan / outcome) is
run per row by ``PerRow``; ``ChainDrafter`` puts prompt lookup after a draft model.

Which drafter a call runs comes from its ``DraftSource`` (one per kind of draft, ``DraftKind``): the source says
what ``SpeculativeMemory`` keeps the draft's estimates by, which draft model the hardware profile prices, which
model's forwards draft, and builds the drafter for a call (``DraftCall``). ``drafters/source.py`` tells the kinds
of a call's draft argument apart, in one place.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence, runtime_checkable

import torch
from transformers import LogitsProcessorList

from ..compiled import EAGER, Verifier
from ..inputs import NO_INPUTS, ModelInputs
from ..round import Offer, Proposal, RoundOutcome, RoundPlan, RowView, Source, SourceKind


@runtime_checkable
class Drafter(Protocol):
    def attach(self, cache) -> None:
        """The target's ``cache.KVStore`` after its prompt read (module docstring). Default: reads nothing."""

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


class DraftKind(enum.Enum):
    """The kinds of draft a call drafts with; each has its ``DraftSource``."""

    MODEL = "draft model"  # a causal LM sharing the target's tokenizer (``DraftModelSource``)
    EARLY_EXIT = "early exit"  # the target's own first N layers, ``EarlyExit(N)`` (``EarlyExitSource``)
    OWN = "own drafter"  # an object implementing ``Drafter`` (``OwnDrafterSource``)
    LOOKAHEAD = "lookahead"  # the target's own window, pool and memory (``LookaheadSource``)


@dataclass(frozen=True)
class DraftCall:
    """What one call gives the drafter it drafts with: the target, the call's logits processors and sampling,
    the target's vocabulary (guesses are over it), the draft's narrow output layer (``SpecConfig.draft_vocab_size``),
    the special token ids it always keeps, the padding id, the draft model's other inputs (``inputs.py``),
    whether prompt lookup follows a draft model's chain (``SpecConfig.history_lookup``), and the caller's batch
    size (``batch``: its processors keep a value per row, ``processors.process_rows``), and its verifier (a draft
    model's single steps run compiled where the verify does, ``Verifier.for_draft``)."""

    target: torch.nn.Module
    logits_processor: LogitsProcessorList
    do_sample: bool
    vocab_size: int
    draft_vocab_size: int | None = None
    special_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    model_inputs: ModelInputs = NO_INPUTS
    history_lookup: bool = False
    batch: int = 1
    verifier: Verifier = EAGER  # the call's verify runner (``compiled.py``), which a draft model's steps follow


class DraftSource(Protocol):
    """Where a call's guesses come from, one per ``DraftKind``.

    ``memory_key``: what ``SpeculativeMemory`` keeps this draft's estimates by across calls (the draft model,
    ``EarlyExit(N)`` with N decided, the drafter object; None for lookahead, whose memory keeps one set).
    ``profile_draft``: the draft model whose costs the hardware profile holds, looked up in its format
    (``models.formats.model_format``); None: the profile prices the target alone (early exit, lookahead, a drafter
    object). ``model``: the model whose forwards draft, checked as the target is (support, trees, vocabulary) and
    given the call's model inputs; None: the drafter runs no model of its own. ``drafter(call)``: the ``Drafter``
    for one call (it reads the target's cache through ``Drafter.attach``)."""

    @property
    def memory_key(self) -> Hashable | None: ...

    @property
    def profile_draft(self) -> torch.nn.Module | None: ...

    @property
    def model(self) -> torch.nn.Module | None: ...

    def drafter(self, call: DraftCall) -> Drafter: ...


class NoDrafter(Drafter):
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


class PerRow(Drafter):
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


class ChainDrafter(Drafter):
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
