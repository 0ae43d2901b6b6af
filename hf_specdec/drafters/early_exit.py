"""Early-exit self-drafting: the target's first N decoder layers, its final norm and its output layer draft for it.

LayerSkip (Elhoushi et al., "LayerSkip: Enabling Early Exit Inference and Self-Speculative Decoding", ACL 2024,
arXiv:2404.16710) drafts with the target's own first layers and verifies with all of them; transformers runs it as
``generate(..., assistant_early_exit=N)`` (``EarlyExitCandidateGenerator``, which sets the target's
``config.num_hidden_layers`` to N around each draft call). Here the draft is a separate object, ``early_exit_model``:

    draft = early_exit_model(target, 8)     # a view: the target's embedding, layers[:8], final norm, lm_head
    draft(input_ids).logits                 # == target.lm_head(target.model.norm(hidden state after layer 8))

The view is a shallow copy of the target's causal-LM module (same class) whose decoder-layer list holds the first N
layers and whose config says N layers: every parameter and buffer is the target's own tensor (no second copy of any
weight), and the target is never changed, so drafting and verifying never race over a shared setting. Exactness is the verifier's, as for any draft: greedy output is plain greedy's, sampled output the target's
distribution (the draft's probabilities are those its tokens were drawn from).

The view drafts through ``EarlyExitDrafter``, a ``DraftModelDrafter`` (chain drafting, confidences, the plan's
in-round rule, the narrow output layer of ``SpecConfig.draft_vocab_size``) that keeps no cache of its own. The
target's cache already holds, for layers < N, exactly the keys and values the view computes for the committed
tokens (same weights, same inputs, same positions): LayerSkip's cache reuse. The loop hands the drafter the
target's ``KVStore`` once the target has read the prompts (``attach``), and each round the drafter borrows its
first N layers (``KVStore.lend``: the same tensors, rows, lengths and mask, no copy), feeds the last committed
token and then its own drafts, and drops the borrowed store when the round ends: nothing to roll back, no prompt
read (a round that drafts costs its draft steps only, which matters most when the early exit turns out not to
agree and speculation is turned off after its first probe), and no second cache. Sliding-window layers keep a
state of their own and cannot be lent (``KVStore.can_lend``): there, and without ``attach``, the drafter reads
the prompt into a cache of its own as any draft model does.

``EarlyExit(N)`` names this draft as a value: ``SpeculativeMemory`` keeps its estimates by it (a stable key across
calls, where a fresh view per call would not be), and ``speculative_generate(draft_model=EarlyExit(N))`` /
``generate(..., assistant_early_exit=N)`` after ``hf_specdec.enable`` run with it. Its ``DraftSource`` for a call
is ``EarlyExitSource``: N decided, the view built, the key ``EarlyExit(N)``, nothing for the hardware profile to
price beyond the target's t(n).

``EarlyExit("auto")`` (``assistant_early_exit="auto"``) picks N when a call starts (``choose_layers``), among a few
depths (``exit_candidates``: 1/8, 1/4, 3/8 and 1/2 of the layers), by the planner's own price: for each, the round
``costmodel.best_round`` finds over what the memory measured for ``EarlyExit(N)`` (its draft step, its acceptance
per position; the target's t(n) of any of them), in expected tokens per second. A depth not measured yet is priced
at the draft's prior acceptance and a step of its share of the target's weights, which is optimistic: each depth
is tried once, by the calls that follow one another, and from then on its measurements decide. One call runs one
N; without a memory (``speculative_memory=None``) every call prices from priors alone and takes the shallowest.

Architectures: a causal LM whose base model keeps its decoder layers in one ``ModuleList`` of
``config.num_hidden_layers`` layers (``layers``: llama, qwen2, qwen3, mistral, gemma, phi3, ...; ``h``: gpt2-style;
``blocks``: mpt, dbrx) and runs them once, in order. Others are refused up front (``EarlyExitUnsupported``, naming
the architecture): layers kept elsewhere (BERT-style ``encoder.layer``, OPT/BART-style ``decoder.layers``),
composite configs (a text model inside a multimodal one), per-layer (heterogeneous) configs, layers that read
other layers' caches (KV sharing), layers run in a loop (``NOT_IN_ORDER``). Over the causal LMs transformers 5.25
ships, ``python tests/arch_sweep.py OUT.json --modes early_exit`` (N = 1) finds every one that speculative
decoding runs either exact with this draft or refused by this check. Whatever the early layers predict, the output is the target's; how often they agree with it is
what decides the speed (a model not trained for early exit agrees rarely at small N).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Sequence

import torch

from .. import cache as kv
from ..costmodel import ForwardCost, RoundCost, best_round, prefix_gains
from ..round import Offer, RoundOutcome, RowView, SourceKind, prior_acceptance
from ..errors import Unsupported
from .base import DraftCall
from .draft_model import DraftModelDrafter, chained

AUTO = "auto"
AUTO_FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2)  # the depths "auto" chooses among, as shares of the layers
PRICED_DRAFT_TOKENS = 12  # longest round "auto" prices (the adaptive policy's rounds rarely go further)

LAYER_LISTS = ("layers", "h", "blocks")  # where a base model keeps its decoder layers: llama, gpt2, mpt style
# Architectures with such a list that do not run it once, in order (found by ``tests/arch_sweep.py --modes
# early_exit``; the reason is what it showed).
NOT_IN_ORDER = MappingProxyType({
    "dory": "it runs its layers as a prelude, a core repeated several times and an output block, not once in order",
})


class EarlyExitUnsupported(Unsupported):
    """This model cannot draft with its own first layers; the message names the architecture and the reason."""


@dataclass(frozen=True)
class EarlyExit:
    """The draft "the target's first ``layers`` decoder layers" (module docstring), as a value.

    It is the key of its estimates in a ``SpeculativeMemory`` (equal values, the same estimates: a memory belongs
    to one target) and what ``speculative_generate(draft_model=...)`` takes; ``view(target)`` builds the model.

    >>> EarlyExit(8) == EarlyExit(8), EarlyExit(8) == EarlyExit(4)
    (True, False)
    >>> EarlyExit(0)
    Traceback (most recent call last):
    ...
    ValueError: assistant_early_exit=0 is invalid: use an int >= 1, the number of the target's decoder layers the draft runs, or 'auto'.
    """

    layers: int | Literal["auto"]

    def __post_init__(self) -> None:
        if self.layers == AUTO:
            return
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"assistant_early_exit={self.layers!r} is invalid: use an int >= 1, the number of the "
                             "target's decoder layers the draft runs, or 'auto'.")

    @classmethod
    def of(cls, layers: "int | Literal['auto'] | EarlyExit") -> "EarlyExit":
        """``assistant_early_exit=`` as a draft: N, "auto", or an ``EarlyExit`` already.

        >>> EarlyExit.of(2) == EarlyExit.of(EarlyExit(2)) == EarlyExit(2)
        True
        """
        return layers if isinstance(layers, EarlyExit) else cls(layers)

    def resolved(self, model, memory=None) -> "EarlyExit":
        """This draft with N decided: itself, or for "auto" the depth ``choose_layers`` prices best."""
        return EarlyExit(choose_layers(model, memory).layers) if self.layers == AUTO else self

    def view(self, model):
        """The draft model over ``model``'s first layers (``early_exit_model``); "auto" must be resolved first."""
        assert self.layers != AUTO, "resolve EarlyExit('auto') against the target first"
        return early_exit_model(model, self.layers)


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(attribute name, list) of ``model``'s decoder layers in its base model; ``EarlyExitUnsupported`` when they
    are not one plain list of ``config.num_hidden_layers`` layers a view can cut.

    >>> from hf_specdec.models.tiny import tiny_model
    >>> name, layers = decoder_layers(tiny_model("gpt2"))
    >>> name, len(layers)
    ('h', 2)
    """
    name = f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"

    def refuse(reason: str) -> None:
        raise EarlyExitUnsupported(
            f"hf_specdec cannot draft with the first layers of {name}: {reason}. Use assistant_model=<a small draft "
            "model> or decoding='lookahead' for this model.")

    if model.config.get_text_config(decoder=True) is not model.config:
        refuse("its decoder is part of a composite (multimodal or encoder-decoder) model")
    if getattr(model.config, "is_heterogeneous", False):
        refuse("its layers have configs of their own (a heterogeneous config), which a cut config cannot keep")
    if getattr(model.config, "kv_sharing_modes", None) or getattr(model.config, "num_kv_shared_layers", 0):
        refuse("some of its layers read other layers' key/value cache, which a cut model may not have")
    if model.config.model_type in NOT_IN_ORDER:
        refuse(NOT_IN_ORDER[model.config.model_type])
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    count = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(base, torch.nn.Module) or base is model:
        refuse("it has no separate base model under its output layer")
    for attribute in LAYER_LISTS:
        layers = base._modules.get(attribute)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == count:
            return attribute, layers
    refuse(f"its decoder layers are not one list of config.num_hidden_layers = {count} layers (looked for "
           f"{', '.join(LAYER_LISTS)})")
    raise AssertionError("unreachable")


def check_early_exit(model, layers: int) -> None:
    """Refuse ``layers`` out of range for ``model`` (1 to its decoder layers - 1), or a model that cannot be cut."""
    decoder_layers(model)
    count = int(model.config.num_hidden_layers)
    model_type = getattr(model.config, "model_type", "?")
    if count < 2:
        raise ValueError(f"assistant_early_exit needs a target of 2 or more decoder layers; this {model_type} model "
                         f"has {count}.")
    if not 1 <= layers < count:
        raise ValueError(f"assistant_early_exit={layers} is out of range: this {model_type} model has {count} "
                         f"decoder layers, so the draft can run 1 to {count - 1} of them.")


def early_exit_model(model, layers: int):
    """A model of ``model``'s class that runs its embedding, its first ``layers`` decoder layers, its final norm
    and its output layer, sharing every tensor with ``model`` (which is left unchanged); see the module docstring.

    >>> from hf_specdec.models.tiny import tiny_model
    >>> target = tiny_model("llama", num_hidden_layers=4)
    >>> draft = early_exit_model(target, 2)
    >>> draft.config.num_hidden_layers, target.config.num_hidden_layers, len(target.model.layers)
    (2, 4, 4)
    >>> {id(p) for p in draft.parameters()} <= {id(p) for p in target.parameters()}  # no copy of any weight
    True
    """
    check_early_exit(model, layers)
    attribute, full = decoder_layers(model)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:layers])
    prefix = model.base_model_prefix
    base = _shallow(getattr(model, prefix), {attribute: torch.nn.ModuleList(full[:layers])}, config)
    return _shallow(model, {prefix: base}, config).eval()


def _shallow(module: torch.nn.Module, children: dict[str, torch.nn.Module], config) -> torch.nn.Module:
    """A new object of ``module``'s class whose parameters, buffers and children are ``module``'s own (the same
    tensors and modules), except ``children`` replaced; its ``config`` is ``config``. ``module`` is not changed:
    the child table is a new dict, never the one ``module`` holds. A ``forward`` set on the ``module`` object itself
    (a wrapper bound to it) is not copied: it would run ``module``, all of its layers, instead of the view."""
    view = copy.copy(module)  # its __dict__ one level deep: the same parameter, buffer and child tables
    view.__dict__.pop("forward", None)
    view._modules = {**module._modules, **children}
    view.config = config
    return view


class EarlyExitDrafter(DraftModelDrafter):
    """A ``DraftModelDrafter`` over an early-exit view (``early_exit_model``) that borrows the target's cache of its
    first layers each round instead of keeping one (module docstring); without ``attach``, or when the target's
    cache cannot lend (``KVStore.can_lend``), it is a ``DraftModelDrafter`` with a cache of its own."""

    target_cache: kv.KVStore | None = None
    head = None

    def attach(self, target_cache: kv.KVStore) -> None:
        """The target's store, once it has read the prompts (the loop calls this before ``prefill``)."""
        self.target_cache = target_cache if target_cache.can_lend() else None
        self.head = None  # the narrowed output layer, made with the first borrow (it depends on the prompts)

    @property
    def borrows(self) -> bool:
        return self.target_cache is not None

    def _read(self, views: Sequence[RowView]) -> float:
        """Borrow the target's kept keys and values of the first layers for this round: no read, 0 s."""
        if not self.borrows:
            return super()._read(views)
        if self.head is None:
            self.head = self._narrow_head(views)
        self.cache = self.target_cache.lend(self.model, head=self.head)
        self._written = [[] for _ in views]
        return 0.0

    def offer(self, views: Sequence[RowView]) -> list[Offer]:
        if not self.borrows:
            return super().offer(views)
        return [Offer(model_tokens=view.budget) for view in views]  # nothing to read before drafting

    def update(self, outcomes: Sequence[RoundOutcome]) -> None:
        """Drop the borrowed store (the target's cache moves on with this round's keep) and the finished rows."""
        if not self.borrows:
            return super().update(outcomes)
        self.cache, self._written = None, []
        self.rows = [row for row, outcome in zip(self.rows, outcomes) if not outcome.finished]

    def release(self) -> None:
        super().release()
        self.target_cache = None


