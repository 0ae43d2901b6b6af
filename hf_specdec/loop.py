"""The single decoding loop every mode shares, for one prompt or a batch of them.

    prefill the target over the (left-padded) prompts, emit each row's first token, the policy learns what that
    read cost (a draft model's read of the same prompts is priced from it), hand the target's cache to a drafter
    that reads it (``attach``: an early-exit draft), prefill the drafter
    repeat until every row has stopped:
      1. offer     the drafter says, per row, what it could propose (``round.Offer``)
      2. plan      the policy sizes each row's round (``round.RoundPlan``; nothing in it = a plain step)
      3. propose   the drafter makes each row's ``Proposal``: a trie of guesses (a chain is a trie with one path)
      4. forward   one target forward over every row's [last token, extra inputs, guesses] (``layout.py``), each
                   row at its own positions, seeing its own cache (``cache.KVStore``), written at new slots
      5. verify    logits processors at every node, each with its own prefix; ``verify.py`` picks each row's path
      6. keep      the cache keeps the slots of each row's last token and accepted path and forgets the other
                   slots written in step 4 (a crop for a chain; other paths leave masked holes)
      7. emit      each row's tokens are cut at its first stop, streamed (one row) and appended
      8. learn     one ``RoundOutcome`` per row (with the plan it followed) to ``stats.record``,
                   ``policy.observe`` and ``drafter.update``;
                   rows that stopped leave the batch

The invariant between rounds: each row's cache keeps exactly its committed tokens except the last one, which is
the first input of its next forward, and nothing written since (no slot is pending a keep); its positions are
those plain ``generate`` gives (``cumsum(mask) - 1``), and ``lengths[r]`` is the position of that last token.

Out of memory while verifying guesses redoes the round with at most half as many guesses per row and no
window (``policy.CappedPolicy``); out of memory again, or in the drafter, frees the drafter and finishes with
plain decoding from the tokens already committed: nothing is lost, nothing is repeated.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import cache as kv
from .drafters.base import Drafter, NoDrafter
from .errors import is_out_of_memory
from .layout import round_layout, stack_layouts
from .policy import CappedPolicy, Policy
from .round import Proposal, RoundOutcome, RowView
from .stats import SpecStats
from .stopping import Emitter, cut_at_stop
from .verify import greedy_choice, verify, verify_tree_greedy

logger = logging.getLogger(__name__)


@dataclass
class DecodeInputs:
    """Everything the loop needs, prepared by ``integration.py``."""

    target: object  # the target model (PreTrainedModel)
    input_ids: torch.LongTensor  # [B, P] prompts, left-padded
    attention_mask: torch.Tensor | None  # [B, P], 0 for padding, or None (no padding)
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    do_sample: bool
    max_length: int  # a row may not grow past this (padded prompt included), as in generate
    vocab_size: int  # the target's (rows of its output layer): every row is verified, none cut to a draft's
    pad_token_id: int = 0  # fills a row after it stopped (and pads draft inputs)
    attention: str = "sdpa"  # the target's attention implementation (how a 4-D mask is given to it)
    output_scores: bool = False
    output_logits: bool = False


@dataclass
class Decoded:
    sequences: torch.LongTensor  # [B, P + new], rows that stopped early padded with pad_token_id
    stats: SpecStats
    scores: tuple[torch.Tensor, ...]  # processed scores [1, V] of each emitted token (one row), if asked
    logits: tuple[torch.Tensor, ...] = ()  # raw logits [1, V] (float32, as generate) of each emitted token, if asked


@dataclass
class _Row:
    """One row's decoding state: its padded prompt, what it emitted, whether it stopped."""

    row: int
    prompt: torch.LongTensor  # [P] as given, padding included
    unpadded: torch.LongTensor  # [L0] without padding
    new: list[int] = field(default_factory=list)
    done: bool = False

    def padded(self) -> torch.LongTensor:
        """[1, P + n]: what plain generate's processors and stopping criteria see."""
        return torch.cat([self.prompt, torch.tensor(self.new, dtype=torch.long)])[None]

    def view(self, max_length: int) -> RowView:
        ids = torch.cat([self.unpadded, torch.tensor(self.new, dtype=torch.long)])
        return RowView(self.row, ids, max_length - (self.prompt.shape[0] + len(self.new)) - 1)


