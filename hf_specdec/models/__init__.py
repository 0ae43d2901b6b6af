"""Model references, offline bundles, the measured hardware profile and the dtype / draft-format choices it makes,
memory, and the draft/target compatibility check.

    from hf_specdec.models import load_model, load_pair
    model, tokenizer, info = load_model("bundle:qwen2.5-coder-1.5b-instruct", dtype="auto")   # measured choice
    draft = load_model("qwen2.5-coder-0.5b-instruct", quantize="auto").model                 # fastest that fits
    (target, tok, _), (draft, _, draft_info) = load_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    print(info.choice.why, draft_info.choice.why)

Importing this package downloads nothing; bundles are fetched and converted on first use.
"""

from .bundles import BUNDLES, Bundle, BundleError, bundle_status, ensure_bundle, resolve_cache_dir
from .loading import LoadedModel, LoadInfo, load_model, load_pair, reference_kind, resolve_reference
from .hardware import ModelLoadOOMError, footprint_bytes, resolve_device, resolve_dtype
from .profile import Choice, HardwareProfile, Workload, choose_draft_format, choose_dtype, get_profile

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
TINY_TARGET = "smollm2-135m-instruct"

__all__ = [
    "BUNDLES", "Bundle", "BundleError", "Choice", "DEFAULT_DRAFT", "DEFAULT_TARGET", "HardwareProfile", "LoadInfo",
    "LoadedModel", "ModelLoadOOMError", "TINY_TARGET", "Workload",
    "bundle_status", "choose_draft_format", "choose_dtype", "ensure_bundle", "footprint_bytes", "get_profile",
    "load_model", "load_pair", "reference_kind", "resolve_cache_dir", "resolve_device", "resolve_dtype",
    "resolve_reference",
]
