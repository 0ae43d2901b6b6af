"""A small draft model proposes tokens, keeping its own KV cache across rounds.

transformers calls ``assistant_model.generate()`` every round; here the draft's forward is driven directly: each
round feeds only the tokens committed since its cache was last valid (1 or 2 tokens, or a longer catch-up after
plain rounds) and then one token per forward.

Each draft token is chosen from the draft's *processed* distribution at its own prefix (the same logits
processors and warpers as the target): argmax when greedy, a sample when sampling. In the sampling case the
distributions are returned as ``draft_probs`` because rejection sampling needs exactly the distribution the token
was drawn from.

Two savings that leave the output unchanged (the target verifies every token):

- A narrower output layer. Batch-1 decoding on a CPU is memory-bound, and a 0.5B draft's output layer over a
  150k vocabulary (136M bf16 weights) reads more bytes per step than its whole 4-bit body. ``SubVocabHead``
  scores only the first ``draft_vocab_size`` token ids (BPE ids are roughly ordered by frequency), the prompt's
  tokens and the special tokens; everything else gets probability 0 in the draft, which rejection sampling
  handles exactly.
- Prompt lookup after the draft. When the draft's tokens continue something already seen in the prompt or the
  output, the tokens that followed it there are appended without any draft forward, as many as the policy's
  expected-rate rule says pay for their extra verify time (it learns how often such tokens are accepted).
  They are deterministic drafts (one-hot ``draft_probs``).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import LogitsProcessorList

from .. import cache as kv
from .base import KeepDrafting, Proposal
from .ngram_pool import HistoryIndex


class SubVocabHead:
    """The draft's output layer restricted to ``token_ids`` ([S] sorted ids); logits elsewhere are -inf."""

    def __init__(self, model, token_ids: torch.LongTensor, vocab_size: int) -> None:
        head = model.get_output_embeddings()
        self.base = getattr(model, model.base_model_prefix)
        self.token_ids = token_ids
        self.weight = head.weight.detach().index_select(0, token_ids.to(head.weight.device))  # [S, hidden]
        self.bias = None if head.bias is None else head.bias.detach().index_select(0, token_ids)
        self.vocab_size = vocab_size

    @staticmethod
    def usable(model) -> bool:
        head = model.get_output_embeddings()
        return (
            isinstance(head, torch.nn.Linear)
            and type(head.weight) is torch.nn.Parameter  # not a quantized weight
            and head.weight.is_floating_point()
            and getattr(model, model.base_model_prefix, None) is not None
        )

    def forward(self, input_ids: torch.LongTensor, cache) -> torch.Tensor:
        """Like ``cache.forward(model, ..., num_logits=1)``: float logits [1, vocab], -inf outside the subset."""
        hidden = kv.forward_hidden(self.base, input_ids, cache)[-1:]  # [1, hidden]
        sub_logits = torch.nn.functional.linear(hidden, self.weight, self.bias).float()  # [1, S]
        logits = torch.full((1, self.vocab_size), float("-inf"), device=sub_logits.device)
        logits[:, self.token_ids] = sub_logits
        return logits