def decode(inputs: DecodeInputs, drafter: Drafter, policy: Policy, stats: SpecStats, streamer=None) -> Decoded:
    """Run the loop (module docstring)."""
    emitter, scores_out = Emitter(streamer), []
    start = time.perf_counter()
    emitter.prompt(inputs.input_ids)
    cache = kv.KVStore(inputs.target, inputs.attention)
    rows = _rows(inputs)
    _prefill(inputs, cache, rows, emitter, scores_out)
    prefill_seconds = time.perf_counter() - start
    stats.record_prefill(prefill_seconds, emitted=len(rows))
    policy.observe_prefill(int(inputs.input_ids.numel()), prefill_seconds)
    active = _leave(cache, rows)
    if active and hasattr(drafter, "attach"):  # a drafter that reads the target's own cache (early exit)
        drafter.attach(cache)
    if active:
        drafter = _guarded(drafter.prefill, [row.view(inputs.max_length) for row in active], drafter, stats)

    while active:
        views = [row.view(inputs.max_length) for row in active]
        # 1-3. offer, plan, propose
        try:
            plans = policy.plan(views, drafter.offer(views))
            proposals = drafter.propose(views, plans)
        except Exception as error:  # noqa: BLE001 - only out of memory is handled, the rest re-raised
            drafter = _drop_drafter(error, drafter, stats)
            continue
        # 4-6. forward, verify, keep
        try:
            outcomes, scores = _verify_round(inputs, cache, active, views, proposals)
        except Exception as error:  # noqa: BLE001 - only out of memory with guesses is handled
            if not any(p.num_tokens or p.extra is not None for p in proposals):
                raise
            cache.discard()  # repair the cache and redo this round: fewer guesses first, then none
            drafter.update([RoundOutcome.discarded(v, p, len(views)) for v, p in zip(views, proposals)])
            policy, drafter = _shrink(error, policy, drafter, proposals, stats)
            continue
        # 7. emit
        outcomes = [_emit(inputs, emitter, scores_out, row, outcome, row_scores, plan=plan)
                    for row, outcome, plan, row_scores in zip(active, outcomes, plans, scores)]
        # 8. learn
        stats.record(outcomes)
        policy.observe(outcomes)
        drafter.update(outcomes)
        active = _leave(cache, active)

    emitter.end()
    stats.total_time_s = time.perf_counter() - start
    stats.cache_bytes, stats.draft_cache_bytes = cache.nbytes(), drafter.cache_bytes()
    drafter.release()
    return Decoded(_sequences(rows, inputs.pad_token_id), stats,
                   tuple(s for s, _ in scores_out) if inputs.output_scores else (),
                   tuple(raw for _, raw in scores_out) if inputs.output_logits else ())


def _rows(inputs: DecodeInputs) -> list[_Row]:
    mask = inputs.attention_mask
    return [_Row(r, inputs.input_ids[r], inputs.input_ids[r] if mask is None else inputs.input_ids[r, mask[r].bool()])
            for r in range(inputs.input_ids.shape[0])]


def _prefill(inputs: DecodeInputs, cache: kv.KVStore, rows: list[_Row], emitter: Emitter, scores_out: list) -> None:
    """The target reads the whole prompts and emits one token per row."""
    try:
        logits = cache.prefill(inputs.input_ids, inputs.attention_mask).logits[:, 0, : inputs.vocab_size]  # [B, V]
    except Exception as error:  # noqa: BLE001 - re-raised, with advice when it is out of memory
        if is_out_of_memory(error):
            raise RuntimeError(
                "Out of memory while reading the prompt with the target model. Shorten the prompt, use a "
                "smaller target or a lower precision (dtype='auto' picks bf16/fp16 where supported)."
            ) from error
        raise
    for row in rows:
        raw = logits[row.row: row.row + 1].clone() if inputs.output_logits else None  # before any processor
        scores = _process(inputs, row.padded(), Proposal(), logits[row.row: row.row + 1])  # [1, V]
        first = verify((), (), None, scores, inputs.do_sample).next_token
        _emit(inputs, emitter, scores_out, row, None, _returned(inputs, scores, raw, [0]), tokens=[first])


