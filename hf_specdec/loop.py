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
                   slots written in step 4 (a crop for a chain; other paths leave masked holes; once holes
                   pass a share of the columns, the cache compacts them: a step timed apart from the forward)
      7. emit      each row's tokens are cut at its first stop, streamed (one row) and appended
      8. learn     one ``RoundOutcome`` per row (with the plan it followed and the round's host time: the loop's
                   seconds outside the timed verify and drafting, the learning of the round before included) to
                   ``stats.record``, ``policy.observe`` and ``drafter.update``;
                   rows that stopped leave the batch

The invariant between rounds: each row's cache keeps exactly its committed tokens except the last one, which is
the first input of its next forward, and nothing written since (no slot is pending a keep); its positions are
those plain ``generate`` gives (the prompt's as ``generate`` derived or was given them, each later token at the
last one + 1), and ``next_positions()[r]`` is the position of that last token. A cache passed in holds the
prompt's first columns: the prefill reads only the others; a cache plain would return is left as plain leaves it
(``KVStore.finish``). A drafter sees each row's tokens the target attends to (no padding, no holes of the mask),
in order: a draft model reads them at its own positions 0, 1, ..., the target's view of the same text.

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
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from . import cache as kv
from .compiled import EAGER, Verifier
from .costmodel import RoundCost
from .drafters.base import Drafter, NoDrafter
from .errors import is_out_of_memory
from .inputs import NO_INPUTS, ModelInputs
from .layout import positions, round_layout, stack_layouts
from .ordinary import ordinary
from .policy import CappedPolicy, Policy
from .processors import process_rows
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
    output_hidden_states: bool = False
    output_attentions: bool = False
    # the model's other inputs (token types, images, a prompt's embeddings, multimodal positions), given to every
    # target forward as plain generate gives them (``inputs.py``); NO_INPUTS for most calls
    model_inputs: ModelInputs = NO_INPUTS
    # the cache generate() prepared: a caller's (holding the prompt's first ``cached`` columns of input_ids, or
    # columns before them when input_ids are only the new tokens) or a fresh one; None: the store makes one
    cache: object | None = None
    cached: int = 0  # input_ids' leading columns that cache holds: the prefill reads the others
    position_ids: torch.Tensor | None = None  # [B or 1, P - cached] the positions of what the prefill reads, or None
    return_cache: bool = False  # hand the cache back (``Decoded.cache``) in the state plain generate leaves it
    verifier: Verifier = EAGER  # runs each round's verify forward (``compiled.py``: compiled over a static cache)

    @property
    def returns(self) -> bool:
        """Does the call return anything per emitted token (``Step``)?"""
        return self.output_scores or self.output_logits or bool(self.record)

    @property
    def record(self) -> kv.Recording:
        """What the target's forwards record for the call to return (nothing unless asked: no cost)."""
        return kv.Recording(self.output_hidden_states, self.output_attentions)


@dataclass(frozen=True)
class Step:
    """What the call returns for one emitted token of one row, as plain ``generate`` returns it for that step, each
    None unless asked: processed scores and raw logits (float32) [1, V]; hidden states (embeddings, then each
    layer) [1, 1, D] and attentions (one per layer) [1, heads, 1, P + t] at step t, from the forward whose input
    was the token before (the row's padding columns at weight 0, a trie's other branches and holes left out),
    and for the first token those of the prompt's forward, [1, P, D] and [1, heads, P, P]; attentions are ()
    where the attention kernel returns none (sdpa, as in plain ``generate``). A model reading encoder states (an
    encoder-decoder) also has the cross-attentions of the same input, [1, heads, 1, S] per layer over the encoder's
    S columns (the prompt's: [1, heads, P, S]): the input's query row, as plain's one-token forward has it."""

    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class Decoded:
    """What ``decode`` returns: per output flag, one entry per step as plain ``generate`` returns them (B rows
    stacked; empty unless asked); ``cache``: the cache to return as plain ``generate`` does, once the loop can
    give it in plain's layout (None until then)."""

    sequences: torch.LongTensor  # [B, P + new], rows that stopped early padded with pad_token_id
    stats: SpecStats
    scores: tuple[torch.Tensor, ...] = ()  # processed scores [B, V] of each step, if asked
    logits: tuple[torch.Tensor, ...] = ()  # raw logits [B, V] (float32, as generate) of each step, if asked
    hidden_states: tuple[tuple[torch.Tensor, ...], ...] = ()  # per step, per layer (Step), if asked
    attentions: tuple[tuple[torch.Tensor, ...], ...] = ()  # per step, per layer (Step), if asked
    cross_attentions: tuple[tuple[torch.Tensor, ...], ...] = ()  # per step, per layer (Step), if asked of a model
    # reading encoder states
    cache: object | None = None


