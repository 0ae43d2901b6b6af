"""Lookahead decoding as a drafter: a Jacobi window, an n-gram pool, prompt lookup and recycled choices.

One target forward per round does both jobs (Fu et al. 2024): a Jacobi iteration over the window (lookahead
branch, the proposal's extra inputs) and the verification of every candidate (verification branch, its trie),
with the 4-D mask and position ids of ``layout.py``. The shared loop runs that forward, verifies the trie and
keeps the accepted path's KV exactly as for a chain; this drafter offers candidates, lays out the window the
policy sized (``policy.Planner``) and learns the window's new guesses from each round's outcome.

What differs from the published algorithm (LADE):

- candidates sharing a prefix are merged into a trie (one input per distinct prefix, not one row per n-gram);
- candidates are longer than N: prompt lookup over prompt + generated text gives continuations of any length,
  and pool n-grams are chained (the last token of one is the key of the next);
- the target's own top choices at every position a forward computed logits for are recycled as candidates
  (Token Recycling, Luo et al. 2025: a table of the top choices after each token, chained);
- the window is re-aligned to what was accepted (it shifts by the number of tokens committed, not by one);
- the round is sized by its expected rate, not fixed W, N, G (``policy.Planner``);
- the window's KV is not kept, the accepted path's KV is (no recomputation);
- what one call learns is kept for the next (``memory.LookaheadMemory``).

A call's ``DraftSource`` is ``LookaheadSource``: one ``LookaheadDrafter`` per row over the call's memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import LookaheadConfig
from ..layout import advance_window, harvest_ngrams, merge_candidates, window_inputs
from ..memory import LookaheadMemory
from ..ngram_pool import HistoryIndex, NgramPool
from ..round import Candidate, Offer, Proposal, RoundOutcome, RoundPlan, RowView, SourceKind
from .base import DraftCall, PerRow

class LookaheadDrafter:
    """Offers lookahead candidates and lays out the window (see module docstring); a ``RowDrafter`` (one row).

    Built by ``integration.lookahead_generate``, one per row. ``memory``: earlier calls' text and recycling
    table (read, and at ``release`` extended with this row's text when ``remember``); None: a private one.
    ``trees``: the model reads a trie and a window in one forward (``support.tree_refusal``); False: chains only,
    its offers ask for one path of the candidates a round and no window (``Offer.one_path``), so every round is a
    chain the model's own causal mask and positions verify, sized by the same planner.
    """

    def __init__(self, model, config: LookaheadConfig, memory: LookaheadMemory | None = None,
                 remember: bool | None = None, trees: bool = True) -> None:
        self.config = config
        self.trees = trees
        self.max_positions = getattr(model.config, "n_positions", None) or getattr(
            model.config, "max_position_embeddings", None)
        self.pool = NgramPool(config.max_pool_per_key)
        self.history = HistoryIndex(max_match=config.history_match) if config.pool_from_prompt else None
        self.memory = memory if memory is not None else LookaheadMemory()
        self.keeps_memory = (memory is not None) if remember is None else remember
        self.fill_generator = torch.Generator().manual_seed(0)  # placeholders for fresh window columns
        self.fill_source = torch.zeros(1, dtype=torch.long)
        self.rows: torch.Tensor | None = None  # [N-1, W] window; rows[0, 0] = last committed token
        self.age: torch.Tensor | None = None  # [W] rounds since each column was filled
        self.pending_out: torch.Tensor | None = None  # [W] the window's new guesses from the last forward
        self.num_committed = 0  # committed tokens when the window was last aligned

    # -- Drafter protocol -------------------------------------------------------------------------------------
    def prefill(self, view: RowView) -> None:
        tokens = view.ids.tolist()
        if self.history is not None:
            self.history.extend(tokens)
        self.fill_source = view.ids.cpu()
        self.num_committed = len(tokens)

    def offer(self, view: RowView) -> Offer:
        length = view.ids.shape[0]
        depth = min(view.budget, self.config.max_depth)
        positions_left = None
        if self.max_positions is not None:  # absolute position embeddings: node i sits at (length - 1) + depth_i
            positions_left = self.max_positions - length
            depth = min(depth, positions_left)
        committed = view.ids[-self.config.history_match:].tolist()
        return Offer(candidates=tuple(self._candidates(committed, depth)), positions_left=positions_left,
                     one_path=not self.trees)

    def propose(self, view: RowView, plan: RoundPlan) -> Proposal:
        start = time.perf_counter()
        self._align_window(plan.window, view.ids)
        return merge_candidates(plan.candidates, max_nodes=self.config.max_forward_tokens,
                                extra=window_inputs(self.rows), top_k=self.config.recycle_width,
                                draft_time=time.perf_counter() - start)

    def update(self, outcome: RoundOutcome) -> None:
        """Keep the window's new guesses, the target's top choices for recycling, and the committed text."""
        self.pending_out = None if outcome.extra_next is None else outcome.extra_next.cpu()
        if outcome.top_inputs is not None:
            self.memory.recycle(outcome.top_inputs.cpu(), outcome.top_next.cpu())
        if self.history is not None:
            self.history.extend(outcome.emitted)

    def release(self) -> None:
        if self.keeps_memory and self.history is not None:
            self.memory.remember(self.history.tokens)  # prompt + output
        self.rows = self.age = self.pending_out = None

    # -- internals --------------------------------------------------------------------------------------------
    def _align_window(self, shape: tuple[int, int], committed: torch.LongTensor) -> None:
        """Bring the window to the new last token (``committed``: [L]): harvest its columns, shift it by what was
        committed."""
        window, ngram = shape
        length, last = committed.shape[0], int(committed[-1])
        same_shape = self.rows is not None and tuple(self.rows.shape) == (ngram - 1, window)
        if same_shape and self.pending_out is not None and self.pending_out.shape[0] == window:
            self.pool.add_all(harvest_ngrams(self.rows, self.pending_out, self.age))
            self.rows, self.age = advance_window(
                self.rows, self.pending_out, self.age, num_emitted=length - self.num_committed,
                next_last=last, fill=self._fill(window, ngram))
        else:  # first round, a new (W, N), or a round without a window: start from placeholders
            self.rows = self._fill(window, ngram)
            self.rows[0, 0] = last
            self.age = torch.zeros(window, dtype=torch.long)
        self.pending_out = None
        self.num_committed = length

    def _fill(self, window: int, ngram: int) -> torch.Tensor:
        """[N-1, W] placeholder tokens drawn from the prompt (as LADE does), reproducibly."""
        index = torch.randint(0, self.fill_source.shape[0], (ngram - 1, window), generator=self.fill_generator)
        return self.fill_source[index].clone()

    def _candidates(self, tail: list[int], depth: int) -> list[Candidate]:
        """Candidates continuing the last token (``tail``: the last committed tokens): prompt lookup in this
        call's text, then in earlier calls' text, each lookup's first continuation apart from its alternatives,
        then pool n-grams chained, then recycled choices (sources: ``round.Source``)."""
        if depth <= 0:
            return []
        limit = self.config.max_candidates_per_source
        found: list[Candidate] = []
        if self.history is not None:
            for kind, matches in (
                (SourceKind.HISTORY, self.history.matches(max_len=depth, limit=limit)),
                (SourceKind.MEMORY, self.memory.corpus.matches(max_len=depth, limit=limit, suffix=tail,
                                                               suffix_only=True)),
            ):
                found += [Candidate(tokens, (kind if rank == 0 else kind.alternative(), n))
                          for rank, (tokens, n) in enumerate(matches)]
        for ngram in self.pool.lookup(tail[-1], limit=limit):
            found.append(Candidate(self._chain(ngram, depth), (SourceKind.POOL, 0)))
        found += self._recycled(tail[-1], depth)
        return found

    def _recycled(self, last: int, depth: int) -> list[Candidate]:
        """Token Recycling (Luo et al. 2025): the target's top choices the last time it read ``last``, each
        continued by the top choice after it, and so on (chains up to ``depth``); source (RECYCLE, rank)."""
        successors = self.memory.successors  # covers every token it holds (``LookaheadMemory.recycle``)
        if successors is None or last >= successors.shape[0]:
            return []
        config = self.config

        def chain(start: list[int]) -> tuple[int, ...]:
            tokens = list(start)
            while len(tokens) < min(depth, config.recycle_depth):
                following = int(successors[tokens[-1], 0])
                if following < 0:
                    break
                tokens.append(following)
            return tuple(tokens[:depth])

        found = []
        firsts = successors[last, : config.recycle_branches].tolist()
        for rank, first in enumerate(firsts):
            if first < 0:
                break
            found.append(Candidate(chain([first]), (SourceKind.RECYCLE, rank)))
        if depth >= 2 and config.recycle_second and found:
            seconds = successors[firsts[0], 1: 1 + config.recycle_second].tolist()
            for rank, second in enumerate(seconds):
                if second < 0:
                    break
                found.append(Candidate(chain([firsts[0], second]), (SourceKind.RECYCLE_SECOND, rank)))
        return found

    def _chain(self, candidate: tuple[int, ...], depth: int) -> tuple[int, ...]:
        """Extend a candidate with the pool's most recent n-gram keyed by its last token, up to ``depth``."""
        chained = candidate
        while len(chained) < depth:
            following = self.pool.lookup(chained[-1], limit=1)
            if not following:
                break
            chained = chained + following[0]
        return chained[:depth]


@dataclass(frozen=True)
class LookaheadSource:
    """The ``DraftSource`` of lookahead decoding: the target's own window, pool and ``memory`` (read, and extended
    with each row's text when ``remember``); ``trees``: the target reads a trie in one forward (else chains only,
    ``LookaheadDrafter``). No draft model: nothing for a speculative memory to key, the hardware profile prices the
    target alone."""

    config: LookaheadConfig
    memory: LookaheadMemory
    remember: bool
    trees: bool = True

    memory_key = None
    profile_draft = None
    model = None

    def drafter(self, call: DraftCall) -> PerRow:
        return PerRow(lambda: LookaheadDrafter(call.target, self.config, self.memory, remember=self.remember,
                                               trees=self.trees))
