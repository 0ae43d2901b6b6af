"""The single decoding loop every mode shares.

    prefill the target, emit its first token
    repeat:
      1. draft     the policy picks k (0 = plain step), the drafter proposes up to k tokens
      2. verify    one target forward over [last committed token, draft tokens]
      3. accept    ``verify.py`` keeps the longest acceptable prefix and adds a recovered or bonus token
      4. roll back target and drafter forget the KV of rejected tokens (``cache.py``)
      5. learn     the policy observes what the round cost and what it gained
      6. emit/stop the round's tokens are cut at the first stop, streamed and appended

The invariant between rounds: the target cache holds every committed token except the last one, which is the
first input of the next verify forward.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import cache as kv
from .drafters.base import Drafter, Proposal
from .policy import DraftLengthPolicy
from .stats import SpecStats
from .stopping import Emitter, cut_at_stop
from .layout import TreeProposal, accepted_input_index, verify_tree
from .verify import Verdict, verify_greedy, verify_sampled

logger = logging.getLogger(__name__)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA OOM, or a failed host allocation (PyTorch reports it as a RuntimeError)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


@dataclass
class DecodeInputs:
    """Everything the loop needs, prepared by ``integration.py``."""

    target: object  # the target model (PreTrainedModel)
    input_ids: torch.LongTensor  # [1, L] prompt
    cache: object  # the target's DynamicCache (empty)
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    do_sample: bool
    max_length: int
    vocab_size: int  # shared vocabulary (target and draft may be padded differently)
    generator: torch.Generator | None = None
    output_scores: bool = False


def decode(inputs: DecodeInputs, drafter: Drafter | None, policy: DraftLengthPolicy, streamer=None,
           stats: SpecStats | None = None) -> tuple[torch.LongTensor, SpecStats, tuple[torch.Tensor, ...]]:
    """Run the loop; returns (sequences [1, L + new], stats, processed scores per emitted token if asked)."""
    stats = stats if stats is not None else SpecStats()
    emitter = Emitter(streamer)
    target, cache = inputs.target, inputs.cache
    scores_out: list[torch.Tensor] = []
    start = time.perf_counter()
    emitter.prompt(inputs.input_ids)

    # prefill: the whole prompt, one token out
    try:
        logits = kv.forward(target, inputs.input_ids, cache, num_logits=1)[:, : inputs.vocab_size]  # [1, V]
    except Exception as error:
        if is_out_of_memory(error):
            raise RuntimeError(
                "Out of memory while reading the prompt with the target model. Shorten the prompt, use a "
                "smaller target or a lower precision (dtype='auto' picks bf16/fp16 where supported)."
            ) from error
        raise
    scores = _process(inputs, inputs.input_ids, torch.empty(0, dtype=torch.long), logits)
    first = _pick(inputs, scores[0])
    ids, stop = _emit(inputs, emitter, stats, scores_out, inputs.input_ids, torch.tensor([first]), scores, 0)
    stats.prefill_time_s = time.perf_counter() - start
    stats.record_prefill(stats.prefill_time_s, emitted=1)
    stats.ttft_s = stats.prefill_time_s

    if drafter is not None and not stop:
        try:
            drafter.prefill(ids)
        except Exception as error:
            drafter = _drop_drafter(error, drafter, stats)

    while not stop:
        length = ids.shape[1]
        budget = inputs.max_length - length - 1  # room for k drafts plus the recovered/bonus token

        # 1. draft
        k = policy.next_k(budget) if drafter is not None else 0
        proposal = Proposal(torch.empty(0, dtype=torch.long))
        if k > 0:
            try:
                proposal = drafter.propose(ids, k, policy.keep_drafting)
            except Exception as error:
                drafter = _drop_drafter(error, drafter, stats)
        if proposal.tree is None and proposal.num_tokens > budget:  # lookup tokens may run past the length limit
            proposal = _truncate(proposal, budget)
        draft_tokens = proposal.token_ids.to(ids.device)

        if proposal.tree is not None:
            # 2-4. lookahead (tree): one forward over the window and the trie, tree verify, keep the path's KV
            verdict, draft_tokens, scores, verify_time = _tree_round(inputs, ids, proposal.tree, drafter)
            drafter.rollback(length + verdict.num_accepted)
            num_drafted, verify_tokens = proposal.tree.depth, proposal.tree.layout.num_tokens
        else:
            # 2. verify: one target forward over the last committed token and the draft tokens
            verify_start = time.perf_counter()
            verify_input = torch.cat([ids[0, -1:], draft_tokens])[None]  # [1, k + 1]
            try:
                logits = kv.forward(target, verify_input, cache, num_logits=verify_input.shape[1])
            except Exception as error:
                if draft_tokens.numel() == 0 or not is_out_of_memory(error):
                    raise
                # out of memory verifying k tokens: repair the cache, stop speculating, redo this round as a plain step
                kv.rollback(cache, length - 1)
                drafter = _drop_drafter(error, drafter, stats)
                continue
            logits = logits[:, : inputs.vocab_size]  # [k + 1, V]

            # 3. accept
            scores = _process(inputs, ids, draft_tokens, logits)  # [k + 1, V]
            verdict = _verify(inputs, draft_tokens, proposal.draft_probs, scores)
            verify_time = time.perf_counter() - verify_start

            # 4. roll back: keep the committed tokens and the accepted draft tokens
            kv.rollback(cache, length + verdict.num_accepted)
            if drafter is not None and draft_tokens.numel():
                drafter.rollback(length + verdict.num_accepted)

            num_drafted = int(draft_tokens.numel())
            verify_tokens = num_drafted + 1

        # 5. learn (the policy chose only the draft model's tokens, not the prompt-lookup ones after them)
        chosen = num_drafted - proposal.num_lookup_tokens
        policy.observe(chosen, min(verdict.num_accepted, chosen), proposal.draft_time, proposal.draft_forwards,
                       verify_tokens, verify_time)
        if proposal.num_lookup_tokens and verdict.num_accepted >= chosen:  # lookup tokens were judged
            policy.observe_lookup(proposal.num_lookup_tokens, verdict.num_accepted - chosen)
        stats.lookup_drafted += proposal.num_lookup_tokens
        stats.lookup_accepted += max(0, verdict.num_accepted - chosen)
        stats.draft_time_s += proposal.draft_time
        stats.draft_forwards += proposal.draft_forwards

        # 6. emit / stop
        new_tokens = torch.cat([draft_tokens[: verdict.num_accepted], torch.tensor([verdict.next_token])])
        ids, stop = _emit(inputs, emitter, stats, scores_out, ids, new_tokens, scores, verdict.num_accepted)
        stats.record_round(num_drafted, verdict.num_accepted, int(ids.shape[1] - length), verify_tokens, verify_time)

    emitter.end()
    stats.total_time_s = time.perf_counter() - start
    if drafter is not None:
        drafter.release()
    return ids, stats, tuple(scores_out)


# -- lookahead (tree) rounds ------------------------------------------------------------------------------------------
def _tree_round(inputs: DecodeInputs, ids: torch.LongTensor, tree: TreeProposal, drafter):
    """Steps 2-4 for a tree proposal: one forward over [last token, window, trie] with the proposal's 4-D mask and
    position ids, verification of the trie (``verify_tree``), and ``cache.compact`` so the cache keeps the KV of
    the last token and of the accepted path (computed in this forward, not recomputed), nothing else.

    Returns (verdict, accepted path tokens [num_accepted], processed scores of the emitted tokens, seconds).
    """
    layout, trie, cache = tree.layout, tree.trie, inputs.cache
    start = ids.shape[1] - 1  # the cache holds every committed token but the last, which is input 0
    verify_start = time.perf_counter()
    # logits only where they are read: the trie's rows, then the window's bottom row
    needed = torch.cat([layout.trie_index, layout.window_out_index]).to(layout.input_ids.device)
    logits = kv.forward(inputs.target, layout.input_ids, cache, num_logits=needed, position_ids=layout.position_ids,
                        attention_mask=tree.attention_mask)[:, : inputs.vocab_size]  # [1 + T + W, V]
    num_trie_rows = layout.trie_index.shape[0]
    window_tokens = logits[num_trie_rows:].argmax(dim=-1)  # [W] next Jacobi guesses (argmax, as LADE)
    # the target's top choices after every input whose logits were computed (trie rows, then the window's bottom
    # row), for the drafter to recycle: [1 + T + W], [1 + T + W, K]
    predicted_after = layout.input_ids[0, needed]
    top_next = logits.topk(drafter.recycle_width, dim=-1).indices
    scores = _process_tree(inputs, ids, trie, logits[:num_trie_rows])  # [1 + T, V]
    if inputs.do_sample:  # one independent sample per node: following matching children is exactly lossless
        target_tokens = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=inputs.generator)[:, 0]
    else:
        target_tokens = scores.argmax(dim=-1)  # [1 + T]
    accepted, next_token = verify_tree(trie, target_tokens.tolist())
    keep = accepted_input_index(trie, accepted, num_window_tokens=layout.num_tokens - len(trie))
    kv.compact(cache, start, torch.tensor(keep, dtype=torch.long))
    verify_time = time.perf_counter() - verify_start
    drafter.observe_forward(window_tokens, layout.num_tokens, verify_time, predicted_after, top_next)
    path_tokens = torch.tensor([trie.tokens[node] for node in accepted], dtype=torch.long)
    path_scores = scores[[0] + [1 + node for node in accepted]]  # rows of the emitted tokens
    return Verdict(len(accepted), next_token), path_tokens, path_scores, verify_time


def _process_tree(inputs: DecodeInputs, ids: torch.LongTensor, trie, logits: torch.Tensor) -> torch.Tensor:
    """Logits processors at the last token (row 0) and at every node (row 1 + i), each with its own prefix."""
    if not inputs.logits_processor:
        return logits
    rows = [inputs.logits_processor(ids, logits[0:1])]
    for node in range(len(trie)):
        path = torch.tensor([[trie.tokens[n] for n in trie.path(node)]], dtype=torch.long, device=ids.device)
        rows.append(inputs.logits_processor(torch.cat([ids, path], dim=1), logits[1 + node: 2 + node]))
    return torch.cat(rows, dim=0)


def _truncate(proposal: Proposal, budget: int) -> Proposal:
    """Keep the first ``budget`` tokens of a chain proposal."""
    lookup = max(0, proposal.num_lookup_tokens - (proposal.num_tokens - budget))
    return Proposal(
        token_ids=proposal.token_ids[:budget],
        draft_probs=None if proposal.draft_probs is None else proposal.draft_probs[:budget],
        draft_time=proposal.draft_time,
        draft_forwards=proposal.draft_forwards,
        num_lookup_tokens=lookup,
    )


def _process(inputs: DecodeInputs, ids: torch.LongTensor, draft_tokens: torch.LongTensor,
             logits: torch.Tensor) -> torch.Tensor:
    """Apply the logits processors at each verified position, each with its own prefix. [n, V] -> [n, V]."""
    if not inputs.logits_processor:
        return logits
    full = torch.cat([ids, draft_tokens[None].to(ids.device)], dim=1)  # [1, L + k]
    length = ids.shape[1]
    rows = [inputs.logits_processor(full[:, : length + i], logits[i: i + 1]) for i in range(logits.shape[0])]
    return torch.cat(rows, dim=0)


def _pick(inputs: DecodeInputs, scores: torch.Tensor) -> int:
    """Plain decoding's choice from one processed row [V]."""
    if inputs.do_sample:
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=inputs.generator))
    return int(scores.argmax())