@dataclass
class _Row:
    """One row's decoding state: its padded prompt, what it emitted, whether it stopped."""

    row: int
    prompt: torch.LongTensor  # [P] as given, padding included
    unpadded: torch.LongTensor  # [L0] without padding
    new: list[int] = field(default_factory=list)
    done: bool = False
    # the padded and unpadded tokens so far, made on first use and remade as tokens are appended (``extend``):
    # ``padded`` and ``view`` hand them out, and nothing writes into a tensor once handed out
    _padded: torch.LongTensor | None = None
    _unpadded: torch.LongTensor | None = None

    def extend(self, tokens: list[int]) -> None:
        """Append emitted tokens (to the buffers too, where made: new tensors, so views handed out stay as they were)."""
        self.new.extend(tokens)
        if self._padded is not None:
            new = torch.tensor(tokens, dtype=torch.long)
            self._padded, self._unpadded = torch.cat([self._padded, new]), torch.cat([self._unpadded, new])

    def _buffers(self) -> tuple[torch.LongTensor, torch.LongTensor]:
        if self._padded is None:
            new = torch.tensor(self.new, dtype=torch.long)
            self._padded, self._unpadded = torch.cat([self.prompt, new]), torch.cat([self.unpadded, new])
        return self._padded, self._unpadded

    def padded(self) -> torch.LongTensor:
        """[1, P + n]: what plain generate's processors and stopping criteria see."""
        return self._buffers()[0][None]

    def view(self, max_length: int) -> RowView:
        return RowView(self.row, self._buffers()[1], max_length - (self.prompt.shape[0] + len(self.new)) - 1)


def decode(inputs: DecodeInputs, drafter: Drafter, policy: Policy, stats: SpecStats, streamer=None) -> Decoded:
    """Run the loop (module docstring) in inference mode; what it returns, and the cache it was passed, hold
    ordinary tensors (``ordinary.py``) unless the caller runs in inference mode itself, as plain's would."""
    if torch.is_inference_mode_enabled():
        return _decode(inputs, drafter, policy, stats, streamer)
    try:
        with torch.inference_mode():
            decoded = _decode(inputs, drafter, policy, stats, streamer)
    finally:  # the caller's cache, also where the call raised (plain's cache is left as far as it got)
        ordinary(inputs.cache)
    return ordinary(decoded)


def _decode(inputs: DecodeInputs, drafter: Drafter, policy: Policy, stats: SpecStats, streamer=None) -> Decoded:
    emitter = Emitter(streamer)
    inputs = dataclasses.replace(inputs, stopping_criteria=_own_stops(inputs))
    steps: list[list[Step]] = [[] for _ in range(inputs.input_ids.shape[0])]  # per row, per emitted token, if asked
    start = time.perf_counter()
    emitter.prompt(inputs.input_ids)
    cache = kv.KVStore(inputs.target, inputs.attention, cache=inputs.cache, returns_cache=inputs.return_cache,
                       keeps_rows=inputs.returns, compacts_on_keep=False)
    rows = _rows(inputs)
    _prefill(inputs, cache, rows, emitter, steps)
    prefill_seconds = time.perf_counter() - start
    stats.record_prefill(prefill_seconds, emitted=len(rows))
    policy.observe_prefill(int(inputs.input_ids[:, inputs.cached:].numel()), prefill_seconds)
    active = _leave(cache, rows)
    if active:  # the target's cache, for a drafter that reads it (early exit); the others ignore it
        drafter.attach(cache)
    if active:
        drafter = _guarded(drafter.prefill, [row.view(inputs.max_length) for row in active], drafter, stats)

    learned = 0.0  # the last round's emit and learning (step 7 on): the next round's outcome carries them
    while active:
        begin = time.perf_counter()
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
        # 7. emit; the round's host work is what its forwards' and drafter's times do not hold
        host = max(0.0, time.perf_counter() - begin - RoundCost.spent(outcomes)) + learned
        begin = time.perf_counter()
        outcomes = [_emit(inputs, emitter, steps, row, outcome, returned, plan=plan, host_time=host)
                    for row, outcome, plan, returned in zip(active, outcomes, plans, scores)]
        # 8. learn
        stats.record(outcomes)
        policy.observe(outcomes)
        drafter.update(outcomes)
        active = _leave(cache, active)
        learned = time.perf_counter() - begin

    emitter.end()
    stats.total_time_s = time.perf_counter() - start
    stats.cache_bytes, stats.draft_cache_bytes = cache.nbytes(), drafter.cache_bytes()
    drafter.release()
    if inputs.returns or inputs.return_cache:  # plain fed each row that stopped early padding until the others did
        fed = cache.feed([row.new for row in rows], inputs.pad_token_id, record=inputs.record,
                         logits_at=None if inputs.returns else 1)
        for r, forward in fed.items():
            if inputs.returns:
                steps[r].extend(_fed_steps(inputs, cache, rows[r], forward))
    if inputs.return_cache:  # as plain generate() leaves it: the prompt and every emitted token but the last
        cache.finish([row.new for row in rows], inputs.pad_token_id)
    return Decoded(_sequences(rows, inputs.pad_token_id), stats, **_stacked(inputs, steps),
                   cache=cache.cache if inputs.return_cache else None)