class DraftModelDrafter:
    LEADING_LOOKUP = 10  # longest continuation a lookup-only round verifies (transformers' prompt lookup uses 10)

    def __init__(
        self,
        draft_model,
        logits_processor: LogitsProcessorList,
        *,
        do_sample: bool,
        vocab_size: int,  # the vocabulary shared with the target (smaller of the two when one is padded)
        need_confidence: bool,
        generator: torch.Generator | None = None,
        draft_vocab_size: int | None = None,
        special_token_ids: tuple[int, ...] = (),
        free_tokens: Callable[[int, int], int] | None = None,  # policy.free_tokens: how many lookup tokens to append
        prefer_lookup: Callable[[int], bool] | None = None,  # policy.prefer_lookup: a lookup-only round instead?
    ) -> None:
        self.model = draft_model
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.vocab_size = vocab_size
        self.need_confidence = need_confidence
        self.generator = generator
        self.draft_vocab_size = draft_vocab_size
        self.special_token_ids = special_token_ids
        self.free_tokens = free_tokens
        self.prefer_lookup = prefer_lookup or (lambda num_lookup: False)
        self.cache = kv.new_cache(draft_model)
        self.num_cached = 0  # committed tokens whose KV is in self.cache
        self.device = next(draft_model.parameters()).device
        self.head: SubVocabHead | None = None
        self.history: HistoryIndex | None = HistoryIndex(max_match=3) if free_tokens is not None else None

    def prefill(self, prompt_ids: torch.LongTensor) -> float:
        start = time.perf_counter()
        prompt_ids = prompt_ids.to(self.device)
        if self.draft_vocab_size and self.draft_vocab_size < self.vocab_size and SubVocabHead.usable(self.model):
            keep = torch.cat([
                torch.arange(self.draft_vocab_size, device=self.device),
                prompt_ids[0],
                torch.tensor(self.special_token_ids, dtype=torch.long, device=self.device),
            ])
            keep = torch.unique(keep[keep < self.vocab_size])
            self.head = SubVocabHead(self.model, keep, self.vocab_size)
        if prompt_ids.shape[1] > 1:
            self._logits(prompt_ids[:, :-1])
        self.num_cached = prompt_ids.shape[1] - 1
        if self.history is not None:
            self.history.extend(prompt_ids[0].tolist())
        return time.perf_counter() - start

    def _logits(self, feed: torch.LongTensor) -> torch.Tensor:
        """Draft forward over ``feed`` ([1, n]) appended to the cache; float logits [1, vocab]."""
        if self.head is not None:
            return self.head.forward(feed, self.cache)
        return kv.forward(self.model, feed, self.cache, num_logits=1)[:, : self.vocab_size]

    def propose(self, committed_ids: torch.LongTensor, max_tokens: int, keep_drafting: KeepDrafting) -> Proposal:
        start = time.perf_counter()
        copied = self._lookup(committed_ids, [], leading=True)
        if copied:  # the history predicts the continuation better than the draft would pay for: no draft forward
            return self._proposal([], [], copied, start)
        ids = committed_ids.to(self.device)  # [1, L]
        feed = ids[:, self.num_cached:]  # at least the last committed token
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for position in range(1, max_tokens + 1):
            logits = self._logits(feed)  # [1, V]
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
            if not keep_drafting(position, confidence) or position == max_tokens:  # the policy sees every token
                break
        # the cache now holds every committed token and every draft token but the last
        self.num_cached = ids.shape[1] - 1
        return self._proposal(tokens, probs, self._lookup(committed_ids, tokens), start)

    def _proposal(self, tokens: list[torch.Tensor], probs: list[torch.Tensor], lookup: tuple[int, ...],
                  start: float) -> Proposal:
        """Draft tokens followed by prompt-lookup tokens (deterministic drafts: one-hot distributions)."""
        drafted = len(tokens)
        for token in lookup:
            tokens.append(torch.tensor([token], device=self.device))
            if self.do_sample:
                probs.append(torch.nn.functional.one_hot(torch.tensor(token), self.vocab_size).float().to(self.device))
        return Proposal(
            token_ids=torch.cat(tokens),
            draft_probs=torch.stack(probs) if self.do_sample else None,
            draft_time=time.perf_counter() - start,
            draft_forwards=drafted,
            num_lookup_tokens=len(lookup),
        )

    def _lookup(self, committed_ids: torch.LongTensor, drafted: list[torch.Tensor],
                leading: bool = False) -> tuple[int, ...]:
        """Prompt-lookup continuation of committed + drafted tokens, as long as the policy says it pays.

        ``leading``: a round of lookup tokens alone, taken only if ``policy.prefer_lookup`` says it beats drafting.
        """
        if self.history is None:
            return ()
        if len(self.history.tokens) < committed_ids.shape[1]:
            self.history.extend(committed_ids[0, len(self.history.tokens):].tolist())
        limit = self.LEADING_LOOKUP if leading else self.free_tokens(len(drafted) + 1, 64)
        if limit <= 0:
            return ()
        found = self.history.continuations(max_len=limit, limit=1, suffix=[int(t) for t in drafted], min_match=2)
        if not found or (leading and not self.prefer_lookup(len(found[0]))):
            return ()
        return found[0]

    def rollback(self, num_valid: int) -> None:
        if self.num_cached > num_valid:
            kv.rollback(self.cache, num_valid)
            self.num_cached = num_valid

    def release(self) -> None:
        self.cache = None
        self.head = None
        self.num_cached = 0
