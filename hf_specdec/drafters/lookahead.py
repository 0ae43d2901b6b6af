"""Lookahead decoding as a drafter: a Jacobi window, an n-gram pool and prompt lookup, verified as a trie.

One target forward per round does both jobs (Fu et al. 2024): a Jacobi iteration over the window (lookahead
branch) and the verification of every candidate (verification branch), with the 4-D mask and position ids of
``layout.py``. The shared loop (``loop.py``) runs that forward, verifies the trie (``verify_tree``), keeps the
accepted path's KV (``cache.compact``) and emits/streams/stops exactly as in speculative mode; this drafter only
proposes the layout and learns from the window's new guesses (``observe_forward``).

What differs from the published algorithm (LADE):

- candidates sharing a prefix are merged into a trie (one input per distinct prefix, not one row per n-gram);
- candidates are longer than N: prompt lookup over prompt + generated text gives continuations of any length,
  and pool n-grams are chained (the last token of one is the key of the next);
- the window is re-aligned to what was accepted (it shifts by the number of tokens committed, not by one);
- W, N, G come from the measured cost of a forward as a function of its token count (``BudgetChooser``), not
  fixed values: extra tokens are added only while a forward stays within ``tolerance`` of a one-token step.
- the window's KV is not kept, the accepted path's KV is (no recomputation).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from ..config import LookaheadConfig
from ..layout import TreeProposal, advance_window, build_layout, build_trie, harvest_ngrams, to_model_mask
from .base import KeepDrafting, Proposal
from .ngram_pool import HistoryIndex, NgramPool

SUPPORTED_ATTENTION = ("sdpa", "eager")


# ----------------------------------------------------------------------------------------------------------------
# Choosing W, N, G from the measured cost of a forward
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepShape:
    """How one round spends its extra tokens: window (W, N) and trie (at most ``max_nodes`` nodes from at most
    ``max_candidates`` candidates). Forward size = (N-1)*W + nodes."""

    window: int
    ngram: int
    max_candidates: int
    max_nodes: int

    @property
    def window_tokens(self) -> int:
        return (self.ngram - 1) * self.window


def split_budget(extra_tokens: int, config: LookaheadConfig) -> StepShape:
    """Spend ``extra_tokens`` (beyond the last token) on the window and the trie; explicit config values win.

    "auto" rule: below 6 extra tokens the window is off (W=1, N=2: the Jacobi branch is only the last token) and
    everything goes to the trie; otherwise about half goes to the window, N=3 below 24 extra tokens, N=4 from 24,
    N=5 from 48, and the trie gets the rest, in candidates of N-1 tokens (G) though prompt-lookup candidates may
    be longer. An explicit G means exactly G * (N-1) trie nodes, so a fully explicit config is deterministic.

    >>> split_budget(15, LookaheadConfig())
    StepShape(window=4, ngram=3, max_candidates=4, max_nodes=8)
    >>> split_budget(3, LookaheadConfig())
    StepShape(window=1, ngram=2, max_candidates=3, max_nodes=3)
    >>> split_budget(0, LookaheadConfig(window=3, ngram=3, max_candidates=2))
    StepShape(window=3, ngram=3, max_candidates=2, max_nodes=4)
    """
    budget = max(0, extra_tokens)
    if config.ngram != "auto":
        ngram = config.ngram
    else:
        ngram = 2 if budget < 6 else 3 if budget < 24 else 4 if budget < 48 else 5
    if config.window != "auto":
        window = config.window
    else:
        window = 1 if budget < 6 else max(2, (budget // 2 + 1) // (ngram - 1))
    if config.max_candidates != "auto":  # explicit G: G candidates of N-1 tokens, whatever the budget
        max_candidates = config.max_candidates
        max_nodes = max_candidates * (ngram - 1)
    else:
        max_nodes = max(0, budget - ((ngram - 1) * window - 1))
        max_candidates = max(1, max_nodes // (ngram - 1)) if max_nodes else 0
    return StepShape(window, ngram, max_candidates, max_nodes)


class BudgetChooser:
    """Largest forward size whose measured cost stays within ``tolerance`` of a one-token forward.

    Sizes are bucketed on a ladder (1, 2, 4, 8, 16, 24, 32, 48, 64 tokens); each bucket keeps its last few
    timings and is judged by their minimum (robust to a noisy, shared CPU). Exploration goes up the ladder one
    bucket at a time: the next unmeasured bucket above the chosen one is tried once, and every ``reprobe``
    rounds again, since costs drift as the context grows.
    """

    LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64)

    def __init__(self, tolerance: float = 0.15, max_size: int = 64, reprobe: int = 32, history: int = 4) -> None:
        self.tolerance = tolerance
        self.ladder = tuple(n for n in self.LADDER if n <= max_size) or (1,)
        self.reprobe = reprobe
        self.timings: dict[int, deque[float]] = {n: deque(maxlen=history) for n in self.ladder}
        self.rounds = 0

    def bucket(self, num_tokens: int) -> int:
        return next((n for n in self.ladder if n >= num_tokens), self.ladder[-1])

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.timings[self.bucket(num_tokens)].append(seconds)
        self.rounds += 1

    def cost(self, size: int) -> float | None:
        samples = self.timings[size]
        return min(samples) if samples else None

    def relative_cost(self) -> dict[int, float]:
        """v(n) = t(n) / t(1) for every measured bucket n."""
        base = self.cost(1)
        if base is None:
            return {}
        return {n: self.cost(n) / base for n in self.ladder if self.cost(n) is not None}

    def chosen_size(self) -> int:
        """Forward size (tokens, the last token included) to use next round."""
        costs = self.relative_cost()
        if not costs:
            return 1  # measure a one-token step first
        chosen = 1
        for n in self.ladder:
            if n in costs:
                if costs[n] > 1.0 + self.tolerance:
                    break
                chosen = n
        # explore the next bucket up once (and again every `reprobe` rounds) while the chosen one is still cheap
        index = self.ladder.index(chosen)
        if index + 1 < len(self.ladder):
            upper = self.ladder[index + 1]
            if upper not in costs or (costs[upper] <= 1.0 + 2 * self.tolerance and self.rounds % self.reprobe == 0):
                return upper
        return chosen


# ----------------------------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------------------------


class LookaheadDrafter:
    """Proposes one lookahead round at a time (see module docstring). Built by ``integration.lookahead_generate``.

    ``max_tokens``: the deepest candidate it will ever propose (the loop's policy caps it further near the end).
    """

    max_tokens = 16

    def __init__(self, model, config: LookaheadConfig, inputs) -> None:
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        if attention not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"decoding='lookahead' needs a custom 4-D attention mask, which attn_implementation={attention!r} "
                f"cannot take. Load the model with attn_implementation='sdpa' (or 'eager')."
            )
        self.config = config
        self.attention = attention
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.vocab_size = int(inputs.vocab_size)
        self.max_positions = getattr(model.config, "n_positions", None) or getattr(
            model.config, "max_position_embeddings", None)
        self.pool = NgramPool(config.max_pool_per_key)
        self.history: HistoryIndex | None = HistoryIndex(max_match=3) if config.pool_from_prompt else None
        self.chooser = BudgetChooser()
        self.fill_generator = torch.Generator().manual_seed(0)  # placeholders for fresh window columns
        self.fill_source = torch.zeros(1, dtype=torch.long)
        self.rows: torch.Tensor | None = None  # [N-1, W] window; rows[0, 0] = last committed token
        self.age: torch.Tensor | None = None  # [W] rounds since each column was filled
        self.pending_out: torch.Tensor | None = None  # [W] the window's new guesses from the last forward
        self.num_committed = 0  # committed tokens when the window was last aligned

    # -- Drafter protocol -------------------------------------------------------------------------------------
    def prefill(self, prompt_ids: torch.LongTensor) -> float:
        start = time.perf_counter()
        tokens = prompt_ids[0].tolist()
        if self.history is not None:
            self.history.extend(tokens)
        self.fill_source = prompt_ids[0].cpu()
        self.num_committed = len(tokens)
        return time.perf_counter() - start

    def propose(self, committed_ids: torch.LongTensor, max_tokens: int, keep_drafting: KeepDrafting) -> Proposal:
        start = time.perf_counter()
        committed = committed_ids[0].cpu()  # [L]
        length = committed.shape[0]
        if self.history is not None and len(self.history.tokens) < length:
            self.history.extend(committed[len(self.history.tokens):].tolist())

        shape = self._shape(max_tokens, past_length=length - 1)
        self._align_window(shape, committed)
        trie = build_trie(self._candidates(committed, shape, max_tokens), shape.max_nodes)
        layout = build_layout(self.rows, trie, past_length=length - 1, device=self.device)
        mask = to_model_mask(layout.attention_mask, self.attention, self.dtype)
        return Proposal(
            token_ids=torch.tensor(trie.tokens, dtype=torch.long),
            draft_time=time.perf_counter() - start,
            tree=TreeProposal(trie=trie, layout=layout, attention_mask=mask),
        )

    def observe_forward(self, window_tokens: torch.LongTensor, num_tokens: int, seconds: float) -> None:
        """The target's choices after each window column ([W]) and what the forward cost."""
        self.pending_out = window_tokens.cpu()
        self.chooser.observe(num_tokens, seconds)

    def rollback(self, num_valid: int) -> None:
        pass  # the window is re-aligned at the next propose, once the round's last token is known

    def release(self) -> None:
        self.rows = self.age = self.pending_out = None

    # -- internals --------------------------------------------------------------------------------------------
    def _shape(self, max_tokens: int, past_length: int) -> StepShape:
        shape = split_budget(self.chooser.chosen_size() - 1, self.config)
        if self.max_positions is not None:  # absolute position embeddings: stay inside the table
            room = self.max_positions - past_length - 1
            if shape.window_tokens - 1 + shape.ngram - 1 > room - 1:
                shape = StepShape(1, 2, shape.max_candidates, shape.max_nodes)
            max_tokens = min(max_tokens, room)
        if max_tokens <= 0:
            return StepShape(shape.window, shape.ngram, 0, 0)
        return shape

    def _align_window(self, shape: StepShape, committed: torch.Tensor) -> None:
        """Bring the window to the new last token: harvest its columns, shift it by what was committed."""
        length, last = committed.shape[0], int(committed[-1])
        same_shape = self.rows is not None and tuple(self.rows.shape) == (shape.ngram - 1, shape.window)
        if same_shape and self.pending_out is not None and self.pending_out.shape[0] == shape.window:
            self.pool.add_all(harvest_ngrams(self.rows, self.pending_out, self.age))
            self.rows, self.age = advance_window(
                self.rows, self.pending_out, self.age, num_emitted=length - self.num_committed,
                next_last=last, fill=self._fill(shape))
        else:  # first round, a new (W, N), or a round without a window: start from placeholders
            self.rows = self._fill(shape)
            self.rows[0, 0] = last
            self.age = torch.zeros(shape.window, dtype=torch.long)
        self.pending_out = None
        self.num_committed = length

    def _fill(self, shape: StepShape) -> torch.Tensor:
        """[N-1, W] placeholder tokens drawn from the prompt (as LADE does), reproducibly."""
        index = torch.randint(0, self.fill_source.shape[0], (shape.ngram - 1, shape.window),
                              generator=self.fill_generator)
        return self.fill_source[index].clone()

    def _candidates(self, committed: torch.Tensor, shape: StepShape, max_tokens: int) -> list[tuple[int, ...]]:
        """Candidates continuing the last token, best first: prompt lookup, then pool n-grams chained."""
        depth = min(max_tokens, self.max_tokens, max(shape.max_nodes, 0))
        if depth <= 0 or shape.max_candidates <= 0:
            return []
        last = int(committed[-1])
        found: list[tuple[int, ...]] = []
        if self.history is not None:
            found += self.history.continuations(max_len=depth, limit=shape.max_candidates)
        for ngram in self.pool.lookup(last, limit=shape.max_candidates):
            found.append(self._chain(ngram, depth))
        return [c[:depth] for c in found[: max(shape.max_candidates, 1) * 2]]

    def _chain(self, candidate: tuple[int, ...], depth: int) -> tuple[int, ...]:
        """Extend a candidate with the pool's most recent n-gram keyed by its last token, up to ``depth``."""
        chained = candidate
        while len(chained) < depth:
            following = self.pool.lookup(chained[-1], limit=1)
            if not following:
                break
            chained = chained + following[0]
        return chained[:depth]