def _verify_round(inputs: DecodeInputs, cache: kv.KVStore, rows: list[_Row], views: list[RowView],
                  proposals: list[Proposal]):
    """Steps 4-6 for every row at once: one forward over the stacked rounds, processors, verification, and the
    cache keeps each row's last token and accepted path (their KV computed in this forward, not recomputed).

    Returns (per row, the outcome without its emitted tokens; per row, processed scores [1 + a, V] of the
    tokens it would emit, or None when the call does not return scores).
    """
    start = time.perf_counter()
    layouts = [round_layout(proposal, int(view.ids[-1])) for view, proposal in zip(views, proposals)]
    batch = stack_layouts(layouts, inputs.pad_token_id)
    # logits only where some row reads them (a window's inner inputs are never read): their union over the rows
    needed = torch.unique(torch.cat([layout.logits_index for layout in layouts]))  # sorted
    where = torch.full((batch.input_ids.shape[1],), -1, dtype=torch.long)
    where[needed] = torch.arange(needed.shape[0])
    full = needed.shape[0] == batch.input_ids.shape[1]
    written = cache.forward(batch, logits_at=needed.shape[0] if full else needed)
    logits = written.logits[..., : inputs.vocab_size]  # [B, |needed|, V]
    # the target's own choice and top choices at every computed row, for the whole batch at once: one call each
    # instead of one per row (per-row calls measured 2-3x slower at B = 8 on CPU); its own choice only where it is
    # read (greedy on raw logits decides by it, a window's next guesses are it)
    raw = not inputs.do_sample and not inputs.logits_processor
    wanted = raw or any(proposal.extra is not None for proposal in proposals)
    choices = greedy_choice(logits).cpu() if wanted else None  # [B, |needed|]
    top_k = max(proposal.top_k for proposal in proposals)
    tops = logits.topk(top_k, dim=-1).indices.cpu() if top_k else None  # [B, |needed|, K]
    indices = [where[layout.logits_index] for layout in layouts]  # per row: [R] into logits
    verdicts, scores, kept = [], [], []
    for i, (row, layout, proposal, index) in enumerate(zip(rows, layouts, proposals, indices)):
        num_rows = 1 + proposal.num_tokens
        if raw:
            verdict = verify_tree_greedy(proposal.tokens, proposal.parents, choices[i, index[:num_rows]])
            returned = inputs.output_scores or inputs.output_logits
            row_scores = row_raw = logits[i, index[:num_rows].to(logits.device)] if returned else None
        else:
            row_logits = logits[i, index[:num_rows].to(logits.device)]  # [1 + T, V]
            row_raw = row_logits.clone() if inputs.output_logits else None  # before any processor
            row_scores = _process(inputs, row.padded(), proposal, row_logits)  # [1 + T, V]
            verdict = verify(proposal.tokens, proposal.parents, proposal.draft_probs, row_scores, inputs.do_sample)
        verdicts.append(verdict)
        scores.append(_returned(inputs, row_scores, row_raw, [0] + [1 + node for node in verdict.accepted]))
        kept.append(written.slots[i, layout.kept_inputs(verdict.accepted)].tolist())
    cache.keep(kept)
    seconds = time.perf_counter() - start
    outcomes = []
    for i, (view, layout, proposal, verdict, index) in enumerate(zip(views, layouts, proposals, verdicts, indices)):
        extra_next = top_inputs = top_next = None
        if proposal.extra is not None:
            extra_next = choices[i, index[layout.read_rows]]  # [r]
        if proposal.top_k:
            computed = torch.cat([torch.arange(1 + proposal.num_tokens), layout.read_rows])
            top_inputs = layout.input_ids[layout.logits_index[computed]]  # [R]
            top_next = tops[i, index[computed], : proposal.top_k]  # [R, K]
        outcomes.append(RoundOutcome(
            proposal=proposal, accepted=verdict.accepted, next_token=verdict.next_token, emitted=(),
            start_length=view.ids.shape[0], forward_tokens=batch.num_tokens, verify_time=seconds,
            extra_next=extra_next, top_inputs=top_inputs, top_next=top_next, row=view.row, rows=len(views)))
    return outcomes, scores


