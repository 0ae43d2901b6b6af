"""The single decoding loop every mode shares.

    prefill the target, emit its first token, prefill the drafter
    repeat until a stop:
      1. offer     the drafter says what it could propose (``round.Offer``)
      2. plan      the policy sizes the round (``round.RoundPlan``; nothing in it = a plain step)
      3. propose   the drafter makes the ``Proposal``: a trie of guesses (a chain is a trie with one path)
      4. forward   one target forward over [last token, extra inputs, guesses] (``layout.forward_inputs``)
      5. verify    logits processors at every node, each with its own prefix; ``verify.py`` picks the path
      6. keep      the cache keeps the accepted path's KV only (``cache.keep``: a crop for a chain)
      7. emit      the round's tokens are cut at the first stop, streamed and appended
      8. learn     one ``RoundOutcome`` to ``stats.record``, ``policy.observe`` and ``drafter.update``

The invariant between rounds: the target cache holds every committed token except the last one, which is the
first input of the next forward.

Out of memory in the drafter, or while verifying guesses, frees the drafter and finishes with plain decoding
from the tokens already committed: nothing is lost, nothing is repeated.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import cache as kv
from .drafters.base import Drafter, NoDrafter
from .errors import is_out_of_memory
from .layout import forward_inputs, to_model_mask
from .policy import Policy
from .round import Proposal, RoundOutcome
from .stats import SpecStats
from .stopping import Emitter, cut_at_stop
from .verify import verify

logger = logging.getLogger(__name__)


@dataclass
class DecodeInputs:
    """Everything the loop needs, prepared by ``integration.py``."""

    target: object  # the target model (PreTrainedModel)
    input_ids: torch.LongTensor  # [1, L] prompt
    cache: object  # the target's cache (empty)
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    do_sample: bool
    max_length: int  # the sequence may not grow past this (prompt included)
    vocab_size: int  # shared vocabulary (target and draft may be padded differently)
    attention: str = "sdpa"  # the target's attention implementation (how a 4-D mask is given to it)
    output_scores: bool = False


@dataclass
class Decoded:
    sequences: torch.LongTensor  # [1, L + new]
    stats: SpecStats
    scores: tuple[torch.Tensor, ...]  # processed scores [1, V] of each emitted token, if asked


def decode(inputs: DecodeInputs, drafter: Drafter, policy: Policy, stats: SpecStats, streamer=None) -> Decoded:
    """Run the loop (module docstring)."""
    emitter, scores_out = Emitter(streamer), []
    start = time.perf_counter()
    emitter.prompt(inputs.input_ids)
    ids, stop = _prefill(inputs, emitter, scores_out)
    stats.record_prefill(time.perf_counter() - start, emitted=ids.shape[1] - inputs.input_ids.shape[1])
    drafter = _guarded(drafter.prefill, ids, drafter, stats) if not stop else drafter

    while not stop:
        length = ids.shape[1]
        budget = inputs.max_length - length - 1  # room for the guesses plus the recovered/bonus token
        # 1-3. offer, plan, propose
        try:
            offer = drafter.offer(ids, budget)
            proposal = drafter.propose(ids, policy.plan(budget, offer))
        except Exception as error:  # noqa: BLE001 - only out of memory is handled, the rest re-raised
            drafter = _drop_drafter(error, drafter, stats)
            continue
        # 4-6. forward, verify, keep
        try:
            outcome, scores = _verify_round(inputs, ids, proposal)
        except Exception as error:  # noqa: BLE001 - only out of memory with guesses is handled
            if not proposal.num_tokens and proposal.extra is None:
                raise
            kv.rollback(inputs.cache, length - 1)  # repair the cache, redo this round as a plain step
            drafter = _drop_drafter(error, drafter, stats)
            continue
        # 7. emit
        new_tokens = torch.tensor([proposal.tokens[n] for n in outcome.accepted] + [outcome.next_token])
        ids, stop = _emit(inputs, emitter, scores_out, ids, new_tokens, scores, outcome.num_accepted)
        outcome = _with_emitted(outcome, ids[0, length:])
        # 8. learn
        stats.record(outcome)
        policy.observe(outcome)
        drafter.update(outcome)

    emitter.end()
    stats.total_time_s = time.perf_counter() - start
    drafter.release()
    return Decoded(ids, stats, tuple(scores_out))


def _prefill(inputs: DecodeInputs, emitter: Emitter, scores_out: list) -> tuple[torch.LongTensor, bool]:
    """The target reads the whole prompt and emits one token."""
    try:
        logits = kv.forward(inputs.target, inputs.input_ids, inputs.cache, num_logits=1)[:, : inputs.vocab_size]
    except Exception as error:  # noqa: BLE001 - re-raised, with advice when it is out of memory
        if is_out_of_memory(error):
            raise RuntimeError(
                "Out of memory while reading the prompt with the target model. Shorten the prompt, use a "
                "smaller target or a lower precision (dtype='auto' picks bf16/fp16 where supported)."
            ) from error
        raise
    scores = _process(inputs, inputs.input_ids, Proposal(), logits)  # [1, V]
    first = verify((), (), None, scores, inputs.do_sample).next_token
    return _emit(inputs, emitter, scores_out, inputs.input_ids, torch.tensor([first]), scores, 0)


def _verify_round(inputs: DecodeInputs, ids: torch.LongTensor, proposal: Proposal):
    """Steps 4-6: one forward over the round's inputs, processors, verification, and the cache keeps the last
    token and the accepted path (their KV computed in this forward, not recomputed).

    Returns (outcome without its emitted tokens, processed scores of the emitted tokens [1 + a, V]).
    """
    start = time.perf_counter()
    past = ids.shape[1] - 1  # the cache holds every committed token but the last, which is input 0
    step = forward_inputs(proposal, int(ids[0, -1]), past, device=ids.device)
    mask = None if step.attention_mask is None else to_model_mask(
        step.attention_mask, inputs.attention, next(inputs.target.parameters()).dtype)
    num_logits = step.num_tokens if step.attention_mask is None else step.logits_index
    logits = kv.forward(inputs.target, step.input_ids, inputs.cache, num_logits=num_logits,
                        position_ids=step.position_ids, attention_mask=mask)[:, : inputs.vocab_size]  # [R, V]
    num_rows = 1 + proposal.num_tokens
    scores = _process(inputs, ids, proposal, logits[:num_rows])  # [1 + T, V]
    verdict = verify(proposal.tokens, proposal.parents, proposal.draft_probs, scores, inputs.do_sample)
    kv.keep(inputs.cache, past, step.kept_inputs(verdict.accepted))
    extra_next = top_inputs = top_next = None
    if proposal.extra is not None:
        extra_next = logits[step.read_rows].argmax(dim=-1)  # [r]
    if proposal.top_k:
        computed = torch.cat([torch.arange(num_rows, device=logits.device), step.read_rows])
        top_inputs = step.input_ids[0, step.logits_index[computed]]  # [R]
        top_next = logits[computed].topk(proposal.top_k, dim=-1).indices  # [R, K]
    outcome = RoundOutcome(
        proposal=proposal, accepted=verdict.accepted, next_token=verdict.next_token, emitted=(),
        start_length=ids.shape[1], forward_tokens=step.num_tokens, verify_time=time.perf_counter() - start,
        extra_next=extra_next, top_inputs=top_inputs, top_next=top_next)
    return outcome, scores[[0] + [1 + node for node in verdict.accepted]]


def _process(inputs: DecodeInputs, ids: torch.LongTensor, proposal: Proposal, logits: torch.Tensor) -> torch.Tensor:
    """Logits processors after the last token (row 0) and after every node (row 1 + i), each with its own
    prefix: the committed tokens and the node's path. [1 + T, V] -> [1 + T, V]."""
    if not inputs.logits_processor:
        return logits
    rows = [inputs.logits_processor(ids, logits[0:1])]
    for node in range(proposal.num_tokens):
        path = torch.tensor([[proposal.tokens[n] for n in proposal.path(node)]], dtype=torch.long, device=ids.device)
        rows.append(inputs.logits_processor(torch.cat([ids, path], dim=1), logits[1 + node: 2 + node]))
    return torch.cat(rows, dim=0)


