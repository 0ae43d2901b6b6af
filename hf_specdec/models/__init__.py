"""Model references, offline bundles, dtype/memory choices and the draft/target compatibility check.

    from hf_specdec.models import load_model
    model, tokenizer, info = load_model("bundle:qwen2.5-coder-1.5b-instruct", dtype="auto")
    draft = load_model("qwen2.5-coder-0.5b-instruct", quantize="4bit").model

Importing this package downloads nothing; bundles are fetched and converted on first use.
"""

from .bundles import BUNDLES, Bundle, BundleError, bundle_status, ensure_bundle, resolve_cache_dir
from .loading import LoadedModel, LoadInfo, load_model, reference_kind, resolve_reference
from .hardware import ModelLoadOOMError, footprint_bytes, resolve_device, resolve_dtype

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
TINY_TARGET = "smollm2-135m-instruct"

__all__ = [
    "BUNDLES", "Bundle", "BundleError", "DEFAULT_DRAFT", "DEFAULT_TARGET", "LoadInfo", "LoadedModel",
    "ModelLoadOOMError", "TINY_TARGET",
    "bundle_status", "ensure_bundle", "footprint_bytes", "load_model", "reference_kind", "resolve_cache_dir",
    "resolve_device", "resolve_dtype", "resolve_reference",
]
