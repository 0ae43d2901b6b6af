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
- the target's own top choices at every position a forward computed logits for are recycled as candidates
  (Token Recycling, Luo et al. 2025: a table of the top choices after each token, chained);
- the window is re-aligned to what was accepted (it shifts by the number of tokens committed, not by one);
- the round is sized by its expected rate, not fixed W, N, G: each candidate token's chance of acceptance is
  learned per source (pool, or prompt lookup by how many context tokens matched) and depth, the cost of a
  forward is measured by its number of inputs (``policy.ForwardCost``), and the trie takes the nodes that
  maximise expected tokens per second (``rank_prefixes``, ``best_node_count``); the Jacobi window only gets
  tokens that keep the forward within ``window_tolerance`` of its cost, and only while its pool is useful;
- the window's KV is not kept, the accepted path's KV is (no recomputation);
- what one call learns is kept for the next (``LookaheadMemory``): the measured cost curve, the acceptance of
  each candidate source, the recycling table, and the text of earlier prompts and outputs as a further source
  of candidates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..config import LookaheadConfig
from ..layout import TreeProposal, advance_window, build_layout, build_trie, harvest_ngrams, to_model_mask
from ..policy import ForwardCost, Ema
from .base import KeepDrafting, Proposal
from .ngram_pool import HistoryIndex, NgramPool

SUPPORTED_ATTENTION = ("sdpa", "eager")


# ----------------------------------------------------------------------------------------------------------------
# Choosing W, N, G from the measured cost of a forward
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepShape:
    """The Jacobi window of one round: W columns of N-1 rows (W=1, N=2 is just the last token: no window)."""

    window: int
    ngram: int

    @property
    def window_tokens(self) -> int:
        return (self.ngram - 1) * self.window


# ----------------------------------------------------------------------------------------------------------------
# Sizing a round by its expected rate: how much of each candidate will be accepted, and what a forward costs
# ----------------------------------------------------------------------------------------------------------------

# Where a candidate came from, which is what its acceptance is learned by:
POOL = ("pool", 0)  # the window's n-gram pool
# ("history", m): prompt lookup in this call's prompt + output, the last m tokens matched;
# ("memory", m): the same in the prompts and outputs of earlier calls (``LookaheadMemory``);
# ("history_alt", m), ("memory_alt", m): the other continuations the same lookup found. They are alternatives to
# the first (at most one of them can be right), so they are learned apart: counting them as likely as the first
# would credit a trie of many alternatives with more tokens than it can give.
# ("recycle", r): a recycled chain starting with the target's r-th choice after the last token (0 = its top
# choice); ("recycle_second", r): the chain through its (r+2)-th choice after the top first choice.
PRIOR_ACCEPTANCE = {
    POOL: 0.25,
    **{("history", m): rate for m, rate in zip((1, 2, 3, 4), (0.3, 0.45, 0.6, 0.7))},
    **{("memory", m): rate for m, rate in zip((1, 2, 3, 4), (0.15, 0.3, 0.45, 0.55))},
    **{("history_alt", m): rate for m, rate in zip((1, 2, 3, 4), (0.1, 0.15, 0.2, 0.25))},
    **{("memory_alt", m): rate for m, rate in zip((1, 2, 3, 4), (0.05, 0.1, 0.15, 0.2))},
    **{("recycle", rank): rate for rank, rate in enumerate((0.3, 0.1, 0.05, 0.03))},
    **{("recycle_second", rank): rate for rank, rate in enumerate((0.1, 0.05, 0.03))},
}