def _own_stops(inputs: DecodeInputs) -> StoppingCriteriaList:
    """The call's stopping criteria less those the loop decides by itself: a ``MaxLengthCriteria`` at or past the
    call's ``max_length`` (no row is offered more tokens than reach it, and a row that reaches it is done), which
    would otherwise be evaluated after each emitted token (``stopping.cut_at_stop``)."""
    return StoppingCriteriaList(criterion for criterion in inputs.stopping_criteria
                                if not (type(criterion) is MaxLengthCriteria
                                        and criterion.max_length >= inputs.max_length))


def _rows(inputs: DecodeInputs) -> list[_Row]:
    mask = inputs.attention_mask  # [B, M]: M >= P with a cache passed in, or a prompt given as embeddings
    if mask is not None:  # the columns of input_ids: a drafter sees the tokens the target attends to
        mask = mask[:, mask.shape[1] - inputs.input_ids.shape[1]:]
    return [_Row(r, inputs.input_ids[r], inputs.input_ids[r] if mask is None else inputs.input_ids[r, mask[r].bool()])
            for r in range(inputs.input_ids.shape[0])]


def _prefill(inputs: DecodeInputs, cache: kv.KVStore, rows: list[_Row], emitter: Emitter,
             steps: list[list[Step]]) -> None:
    """The target reads the whole prompts and emits one token per row (its step 0: the prompt's hidden states and
    attentions, when asked)."""
    try:
        read = cache.prefill(inputs.model_inputs.prompt_ids(inputs.input_ids)[:, inputs.cached:], inputs.attention_mask,
                             record=inputs.record, positions=inputs.position_ids, inputs=inputs.model_inputs)
        logits = read.logits[:, 0, : inputs.vocab_size]  # [B, V]
    except Exception as error:  # noqa: BLE001 - re-raised, with advice when it is out of memory
        if is_out_of_memory(error):
            raise RuntimeError(
                "Out of memory while reading the prompt with the target model. Shorten the prompt, use a "
                "smaller target or a lower precision (dtype='auto' picks bf16/fp16 where supported)."
            ) from error
        raise
    processed = _process(inputs, [(row.row, row.padded(), Proposal(), logits[row.row: row.row + 1]) for row in rows])
    for row, scores in zip(rows, processed):  # scores: [1, V]
        raw = logits[row.row: row.row + 1].clone() if inputs.output_logits else None  # before any processor
        first = verify((), (), None, scores, inputs.do_sample).next_token
        prompt = [_rows_of(read.hidden_states, row.row), _rows_of(read.attentions, row.row),
                  _rows_of(read.cross_attentions, row.row)]
        _emit(inputs, emitter, steps, row, None, _returned(inputs, scores, raw, [0], [prompt]), tokens=[first])


