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

A plan with a ``tree`` grows a tree of the draft's likely continuations instead of a chain (``draft_tree.py``:
one batched draft forward per depth over its frontier, every node continuing its parent's path in the cache).

Where the call's verify runs compiled (``compiled.py``), the draft's store has a static cache of its own and every
forward of one or two tokens per row runs through the draft's own compiled call at width 1 or 2 (the drafter's
``step``, a ``compiled.Verifier``: ``CompiledVerify.draft_step``, else ``EAGER`` and a dynamic cache): a chain's
steps after the first, and a round's first step where every row feeds one token or two (the two after a round
whose draft was all accepted). The prompt read, a first step that feeds more (a catch-up) and a tree's frontiers
run eagerly. There
the draft scores its whole vocabulary (no ``SubVocabHead``): the compiled call is the draft's own forward, output
layer included, which transformers keeps on the model so that later calls reuse its graphs. An early-exit view
(``drafters/early_exit.py``) steps eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import LogitsProcessorList

from .. import cache as kv
from ..compiled import EAGER, Verifier
from ..inputs import NO_INPUTS, ModelInputs
from ..layout import NOTHING_READ, BatchInputs, RoundLayout, positions, stack_layouts
from ..processors import process_rows
from ..round import Offer, Proposal, RoundOutcome, RoundPlan, RowView, Source, SourceKind
from ..verify import greedy_choice
from . import draft_tree
from .base import ChainDrafter, DraftCall, Drafter, PerRow
from .prompt_lookup import PromptLookupDrafter