class DepthAcceptance:
    """P(a candidate's token at depth d is accepted | its tokens before d were), for one source of candidates.

    Decayed counts with a Beta prior of weight 2 centred on ``prior``. A judged candidate counts once at every
    depth the target judged: its accepted prefix plus the first miss (depths after a miss were never judged).

    >>> rates = DepthAcceptance(prior=0.5, max_depth=4)
    >>> rates.observe(judged=3, accepted=2)
    >>> [round(rates.rate(d), 2) for d in (1, 2, 3, 4)]
    [0.67, 0.67, 0.33, 0.5]
    """

    def __init__(self, prior: float, max_depth: int, decay: float = 0.98) -> None:
        self.prior, self.decay = prior, decay
        self.reached = [0.0] * max_depth
        self.kept = [0.0] * max_depth

    def rate(self, depth: int) -> float:
        i = min(depth, len(self.reached)) - 1
        return (self.kept[i] + 2.0 * self.prior) / (self.reached[i] + 2.0)

    def observe(self, judged: int, accepted: int) -> None:
        self.reached = [x * self.decay for x in self.reached]
        self.kept = [x * self.decay for x in self.kept]
        for i in range(min(judged, len(self.reached))):
            self.reached[i] += 1.0
            if i < accepted:
                self.kept[i] += 1.0


def rank_prefixes(candidates: Sequence[tuple[Sequence[int], Sequence[float]]]) -> list[tuple[tuple[int, ...], float]]:
    """Every distinct prefix of the candidates with its gain, best first.

    ``candidates``: (tokens, per-depth acceptance rates). The gain of a prefix is the probability that all of it
    is accepted (the product of its candidate's rates; a prefix shared by several candidates takes the highest),
    i.e. what its last token adds to the expected number of accepted tokens. A parent's gain is never below its
    child's, and ties go to the shorter prefix, so every prefix comes after its parent: the first n prefixes
    always form a trie.

    >>> rank_prefixes([((7, 8, 9), (0.9, 0.5, 0.5)), ((3,), (0.6,))])
    [((7,), 0.9), ((3,), 0.6), ((7, 8), 0.45), ((7, 8, 9), 0.225)]
    """
    gains: dict[tuple[int, ...], float] = {}
    for tokens, rates in candidates:
        all_kept = 1.0
        for depth in range(len(tokens)):
            all_kept *= rates[depth]
            prefix = tuple(int(t) for t in tokens[: depth + 1])
            gains[prefix] = max(gains.get(prefix, 0.0), all_kept)
    return sorted(gains.items(), key=lambda item: (-item[1], len(item[0])))


