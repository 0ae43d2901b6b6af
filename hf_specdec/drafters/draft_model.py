"""A small draft model proposes tokens, keeping its own KV cache across rounds.

transformers calls ``assistant_model.generate()`` every round; here the draft's forward is driven directly: each
round feeds only the tokens committed since its cache was last valid (1 or 2 tokens, or a longer catch-up after
plain rounds) and then one token per forward.

Each draft token is chosen from the draft's *processed* distribution at its own prefix (the same logits
processors and warpers as the target): argmax when greedy, a sample when sampling. In the sampling case the
distributions are returned as ``draft_probs`` because rejection sampling needs exactly the distribution the token
was drawn from.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessorList

from .. import cache as kv
from .base import KeepDrafting, Proposal


class DraftModelDrafter:
    def __init__(
        self,
        draft_model,
        logits_processor: LogitsProcessorList,
        *,
        do_sample: bool,
        vocab_size: int,  # the vocabulary shared with the target (smaller of the two when one is padded)
        need_confidence: bool,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model = draft_model
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.vocab_size = vocab_size
        self.need_confidence = need_confidence
        self.generator = generator
        self.cache = kv.new_cache(draft_model)
        self.num_cached = 0  # committed tokens whose KV is in self.cache
        self.device = next(draft_model.parameters()).device

    def prefill(self, prompt_ids: torch.LongTensor) -> float:
        start = time.perf_counter()
        if prompt_ids.shape[1] > 1:
            kv.forward(self.model, prompt_ids[:, :-1].to(self.device), self.cache, num_logits=1)
        self.num_cached = prompt_ids.shape[1] - 1
        return time.perf_counter() - start

    def propose(self, committed_ids: torch.LongTensor, max_tokens: int, keep_drafting: KeepDrafting) -> Proposal:
        start = time.perf_counter()
        ids = committed_ids.to(self.device)  # [1, L]
        feed = ids[:, self.num_cached:]  # at least the last committed token
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for position in range(1, max_tokens + 1):
            logits = kv.forward(self.model, feed, self.cache, num_logits=1)[:, : self.vocab_size]  # [1, V]
            scores = self.logits_processor(ids, logits) if self.logits_processor else logits
            if self.do_sample:
                draft_probs = torch.softmax(scores, dim=-1)  # [1, V]
                token = torch.multinomial(draft_probs, 1, generator=self.generator)[0]  # [1]
                probs.append(draft_probs[0])
                confidence = float(draft_probs[0, token]) if self.need_confidence else 1.0
            else:
                token = scores.argmax(dim=-1)  # [1]
                confidence = float(torch.softmax(scores[0], dim=-1)[token]) if self.need_confidence else 1.0
            tokens.append(token)
            ids = torch.cat([ids, token[None]], dim=1)
            feed = token[None]
            if position < max_tokens and not keep_drafting(position, confidence):
                break
        # the cache now holds every committed token and every draft token but the last
        self.num_cached = ids.shape[1] - 1
        return Proposal(
            token_ids=torch.cat(tokens),
            draft_probs=torch.stack(probs) if self.do_sample else None,
            draft_time=time.perf_counter() - start,
            draft_forwards=len(tokens),
        )

    def rollback(self, num_valid: int) -> None:
        if self.num_cached > num_valid:
            kv.rollback(self.cache, num_valid)
            self.num_cached = num_valid

    def release(self) -> None:
        self.cache = None
        self.num_cached = 0