def _emit(inputs, emitter, scores_out, ids, new_tokens, scores, num_accepted):
    """Cut the round's tokens at the first stop, stream them, append them. Returns (ids, stop)."""
    new_tokens = new_tokens.to(ids.device)
    new_tokens, stop = cut_at_stop(ids, new_tokens, inputs.stopping_criteria)
    emitter.round(new_tokens, num_accepted)
    if inputs.output_scores:
        scores_out.extend(scores[i: i + 1] for i in range(new_tokens.shape[0]))
    ids = torch.cat([ids, new_tokens[None]], dim=1)
    return ids, stop or ids.shape[1] >= inputs.max_length


def _with_emitted(outcome: RoundOutcome, emitted: torch.LongTensor) -> RoundOutcome:
    return dataclasses.replace(outcome, emitted=tuple(emitted.tolist()))


def _guarded(step, ids, drafter, stats):
    """Run a drafter step; out of memory drops the drafter (returned: the drafter to go on with)."""
    try:
        step(ids)
    except Exception as error:  # noqa: BLE001 - only out of memory is handled, the rest re-raised
        return _drop_drafter(error, drafter, stats)
    return drafter


def _drop_drafter(error: BaseException, drafter, stats: SpecStats):
    """Out of memory while drafting or verifying guesses: free the drafter and finish with plain decoding."""
    if not is_out_of_memory(error):
        raise error
    logger.warning(
        "hf_specdec: out of memory while speculating (%s). Continuing with plain decoding from the tokens "
        "already accepted; nothing is lost. To speculate, use a 4-bit draft (quantize='4bit'), a smaller draft "
        "model, or fewer guesses per round.", error,
    )
    stats.fell_back = f"out of memory: {error}"
    drafter.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return NoDrafter()
