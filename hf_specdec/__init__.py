"""hf_specdec: faster decoding for Hugging Face transformers without changing what the model says.

    import hf_specdec
    hf_specdec.enable(model)
    out = model.generate(**inputs, assistant_model=draft)       # adaptive speculative decoding
    out = model.generate(**inputs, decoding="lookahead")        # lookahead decoding, no draft model
    print(model.last_spec_stats.summary())
"""

from .config import LookaheadConfig, SpecConfig
from .memory import LookaheadMemory, SpeculativeMemory
from .integration import SpecGenerateOutput, disable, enable, lookahead_generate, speculative_generate
from .stats import SpecStats

__version__ = "0.1.0"

__all__ = [
    "LookaheadConfig",
    "LookaheadMemory",
    "SpecConfig",
    "SpecGenerateOutput",
    "SpecStats",
    "SpeculativeMemory",
    "disable",
    "enable",
    "lookahead_generate",
    "speculative_generate",
    "__version__",
]
