"""One harness for everything that runs and measures decoding modes: the eval harness, the demo, the bench
presets and ``hf-specdec generate``.

    from hf_specdec.harness import Harness, Settings
    with Harness(target, tokenizer, draft, Settings(max_new_tokens=64)) as harness:
        prompt = harness.encode("Write a function that reverses a list.", chat=True)
        row = harness.generate_row("specdec_adaptive", prompt.input_ids, seed=0)
        print(row["tokens_per_s"], row["mean_accepted_length"], harness.memory_seed["why"])

- ``modes``: the mode registry (``MODES``, ``get_mode``, ``parse_modes``; ``PLAIN_DTYPE_MODES``) and
  ``Settings``, how every mode decodes;
- ``streaming``: ``RoundStreamer`` (first-token time, rounds, cancel), ``IncrementalText``;
- ``encoding``: ``encode_prompt``, ``chat_text``;
- ``formats``: ``choice_line`` / ``choices_record`` (what loading chose and why), ``seed_memory``;
- ``run``: ``Harness.generate_row`` (one timed call and its measurements), ``warm_up``.

Handed on from ``hf_specdec.models`` (the harness stands on it, never the other way round): ``machine_record``
(the machine every report carries) and ``measure_costs`` (the offline cost probe of loaded models).
"""

from .encoding import EncodedPrompt, chat_text, encode_prompt
from .formats import choice_line, choices_record, loaded_format, seed_memory
from ..models.hardware import machine_record
from ..models.measure import measure_costs
from .modes import (DRAFT_MODES, MODES, PLAIN_DTYPE_MODES, PLAIN_FORMATS, Mode, Settings, get_mode, parse_modes,
                    plain_format)
from .run import ForwardCounter, Harness, device_of, warm_up
from .streaming import GenerationCancelled, IncrementalText, RoundStreamer

__all__ = [
    "DRAFT_MODES", "EncodedPrompt", "ForwardCounter", "GenerationCancelled", "Harness", "IncrementalText", "MODES",
    "Mode", "PLAIN_DTYPE_MODES", "PLAIN_FORMATS", "RoundStreamer", "Settings", "chat_text", "choice_line",
    "choices_record", "device_of", "encode_prompt", "get_mode", "loaded_format", "machine_record", "measure_costs",
    "parse_modes", "plain_format", "seed_memory", "warm_up",
]