@dataclass(frozen=True)
class EarlyExitSource:
    """The ``DraftSource`` of an early-exit draft for one call: ``draft`` with N decided (the memory's key, a value:
    the same estimates across calls), ``model`` its view over the target (``early_exit_model``), whose drafter
    borrows the target's cache (``EarlyExitDrafter.attach``). The hardware profile holds no draft entry for it: a
    memory's first call is seeded with the target's t(n) alone."""

    draft: EarlyExit
    model: torch.nn.Module

    @classmethod
    def of(cls, draft: EarlyExit, target, memory=None) -> "EarlyExitSource":
        """``draft`` over ``target`` for a call: "auto" decided from ``memory`` (``choose_layers``), the view
        built (refusing a depth out of range or a model that cannot be cut)."""
        resolved = draft.resolved(target, memory)
        return cls(resolved, resolved.view(target))

    @property
    def memory_key(self) -> EarlyExit:
        return self.draft

    @property
    def profile_draft(self) -> None:
        return None

    def drafter(self, call: DraftCall):
        return chained(EarlyExitDrafter, self.model, call)


# -- "auto": the depth the planner prices best ------------------------------------------------------------------------
def exit_candidates(count: int) -> tuple[int, ...]:
    """The depths ``EarlyExit("auto")`` chooses among for a target of ``count`` decoder layers.

    >>> exit_candidates(28), exit_candidates(4), exit_candidates(2)
    ((4, 7, 10, 14), (1, 2), (1,))
    """
    return tuple(sorted({min(count - 1, max(1, round(count * fraction))) for fraction in AUTO_FRACTIONS}))


