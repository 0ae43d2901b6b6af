"""What one ``generate`` call learns, carried into the next calls on the same model.

``SpeculativeMemory``: per draft model, the ``Estimates`` speculative decoding measured with it (the target's
forward cost t(n), the draft's step time, how often its and prompt lookup's guesses are accepted), so that a
later call starts sized instead of measuring a plain step and probing a first draft length again. It can be
seeded from a hardware profile (``seed``) before the first call.

``LookaheadMemory``: what lookahead learns in one call, carried into the next calls.

- ``corpus``: the prompts and outputs of earlier calls, indexed for prompt lookup. Requests repeat each other
  (imports, boilerplate, a test harness, the same function asked for again), so their text predicts the next
  answer the way the prompt does; at most ``max_tokens`` of it are kept, the oldest dropped first.
- ``successors``: the target's newest top choices after each token it has read (Token Recycling).
- ``estimates``: the measured forward cost by number of inputs and every source's acceptance (``costmodel``),
  so that a new call starts with a known cost curve instead of a plain first step and one doubling of forward
  size per round.

Outputs never depend on it (every candidate is verified by the target); only speed does. ``enable(model)``
keeps one per model as ``model.lookahead_memory``; pass ``lookahead_memory=None`` to ``generate`` for a call
that neither reads nor writes it, or your own ``LookaheadMemory()`` to scope it (one per user, say).
"""

from __future__ import annotations

import weakref
from typing import Mapping, Sequence

import torch

from .config import LookaheadConfig
from .costmodel import Estimates, ForwardCost
from .drafters.early_exit import EarlyExit
from .drafters.ngram_pool import HistoryIndex


class SpeculativeMemory:
    """The estimates of each draft model used with one target (held weakly: a draft that is gone is forgotten),
    and of each early-exit draft of the target itself (``EarlyExit(N)``: a value, held by value).

    Outputs never depend on it (every guess is verified); only speed does. ``enable(model)`` keeps one per model
    as ``model.speculative_memory``; pass ``speculative_memory=None`` for a call that neither reads nor writes
    it.
    """

    def __init__(self) -> None:
        self._by_draft: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._by_value: dict[EarlyExit, Estimates] = {}

    def estimates(self, draft) -> Estimates:
        """The estimates for ``draft`` (made empty on first use)."""
        table = self._by_value if isinstance(draft, EarlyExit) else self._by_draft
        found = table.get(draft)
        if found is None:
            found = table[draft] = Estimates()
        return found

    def seed(self, draft, forward_seconds: Mapping[int, float] | None = None,
             draft_step_seconds: float | Mapping[int, float] | None = None, *,
             draft_read_share: float | None = None) -> None:
        """Start ``draft``'s estimates from measured costs (a hardware profile): t(n) of the target by inputs,
        the seconds of one draft step, of one row or by rows (``{rows: seconds}``: its shape also prices batch
        sizes not measured yet, ``Estimates.draft_seconds``), and the draft's prompt read as a share of the
        target's prefill of the same prompt (``costmodel.ReadCost``). They are priors: the first measurement at
        each size replaces its seed (``ForwardCost.from_table(prior=True)``), the first reads timed here replace
        the share."""
        estimates = self.estimates(draft)
        if forward_seconds:
            estimates.forward = ForwardCost.from_table(forward_seconds, prior=True)
        if isinstance(draft_step_seconds, Mapping):
            estimates.draft_rows = ForwardCost.from_table(draft_step_seconds)
            draft_step_seconds = draft_step_seconds.get(1)
        if draft_step_seconds is not None:
            estimates.draft_step = ForwardCost.from_table({1: draft_step_seconds}, prior=True)
        if draft_read_share is not None:
            estimates.draft_read.prior = float(draft_read_share)

    def clear(self) -> None:
        self._by_draft = weakref.WeakKeyDictionary()
        self._by_value = {}


class LookaheadMemory:
    def __init__(self, max_tokens: int = 1 << 16) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"LookaheadMemory(max_tokens={max_tokens!r}) is invalid: use an int >= 1.")
        self.max_tokens = max_tokens
        self.clear()

    def clear(self) -> None:
        """Forget everything: the earlier calls' text and what was measured."""
        self.corpus = HistoryIndex(max_match=LookaheadConfig().history_match)
        self.estimates = Estimates()
        self.successors: torch.Tensor | None = None  # [V, K] the target's top choices after each token, -1 unknown

    def seed(self, forward_seconds: Mapping[int, float] | None) -> None:
        """Start the target's t(n) from measured costs (a hardware profile: ``{n: seconds}``) while nothing has
        been measured yet, so the first call prices every size from the start instead of trying sizes it has
        not measured (on a CPU without bf16 units a 2-token forward costs 1.8 plain steps). They are priors: the
        first measurement at each size replaces its seed; text and acceptance are not touched."""
        if forward_seconds and not self.estimates.forward.largest:
            self.estimates.forward = ForwardCost.from_table(forward_seconds, prior=True)

    def recycle(self, inputs: torch.LongTensor, top_next: torch.LongTensor) -> None:
        """Keep the target's newest top choices ``top_next`` [R, K] after each of the tokens ``inputs`` [R].

        The table grows to hold every token it names, as an input or a choice, so a chain can always look up the
        choices after any token it holds."""
        needed = int(max(int(inputs.max()), int(top_next.max()))) + 1
        if self.successors is not None and self.successors.shape[1] != top_next.shape[1]:
            self.successors = None  # another recycle_width: start a new table
        if self.successors is None or self.successors.shape[0] < needed:
            size = max(needed, 1024, 2 * (0 if self.successors is None else self.successors.shape[0]))
            grown = torch.full((size, top_next.shape[1]), -1, dtype=torch.long)
            if self.successors is not None:
                grown[: self.successors.shape[0]] = self.successors
            self.successors = grown
        self.successors[inputs] = top_next

    def remember(self, tokens: Sequence[int]) -> None:
        """Add one call's prompt and output; past ``max_tokens``, keep the newest half."""
        self.corpus.extend(tokens)
        if len(self.corpus.tokens) > self.max_tokens:
            kept = self.corpus.tokens[len(self.corpus.tokens) - self.max_tokens // 2:]
            self.corpus = HistoryIndex(kept, max_match=self.corpus.max_match)