def _process(inputs: DecodeInputs, ids: torch.LongTensor, proposal: Proposal, logits: torch.Tensor) -> torch.Tensor:
    """Logits processors after the last token (row 0) and after every node (row 1 + i), each with its own
    prefix: the row's committed tokens (``ids``: [1, L], padding included) and the node's path.
    [1 + T, V] -> [1 + T, V]."""
    if not inputs.logits_processor:
        return logits
    ids = ids.to(logits.device)
    rows = [inputs.logits_processor(ids, logits[0:1])]
    for node in range(proposal.num_tokens):
        path = torch.tensor([[proposal.tokens[n] for n in proposal.path(node)]], dtype=torch.long, device=ids.device)
        rows.append(inputs.logits_processor(torch.cat([ids, path], dim=1), logits[1 + node: 2 + node]))
    return torch.cat(rows, dim=0)


def _returned(inputs: DecodeInputs, scores, logits, kept: list[int]):
    """What the call returns for the tokens at rows ``kept`` of a round: (processed scores [n, V], raw logits
    [n, V] in float32 as generate returns them), each None unless asked; None when neither is."""
    if not (inputs.output_scores or inputs.output_logits):
        return None
    return (scores[kept] if inputs.output_scores else None, logits[kept].float() if inputs.output_logits else None)


def _emit(inputs, emitter, scores_out, row: _Row, outcome: RoundOutcome | None, scores, tokens=None, plan=None):
    """Cut the row's tokens at its first stop, stream them, append them; the outcome gets what was emitted."""
    if tokens is None:
        tokens = [outcome.proposal.tokens[n] for n in outcome.accepted] + [outcome.next_token]
    ids = row.padded()
    new_tokens, stop = cut_at_stop(ids, torch.tensor(tokens, dtype=torch.long), inputs.stopping_criteria)
    if outcome is None:
        emitter.round(new_tokens, 0)
    else:
        emitter.round(new_tokens, outcome.num_accepted, outcome.proposal)
    if scores is not None:  # (processed scores, raw logits) of the tokens offered, each None unless asked
        scores_out.extend(tuple(None if part is None else part[i: i + 1] for part in scores)
                          for i in range(new_tokens.shape[0]))
    row.new.extend(new_tokens.tolist())
    row.done = stop or row.prompt.shape[0] + len(row.new) >= inputs.max_length
    if outcome is None:
        return None
    return dataclasses.replace(outcome, emitted=tuple(new_tokens.tolist()), finished=row.done,
                               plan=outcome.plan if plan is None else plan)


def _leave(cache: kv.KVStore, rows: list[_Row]) -> list[_Row]:
    """The rows still decoding; the cache forgets the others."""
    active = [i for i, row in enumerate(rows) if not row.done]
    if len(active) < len(rows) and active:
        cache.select_rows(active)
    return [rows[i] for i in active]


def _sequences(rows: list[_Row], pad_token_id: int) -> torch.LongTensor:
    """[B, P + longest]: each row's prompt and tokens, padded after a row that stopped early."""
    longest = max(len(row.new) for row in rows)
    return torch.stack([torch.cat([row.prompt, torch.tensor(row.new + [pad_token_id] * (longest - len(row.new)),
                                                           dtype=torch.long)]) for row in rows])


def _guarded(step, views, drafter, stats):
    """Run a drafter step; out of memory drops the drafter (returned: the drafter to go on with)."""
    try:
        step(views)
    except Exception as error:  # noqa: BLE001 - only out of memory is handled, the rest re-raised
        return _drop_drafter(error, drafter, stats)
    return drafter


def _shrink(error: BaseException, policy: Policy, drafter, proposals: list[Proposal], stats: SpecStats):
    """Out of memory while verifying guesses: the first time, at most half as many guesses per row from now on
    (no window); after that, plain decoding. Returns (policy, drafter) to go on with."""
    largest = max(p.num_tokens + (p.extra.token_ids.shape[0] if p.extra is not None else 0) for p in proposals)
    if not is_out_of_memory(error) or isinstance(policy, CappedPolicy) or largest <= 1:
        return policy, _drop_drafter(error, drafter, stats)
    stats.guess_cap = max(1, largest // 2)
    logger.warning("hf_specdec: out of memory while verifying %d guesses per row (%s); going on with at most %d.",
                   largest, error, stats.guess_cap)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return CappedPolicy(policy, stats.guess_cap), drafter


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