def best_node_count(gains: Sequence[float], forward_seconds: Callable[[int], float], max_nodes: int) -> int:
    """How many of the ranked trie nodes to verify: the n that maximises the expected tokens per second,

        (1 + gains[0] + ... + gains[n-1]) / t(1 + n),

    a round always emitting the target's own token plus every accepted node, for a forward over the last token
    and n nodes. With a flat t (GPU, CPU in bf16 up to a few tokens) every useful node is taken; with a steep one
    (CPU in fp32) only the likely ones, down to none (a plain step).

    >>> flat, steep = (lambda n: 1.0), (lambda n: 1.0 + 0.5 * (n - 1))
    >>> best_node_count([0.9, 0.8, 0.1], flat, 8), best_node_count([0.9, 0.8, 0.1], steep, 8)
    (3, 2)
    >>> best_node_count([0.3, 0.1], steep, 8)
    0
    """
    best, emitted = 0, 1.0
    best_rate = emitted / forward_seconds(1)
    for n in range(1, min(len(gains), max_nodes) + 1):
        emitted += gains[n - 1]
        rate = emitted / forward_seconds(1 + n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def free_extra_tokens(forward_seconds: Callable[[int], float], used: int, limit: int, tolerance: float) -> int:
    """The most tokens that can join a forward of ``used`` tokens while it stays within ``tolerance`` of its cost.

    >>> free_extra_tokens(lambda n: 1.0 if n <= 8 else 2.0, used=3, limit=20, tolerance=0.15)
    5
    """
    base = forward_seconds(used)
    return max((e for e in range(limit + 1) if forward_seconds(used + e) <= (1.0 + tolerance) * base), default=0)


def window_shape(extra_tokens: int) -> tuple[int, int]:
    """(W, N) spending ``extra_tokens`` on the Jacobi window: off below 5 (W=1, N=2: just the last token), N=3
    below 24 extra tokens, N=4 below 48, else N=5, and as many columns as fit.

    >>> window_shape(3), window_shape(5), window_shape(15), window_shape(30)
    ((1, 2), (3, 3), (8, 3), (10, 4))
    """
    if extra_tokens < 5:
        return 1, 2
    ngram = 3 if extra_tokens < 24 else 4 if extra_tokens < 48 else 5
    return (extra_tokens + 1) // (ngram - 1), ngram


# ----------------------------------------------------------------------------------------------------------------
# The drafter
# ----------------------------------------------------------------------------------------------------------------


class LookaheadDrafter:
    """Proposes one lookahead round at a time (see module docstring). Built by ``integration.lookahead_generate``.

    ``max_tokens``: the deepest candidate it will ever propose (the loop's policy caps it further near the end).
    """

    max_tokens = 32
    max_forward_tokens = 64  # never more inputs than this in one forward
    window_tolerance = 0.15  # the window only gets tokens that keep the forward within 15% of its cost without it
    # ... and only while the tokens the pool adds per round (beyond prompt lookup), as a share of the tokens a
    # round emits, exceed the window's share of the forward's cost; optimistic prior so that it gets tried
    prior_pool_gain = 0.3
    remeasure_interval = 16  # a round with nothing to verify is a plain step if t(1) is older than this
    max_candidates_per_source = 8  # prompt-lookup continuations and pool n-grams considered per round, each
    history_match = 4  # longest context match prompt lookup looks for (a longer match predicts better)
    # Token Recycling: the target's top ``recycle_width`` choices are kept per token; a round proposes a chain
    # from each of the top ``recycle_branches`` choices after the last token and from each of the next
    # ``recycle_second`` choices after the top one, each chain up to ``recycle_depth`` tokens. Measured on
    # HumanEval (8 prompts, interleaved with prompt lookup): 4/4/3 beat 4/3/0 and 8/6/5.
    recycle_width = 4
    recycle_branches = 4
    recycle_second = 3
    recycle_depth = 8

    def __init__(self, model, config: LookaheadConfig, inputs, memory: LookaheadMemory | None = None) -> None:
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
        self.max_positions = getattr(model.config, "n_positions", None) or getattr(
            model.config, "max_position_embeddings", None)
        self.pool = NgramPool(config.max_pool_per_key)
        self.history: HistoryIndex | None = (
            HistoryIndex(max_match=self.history_match) if config.pool_from_prompt else None)
        # what is learned (forward cost, acceptance by source) and earlier calls' text; without one, a private
        # memory for this call alone, which is not worth extending at the end
        self.memory = memory if memory is not None else LookaheadMemory()
        self.keeps_memory = memory is not None
        self.rounds = 0
        self.last_plain_round = 0  # the round that last measured t(1)
        self.judging: list[tuple[tuple[int, ...], tuple[str, int]]] = []  # last round's (tokens in trie, source)
        self.fill_generator = torch.Generator().manual_seed(0)  # placeholders for fresh window columns
        self.fill_source = torch.zeros(1, dtype=torch.long)
        self.rows: torch.Tensor | None = None  # [N-1, W] window; rows[0, 0] = last committed token
        self.age: torch.Tensor | None = None  # [W] rounds since each column was filled
        self.pending_out: torch.Tensor | None = None  # [W] the window's new guesses from the last forward
        self.num_committed = 0  # committed tokens when the window was last aligned

    # what the memory holds, read through it (``LookaheadMemory.clear`` replaces these objects)
    @property
    def cost(self) -> ForwardCost:
        return self.memory.cost  # measured seconds of a target forward by its number of inputs

    @property
    def acceptance(self) -> dict[tuple[str, int], DepthAcceptance]:
        return self.memory.acceptance

    @property
    def pool_gain(self) -> Ema:
        return self.memory.pool_gain  # tokens per round the pool's candidates add beyond the others

    @property
    def round_tokens(self) -> Ema:
        return self.memory.round_tokens  # tokens emitted per round

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
        self._learn(committed)
        if self.history is not None and len(self.history.tokens) < length:
            self.history.extend(committed[len(self.history.tokens):].tolist())

        depth = self._max_depth(max_tokens, past_length=length - 1)
        candidates = self._candidates(committed, depth)
        trie, shape = self._plan(candidates, past_length=length - 1)
        children = trie.children()
        self.judging = [(tokens[: _depth_in_trie(children, tokens)], source) for tokens, source in candidates]
        self._align_window(shape, committed)
        layout = build_layout(self.rows, trie, past_length=length - 1, device=self.device)
        mask = to_model_mask(layout.attention_mask, self.attention, self.dtype)
        return Proposal(
            token_ids=torch.tensor(trie.tokens, dtype=torch.long),
            draft_time=time.perf_counter() - start,
            tree=TreeProposal(trie=trie, layout=layout, attention_mask=mask),
        )

    def observe_forward(self, window_tokens: torch.LongTensor, num_tokens: int, seconds: float,
                        inputs: torch.LongTensor | None = None, top_next: torch.LongTensor | None = None) -> None:
        """The target's choices after each window column ([W]), what the forward cost and, for recycling, its
        top choices ``top_next`` [R, K] after the inputs ``inputs`` [R] whose logits it computed."""
        self.pending_out = window_tokens.cpu()
        self.cost.observe(num_tokens, seconds)
        if inputs is not None and top_next is not None:
            self.memory.recycle(inputs.cpu(), top_next.cpu())

    def rollback(self, num_valid: int) -> None:
        pass  # the window is re-aligned at the next propose, once the round's last token is known

    def release(self) -> None:
        if self.keeps_memory and self.history is not None:
            self.memory.remember(self.history.tokens)  # prompt + output (but the last round's tokens)
        self.rows = self.age = self.pending_out = None

    # -- internals --------------------------------------------------------------------------------------------
    def _learn(self, committed: torch.Tensor) -> None:
        """Score last round's candidates against what the target committed (accepted path + its own token)."""
        if not self.judging:
            return
        emitted = committed[self.num_committed:].tolist()
        self.round_tokens.update(len(emitted))
        best = {True: 0, False: 0}  # longest accepted prefix among pool / history candidates
        for tokens, source in self.judging:
            accepted = 0
            while accepted < min(len(tokens), len(emitted)) and tokens[accepted] == emitted[accepted]:
                accepted += 1
            if tokens:
                self.acceptance[source].observe(judged=min(len(tokens), accepted + 1), accepted=accepted)
                best[source == POOL] = max(best[source == POOL], accepted)
        if any(tokens and source == POOL for tokens, source in self.judging):
            self.pool_gain.update(max(0, best[True] - best[False]))
        self.judging = []

    def _max_depth(self, max_tokens: int, past_length: int) -> int:
        depth = min(max_tokens, self.max_tokens)
        if self.max_positions is not None:  # absolute position embeddings: node i sits at past_length + depth_i
            depth = min(depth, self.max_positions - past_length - 1)
        return max(depth, 0)

    def _forward_seconds(self, num_tokens: int) -> float:
        return self.cost.estimate(num_tokens) or 0.0

    def _plan(self, candidates: list[tuple[tuple[int, ...], tuple[str, int]]], past_length: int):
        """The round's trie and window. Auto: the trie nodes that maximise the expected tokens per second (with
        the measured forward cost and the learned acceptance of each source), then a window from whatever extra
        tokens keep the forward within ``window_tolerance`` of its cost. Explicit W/N/G are used as given
        (explicit G: exactly G*(N-1) trie nodes, candidates in priority order)."""
        config = self.config
        self.rounds += 1
        if not self.cost.measured(1):  # measure a one-token step first: every other size is compared to it
            self.last_plain_round = self.rounds
            return build_trie([], 0), StepShape(1, 2)
        # sizes above twice the largest measured are not considered yet: exploration grows one doubling a round
        limit = min(self.max_forward_tokens, max(8, 2 * self.cost.largest))
        if config.max_candidates == "auto":
            ranked = rank_prefixes([(tokens, [self.acceptance[source].rate(d) for d in range(1, len(tokens) + 1)])
                                    for tokens, source in candidates])
            nodes = best_node_count([gain for _, gain in ranked], self._forward_seconds, limit - 1)
            trie = build_trie([prefix for prefix, _ in ranked[:nodes]], nodes)
        if config.window != "auto":
            window = config.window
            ngram = config.ngram if config.ngram != "auto" else (3 if window > 1 else 2)
        else:
            used = 1 + (len(trie) if config.max_candidates == "auto" else 0)
            pool_gain = self.prior_pool_gain if self.pool_gain.value is None else self.pool_gain.value
            worth = min(self.window_tolerance, pool_gain / (self.round_tokens.value or 1.0))
            extra = free_extra_tokens(self._forward_seconds, used, limit - used, worth)
            if used == 1 and self.rounds - self.last_plain_round >= self.remeasure_interval:
                extra = 0  # nothing to verify: a plain step, which keeps t(1), the reference of every size, fresh
            if used + extra == 1:
                self.last_plain_round = self.rounds
            window, ngram = window_shape(extra)
            if config.ngram != "auto":
                ngram = config.ngram
                window = max(1, (extra + 1) // (ngram - 1)) if extra >= 5 else 1
        if config.max_candidates != "auto":
            trie = build_trie([tokens for tokens, _ in candidates], config.max_candidates * (ngram - 1))
        if self.max_positions is not None and past_length + (ngram - 2) + (window - 1) >= self.max_positions:
            window, ngram = 1, 2  # the window would run past the position table
        return trie, StepShape(window, ngram)

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

    def _candidates(self, committed: torch.Tensor, depth: int) -> list[tuple[tuple[int, ...], tuple[str, int]]]:
        """(tokens, source) candidates continuing the last token: prompt lookup in this call's text, then in
        earlier calls' text (``LookaheadMemory``), each lookup's first continuation apart from its alternatives,
        then pool n-grams chained (see ``PRIOR_ACCEPTANCE``)."""
        if depth <= 0:
            return []
        limit = self.max_candidates_per_source
        found: list[tuple[tuple[int, ...], tuple[str, int]]] = []
        if self.history is not None:
            tail = committed[-self.history_match:].tolist()
            for kind, matches in (
                ("history", self.history.matches(max_len=depth, limit=limit)),
                ("memory", self.memory.corpus.matches(max_len=depth, limit=limit, suffix=tail, suffix_only=True)),
            ):
                found += [(tokens, (kind if rank == 0 else f"{kind}_alt", n))
                          for rank, (tokens, n) in enumerate(matches)]
        for ngram in self.pool.lookup(int(committed[-1]), limit=limit):
            found.append((self._chain(ngram, depth), POOL))
        found += self._recycled(int(committed[-1]), depth)
        return found

    def _recycled(self, last: int, depth: int) -> list[tuple[tuple[int, ...], tuple[str, int]]]:
        """Token Recycling (Luo et al. 2025): the target's top choices the last time it read ``last``, each
        continued by the top choice after it, and so on (chains up to ``depth``); source ("recycle", rank)."""
        successors = self.memory.successors  # covers every token it holds (``LookaheadMemory.recycle``)
        if successors is None or last >= successors.shape[0]:
            return []

        def chain(start: list[int]) -> tuple[int, ...]:
            tokens = list(start)
            while len(tokens) < min(depth, self.recycle_depth):
                following = int(successors[tokens[-1], 0])
                if following < 0:
                    break
                tokens.append(following)
            return tuple(tokens[:depth])

        found = []
        firsts = successors[last, : self.recycle_branches].tolist()
        for rank, first in enumerate(firsts):
            if first < 0:
                break
            found.append((chain([first]), ("recycle", rank)))
        if depth >= 2 and self.recycle_second and found:
            seconds = successors[firsts[0], 1: 1 + self.recycle_second].tolist()
            for rank, second in enumerate(seconds):
                if second < 0:
                    break
                found.append((chain([firsts[0], second]), ("recycle_second", rank)))
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


def _depth_in_trie(children: dict[tuple[int, int], int], tokens: Sequence[int]) -> int:
    """How many leading tokens of ``tokens`` are a path from the root of the trie with these ``children``."""
    node, depth = -1, 0
    for token in tokens:
        node = children.get((node, int(token)), None)
        if node is None:
            break
        depth += 1
    return depth


class LookaheadMemory:
    """What lookahead learns in one ``generate`` call, carried into the next calls on the same model.

    - ``corpus``: the prompts and outputs of earlier calls, indexed for prompt lookup. Requests repeat each other
      (imports, boilerplate, a test harness, the same function asked for again), so their text predicts the next
      answer the way the prompt does; at most ``max_tokens`` of it are kept, the oldest dropped first.
    - ``cost``: the measured forward cost by number of inputs, so that a new call starts with a known cost curve
      instead of a plain first step and one doubling of forward size per round.
    - ``acceptance``, ``pool_gain``, ``round_tokens``: what each candidate source's tokens are worth.

    Outputs never depend on it (every candidate is verified by the target); only speed does. ``enable(model)``
    keeps one per model as ``model.lookahead_memory``; pass ``lookahead_memory=None`` to ``generate`` for a call
    that neither reads nor writes it, or your own ``LookaheadMemory()`` to scope it (one per user, say).
    """

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"LookaheadMemory(max_tokens={max_tokens!r}) is invalid: use an int >= 1.")
        self.max_tokens = max_tokens
        self.clear()

    def clear(self) -> None:
        """Forget everything: the earlier calls' text and what was measured."""
        self.corpus = HistoryIndex(max_match=LookaheadDrafter.history_match)
        self.cost = ForwardCost()
        self.acceptance = {source: DepthAcceptance(prior, LookaheadDrafter.max_tokens)
                           for source, prior in PRIOR_ACCEPTANCE.items()}
        self.pool_gain = Ema()
        self.round_tokens = Ema()
        self.successors: torch.Tensor | None = None  # [V, K] the target's top choices after each token, -1 unknown

    def recycle(self, inputs: torch.LongTensor, top_next: torch.LongTensor) -> None:
        """Keep the target's newest top choices ``top_next`` [R, K] after each of the tokens ``inputs`` [R].

        The table grows to hold every token it names, as an input or a choice, so a chain can always look up the
        choices after any token it holds."""
        needed = int(max(int(inputs.max()), int(top_next.max()))) + 1
        if self.successors is None or self.successors.shape[0] < needed:
            size = max(needed, 1024, 2 * (0 if self.successors is None else self.successors.shape[0]))
            grown = torch.full((size, top_next.shape[1]), -1, dtype=torch.long)
            if self.successors is not None:
                grown[: self.successors.shape[0]] = self.successors
            self.successors = grown
        self.successors[inputs] = top_next

    def remember(self, tokens: Sequence[int]) -> None:
        """Add one call's prompt and output; past ``max_tokens``, keep the newest half."""
        self.corpus.extend(tokens)
        if len(self.corpus.tokens) > self.max_tokens:
            kept = self.corpus.tokens[len(self.corpus.tokens) - self.max_tokens // 2:]
            self.corpus = HistoryIndex(kept, max_match=self.corpus.max_match)
