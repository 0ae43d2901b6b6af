"""A speculative call's draft argument as a ``base.DraftSource``: the one place its kinds are told apart.

``draft_model=`` (``assistant_model=`` after ``enable``) is one of three things, and each has its source:

- ``EarlyExit(N)`` (``assistant_early_exit=N``): the target's own first N layers, ``early_exit.EarlyExitSource``;
- an object that proposes guesses itself (``propose``, the ``base.Drafter`` methods): a drafter of one's own,
  ``OwnDrafterSource``;
- anything else: a draft model, a causal LM sharing the target's tokenizer, ``draft_model.DraftModelSource``.

Lookahead's source (``lookahead.LookaheadSource``) is built by ``lookahead_generate`` itself: it has no draft
argument. Everything after this point (integration, the memory, the hardware profile's seeding, the loop) reads
the source's ``memory_key``, ``profile_draft``, ``model`` and ``drafter(call)`` and never asks what kind it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence, runtime_checkable

from ..round import Offer, Proposal, RoundOutcome, RoundPlan, RowView
from .base import DraftCall, DraftKind, Drafter, DraftSource
from .draft_model import DraftModelSource
from .early_exit import EarlyExit, EarlyExitSource


@runtime_checkable
class Proposes(Protocol):
    """What marks a drafter of one's own among draft arguments: it proposes its guesses itself (a draft model
    is run by ``DraftModelDrafter``, and no model has ``propose``)."""

    def propose(self, views: Sequence[RowView], plans: Sequence[RoundPlan]) -> list[Proposal]: ...


def draft_kind(draft) -> DraftKind:
    """The kind of a speculative call's draft argument (module docstring).

    >>> from hf_specdec.drafters.base import NoDrafter
    >>> from hf_specdec.models.tiny import tiny_model
    >>> [draft_kind(d).name for d in (EarlyExit(2), NoDrafter(), tiny_model("llama"))]
    ['EARLY_EXIT', 'OWN', 'MODEL']
    """
    if isinstance(draft, EarlyExit):
        return DraftKind.EARLY_EXIT
    if isinstance(draft, Proposes):
        return DraftKind.OWN
    return DraftKind.MODEL


def draft_source(draft, target, memory=None) -> DraftSource:
    """The source of ``draft`` for a call on ``target``; ``memory``: the call's ``SpeculativeMemory`` (None:
    none), from which ``EarlyExit("auto")`` picks its depth. Refuses an early exit the target cannot run (a depth
    out of range, layers that cannot be cut) before any forward."""
    kind = draft_kind(draft)
    if kind is DraftKind.EARLY_EXIT:
        return EarlyExitSource.of(draft, target, memory)
    if kind is DraftKind.OWN:
        return OwnDrafterSource(draft)
    return DraftModelSource(draft)


@dataclass(frozen=True)
class OwnDrafterSource:
    """The ``DraftSource`` of a drafter of one's own (``docs/CONTRACT.md``): no model of the draft's to check or
    to price (the hardware profile seeds the target's t(n) alone), the memory keeps its estimates by the object
    (weakly), and every call drafts with the object itself. One that lacks ``Drafter.attach`` (it reads nothing
    of the target's cache) runs behind ``ReadsNothing``, which adds it."""

    own: object

    @property
    def memory_key(self) -> Hashable:
        return self.own

    @property
    def profile_draft(self) -> None:
        return None

    @property
    def model(self) -> None:
        return None

    def drafter(self, call: DraftCall) -> Drafter:
        return self.own if isinstance(self.own, Drafter) else ReadsNothing(self.own)


class ReadsNothing(Drafter):
    """A drafter of one's own without ``attach``, as a whole ``Drafter``: the protocol's ``attach`` (nothing),
    every other method its own."""

    def __init__(self, own) -> None:
        self.own = own

    def prefill(self, views: Sequence[RowView]) -> None:
        self.own.prefill(views)

    def offer(self, views: Sequence[RowView]) -> list[Offer]:
        return self.own.offer(views)

    def propose(self, views: Sequence[RowView], plans: Sequence[RoundPlan]) -> list[Proposal]:
        return self.own.propose(views, plans)

    def update(self, outcomes: Sequence[RoundOutcome]) -> None:
        self.own.update(outcomes)

    def cache_bytes(self) -> int:
        return self.own.cache_bytes()

    def release(self) -> None:
        self.own.release()
