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
- Prompt lookup after the draft (``base.ChainDrafter`` with ``prompt_lookup.PromptLookupDrafter``): when the
  draft's tokens continue something already seen in the prompt or the output, the tokens that followed it there
  are appended without any draft forward, as many as the policy's rule says pay for their extra verify time.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessorList

from .. import cache as kv
from ..round import Offer, Proposal, RoundOutcome, RoundPlan, Source


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
    """Drafts a chain with a small causal LM that keeps its own KV cache across rounds (module docstring)."""

    def __init__(
        self,
        draft_model,
        logits_processor: LogitsProcessorList,
        *,
        do_sample: bool,
        vocab_size: int,  # the vocabulary shared with the target (smaller of the two when one is padded)
        draft_vocab_size: int | None = None,
        special_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.model = draft_model
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        self.special_token_ids = special_token_ids
        self.cache = kv.new_cache(draft_model)
        self.num_cached = 0  # committed tokens whose KV is in self.cache
        self.device = next(draft_model.parameters()).device
        self.head: SubVocabHead | None = None

    def prefill(self, prompt_ids: torch.LongTensor) -> None:
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

    def _logits(self, feed: torch.LongTensor) -> torch.Tensor:
        """Draft forward over ``feed`` ([1, n]) appended to the cache; float logits [1, vocab]."""
        if self.head is not None:
            return self.head.forward(feed, self.cache)
        return kv.forward(self.model, feed, self.cache, num_logits=1)[:, : self.vocab_size]

    def offer(self, committed_ids: torch.LongTensor, max_depth: int) -> Offer:
        return Offer(model_tokens=max_depth)

    def propose(self, committed_ids: torch.LongTensor, plan: RoundPlan) -> Proposal:
        """Up to ``plan.model_tokens`` tokens, each from the draft's processed distribution at its own prefix;
        ``plan.rule`` (if any) may stop the chain earlier on the confidences so far."""
        start = time.perf_counter()
        ids = committed_ids.to(self.device)  # [1, L]
        feed = ids[:, self.num_cached:]  # at least the last committed token
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        confidences: list[float] = []
        for _ in range(plan.model_tokens):
            logits = self._logits(feed)  # [1, V]
            scores = self.logits_processor(ids, logits) if self.logits_processor else logits
            draft_probs = torch.softmax(scores, dim=-1)  # [1, V]
            if self.do_sample:
                token = torch.multinomial(draft_probs, 1)[0]  # [1]
                probs.append(draft_probs[0])
            else:
                token = scores.argmax(dim=-1)  # [1]
            confidences.append(float(draft_probs[0, token]))
            tokens.append(int(token))
            ids = torch.cat([ids, token[None]], dim=1)
            feed = token[None]
            if plan.rule is not None and not plan.rule.keep_drafting(confidences):
                break
        # the cache now holds every committed token and every draft token but the last
        self.num_cached = ids.shape[1] - 1
        return Proposal.chain(
            tokens, [Source("draft", 0, i) for i in range(1, len(tokens) + 1)],
            torch.stack(probs) if self.do_sample and probs else None,
            confidences=tuple(confidences), draft_time=time.perf_counter() - start, draft_forwards=len(tokens))

    def update(self, outcome: RoundOutcome) -> None:
        """Forget the KV of draft tokens the target rejected (it holds at most the drafted chain)."""
        num_valid = outcome.start_length + outcome.num_accepted
        if self.num_cached > num_valid:
            kv.rollback(self.cache, num_valid)
            self.num_cached = num_valid

    def release(self) -> None:
        self.cache = None
        self.head = None
        self.num_cached = 0
