"""Exact stops inside an accepted block, and streaming of exactly what is returned.

A speculative round emits several tokens at once. transformers (5.23/5.24) checks EOS and max length inside the
block but lets custom ``StoppingCriteria`` and ``stop_strings`` overshoot. Here every criterion is evaluated
after each emitted token, and the block is cut right after the first token that stops generation: what is
returned, and what is streamed, ends exactly where plain ``generate`` would have ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from transformers import StoppingCriteriaList

if TYPE_CHECKING:
    from .round import Proposal


def cut_at_stop(
    committed_ids: Callable[[], torch.LongTensor],  # () -> [1, L], called only where there are criteria
    new_tokens: list[int],  # tokens this round wants to emit
    stopping_criteria: StoppingCriteriaList,
) -> tuple[list[int], bool]:
    """Return (the tokens to emit, whether generation stops after them)."""
    if not stopping_criteria:
        return new_tokens, False
    committed = committed_ids()
    full = torch.cat([committed, torch.tensor([new_tokens], dtype=torch.long, device=committed.device)], dim=1)
    length = committed.shape[1]
    for j in range(1, len(new_tokens) + 1):
        if bool(stopping_criteria(full[:, : length + j], None).any()):
            return new_tokens[:j], True
    return new_tokens, False


class Emitter:
    """Streams each round's emitted tokens; the demo's highlight uses the optional ``on_round`` hook, its plot of
    tree rounds the optional ``on_round_paths`` hook (docs/CONTRACT.md)."""

    def __init__(self, streamer) -> None:
        self.streamer = streamer
        self.on_round = getattr(streamer, "on_round", None)
        self.on_round_paths = getattr(streamer, "on_round_paths", None)

    def prompt(self, prompt_ids: torch.LongTensor) -> None:
        if self.streamer is not None:
            self.streamer.put(prompt_ids.cpu())

    def round(self, tokens: torch.LongTensor, num_accepted_draft: int, proposal: Proposal | None = None) -> None:
        """``proposal``: the round's trie (``round.Proposal``; None for the prefill's token): its nodes and leaves
        go to ``on_round_paths``."""
        if self.streamer is None or tokens.numel() == 0:
            return
        if self.on_round_paths is not None:
            self.on_round_paths(*((len(proposal.tokens), proposal.paths) if proposal is not None else (0, 0)))
        if self.on_round is not None:
            self.on_round(min(num_accepted_draft, tokens.numel()), tokens.numel())
        self.streamer.put(tokens[None].cpu())

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
