"""A compiled verify: the target's forward over a static cache at a few fixed widths, compiled once per width.

Where plain ``generate`` compiles its decoding forward, hf_specdec compiles its verify forward the same way. The
decision is transformers' own (``verifier_for``): a static cache (``cache_implementation="static"`` or a
``StaticCache`` passed in) on an accelerator (CUDA: ``mode="reduce-overhead"``, CUDA graphs), or wherever the
caller's ``compile_config`` asks for it on every device; ``disable_compile`` turns it off. Everything else runs
eagerly. On a CPU it runs only where the ``compile_config`` asks for every device (transformers' own flag):
inductor's compile costs tens of seconds per width in the first call of a fresh process, far more than a CPU
forward saves over a call (bench/compiled_verify.py measures both).

Why widths: a verify forward reads n inputs per row, and n changes from round to round. A static cache gives the
forward fixed shapes except for n, so n is padded up to the next of a few *widths* (``Buckets``: 1, 2, 4, 8, 16,
32, 64): one graph per width (``dynamic=False``), reused round after round. The padding inputs sit after each
row's own inputs and see only themselves and the row's kept columns (as ``layout.stack_layouts`` pads the shorter
rows of a batch); no row's input sees them, and the store forgets them at the round's keep, like any slot not kept
(their columns are past the row's kept ones, so the keep crops them: the static buffers' next forward writes over
them). The mask is always passed (a forward with nothing to mask too), so one width is one graph. A round of more
inputs than the widest width runs eagerly, and so does one whose padding would not fit the static buffers (near
the end of a call: growing them would change every width's shapes). The price of a verify of n inputs is the
price of its width (``CompiledVerify.width``: the cost model's width(n)).

Terms: a *width* is the number of inputs per row of a compiled forward; a *verifier* runs a round's verify forward
over the store, or a draft model's step over its own (``Verifier``: ``EAGER``, or a ``CompiledVerify``).

The draft model's single step is the same thing at two widths (``CompiledVerify.draft_step``: 1, and 2 for the
first step after a round whose draft was all accepted, which feeds its last guess and the target's token). Where the
call's verify compiles, a draft model's store gets a static cache of its own (``Verifier.store_cache``) and its
one-token-per-row forwards run through the draft's own compiled call, with the target's compile config
(``Verifier.for_draft``: where the draft itself meets transformers' criterion); where the verify runs eagerly, so
does the draft, over a dynamic cache. Which draft forwards run compiled is said in ``drafters/draft_model.py``. On
a CPU, the tests compile with a counting backend (the graph capture, padding and cache handling all run; the
kernels are eager ones, bit-identical to eager).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from transformers import CompileConfig, DynamicCache, EncoderDecoderCache, GenerationConfig, StaticCache
from transformers.cache_utils import Cache

from .backends import Buffers
from .cache import NOTHING, Continue, ForwardResult, KVStore, LogitsAt, Recording, _select, split_cache
from .encoder_decoder import reads_encoder
from .layout import BatchInputs


@dataclass(frozen=True)
class Buckets:
    """The widths a compiled forward runs at (increasing): n inputs per row run at the smallest width >= n.

    >>> buckets = Buckets()
    >>> [buckets.width(n) for n in (1, 2, 3, 5, 9, 33, 65)]
    [1, 2, 4, 8, 16, 64, None]
    """

    widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # chains of up to 31 guesses; lookahead's windows and tries

    def width(self, n: int) -> int | None:
        """The width n inputs per row run at (None: wider than every width, run eagerly)."""
        return next((width for width in self.widths if width >= n), None)


def padded(batch: BatchInputs, width: int) -> BatchInputs:
    """``batch`` ([B, n] inputs) with ``width - n`` padding inputs after every row's: each sees only itself (and
    the row's kept columns), nobody sees it; ``valid`` is always given, so that the store always passes a mask.

    >>> batch = BatchInputs(torch.tensor([[4, 5]]), torch.tensor([[0, 1]]), None, None)
    >>> wide = padded(batch, 4)
    >>> wide.input_ids.tolist(), wide.offsets.tolist(), wide.valid.tolist()
    ([[4, 5, 0, 0]], [[0, 1, 1, 1]], [[True, True, False, False]])
    """
    rows, n = batch.input_ids.shape
    extra = width - n
    assert extra >= 0, "padded: a width at least as wide as the batch"
    input_ids = torch.cat([batch.input_ids, batch.input_ids.new_zeros(rows, extra)], dim=1)
    last = batch.offsets[:, -1:]  # padding at the last input's position: any position the model takes will do
    offsets = torch.cat([batch.offsets, last.expand(rows, extra)], dim=1)
    valid = batch.valid if batch.valid is not None else torch.ones(rows, n, dtype=torch.bool)
    valid = torch.cat([valid, torch.zeros(rows, extra, dtype=torch.bool)], dim=1)
    inner = None
    if batch.inner is not None:
        inner = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)
        inner[:, :n, :n] = batch.inner
    return BatchInputs(input_ids, offsets, valid, inner)


After = torch.LongTensor | Continue | None  # ``KVStore.forward``'s ``after``: the written path each row continues


class Verifier(Protocol):
    """Runs a round's verify forward over the target's store, or a draft model's step over its own
    (``KVStore.forward``'s inputs and result: logits at ``logits_at``, ``slots`` [B, n])."""

    def width(self, n: int) -> int: ...

    def forward(self, store: KVStore, batch: BatchInputs, *, after: After = None, logits_at: LogitsAt = None,
                record: Recording = NOTHING) -> ForwardResult: ...

    @property
    def takes_head(self) -> bool:
        """Do its forwards take the store's own output layer (``KVStore(head=)``, a draft's narrowed vocabulary)?
        An eager forward does; a compiled one runs the model's own forward, output layer included."""

    def for_draft(self, draft) -> "Verifier":
        """The runner of a draft model's single steps in a call this verifier verifies."""

    def store_cache(self, model, columns: int) -> Cache | None:
        """The cache a store of ``model`` this runner runs over is made with, for a call that holds ``columns``
        columns (None: the store's own, dynamic)."""


@dataclass(frozen=True)
class Eager:
    """The model's own forward, at the round's own width."""

    def width(self, n: int) -> int:
        """n inputs cost a forward of n."""
        return n

    def forward(self, store: KVStore, batch: BatchInputs, *, after: After = None, logits_at: LogitsAt = None,
                record: Recording = NOTHING) -> ForwardResult:
        return store.forward(batch, after=after, logits_at=logits_at, record=record)

    @property
    def takes_head(self) -> bool:
        return True

    def for_draft(self, draft) -> "Eager":
        """An eager verify: the draft steps eagerly too."""
        return self

    def store_cache(self, model, columns: int) -> None:
        """A dynamic cache, the store's own."""
        return None


EAGER = Eager()


@dataclass(frozen=True)
class CompiledVerify:
    """The target's forward compiled (``call``: transformers' ``get_compiled_call`` with ``config``), run at
    ``buckets``' widths over a static cache's store. A forward it cannot run compiled runs eagerly: a round wider
    than every width, one that records hidden states or attentions (their tuples vary by call), a store with a
    dynamic cache or with model inputs besides tokens (images, token types). A draft model's steps are one
    (``draft_step``), at widths 1 and 2."""

    call: Callable
    buckets: Buckets = Buckets()
    config: CompileConfig | None = None  # what ``call`` compiles with, which a draft's step compiles with too

    def width(self, n: int) -> int:
        """The width n inputs per row are verified at (n itself past the widest: eager)."""
        width = self.buckets.width(n)
        return n if width is None else width

    def runs(self, store: KVStore, n: int, record: Recording) -> bool:
        """Does a forward of ``n`` inputs per row over ``store`` run compiled? Also not where its padding would
        not fit the buffers (the call's last rounds): growing them would change every width's shapes."""
        width = self.buckets.width(n)
        return (width is not None and not record and store.buffers is not None and not store.inputs.step(n)
                and store.width + store.num_written + width <= store.buffers.width)

    def forward(self, store: KVStore, batch: BatchInputs, *, after: After = None, logits_at: LogitsAt = None,
                record: Recording = NOTHING) -> ForwardResult:
        n = int(batch.input_ids.shape[1])
        if not self.runs(store, n, record):
            return store.forward(batch, after=after, logits_at=logits_at, record=record)
        width = self.width(n)
        if isinstance(after, torch.Tensor) and after.dim() == 2:  # a path per input: the padding continues the last's
            after = torch.cat([after, after[:, -1:].expand(-1, width - n)], dim=1)
        result = store.forward(padded(batch, width), after=after, call=self.call)  # logits at every input: one shape
        return dataclasses.replace(result, logits=_select(result.logits[:, :n], logits_at), slots=result.slots[:, :n])

    @classmethod
    def draft_step(cls, call: Callable, config: CompileConfig | None = None) -> "CompiledVerify":
        """A draft model's single step compiled the same way (a draft store with a static cache): width 1, and 2
        for a round's first step after a round whose draft was all accepted (its last guess and the target's token,
        the first step of every round where the draft agrees)."""
        return cls(call, Buckets((1, 2)), config)

    @property
    def takes_head(self) -> bool:
        """No: its call is the model's own compiled forward (transformers keeps it on the model, so later calls
        reuse its graphs; a call of the base model under a head of the store's own would be compiled anew)."""
        return False

    def for_draft(self, draft) -> Verifier:
        """The draft's steps compiled with this verify's config (``draft_step`` over the draft's own
        ``get_compiled_call``), where the draft itself compiles as transformers decides it for the target (its
        device, its quantizer, its offload, over a static cache of its own: ``compile_config_for``); else
        ``EAGER``. An encoder-decoder draft steps eagerly (its static cache would be an encoder-decoder's)."""
        if self.config is None:
            return EAGER
        text = draft.config.get_text_config(decoder=True)
        static = StaticCache(config=text, max_cache_len=1)  # (lazy: nothing is allocated)
        cache = EncoderDecoderCache(static, DynamicCache(config=text)) if reads_encoder(draft) else static
        # a copy: transformers' criterion may turn ``fullgraph`` off in the config it is given (flash attention)
        config = compile_config_for(draft, GenerationConfig(compile_config=copy.copy(self.config)), cache)
        if config is None:
            return EAGER
        return CompiledVerify.draft_step(draft.get_compiled_call(config), config)

    def store_cache(self, model, columns: int) -> Cache | None:
        """A ``StaticCache`` of ``columns`` columns for ``model``; None (a dynamic cache, eager steps) where the
        store could not speculate on its buffers (sliding-window layers narrower than ``columns``)."""
        static = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=columns)
        buffers = Buffers.of(static.layers)
        return static if buffers is not None and buffers.refusal() is None else None