def _verify(inputs: DecodeInputs, draft_tokens, draft_probs, scores) -> Verdict:
    if draft_tokens.numel() == 0:
        return Verdict(0, _pick(inputs, scores[0]))
    if not inputs.do_sample:
        return verify_greedy(draft_tokens, scores.argmax(dim=-1))
    target_probs = torch.softmax(scores, dim=-1)  # [k + 1, V]
    if draft_probs is not None:
        draft_probs = draft_probs.to(target_probs.device)
    return verify_sampled(draft_tokens, draft_probs, target_probs, generator=inputs.generator)


def _emit(inputs, emitter, stats, scores_out, ids, new_tokens, scores, num_accepted):
    """Cut the round's tokens at the first stop, stream them, append them. Returns (ids, stop)."""
    new_tokens = new_tokens.to(ids.device)
    new_tokens, stop = cut_at_stop(ids, new_tokens, inputs.stopping_criteria)
    emitter.round(new_tokens, num_accepted)
    if inputs.output_scores:
        scores_out.extend(scores[i: i + 1] for i in range(new_tokens.shape[0]))
    ids = torch.cat([ids, new_tokens[None]], dim=1)
    return ids, stop or ids.shape[1] >= inputs.max_length


def _drop_drafter(error: BaseException, drafter, stats: SpecStats):
    """Out of memory in the drafter: free it and finish with plain decoding; anything else is a real error."""
    if not is_out_of_memory(error):
        raise error
    logger.warning(
        "hf_specdec: out of memory while drafting (%s). Continuing with plain decoding from the tokens already "
        "accepted; nothing is lost. To speculate, use a 4-bit draft (quantize='4bit') or a smaller draft model.",
        error,
    )
    stats.fell_back = f"out of memory: {error}"
    if drafter is not None:
        drafter.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None
