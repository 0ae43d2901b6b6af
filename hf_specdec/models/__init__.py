"""Model references, offline bundles, the measured hardware profile and the dtype / draft-format choices it makes,
memory, and the draft/target compatibility check.

    from hf_specdec.models import load_model, load_pair
    model, tokenizer, info = load_model("bundle:qwen2.5-coder-1.5b-instruct", dtype="auto")   # measured choice
    draft = load_model("qwen2.5-coder-0.5b-instruct", quantize="auto").model                 # fastest that fits
    (target, tok, _), (draft, _, draft_info) = load_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    print(info.choice.why, draft_info.choice.why)

Rooms, from the ground up: ``bundles`` (offline bundles, the cache dir), ``hardware`` (dtypes, quantization,
memory, the machine record), ``int4`` (the int4 weight-only draft format over torch's CPU kernel), ``formats``
(format names), ``refs`` (references, configs, the one weight load),
``profile`` (the profile's data and keys), ``measure`` (timing), ``store`` (the profile cache, ``get_profile``),
``seeding`` (the decoding memories started from the cached profile), ``choose`` (dtype and draft format),
``loading`` (``load_model``), ``compat`` and ``cli`` (``check``, ``tune``, ``models``). Importing this package downloads nothing; bundles are fetched and converted on first use.
"""

from .bundles import BUNDLES, Bundle, BundleError, bundle_status, ensure_bundle, resolve_cache_dir
from .choose import Choice, ChoiceKind, Workload, choose_draft_format, choose_dtype
from .formats import FormatUnavailable, as_format, candidate_formats, format_load_args, model_format
from .hardware import ModelLoadOOMError, footprint_bytes, machine_record, resolve_device, resolve_dtype
from .int4 import Int4Linear, Int4Report, quantize_int4
from .loading import LoadedModel, LoadInfo, load_model, load_pair
from .measure import build_proxy, measure_costs, measure_format, measure_model
from .profile import DeviceIdentity, FormatCost, HardwareProfile, ProfileKey, model_fingerprint
from .refs import config_of, reference_kind, resolve_reference
from .seeding import seed_lookahead, seed_speculative
from .store import cached_costs, cached_profile, get_profile, read_profile_file

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
TINY_TARGET = "smollm2-135m-instruct"

__all__ = [
    "BUNDLES", "Bundle", "BundleError", "Choice", "ChoiceKind", "DEFAULT_DRAFT", "DEFAULT_TARGET", "DeviceIdentity",
    "FormatCost", "FormatUnavailable", "HardwareProfile", "Int4Linear", "Int4Report", "LoadInfo", "LoadedModel",
    "ModelLoadOOMError", "ProfileKey", "TINY_TARGET", "Workload",
    "as_format", "build_proxy", "bundle_status", "cached_costs", "cached_profile", "candidate_formats",
    "choose_draft_format", "choose_dtype", "config_of", "ensure_bundle", "footprint_bytes", "format_load_args",
    "get_profile", "load_model", "load_pair", "machine_record", "measure_costs", "measure_format", "measure_model",
    "model_fingerprint", "model_format", "quantize_int4", "read_profile_file", "reference_kind",
    "resolve_cache_dir", "resolve_device", "resolve_dtype", "resolve_reference", "seed_lookahead",
    "seed_speculative",
]
