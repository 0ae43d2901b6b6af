"""The demo's models: which ones an app serves, loaded once each on first use and warmed up.

A ``ModelCache`` belongs to one app (``build_demo`` creates it, its handlers capture it); no module global
holds a model. After loading, every mode the panes use runs once, untimed, on a short prompt (kernels,
allocator, lazy imports), so a visitor's first run is timed as honestly as the later ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..harness import MODES, Harness, choice_line, warm_up
from ..models import DEFAULT_DRAFT, DEFAULT_TARGET, get_profile, load_model
from ..models.tiny import tiny_pair

TINY_LABEL = "tiny random Llama pair (offline, random weights: the text is gibberish)"
RETRY_LOAD_S = 60  # a model that failed to load is tried again on a Run after this long
WARMUP_TOKENS = 8  # the untimed run of every mode after loading
LOAD_ERRORS = (OSError, ValueError, RuntimeError, ImportError)  # what loading a reference can raise


@dataclass(frozen=True)
class ModelChoice:
    """Which models an app serves. ``tiny`` ignores target/draft and builds the offline random pair."""

    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    tiny: bool = False
    dtype: str = "auto"

    def describe(self, draft_quant: str = "auto") -> str:
        if self.tiny:
            return TINY_LABEL
        quant = {"4bit": "4-bit", "none": "unquantized"}.get(draft_quant, "format measured fastest here")
        return f"target `{self.target}` · draft `{self.draft}` ({quant}) · dtype {self.dtype} · CPU"


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message is shown in the UI as is."""


@dataclass(frozen=True)
class Loaded:
    harness: Harness  # its draft is None when the draft failed to load (the panes that need it say why)
    draft_error: str | None
    notes: tuple[str, ...]


class ModelCache:
    """Loads the target once and each draft quantization once, on first use, then warms every mode up (one
    short untimed run); thread-safe. One per app, captured by its handlers (no module global holds a model)."""

    def __init__(self, choice: ModelChoice, warm_modes: Sequence[str] = (), warm_prompt: str = "def f(x):"):
        self.choice = choice
        self.warm_modes, self.warm_prompt = tuple(warm_modes), warm_prompt
        self._lock = threading.Lock()
        self._target = self._tokenizer = None
        self._target_error: str | None = None
        self._failed_at = float("-inf")
        self._loaded: dict[str, Loaded] = {}
        self._target_notes: list[str] = []  # what loading chose for the target, and why
        self._profile = None  # the pair's hardware profile, when loading chooses a format (as load_pair's)

    def is_loaded(self, draft_quant: str = "auto") -> bool:
        return draft_quant in self._loaded

    def get(self, draft_quant: str = "auto") -> Loaded:
        with self._lock:
            retry = time.monotonic() - self._failed_at > RETRY_LOAD_S
            if self._target is None and (self._target_error is None or retry):
                self._load_target()
            if self._target_error is not None:
                self._failed_at = time.monotonic() if retry else self._failed_at
                raise ModelLoadError(self._target_error)
            found = self._loaded.get(draft_quant)
            if found is None or (found.harness.draft is None and retry):
                draft, error, notes = self._load_draft(draft_quant)
                harness = Harness(self._target, self._tokenizer, draft)
                found = self._loaded[draft_quant] = Loaded(
                    harness, error, tuple(self._target_notes + notes + self._warm(harness)))
                self._failed_at = time.monotonic() if draft is None else self._failed_at
            return found

    def _load_target(self) -> None:
        self._target_error = None
        try:
            if self.choice.tiny:
                target, draft, tokenizer = tiny_pair()
                harness = Harness(target, tokenizer, draft)
                warmed = tuple(self._warm(harness))
                self._loaded["none"] = Loaded(harness, None, warmed)
                for quant in ("4bit", "auto"):
                    self._loaded[quant] = Loaded(harness, None, ("quantization is not applied to the tiny random "
                                                                 "draft",) + warmed)
            else:
                print(f"[demo] loading target {self.choice.target} (the first start downloads the bundle) ...",
                      flush=True)
                if self.choice.dtype == "auto":  # the target's dtype priced with the draft's step, as load_pair
                    self._profile = get_profile(self.choice.target, self.choice.draft)
                target, tokenizer, info = load_model(self.choice.target, dtype=self.choice.dtype,
                                                     profile=self._profile)
                self._target_notes = [choice_line("target", info)]
        except LOAD_ERRORS as exc:
            what = "the tiny models" if self.choice.tiny else f"the target model `{self.choice.target}`"
            self._target_error = f"Could not load {what}: {type(exc).__name__}: {exc}"
            return
        self._target, self._tokenizer = target, tokenizer

    def _load_draft(self, draft_quant: str) -> tuple[object | None, str | None, list[str]]:
        """The draft in ``draft_quant`` ("auto": the profile's fastest format that fits; "4bit"; "none": the
        target's dtype); a 4-bit draft that fails to load is loaded unquantized, with a note."""
        quantize = {"4bit": "4bit", "auto": "auto"}.get(draft_quant)
        dtype = str(self._target.dtype).removeprefix("torch.") if quantize is None else self.choice.dtype
        print(f"[demo] loading draft {self.choice.draft} (quantize={quantize}) ...", flush=True)
        try:
            loaded = load_model(self.choice.draft, dtype=dtype, quantize=quantize,
                                profile=self._profile if quantize == "auto" else None)
            return loaded.model, None, [choice_line("draft", loaded.info)]
        except LOAD_ERRORS as exc:
            if quantize is None:
                return None, f"Could not load the draft `{self.choice.draft}`: {type(exc).__name__}: {exc}", []
            note = f"the {quantize} draft failed to load ({type(exc).__name__}: {exc}); using it unquantized"
        draft, error, notes = self._load_draft("none")
        return draft, error, [note] + notes

    def _warm(self, harness: Harness) -> list[str]:
        """One short untimed run of every warm-up mode this harness can run; returns notes on failures."""
        ids = harness.encode(self.warm_prompt, chat=True).input_ids
        modes = [m for m in self.warm_modes if harness.draft is not None or not MODES[m].needs_draft]
        failed = warm_up(lambda mode: harness.generate_row(mode, ids, max_new_tokens=WARMUP_TOKENS), modes)
        return [f"warm-up of {mode} failed: {error}" for mode, error in failed.items()]