def _verify_round(inputs: DecodeInputs, cache: kv.KVStore, rows: list[_Row], views: list[RowView],
                  proposals: list[Proposal]):
    """Steps 4-6 for every row at once: one forward over the stacked rounds, processors, verification, and the
    cache keeps each row's last token and accepted path (their KV computed in this forward, not recomputed).

    Returns (per row, the outcome without its emitted tokens; per row, the ``Step`` of each token it would emit,
    or None when the call returns none).
    """
    start = time.perf_counter()
    layouts = [round_layout(proposal, int(view.ids[-1])) for view, proposal in zip(views, proposals)]
    batch = stack_layouts(layouts, inputs.pad_token_id)
    n = batch.input_ids.shape[1]
    chains = all(layout.inner is None and not layout.read_rows.shape[0] for layout in layouts)
    if chains:  # every input
        needed, where = positions(n), positions(n)
    else:  # logits only where some row reads them (a window's inner inputs are never read): their union
        needed = torch.unique(torch.cat([layout.logits_index for layout in layouts]))  # sorted
        where = torch.full((n,), -1, dtype=torch.long)
        where[needed] = torch.arange(needed.shape[0])
    full = needed.shape[0] == n
    written = inputs.verifier.forward(cache, batch, logits_at=needed.shape[0] if full else needed,
                                      record=inputs.record)
    logits = written.logits[..., : inputs.vocab_size]  # [B, |needed|, V]
    # the target's own choice and top choices at every computed row, for the whole batch at once: one call each
    # instead of one per row (per-row calls measured 2-3x slower at B = 8 on CPU); its own choice only where it is
    # read (greedy on raw logits decides by it, a window's next guesses are it)
    raw = not inputs.do_sample and not inputs.logits_processor
    wanted = raw or any(proposal.extra is not None for proposal in proposals)
    top_k = max(proposal.top_k for proposal in proposals)
    # the round's one device-to-host transfer: the target's choices (and top choices), with the draft tokens still
    # on the device (``Proposal.device_tokens``)
    choices, tops, proposals = _read_back(greedy_choice(logits) if wanted else None,
                                          logits.topk(top_k, dim=-1).indices if top_k else None, proposals)
    # per row: [R] into logits (a chain's: its inputs, 0..R-1, as ``where`` maps them)
    indices = [layout.logits_index if chains else where[layout.logits_index] for layout in layouts]
    processed = None if raw else _process(inputs, [
        (row.row, row.padded(), proposal, logits[i, index[:1 + proposal.num_tokens].to(logits.device)])
        for i, (row, proposal, index) in enumerate(zip(rows, proposals, indices))])  # per row: [1 + T, V]
    verdicts, scores, kept = [], [], []
    slots = written.slots.tolist()  # [B, n] (host)
    for i, (row, layout, proposal, index) in enumerate(zip(rows, layouts, proposals, indices)):
        num_rows = 1 + proposal.num_tokens
        if raw:
            verdict = verify_tree_greedy(proposal.tokens, proposal.parents, choices[i, index[:num_rows]])
            returned = inputs.output_scores or inputs.output_logits
            row_scores = row_raw = logits[i, index[:num_rows].to(logits.device)] if returned else None
        else:
            row_logits = logits[i, index[:num_rows].to(logits.device)]  # [1 + T, V]
            row_raw = row_logits.clone() if inputs.output_logits else None  # before any processor
            row_scores = processed[i]  # [1 + T, V]
            verdict = verify(proposal.tokens, proposal.parents, proposal.draft_probs, row_scores, inputs.do_sample)
        verdicts.append(verdict)
        kept.append([slots[i][j] for j in layout.kept_inputs(verdict.accepted)])
        recorded = _recorded(written, cache, i, layout.kept_inputs(verdict.accepted), kept[-1],
                             row.prompt.shape[0] - row.unpadded.shape[0]) if inputs.record else None
        scores.append(_returned(inputs, row_scores, row_raw, [0] + [1 + node for node in verdict.accepted], recorded))
    cache.keep(kept)
    seconds = time.perf_counter() - start
    compacted, compact_time = 0, 0.0
    if cache.compaction_due():  # a step of its own, timed apart: t(n) learns the forward, not the compaction
        begin = time.perf_counter()
        compacted = cache.compact()
        compact_time = time.perf_counter() - begin
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
            start_length=view.ids.shape[0], verify_time=seconds,  # the forward's inputs: at the width it ran
            forward_tokens=batch.input_ids.shape[0] * inputs.verifier.width(batch.input_ids.shape[1]),
            extra_next=extra_next, top_inputs=top_inputs, top_next=top_next, row=view.row, rows=len(views),
            compacted=compacted, compact_time=compact_time))
    return outcomes, scores