def compile_config_for(model, generation_config, cache) -> CompileConfig | None:
    """The ``CompileConfig`` the verify forward compiles with, or None (eager): where plain ``generate`` would
    compile its decoding forward over ``cache`` (transformers' ``_valid_auto_compile_criteria``: an accelerator, or
    a ``compile_config`` asking for every device; a static cache; no offload, a quantizer that compiles), the
    caller's ``compile_config`` (transformers' default where none) with ``dynamic=False``: one graph per width.
    A dynamic cache (the default), an encoder-decoder's cache or a layer kind with no buffers runs eagerly."""
    if cache is None or generation_config.disable_compile:
        return None
    speculated, fixed = split_cache(cache)
    if fixed or Buffers.of(speculated.layers) is None:
        return None
    if not model._valid_auto_compile_criteria({"cache": cache}, generation_config):
        return None
    config = generation_config.compile_config or model._default_compile_config()
    compiled = dataclasses.replace(config, dynamic=False)
    compiled._compile_all_devices = config._compile_all_devices  # (transformers' flag, not a field: a draft's
    # criterion reads it, ``CompiledVerify.for_draft``)
    return compiled


def verifier_for(model, generation_config, cache) -> Verifier:
    """The verifier of a call (module docstring): compiled where ``compile_config_for`` gives a config, else
    ``EAGER``. The compiled call is transformers' own (``get_compiled_call``, kept on the model), so a second call
    with the same config reuses its graphs."""
    config = compile_config_for(model, generation_config, cache)
    if config is None:
        return EAGER
    return CompiledVerify(model.get_compiled_call(config), config=config)