class SubVocabHead:
    """The draft's output layer restricted to ``token_ids`` ([S] sorted ids); logits elsewhere are -inf. The draft's
    store runs the base model and hands its hidden states to this head (``cache.call_model(head=...)``)."""

    def __init__(self, model, token_ids: torch.LongTensor, vocab_size: int) -> None:
        head = model.get_output_embeddings()
        self.token_ids = token_ids
        self.weight = head.weight.detach().index_select(0, token_ids.to(head.weight.device))  # [S, hidden]
        self.bias = None if head.bias is None else head.bias.detach().index_select(0, token_ids)
        self.vocab_size = vocab_size

    @staticmethod
    def usable(model) -> bool:
        head = model.get_output_embeddings()
        return (
            type(getattr(head, "weight", None)) is torch.nn.Parameter  # a Linear (or a packed one) with a float
            and head.weight.dim() == 2  # weight, not a quantized one
            and head.weight.is_floating_point()
            and getattr(model, model.base_model_prefix, None) is not None
        )

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [B, n, H] -> float logits [B, n, vocab], -inf outside the subset."""
        # a plain matmul: F.linear over these bf16 shapes took a slow oneDNN path for some inputs (measured on a
        # Xeon with amx_bf16: 150 ms instead of 4 ms for one row of a 0.5B draft's hidden states)
        sub_logits = (hidden.reshape(-1, hidden.shape[-1]) @ self.weight.T).reshape(*hidden.shape[:2], -1)
        if self.bias is not None:
            sub_logits = sub_logits + self.bias
        sub_logits = sub_logits.float()  # [B, n, S]
        logits = torch.full((*hidden.shape[:2], self.vocab_size), float("-inf"), device=sub_logits.device)
        logits[..., self.token_ids] = sub_logits
        return logits


class DraftModelDrafter(Drafter):
    """Drafts a chain per row with a small causal LM that keeps its own KV cache (a ``cache.KVStore``) across
    rounds; all rows draft in one batched forward per step (module docstring).

    A round writes, per row, the tokens committed since the store's last keep and then each drafted token that
    another step needed, one forward per step (through ``step``: compiled or eager, module docstring), each
    continuing the row's previous slot (``forward(after=)``);
    ``_written[r]`` lists those slots (a chain's in sequence order). A tree round writes the committed tokens
    (``_caught_up[r]`` slots) and then, depth by depth, the nodes it reads, each continuing its parent's slot
    (``_node_slots[r]``: proposal node -> slot). ``update`` keeps the slots of the tokens the target agreed with
    (the committed tokens but the newest) and the store forgets the rest.
    """

    def __init__(
        self,
        draft_model,
        logits_processor: LogitsProcessorList,
        *,
        do_sample: bool,
        vocab_size: int,  # the target's: drafts are over it, probability 0 in rows the draft lacks
        draft_vocab_size: int | None = None,
        special_token_ids: tuple[int, ...] = (),
        pad_token_id: int = 0,
        model_inputs: ModelInputs = NO_INPUTS,  # the draft's other inputs (``inputs.py``): token types, images
        batch: int = 1,  # the caller's rows: its processors are called over them (``processors.process_rows``)
        step: Verifier = EAGER,  # runs the forwards of one token per row (module docstring)
    ) -> None:
        self.batch = batch
        self.step = step
        self.model = draft_model
        self.inputs = model_inputs
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.vocab_size = vocab_size
        # ids the draft has an embedding for (others read as padding: only its guesses depend on them)
        self.readable = int(getattr(draft_model.get_input_embeddings(), "num_embeddings", vocab_size))
        self.draft_vocab_size = draft_vocab_size
        self.special_token_ids = special_token_ids
        self.pad_token_id = pad_token_id
        self.device = next(draft_model.parameters()).device
        self.cache: kv.KVStore | None = None
        self.rows: list[int] = []  # the batch rows held by the cache, in its order
        self._written: list[list[int]] = []  # per row: the slots written since the last keep
        self._caught_up: list[int] = []  # per row, in a tree round: how many of them hold committed tokens
        self._node_slots: list[dict[int, int]] | None = None  # per row, in a tree round: proposal node -> slot

    def prefill(self, views: Sequence[RowView]) -> None:
        """Nothing yet: the draft reads the prompts the first time a plan asks it to draft (``_read``), so a call
        in which speculation never pays never runs the draft model at all; a draft with images of its own reads
        them with the prompts now, in the caller's layout (``ModelInputs.layout``)."""
        self.rows = [view.row for view in views]
        if self.inputs.laid_out:
            self._read(views)

    @torch.no_grad()  # the loop decodes under no_grad; a drafter called on its own must not build a graph
    def _read(self, views: Sequence[RowView]) -> float:
        """Prefill the draft's cache with every row's committed tokens but the last; returns the seconds. A draft
        whose inputs are tied to the caller's layout (``ModelInputs.layout``: its images) reads the caller's prompts
        as laid out, mask included, at the loop's prefill (each row's committed tokens are its prompt's attended
        ones and its first token), then keeps the rows still decoding; any other reads them without their masked
        columns, left-padded."""
        start = time.perf_counter()
        attention = getattr(self.model.config, "_attn_implementation", None) or "eager"
        # a static cache where the steps compile: the prompts (left-padded) and every token the call may still add
        # (a round's draft is within the rows' budget); a batch's holes grow it past that (``backends.Buffers``)
        columns = max(int(view.ids.shape[0]) - 1 for view in views) + max(view.budget for view in views) + 1
        self.cache = kv.KVStore(self.model, attention, head=self._narrow_head(views),
                                cache=self.step.store_cache(self.model, columns))
        layout = self.inputs.layout
        if layout is not None:
            self.cache.prefill(self._readable(self.inputs.prompt_ids(layout.input_ids)), layout.mask, logits_at=1,
                               positions=layout.positions, inputs=self.inputs)
            rows = [view.row for view in views]
            if rows != list(range(self.cache.num_rows)):  # rows that stopped at their first token
                self.cache.select_rows(rows)
            assert self.cache.lengths.tolist() == [view.ids.shape[0] - 1 for view in views], "read at the prefill"
        else:
            prompts, mask = _left_padded([self._readable(view.ids[:-1]) for view in views], self.pad_token_id)
            inputs = self.inputs.relaid([view.row for view in views], [view.ids.shape[0] - 1 for view in views],
                                        prompts.shape[1])
            self.cache.prefill(prompts, mask, logits_at=1, inputs=inputs)
        self._written = [[] for _ in views]
        return time.perf_counter() - start

    def _narrow_head(self, views: Sequence[RowView]) -> SubVocabHead | None:
        """The narrowed output layer (module docstring) over ``draft_vocab_size`` ids, the prompts' tokens and the
        special tokens; None when the draft scores its whole vocabulary, as it does where its steps compile (they
        run the draft's own forward, ``Verifier.takes_head``)."""
        if not (self.draft_vocab_size and self.draft_vocab_size < self.vocab_size and SubVocabHead.usable(self.model)
                and self.step.takes_head):
            return None
        keep = torch.cat([torch.arange(self.draft_vocab_size), *[view.ids.cpu() for view in views],
                          torch.tensor(self.special_token_ids, dtype=torch.long)])
        scored = min(self.vocab_size, self.model.get_output_embeddings().weight.shape[0])  # rows it has
        return SubVocabHead(self.model, torch.unique(keep[keep < scored]).to(self.device), self.vocab_size)

    def _logits(self, feeds: list[torch.Tensor]) -> torch.Tensor:
        """Each row's ``feeds[r]`` ([u_r] tokens, >= 1) written after what the row wrote this round (after its kept
        tokens in the round's first step): float logits [B, V] after each row's last token."""
        batch = stack_layouts([_fed(self._readable(feed)) for feed in feeds], self.pad_token_id)
        even = batch.valid is None  # every row feeds as many tokens: only the last position's logits are needed
        after = torch.tensor([row[-1] for row in self._written]) if all(self._written) else None
        assert after is not None or not any(self._written), "rows step together"
        written = self.step.forward(self.cache, batch, after=after,
                                    logits_at=1 if even else None)  # logits [B, 1 or n, V]
        for row, feed, slots in zip(self._written, feeds, written.slots.tolist()):
            row.extend(slots[: feed.shape[0]])
        if even:
            return self._over_vocab(written.logits[:, 0])
        last = torch.tensor([f.shape[0] - 1 for f in feeds])
        # over the target's vocabulary: the draft's padding rows past it are never proposed, and the target's rows
        # the draft lacks get -inf (never proposed, probability 0, which rejection sampling handles exactly)
        return self._over_vocab(written.logits[torch.arange(len(feeds)), last.to(written.logits.device)])

    def _logits_after(self, tokens: torch.Tensor) -> torch.Tensor:
        """``_logits`` of one token per row, ``tokens`` [B] where the last step computed them (the device): each row
        writes its token after its last written slot. Float logits [B, V]."""
        rows = tokens.shape[0]
        batch = BatchInputs(self._readable(tokens[:, None]), positions(1)[None].expand(rows, 1), None, None)
        last = self.cache.width + self.cache.num_written - 1  # every row's last written slot, where rows step together
        after = (kv.Continue.LAST if all(row[-1] == last for row in self._written)
                 else torch.tensor([row[-1] for row in self._written]))
        written = self.step.forward(self.cache, batch, after=after, logits_at=1)  # logits [B, 1, V]
        slot = last + 1  # (the forward wrote one column)
        for row in self._written:
            row.append(slot)
        return self._over_vocab(written.logits[:, 0])

    def _chain(self, feeds: list[torch.Tensor], most: int, step: Callable[[torch.Tensor], torch.Tensor | None]
               ) -> None:
        """Up to ``most`` forwards: the first over each row's ``feeds[r]`` ([u_r] tokens after its kept ones), each
        next over one token per row, what ``step`` makes of the last one's float logits [B, V] (None: stop). One
        row whose store's forwards take the fast lane runs them all as one chain (``KVStore.lane_steps``)."""
        if len(feeds) == 1 and self.step.takes_head and self.cache.starts_lane():
            self._lane_chain(feeds[0][None], most, step)
            return
        tokens = step(self._logits(feeds))
        if tokens is not None:
            self._steps(tokens, most - 1, step)

    def _steps(self, tokens: torch.Tensor, most: int, step: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Up to ``most`` forwards of one token per row, the first over ``tokens`` [B], each next over what ``step``
        makes of the last one's float logits [B, V] (None: stop). Where the last forward took the store's fast lane
        and the steps run the store's own forward (an eager step), the store runs them as one chain
        (``_lane_chain``); else each is a ``_logits_after``."""
        if most <= 0:
            return
        if self.step.takes_head and self.cache.continues_lane():
            self._lane_chain(tokens[:, None], most, step)
            return
        for _ in range(most):
            tokens = step(self._logits_after(tokens))
            if tokens is None:
                return

    def _lane_chain(self, tokens: torch.Tensor, most: int, step: Callable[[torch.Tensor], torch.Tensor | None]
                    ) -> None:
        """Up to ``most`` forwards in the store's fast lane for one row (``KVStore.lane_steps``): the first over
        ``tokens`` [1, u], each next over what ``step`` makes of the last one's float logits [1, V] (None: stop)."""
        first = self.cache.width + self.cache.num_written  # the slot the first input is written at
        ran = self.cache.lane_steps(self._readable(tokens), most,
                                    lambda logits: self._fed_back(step(self._over_vocab(logits))))
        self._written[0].extend(range(first, first + tokens.shape[1] + ran - 1))

    def _fed_back(self, tokens: torch.Tensor | None) -> torch.Tensor | None:
        """A step's tokens [1] as the next lane forward's input [1, 1] (None: stop)."""
        return None if tokens is None else self._readable(tokens[:, None])

    def _over_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V] over the target's vocabulary: the draft's padding rows past it are never
        proposed, and the target's rows the draft lacks get -inf (never proposed, probability 0, which rejection
        sampling handles exactly)."""
        logits = logits[..., : self.vocab_size]
        if logits.shape[-1] < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        return logits

    def _read_nodes(self, nodes: list[list[tuple[int, int]]], roots: Sequence[int]) -> tuple[list[list[int]],
                                                                                           torch.Tensor]:
        """One draft forward over each row's tree ``nodes`` ([(token, parent slot)]), every node continuing its
        parent's path in the cache and seeing no other node of the forward (``roots[r]``: a slot of the row that
        its padding inputs continue). Returns per row the slots written, and float logits [B, n, V]."""
        rows, n = len(nodes), max(len(row) for row in nodes)
        input_ids = torch.full((rows, n), self.pad_token_id, dtype=torch.long)
        after = torch.tensor(roots, dtype=torch.long)[:, None].repeat(1, n)
        valid = torch.zeros(rows, n, dtype=torch.bool)
        for r, row in enumerate(nodes):
            if row:
                input_ids[r, : len(row)] = torch.tensor([token for token, _ in row])
                after[r, : len(row)] = torch.tensor([slot for _, slot in row])
                valid[r, : len(row)] = True
        batch = BatchInputs(self._readable(input_ids), torch.zeros(rows, n, dtype=torch.long),
                            None if bool(valid.all()) else valid, torch.eye(n, dtype=torch.bool).repeat(rows, 1, 1))
        written = self.cache.forward(batch, after=after)  # logits [B, n, V]
        slots = [written.slots[r, : len(row)].tolist() for r, row in enumerate(nodes)]
        for row, row_slots in zip(self._written, slots):
            row.extend(row_slots)
        return slots, self._over_vocab(written.logits)

    def _scores(self, row: int, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The processed draft scores [1, V] after ``prefix`` [L] (the row's tokens and the node's path) of the
        caller's row ``row``, as the target's are processed (``processors.process_rows``)."""
        if not self.logits_processor:
            return logits[None]
        return process_rows(self.logits_processor, self.batch, [(row, prefix, logits)])[0][None]

    def _distribution(self, row: int, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The processed draft distribution [V] after ``prefix`` [L] of the caller's row ``row``."""
        return torch.softmax(self._scores(row, prefix, logits).float(), dim=-1)[0]

    def _readable(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with those the draft has no embedding for replaced by padding."""
        if self.readable >= self.vocab_size:
            return ids
        return ids.masked_fill(ids >= self.readable, self.pad_token_id if self.pad_token_id < self.readable else 0)

    def offer(self, views: Sequence[RowView]) -> list[Offer]:
        """Up to the room left per row; before the draft has read the prompts, what reading them costs: each
        row's share of the left-padded batch (the longest row's committed tokens but the last)."""
        width = 0 if self.cache is not None else max((int(view.ids.shape[0]) - 1 for view in views), default=0)
        return [Offer(model_tokens=view.budget, trees=True, setup_tokens=width) for view in views]

    @torch.no_grad()
    def propose(self, views: Sequence[RowView], plans: Sequence[RoundPlan]) -> list[Proposal]:
        """Up to ``plan.model_tokens`` tokens per row, each from the draft's processed distribution at its own
        prefix; a plan's rule may stop a row earlier on its confidences; all rows step together. A plan with a
        ``tree`` grows a tree instead (``_propose_trees``)."""
        assert [view.row for view in views] == self.rows, "rows must come in the order the cache holds them"
        limits = [plan.model_tokens for plan in plans]
        steps = max(limits, default=0)
        if steps == 0:
            return [Proposal() for _ in views]
        read_tokens = self.offer(views)[0].setup_tokens  # each row's share of the left-padded batch, 0 once read
        setup = self._read(views) / len(views) if self.cache is None else 0.0
        start = time.perf_counter()
        if any(self._written):  # the last round's update never came (its forward failed): forget what it wrote
            self.cache.discard()
            self._written = [[] for _ in views]
        self._node_slots = None  # a chain round, unless it grows trees
        ids = [view.ids.to(self.device) for view in views]
        feeds = [row_ids[int(length):] for row_ids, length in zip(ids, self.cache.lengths)]  # >= 1 token each
        if any(plan.tree is not None for plan in plans):
            return self._propose_trees(plans, ids, feeds, start, setup_time=setup, setup_tokens=read_tokens)
        if not self.do_sample and not self.logits_processor and all(plan.rule is None for plan in plans):
            return self._propose_on_device(views, limits, feeds, start, setup, read_tokens)
        tokens: list[list[int]] = [[] for _ in views]
        probs: list[list[torch.Tensor]] = [[] for _ in views]
        confidences: list[list[float]] = [[] for _ in views]
        drafting = [limit > 0 for limit in limits]

        def step(logits: torch.Tensor) -> torch.Tensor | None:
            """One drafted token per row from ``logits`` [B, V]; the tokens to feed next, or None: every row done."""
            nonlocal ids
            if self.do_sample or self.logits_processor:
                scores = torch.cat([self._scores(views[r].row, ids[r], logits[r]) for r in range(len(views))])
            else:
                scores = logits
            draft_probs = torch.softmax(scores, dim=-1)  # [B, V]
            chosen = (torch.cat([torch.multinomial(row_probs, 1) for row_probs in draft_probs]) if self.do_sample
                      else greedy_choice(scores))  # [B]
            # the step's one read: every row's token and its confidence (what the plan's rule reads)
            read = torch.stack([chosen.to(draft_probs.dtype), draft_probs.gather(1, chosen[:, None])[:, 0]])
            step_tokens, step_confidences = read.tolist()
            for r, plan in enumerate(plans):
                if drafting[r]:
                    tokens[r].append(int(step_tokens[r]))
                    confidences[r].append(step_confidences[r])
                    if self.do_sample:
                        probs[r].append(draft_probs[r])
                    drafting[r] = len(tokens[r]) < limits[r] and (
                        plan.rule is None or plan.rule.keep_drafting(confidences[r]))
            if not any(drafting):
                return None
            if self.logits_processor:
                ids = [torch.cat([row_ids, token[None]]) for row_ids, token in zip(ids, chosen)]
            return chosen

        self._chain(feeds, steps, step)
        seconds = (time.perf_counter() - start) / len(views)  # the batch's drafting time, shared by its rows
        forwards = max(len(row) for row in tokens)
        return [Proposal.chain(
            row, [Source(SourceKind.DRAFT, 0, i) for i in range(1, len(row) + 1)],
            torch.stack(row_probs) if self.do_sample and row_probs else None,
            confidences=tuple(row_confidences), draft_time=seconds, draft_forwards=forwards if row else 0,
            setup_time=setup, setup_tokens=read_tokens)
            for row, row_probs, row_confidences in zip(tokens, probs, confidences)]

    def _propose_on_device(self, views: Sequence[RowView], limits: list[int], feeds: list[torch.Tensor], start: float,
                           setup: float, read_tokens: int) -> list[Proposal]:
        """A greedy chain whose plan reads no confidences: each step is a forward and an argmax on the device, fed
        to the next step as it is; nothing is read back here (``Proposal.device_tokens``: the loop reads the
        tokens with the target's choices, in the round's one transfer). Each row keeps its first ``limits[r]``."""
        steps = max(limits)
        chosen: list[torch.Tensor] = []  # [B] each

        def step(logits: torch.Tensor) -> torch.Tensor | None:
            chosen.append(greedy_choice(logits))
            return chosen[-1] if len(chosen) < steps else None

        self._chain(feeds, steps, step)
        drafted = torch.stack(chosen, dim=1)  # [B, steps]
        seconds = (time.perf_counter() - start) / len(views)  # the batch's drafting time, shared by its rows
        return [Proposal.device_chain(
            drafted[r, :limit], [Source(SourceKind.DRAFT, 0, i) for i in range(1, limit + 1)],
            draft_time=seconds, draft_forwards=steps if limit else 0, setup_time=setup, setup_tokens=read_tokens)
            if limit else Proposal(setup_time=setup, setup_tokens=read_tokens)
            for r, limit in enumerate(limits)]

    def _propose_trees(self, plans: Sequence[RoundPlan], ids: list[torch.Tensor], feeds: list[torch.Tensor],
                       start: float, **fields) -> list[Proposal]:
        """Each row's tree of its plan's shape (``draft_tree.grow``): the forward over the committed tokens gives
        the root distributions, then one forward per depth over the frontier."""
        shapes = [draft_tree.row_shape(plan) for plan in plans]
        logits = self._logits(feeds)  # [B, V] after each row's last committed token
        trees = [draft_tree.GrownTree(distributions={-1: self._distribution(row, row_ids, row_logits)},
                                      rates=shape.rates if shape is not None else None)
                 for row, row_ids, row_logits, shape in zip(self.rows, ids, logits, shapes)]
        self._caught_up = [len(row) for row in self._written]
        self._node_slots = [{} for _ in plans]
        roots = [row[-1] for row in self._written]
        first = time.perf_counter() - start

        def read(frontiers: list[list[tuple[int, int, int]]]) -> list[tuple[list[int], torch.Tensor]]:
            slots, node_logits = self._read_nodes([[(token, slot) for _, token, slot in row] for row in frontiers],
                                                  roots)
            return [(row_slots, [self._distribution(self.rows[r], torch.cat([row_ids, torch.tensor(
                tree.path(node), device=row_ids.device)]), node_logits[r, i]) for i, (node, _, _) in enumerate(row)])
                    for r, (row, row_slots, row_ids, tree) in enumerate(zip(frontiers, slots, ids, trees))]

        steps = ((1, first), *draft_tree.grow(trees, shapes, roots, read, self.do_sample))
        seconds = (time.perf_counter() - start) / len(plans)  # the batch's drafting time, shared by its rows
        proposals = []
        for r, (tree, shape) in enumerate(zip(trees, shapes)):
            nodes = draft_tree.verified(tree, shape, self.do_sample) if shape is not None else []
            proposal, self._node_slots[r] = draft_tree.proposal(
                tree, nodes, draft_time=seconds, draft_forwards=len(steps) if nodes else 0,
                draft_steps=steps if nodes else (), **fields)
            proposals.append(proposal)
        return proposals

    def _kept_path(self, row: int, outcome: RoundOutcome) -> list[int]:
        """The slots of row ``row``'s committed tokens, in sequence order, among those written this round: a
        chain's are its written slots; a tree's, the committed tokens it caught up on and then the accepted
        nodes the draft read."""
        written = self._written[row]
        if self._node_slots is None:
            return written
        path, nodes = written[: self._caught_up[row]], self._node_slots[row]
        for node in outcome.accepted:
            if node not in nodes:
                break
            path.append(nodes[node])
        return path

    def update(self, outcomes: Sequence[RoundOutcome]) -> None:
        """Keep the KV of the committed tokens but the newest (which the next round feeds): of the slots written
        this round, those of the tokens fed before the first rejected draft token; drop the rows that finished.

        Row r wrote the tokens from its kept length on, in order: the committed ones it caught up on, then its
        draft. The target accepted ``num_accepted`` of the draft (fewer were committed when a stop cut the
        round; none when the round was discarded), so the first ``committed - 1 - length`` written slots are kept.
        """
        keep = [i for i, outcome in enumerate(outcomes) if not outcome.finished]
        if self.cache is not None:
            ends = [min(outcome.start_length + outcome.num_accepted, outcome.start_length + len(outcome.emitted) - 1)
                    for outcome in outcomes]
            self.cache.keep([self._kept_path(r, outcome)[: max(0, end - int(length))]
                             for r, (outcome, end, length) in enumerate(zip(outcomes, ends, self.cache.lengths))])
            self._written = [[] for _ in outcomes]
            self._node_slots = None
            if len(keep) < len(outcomes) and keep:
                self.cache.select_rows(keep)
                self._written = [[] for _ in keep]
        self.rows = [self.rows[i] for i in keep]

    def cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()

    def release(self) -> None:
        self.cache = None
        self.rows = []
        self._written = []
        self._node_slots = None


def chained(drafter_class: type[DraftModelDrafter], model, call: DraftCall, step: Verifier = EAGER) -> ChainDrafter:
    """A ``drafter_class`` over ``model`` for ``call`` whose one-token steps run through ``step``, followed by
    prompt lookup where the call asks for it."""
    drafter = drafter_class(model, call.logits_processor, do_sample=call.do_sample, vocab_size=call.vocab_size,
                            draft_vocab_size=call.draft_vocab_size, special_token_ids=call.special_token_ids,
                            pad_token_id=call.pad_token_id, model_inputs=call.model_inputs, batch=call.batch,
                            step=step)
    return ChainDrafter(drafter, PerRow(PromptLookupDrafter) if call.history_lookup else None)


@dataclass(frozen=True)
class DraftModelSource:
    """The ``DraftSource`` of a draft model: a causal LM sharing the target's tokenizer, with a KV cache of its own.
    The memory keeps its estimates by the model object (weakly); the profile prices it in its format."""

    model: torch.nn.Module

    @property
    def memory_key(self) -> torch.nn.Module:
        return self.model

    @property
    def profile_draft(self) -> torch.nn.Module:
        return self.model

    def drafter(self, call: DraftCall) -> ChainDrafter:
        """The call's drafter; its steps compile where the call's verify does (``Verifier.for_draft``)."""
        return chained(DraftModelDrafter, self.model, call, step=call.verifier.for_draft(self.model))


def _fed(tokens: torch.Tensor) -> RoundLayout:
    """Tokens fed as a plain chain (the first is the "last token" of a round without guesses)."""
    n = tokens.shape[0]
    return RoundLayout(tokens.cpu(), positions(n), None, positions(n), NOTHING_READ, 0)  # (shared, never modified)


def _left_padded(rows: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of different lengths as one left-padded [B, L] batch and its mask (None without padding)."""
    width = max(row.shape[0] for row in rows)
    batch = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        if row.shape[0]:
            batch[i, width - row.shape[0]:] = row.cpu()
            mask[i, width - row.shape[0]:] = 1
    return batch, (None if bool(mask.all()) else mask)