def _read_back(choices: torch.Tensor | None, tops: torch.Tensor | None, proposals: list[Proposal]
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[Proposal]]:
    """The round's one device-to-host transfer: the target's choices [B, m] and top choices [B, m, K] (each or
    None) and the tokens of the proposals still on the device (``Proposal.device_tokens``), read together.
    Returns (choices, tops) on the host and the proposals with their tokens read (``Proposal.resolved``)."""
    parts = [part.reshape(-1) for part in (choices, tops) if part is not None]
    parts += [proposal.device_tokens for proposal in proposals if proposal.device_tokens is not None]
    if not parts:
        return choices, tops, proposals
    values = torch.cat(parts).cpu() if len(parts) > 1 else parts[0].cpu()
    start = 0
    read = []
    for part in (choices, tops):
        if part is None:
            read.append(None)
            continue
        read.append(values[start: start + part.numel()].view(part.shape))
        start += part.numel()
    if any(proposal.device_tokens is not None for proposal in proposals):
        rest = values[start:].tolist()
        resolved = []
        for proposal in proposals:
            if proposal.device_tokens is not None:
                resolved.append(proposal.resolved(rest[: proposal.num_tokens]))
                rest = rest[proposal.num_tokens:]
            else:
                resolved.append(proposal)
        proposals = resolved
    return read[0], read[1], proposals


def _process(inputs: DecodeInputs, requests: list[tuple[int, torch.LongTensor, Proposal, torch.Tensor]]
             ) -> list[torch.Tensor]:
    """Logits processors over rounds of rows: per request (the row's index in the caller's batch, its committed
    tokens ``ids`` [1, L] padding included, its proposal, its logits [1 + T, V]) the scores after the last token
    (row 0) and after every node (row 1 + i), each with its own prefix: the committed tokens and the node's path.
    Returns per request [1 + T, V]. The processors are called over the caller's batch, each prefix at its row's
    index, as plain calls them (``processors.process_rows``)."""
    if not inputs.logits_processor:
        return [logits for _, _, _, logits in requests]
    entries = [(row, torch.cat([ids[0], torch.tensor([proposal.tokens[n] for n in proposal.path(node - 1)],
                                                     dtype=torch.long)]) if node else ids[0], logits[node])
               for row, ids, proposal, logits in requests for node in range(logits.shape[0])]
    out = process_rows(inputs.logits_processor, inputs.input_ids.shape[0], entries)
    result, start = [], 0
    for _, _, _, logits in requests:
        result.append(torch.stack(out[start: start + logits.shape[0]]))
        start += logits.shape[0]
    return result


def _returned(inputs: DecodeInputs, scores, logits, kept: list[int], recorded=None) -> list[Step] | None:
    """What the call returns for the tokens at rows ``kept`` of a round (processed scores and raw logits
    [1 + T, V]; ``recorded``: per kept token, its (hidden states, attentions, cross-attentions), ``_recorded``):
    one ``Step`` per token, None when nothing is asked."""
    if not inputs.returns:
        return None
    recorded = recorded or [(None, None, None)] * len(kept)
    return [Step(scores[k: k + 1] if inputs.output_scores else None,
                 logits[k: k + 1].float() if inputs.output_logits else None,
                 hidden if inputs.output_hidden_states else None,
                 attentions if inputs.output_attentions else None,
                 cross if inputs.output_attentions else None) for k, (hidden, attentions, cross) in zip(kept, recorded)]


def _rows_of(states: tuple[torch.Tensor, ...] | None, row: int) -> tuple[torch.Tensor, ...] | None:
    """One row of each layer's tensor (the prompt's hidden states or attentions), None when not recorded."""
    return None if states is None else tuple(layer[row: row + 1] for layer in states)


def _recorded(written: kv.ForwardResult, cache: kv.KVStore, i: int, inputs: list[int], slots: list[int],
              padding: int) -> list[tuple]:
    """Per emitted token of row ``i`` of a verify forward, its (hidden states, attentions, cross-attentions) as
    plain ``generate`` records them: those of the input before it on the kept path (``inputs``: the last token,
    then the accepted nodes, written at ``slots``); attention rows with the columns plain's forward had
    (``KVStore.attention_rows``: the row's ``padding`` at weight 0, its tokens, the path up to the input; no hole,
    no other branch, no other row's padding); cross-attention rows as they are (the encoder's columns, the same
    in every forward). Computed before ``keep``."""
    recorded = []
    for j, index in enumerate(inputs):
        hidden = None if written.hidden_states is None else tuple(
            layer[i: i + 1, index: index + 1] for layer in written.hidden_states)  # [1, 1, D] each
        attentions = None
        if written.attentions is not None:
            total = int(written.slots[i, -1]) + 1  # every column of the forward: the kept ones and its inputs
            attentions = cache.attention_rows(written.attentions, i, index, slots[: j + 1], padding, total)
        recorded.append((hidden, attentions, _query_rows(written.cross_attentions, i, index)))
    return recorded