def layer_share(model, layers: int) -> float:
    """The share of the target's per-token weights its first ``layers`` layers and output layer read (the input
    embedding is a lookup): the prior of a draft step over a target step, before one was timed."""
    _, full = decoder_layers(model)
    head = sum(p.numel() for p in model.get_output_embeddings().parameters())
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in full]
    return (sum(sizes[:layers]) + head) / (sum(sizes) + head)


@dataclass(frozen=True)
class ExitChoice:
    """What ``choose_layers`` decided: ``layers`` (N), and per candidate N its expected tokens per second
    (``rates``; per plain step when nothing was timed) and whether its acceptance was measured (``measured``)."""

    layers: int
    rates: MappingProxyType
    measured: frozenset


def choose_layers(model, memory=None) -> ExitChoice:
    """The depth among ``exit_candidates`` whose best round (``costmodel.best_round``) has the highest expected
    tokens per second, from ``memory``'s estimates of each ``EarlyExit(N)`` (module docstring); ties go to the
    shallower depth.

    >>> from hf_specdec.models.tiny import tiny_model
    >>> from hf_specdec.memory import SpeculativeMemory
    >>> target, memory = tiny_model("llama", num_hidden_layers=8), SpeculativeMemory()
    >>> choose_layers(target, memory).layers  # nothing measured: every depth at the prior, the cheapest wins
    1
    >>> def measured(n, kept, missed):  # `kept` rounds that kept all 4 draft tokens, `missed` that missed the first
    ...     estimates = memory.estimates(EarlyExit(n))
    ...     estimates.forward.observe(1, 1.0); estimates.draft_step.observe(1, 0.1 * n)
    ...     acceptance = estimates.source((SourceKind.DRAFT, 0), prior=2 / 3)
    ...     for _ in range(kept): acceptance.observe(judged=4, accepted=4)
    ...     for _ in range(missed): acceptance.observe(judged=1, accepted=0)
    >>> measured(1, kept=1, missed=19)  # depth 1 rarely agrees
    >>> choose_layers(target, memory).layers  # the next depth is tried
    2
    >>> measured(2, kept=18, missed=2)  # depth 2 mostly does
    >>> choice = choose_layers(target, memory)
    >>> choice.layers, sorted(choice.measured)  # deeper ones cost more, and their prior is below what depth 2 kept
    (2, [1, 2])
    """
    check_early_exit(model, 1)
    candidates = exit_candidates(int(model.config.num_hidden_layers))
    found = {n: memory.estimates(EarlyExit(n)) for n in candidates} if memory is not None else {}
    timed = [e.forward for e in found.values() if e.forward.measured_only().largest]
    forward = max(timed, key=lambda cost: len(cost.measured_only().table())) if timed else None  # the target's
    step = RoundCost(forward).step() if forward is not None else None
    if forward is None or not step:  # nothing timed: in plain steps, t(n) flat
        forward, step = ForwardCost.from_table({n: 1.0 for n in range(1, PRICED_DRAFT_TOKENS + 2)}), 1.0
    key, prior = (SourceKind.DRAFT, 0), prior_acceptance((SourceKind.DRAFT, 0))
    rates, measured = {}, set()
    for n in candidates:
        estimates = found.get(n)
        acceptance = estimates.acceptance.get(key) if estimates is not None else None
        if acceptance is not None and acceptance.judged[0] > 0:
            measured.add(n)
        per_position = acceptance.rates(PRICED_DRAFT_TOKENS) if acceptance is not None else [prior] * PRICED_DRAFT_TOKENS
        draft = estimates.draft_seconds(1) if estimates is not None else None
        price = RoundCost(forward, t_draft=draft if draft is not None else layer_share(model, n) * step)
        best = best_round(price, prefix_gains(per_position))
        rates[n] = best.rate if best is not None else 0.0
    chosen = max(candidates, key=lambda n: (rates[n], -n))
    return ExitChoice(chosen, MappingProxyType(rates), frozenset(measured))