def _query_rows(attentions: tuple[torch.Tensor, ...] | None, row: int, query: int
                ) -> tuple[torch.Tensor, ...] | None:
    """Per layer, the weights [1, heads, 1, K] of input ``query`` of row ``row`` (a forward's cross-attentions
    [B, heads, n, K] per layer), None when not recorded."""
    return None if attentions is None else tuple(layer[row: row + 1, :, query: query + 1] for layer in attentions)


def _fed_steps(inputs: DecodeInputs, cache: kv.KVStore, row: _Row, fed: kv.Fed) -> list[Step]:
    """The ``Step`` plain ``generate`` returns for each step of a row after its stop, from the forward over its
    last token and the padding plain fed it (``KVStore.feed``): at input j, the processors over the row's ids and
    j pads, its raw logits, and its hidden states and attention row (the row's padding at weight 0, its tokens,
    the inputs up to j)."""
    logits = fed.result.logits[0, :, : inputs.vocab_size]  # [L, V]
    raw = logits.clone() if inputs.output_logits else None  # before any processor
    ids = row.padded()
    scores = torch.cat(_process(inputs, [(row.row, torch.cat([ids, torch.full((1, j), inputs.pad_token_id)], dim=1),
                                          Proposal(), logits[j: j + 1]) for j in range(logits.shape[0])]))  # [L, V]
    padding = row.prompt.shape[0] - row.unpadded.shape[0]
    recorded = [(None if fed.result.hidden_states is None else
                 tuple(layer[:, j: j + 1] for layer in fed.result.hidden_states),  # [1, 1, D] each
                 None if fed.result.attentions is None else cache.fed_attention_rows(fed, j, padding),
                 _query_rows(fed.result.cross_attentions, 0, j))
                for j in range(logits.shape[0])]
    return _returned(inputs, scores, raw, list(range(logits.shape[0])), recorded)


def _stacked(inputs: DecodeInputs, steps: list[list[Step]]) -> dict:
    """Each row's steps stacked per step, as plain ``generate`` returns them: ``Decoded``'s flag fields (a row
    that stopped before the others has the steps of the padding plain fed it after, ``_fed_steps``)."""
    longest = max(len(row) for row in steps)
    if not inputs.returns or not longest:
        return {}
    assert all(len(row) == longest for row in steps), "every row has a step per emitted token of the longest"
    fields = {}
    for name in ("scores", "logits", "hidden_states", "attentions", "cross_attentions"):
        if getattr(steps[0][0], name) is None:
            continue
        fields[name] = tuple(_stack([getattr(row[t], name) for row in steps]) for t in range(longest))
    return fields


def _stack(entries: list):
    """Rows' entries of one step (a tensor, or a tuple of them per layer) concatenated over rows."""
    if isinstance(entries[0], tuple):
        return tuple(_stack([entry[layer] for entry in entries]) for layer in range(len(entries[0])))
    return torch.cat(entries)


def _emit(inputs, emitter, steps: list[list[Step]], row: _Row, outcome: RoundOutcome | None, returned,
          tokens=None, plan=None, host_time: float = 0.0):
    """Cut the row's tokens at its first stop, stream them, append them; the outcome gets what was emitted (and the
    round's ``host_time``)."""
    if tokens is None:
        tokens = [outcome.proposal.tokens[n] for n in outcome.accepted] + [outcome.next_token]
    tokens = tokens[: inputs.max_length - row.prompt.shape[0] - len(row.new)]  # (``_own_stops``: the length's stop)
    tokens, stop = cut_at_stop(row.padded, tokens, inputs.stopping_criteria)
    if emitter.streamer is not None:
        new_tokens = torch.tensor(tokens, dtype=torch.long)
        if outcome is None:
            emitter.round(new_tokens, 0)
        else:
            emitter.round(new_tokens, outcome.num_accepted, outcome.proposal)
    if returned is not None:  # the Step of each token offered; those emitted are returned
        steps[row.row].extend(returned[: len(tokens)])
    row.extend(tokens)
    row.done = stop or row.prompt.shape[0] + len(row.new) >= inputs.max_length
    if outcome is None:
        return None
    return dataclasses.replace(outcome, emitted=tuple(tokens), finished=row.done,
                               plan=outcome.plan if plan is None else plan, host_time=host_time)


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
