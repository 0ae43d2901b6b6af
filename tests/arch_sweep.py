"""Architecture sweep (issue 15): every causal LM transformers ships, tiny and random, decoded three ways.

For each model type in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny fp32 model is built from its config, a
15-token repetitive prompt is decoded for 24 greedy tokens with plain ``generate`` and with a no-cache greedy
reference (a full forward over the whole sequence every step), and then with hf_specdec through its public API:

    speculative_self     custom_generate=hf_specdec.speculative_generate, draft_model=the target itself
    speculative_random   the same with a random draft of the same architecture (another seed)
    lookahead            custom_generate=hf_specdec.lookahead_generate

and, on request (``--modes early_exit``), ``draft_model=EarlyExit(1)``: the target's first layer drafts for it.

Each (architecture, mode) is classified:

    exact        the tokens equal plain generate's (or the no-cache reference's, where plain generate disagrees)
    refused      ValueError raised before the first model forward (counted with forward pre-hooks)
    crash        any other exception, or a ValueError after forwards ran (the message is kept)
    plain_fails  the same exception as transformers' own plain generate raises for this model (before hf_specdec
                 runs: generate prepares its cache first)
    mismatch     different tokens

Architectures whose tiny model cannot be built, or whose references cannot be computed, are listed with the
exception (status "unbuildable" / "no_reference"), never skipped silently.

Choices that make the sweep able to see a bug (each measured):

- untied output layer and init std 0.1: a tied std-0.02 tiny model mostly repeats its last input token, so a lost
  cache or wrong positions still give the same argmax (openai-gpt looked "exact" that way);
- the pad token is suppressed in every reference and mode (a generated pad gets a position of its own in
  RoBERTa-style models, a second difference unrelated to cache handling);
- ``is_decoder=True`` (BERT-style decoders are bidirectional otherwise), ``use_cache=True`` (MPT defaults to
  False and would be refused), DSA ``index_topk`` above the sequence length (sparse top-k over ReLU scores ties);
- the layout of published checkpoints, not a simpler one that hides a kind of layer: Gemma 3n / Gemma 4 share keys
  and values between layers as their E2B/E4B checkpoints do (``_kv_sharing``), hybrid models keep their recurrent
  and attention layers (``_OVERRIDES``). A kind of cache layer hf_specdec has no backend for is refused, and shows;
- fixed draft lengths / lookahead shape (``SPEC_CONFIG`` / ``LOOKAHEAD_CONFIG``), so every round drafts and rolls
  back; each row records ``drafted`` / ``accepted`` so an exact row that never exercised anything shows.

Not a pytest module (no test functions); run it as a script, in one process (about 2 minutes on 2 CPU cores):

    python tests/arch_sweep.py /tmp/arch_sweep.json                 # every architecture
    python tests/arch_sweep.py /tmp/out.json --arch llama,mistral   # a few
    PYTHONPATH=/path/to/other/checkout python tests/arch_sweep.py ...  # another hf_specdec (the JSON says which)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import time
import traceback
import warnings
from typing import Any, Iterable

import torch

MODES = ("speculative_self", "speculative_random", "lookahead")
PROMPT = [3, 4, 5, 6, 7] * 3  # 15 tokens
NEW_TOKENS = 24
VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
LAYERS = 2
MAX_POSITIONS = 512
SLIDING_WINDOW = 8  # 15-token prompt + 24 tokens run well past it
# Every round drafts: the fixed policy (4 draft tokens) and an explicit lookahead shape (window 4, 3-grams, 4
# candidates), so rollback and compaction run every round. (The adaptive defaults soon stop drafting on a CPU-sized
# tiny model, which leaves the cache code unexercised.) ``--auto`` uses the defaults instead.
SPEC_CONFIG = {"policy": "fixed", "num_draft_tokens": 4}
LOOKAHEAD_CONFIG = {"window": 4, "ngram": 3, "max_candidates": 4}
ARCH_TIME_LIMIT_S = 120  # one architecture (build + references + every mode); a hang becomes a crash row


# ----------------------------------------------------------------------------------------------------------------
# 1. The architectures
# ----------------------------------------------------------------------------------------------------------------


def causal_lm_architectures() -> list[tuple[str, Any, Any]]:
    """``(model_type, config class, causal-LM class)`` for every entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``.

    A class that cannot be imported is returned as the exception instead (the sweep lists it as unbuildable).
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            config_class = CONFIG_MAPPING[model_type]
        except Exception as error:  # noqa: BLE001 - reported, not raised
            config_class = error
        try:
            model_class = getattr(transformers, class_name)
        except Exception as error:  # noqa: BLE001
            model_class = error
        found.append((model_type, config_class, model_class))
    return found


# ----------------------------------------------------------------------------------------------------------------
# 2. Tiny configs
# ----------------------------------------------------------------------------------------------------------------

# Every name a config may use for a size, and the tiny value. Only names the config class declares are passed.
_ALIASES: dict[str, Any] = {
    # width
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "embedding_size", "word_embed_proj_dim",
                     "hidden_dim", "backbone_hidden_size"), HIDDEN),
    # depth
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "num_encoder_layers", "num_decoder_layers"), LAYERS),
    # heads
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
                     "swa_num_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "swa_num_key_value_heads",
                     "multi_query_group_num"), KV_HEADS),
    **dict.fromkeys(("head_dim", "swa_head_dim", "attention_head_dim", "kv_channels", "d_head",
                     "attention_head_size"), HEAD_DIM),
    # feed-forward
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
                     "feed_forward_size", "ffn_hidden_size", "d_ff",
                     "d_inner", "shared_intermediate_size", "shared_expert_intermediate_size",
                     "dense_intermediate_size"), INTERMEDIATE),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size"), INTERMEDIATE // 2),
    # vocabulary and positions
    **dict.fromkeys(("vocab_size",), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length",
                     "seq_length", "model_max_length", "max_target_positions", "max_length"), MAX_POSITIONS),
    # sliding window / chunked attention
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "window_size"), SLIDING_WINDOW),
    "attention_chunk_size": SLIDING_WINDOW,
    # experts
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
                     "n_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk", "moe_k", "num_experts_per_token",
                     "num_selected_experts", "experts_per_token", "moe_top_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    # multi-head latent attention
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # sparse (DSA) indexers
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 64,  # more than the 39 tokens: dense selection, like a real 2048 on a short prompt (a smaller
    # top-k over ReLU scores has exact ties at 0, and which tied key is picked differs between a one-token and a
    # many-token forward, so even plain generate would disagree with the no-cache reference)
    # state-space / linear attention
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "d_state"), 8),
    # mamba heads x head dim = expand (2) x hidden
    **dict.fromkeys(("mamba_n_heads",), 8),
    **dict.fromkeys(("linear_num_value_heads", "linear_num_key_heads", "n_mamba_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "linear_key_head_dim", "linear_value_head_dim"), 16),
    **dict.fromkeys(("mamba_n_groups", "n_groups"), 1),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    # assorted
    "rotary_dim": 8,
    "num_nextn_predict_layers": 0,
    "num_mtp_layers": 0,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "unpadded_vocab_size": VOCAB,
    # sensitivity: an untied random head and a wider init make the next token depend on the context (a tied tiny
    # model at std 0.02 mostly repeats its input token, which would hide a lost cache)
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
    "init_std": 0.1,
    "use_cache": True,
    # BERT/RoBERTa-style decoders attend bidirectionally unless is_decoder (the no-cache reference would see the future)
    "is_decoder": True,
}

# Sub-configs (vision/audio towers of multimodal causal LMs) get the same treatment, plus these.
_SUB_ALIASES: dict[str, Any] = {
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
    "out_hidden_size": HIDDEN,
    "projection_dim": HIDDEN,
}

_NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "forced_eos_token_id": None}


class _DropLater:
    """An override value that removes a generic kwarg (e.g. a derived per-layer pattern the config rebuilds)."""

    def __repr__(self) -> str:
        return "<drop>"


_DROP_LATER = _DropLater()

# What the generic table cannot know, per model type (applied last, over the generic values; a dict value for a
# sub-config is merged into the generic one). Each entry says why.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # heads of MLA/DSA models: the latent attention has as many KV heads as query heads
    # Dots 3 Note: the sliding layers' MLA sizes come from swa_* fields; the vision tower's experts pyramid is per
    # layer of its default 42
    "dots3_note": {"text_config": {"num_key_value_heads": HEADS, **{f"swa_{k}": v for k, v in (
        ("num_attention_heads", HEADS), ("num_key_value_heads", HEADS), ("q_lora_rank", 32), ("kv_lora_rank", 16),
        ("head_dim", 16), ("qk_nope_head_dim", 8), ("v_head_dim", 16))}},
        "vision_config": {"pyramid_num_routed": [-1, 4], "adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN},
        "audio_config": {"adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN}},
    "dots3_note_text": {"num_key_value_heads": HEADS, **{f"swa_{k}": v for k, v in (
        ("num_attention_heads", HEADS), ("num_key_value_heads", HEADS), ("q_lora_rank", 32), ("kv_lora_rank", 16),
        ("head_dim", 16), ("qk_nope_head_dim", 8), ("v_head_dim", 16))}},
    # BLT: the byte-group hash embedding (500002 rows by default) and the global width the local models project to
    "blt": {"encoder_hash_byte_group_vocab": 256, "encoder_config": {"hidden_size_global": HIDDEN},
            "decoder_config": {"hidden_size_global": HIDDEN}},
    # LongCat's rotary dim is head_dim; zero experts and expert width are separate fields
    "longcat_flash": {"head_dim": 8, "zero_expert_num": 2, "expert_ffn_hidden_size": 64},
    # DbrxAttention reads attn_config.rope_theta, which the attention sub-config no longer declares
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": KV_HEADS, "clip_qkv": 8.0}, "ffn_config": {"ffn_hidden_size": 128,
             "moe_num_experts": 4, "moe_top_k": 2}},
    # the per-layer rope table is keyed by layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # LFM2: a short-conv layer and an attention layer (the default is attention only for lfm2, unset for lfm2_moe)
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # an assistant head of Gemma 4: no per-layer inputs, every layer reads the target's keys and values (its config
    # sets that itself), single-width MLPs
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "num_kv_shared_layers": _DROP_LATER, "use_double_wide_mlp": _DROP_LATER}},
    # Falcon-H1: the SSM width follows expand x hidden (the default pins it to 1024)
    "falcon_h1": {"mamba_d_ssm": None, "mamba_d_head": "auto"},
    # Bamba: attention at the listed layers (the default lists none: all mamba)
    "bamba": {"attn_layer_indices": [1]},
    # Granite 4 hybrid: one mamba layer and one attention layer (the default is all mamba)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "mamba_d_head": "auto"},
    # local attention over a window, one global layer and one local layer
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
    # one attention layer and one mamba layer, experts on the second
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2},
    # one hybrid (mamba + shared transformer) layer in four
    # Zamba: the config starts with mamba, mamba, hybrid; two hybrid layers so the shared block is tied
    "zamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "num_hidden_layers": 5, "layers_block_type": _DROP_LATER,
              "layer_types": _DROP_LATER},
    "zamba2": {},
    # Mamba-2: heads x head_dim = expand x hidden
    "mamba2": {"num_heads": 8, "head_dim": 16},
    # recurrent block then local attention block
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "num_hidden_layers": 2, "layer_types": _DROP_LATER,
                        "attention_window_size": SLIDING_WINDOW},
    # Reformer: decoder, local attention only (LSH hashing is random), axial positions of product 512 and sum 64
    "reformer": {"is_decoder": True, "attn_layers": ["local", "local"], "axial_pos_shape": [16, 32],
                 "axial_pos_embds_dim": [32, 32], "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    # ZAYA supports one expert per token only
    "zaya": {"num_experts_per_tok": 1},
    # xLSTM: equal q/k and v widths
    "xlstm": {"qk_dim_factor": 1.0, "v_dim_factor": 1.0},
    # Dory: one input, one recurrent and one output layer
    "dory": {"n_input_layers": 1, "n_output_layers": 1, "n_recurrent_layers": 1, "num_hidden_layers": 3,
             "layer_types": _DROP_LATER},
    # Qwen4-Exp: the QSA token indexer of its indexed-attention layers
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
                       "indexer_compress_ratio": 4},
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                                  "indexer_budget": 16, "indexer_compress_ratio": 4}},
    # Kolibri 1.1: its indexer scores with the leading query heads of key head 0 (at most heads / KV heads)
    "kolibri1_1": {"index_num_heads": HEADS // KV_HEADS},
    # MusicGen decoder: one codebook, so input_ids is a plain [batch, seq] sequence
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
}


def _config_fields(config_class) -> set[str]:
    try:
        names = {field.name for field in dataclasses.fields(config_class)}
    except TypeError:
        names = set()
    return names | set(getattr(config_class, "attribute_map", {}) or {})


def _sub_config_class(spec):
    """The concrete class of a ``sub_configs_defaults`` entry (``AutoConfig`` resolved by its default model type)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = getattr(spec, "config_class", spec)
    model_type = getattr(spec, "model_type", None)
    if config_class is AutoConfig:
        return CONFIG_MAPPING[model_type], model_type
    return config_class, getattr(config_class, "model_type", None)


def _field_type(config_class, name: str) -> str:
    try:
        for field in dataclasses.fields(config_class):
            if field.name == name:
                return str(field.type)
    except TypeError:
        pass
    return ""


def _is_property(config_class, name: str) -> bool:
    target = (getattr(config_class, "attribute_map", {}) or {}).get(name, name)
    return isinstance(getattr(config_class, target, None), property)


def _tiny_kwargs(config_class, sub: bool = False) -> dict[str, Any]:
    fields = {name for name in _config_fields(config_class) if not _is_property(config_class, name)}
    table = {**_ALIASES, **(_SUB_ALIASES if sub else {})}
    kwargs = {name: value for name, value in table.items() if name in fields}
    for name, value in _NO_SPECIAL_TOKENS.items():
        # no stop tokens; a field typed plain ``int`` (no None) keeps its default, generation_config drops it later
        if name in fields and ("None" in _field_type(config_class, name) or not _field_type(config_class, name)):
            kwargs[name] = value
    if "pad_token_id" in fields:  # keep a pad id, inside the vocabulary (RoBERTa-style position ids need one)
        kwargs["pad_token_id"] = 1
    if "kv_lora_rank" in fields:  # multi-head latent attention: as many KV heads as query heads
        kwargs["num_key_value_heads"] = HEADS
    if "use_sliding_window" in fields:  # Qwen-style switch: sliding on, first layer full, the second sliding
        kwargs["use_sliding_window"] = True
        if "max_window_layers" in fields:
            kwargs["max_window_layers"] = 1
    return kwargs


def _layer_kinds(values: Iterable[Any]) -> list[Any]:
    """Distinct values in order of first appearance."""
    kinds: list[Any] = []
    for value in values:
        if value not in kinds:
            kinds.append(value)
    return kinds


def tiny_config(model_type: str):
    """A tiny config for ``model_type``: width 64, 2 layers (or one per layer kind), 4 heads, vocabulary 128,
    sliding window 8, 512 positions, small expert counts, no bos/eos stop tokens; per-architecture overrides last.

    Mixed-layer models keep a small ``layer_types`` pattern that still holds every kind of their default pattern.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    kwargs = _tiny_kwargs(config_class)

    sub_specs = dict(getattr(config_class, "sub_configs_defaults", None) or {})
    for name, spec in sub_specs.items():
        try:
            sub_class, sub_type = _sub_config_class(spec)
        except Exception:  # noqa: BLE001 - leave that sub-config at its default
            continue
        sub_kwargs = dict(getattr(spec, "init_kwargs", None) or {})
        sub_kwargs.update(_tiny_kwargs(sub_class, sub=True))
        sub_kwargs.update(_layer_pattern(sub_class, sub_kwargs))
        sub_kwargs.update(_kv_sharing(sub_class, sub_kwargs))
        sub_kwargs = _canonical(sub_class, sub_kwargs)
        if sub_type is not None:
            sub_kwargs["model_type"] = sub_type
        kwargs[name] = sub_kwargs

    kwargs.update(_layer_pattern(config_class, kwargs))
    kwargs.update(_kv_sharing(config_class, kwargs))
    kwargs = _canonical(config_class, kwargs)
    override = _canonical(config_class, _OVERRIDES.get(model_type, {}))
    for name, value in override.items():
        if isinstance(value, dict) and isinstance(kwargs.get(name), dict):
            kwargs[name] = {**kwargs[name], **value}
        else:
            kwargs[name] = value
    kwargs = _without_drops(kwargs)
    return config_class(**kwargs)


def _canonical(config_class, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keys through the config's ``attribute_map`` (``n_embd`` -> ``hidden_size``...), so one value per field."""
    attribute_map = getattr(config_class, "attribute_map", {}) or {}
    return {attribute_map.get(name, name): value for name, value in kwargs.items()}


def _without_drops(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {name: (_without_drops(value) if isinstance(value, dict) else value)
            for name, value in kwargs.items() if value is not _DROP_LATER}


# Per-layer pattern fields: their default (full-size) list is shrunk to one entry per distinct kind.
_PATTERN_FIELDS = ("layer_types", "mlp_layer_types", "layers_block_type", "attn_type_list", "block_types",
                   "layers_block_types", "hybrid_override_pattern", "indexer_types")
_DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


def _layer_pattern(config_class, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Shrink the default per-layer patterns to the fewest layers that hold every kind (at least ``LAYERS``)."""
    fields = {name for name in _config_fields(config_class) if not _is_property(config_class, name)}
    pattern_fields = [name for name in _PATTERN_FIELDS if name in fields]
    if not pattern_fields:
        return {}
    try:
        # the default, full-size config shows the pattern (same sub-sizes, so no huge allocation: configs are data)
        default = config_class(**{k: v for k, v in kwargs.items() if k not in _DEPTH_FIELDS and k not in pattern_fields
                                  and not isinstance(v, dict)})
    except Exception:  # noqa: BLE001
        return {}
    patterns = {}
    for name in pattern_fields:
        value = getattr(default, name, None)
        if isinstance(value, (list, tuple)) and value:
            patterns[name] = list(value)
        elif isinstance(value, str) and value:
            patterns[name] = value
    if not patterns:
        return {}
    # the fewest leading layers whose every pattern holds all its kinds
    depth = LAYERS
    for value in patterns.values():
        kinds = _layer_kinds(value)  # a str pattern ("MMM*...") gives its distinct characters
        needed = max(value.index(kind) for kind in kinds) + 1  # leading layers that hold every kind
        if needed <= 2 * LAYERS:
            depth = max(depth, needed)
        else:  # the kinds appear late (e.g. one full layer every sixth): take one of each, in first-seen order
            depth = max(depth, len(kinds))
    result: dict[str, Any] = {}
    for name, value in patterns.items():
        if isinstance(value, str):
            kinds = "".join(_layer_kinds(value))
            head = value[:depth]
            result[name] = head if set(head) == set(value) else (kinds + kinds[-1] * depth)[:depth]
        else:
            head = value[:depth]
            if set(map(repr, head)) == set(map(repr, value)):
                result[name] = head
            else:
                kinds = _layer_kinds(value)
                result[name] = (kinds + [kinds[-1]] * depth)[:depth]
    for name in _DEPTH_FIELDS:
        if name in fields:
            result[name] = depth
    return result


def _kv_sharing(config_class, kwargs: dict[str, Any]) -> dict[str, Any]:
    """KV sharing as the published checkpoints that have it use it (Gemma 3n E2B/E4B: the last 10 or 15 of 30 or
    35 layers; Gemma 4 E2B/E4B: 20 of 35 and 18 of 42, with double-wide MLPs in them): the last layers compute
    no keys and values of their own but read those of the last earlier layer of their type. Tiny: one layer of
    each kind producing, then one of each kind reading (``num_kv_shared_layers`` = the number of kinds)."""
    fields = {name for name in _config_fields(config_class) if not _is_property(config_class, name)}
    if "num_kv_shared_layers" not in fields or "layer_types" not in fields:
        return {}
    kinds = _layer_kinds(kwargs.get("layer_types") or getattr(config_class(), "layer_types", None) or [])
    if not kinds:
        return {}
    result: dict[str, Any] = {"layer_types": kinds + kinds, "num_kv_shared_layers": len(kinds)}
    result.update({name: 2 * len(kinds) for name in _DEPTH_FIELDS if name in fields})
    if "use_double_wide_mlp" in fields:
        result["use_double_wide_mlp"] = True
    return result


def build_model(model_type: str, model_class, seed: int = 0, config=None):
    """The tiny model in fp32 eval mode, sdpa attention where the class supports it (else eager)."""
    config = config if config is not None else tiny_config(model_type)
    expected = getattr(model_class, "config_class", None)
    if isinstance(expected, type) and not isinstance(config, expected):
        # a composite (multimodal) config mapped to a text-only causal LM: build it from the text config
        config = config.get_text_config(decoder=True)
    attention = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    torch.manual_seed(seed)
    try:
        model = model_class._from_config(config, attn_implementation=attention, dtype=torch.float32)
    except (ValueError, ImportError) as error:
        if attention != "sdpa":
            raise
        torch.manual_seed(seed)
        model = model_class._from_config(config, attn_implementation="eager", dtype=torch.float32)
        del error
    model = model.float().eval()
    if hasattr(model, "set_default_language"):  # X-MOD: pick the adapter of one language
        languages = getattr(model.config, "languages", None) or []
        if languages:
            model.set_default_language(languages[0])
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        for name in ("eos_token_id", "bos_token_id", "forced_eos_token_id"):  # pad stays: it stops nothing
            if hasattr(generation_config, name):
                setattr(generation_config, name, None)
        for name in ("suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids", "bad_words_ids"):
            if getattr(generation_config, name, None) is not None:
                setattr(generation_config, name, None)
    return model


# ----------------------------------------------------------------------------------------------------------------
# 3. References
# ----------------------------------------------------------------------------------------------------------------


def _prompt_tensor(prompt) -> torch.LongTensor:
    if isinstance(prompt, torch.Tensor):
        return prompt.reshape(1, -1).long()
    return torch.tensor([list(prompt)], dtype=torch.long)


def _suppressed(model) -> list[int]:
    """The pad token, never generated in any reference or mode: a generated pad gets a position of its own in
    RoBERTa-style models (``create_position_ids_from_input_ids`` skips it), which would mix a second, unrelated
    difference into the position-offset one this sweep is after."""
    config = model.config.get_text_config(decoder=True)
    pad = getattr(config, "pad_token_id", None)
    vocab = getattr(config, "vocab_size", None)
    return [pad] if isinstance(pad, int) and vocab is not None and 0 <= pad < vocab else []


def _greedy_kwargs(n: int, model=None) -> dict[str, Any]:
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, eos_token_id=None,
                  temperature=None, top_k=None, top_p=None)
    if model is not None and _suppressed(model):
        kwargs["suppress_tokens"] = _suppressed(model)
    return kwargs


def plain_generate(model, prompt, n: int) -> list[int]:
    """``type(model).generate`` (so ``hf_specdec.enable`` patching cannot interfere), greedy, ``n`` new tokens."""
    ids = _prompt_tensor(prompt)
    with torch.no_grad():
        out = type(model).generate(model, ids, attention_mask=torch.ones_like(ids), **_greedy_kwargs(n, model))
    return out[0, ids.shape[1]:].tolist()


def no_cache_greedy(model, prompt, n: int) -> list[int]:
    """Full forward over the whole sequence each step, ``use_cache=False``, argmax of the last logit."""
    ids = _prompt_tensor(prompt)
    new: list[int] = []
    suppressed = _suppressed(model)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
            logits[suppressed] = float("-inf")
            token = int(logits.argmax())
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


def reference_greedy(model, prompt, n: int) -> tuple[list[int], list[int]]:
    """(plain ``generate`` tokens, no-cache greedy tokens): ``n`` new tokens each."""
    return plain_generate(model, prompt, n), no_cache_greedy(model, prompt, n)


def _references(model, prompt, n: int) -> tuple[list[int] | None, list[int], str | None]:
    """Like ``reference_greedy``, but a plain ``generate`` that raises (a transformers bug for that model) leaves
    the no-cache reference alone: ``(None, no_cache, error)``. A failing no-cache reference raises."""
    no_cache = no_cache_greedy(model, prompt, n)
    try:
        return plain_generate(model, prompt, n), no_cache, None
    except Exception as error:  # noqa: BLE001
        return None, no_cache, _short(error)


# ----------------------------------------------------------------------------------------------------------------
# 4. The sweep
# ----------------------------------------------------------------------------------------------------------------


class _ForwardCounter:
    """Counts forwards of the given top-level modules (forward pre-hooks)."""

    def __init__(self, *modules) -> None:
        self.count = 0
        self.handles = []
        for module in {id(m): m for m in modules if m is not None}.values():
            self.handles.append(module.register_forward_pre_hook(self._hook))

    def _hook(self, module, args):
        self.count += 1

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _TimeLimit(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise ``_TimeLimit`` in the block after ``seconds``. A timer already running (pytest-timeout's, say) keeps
    its deadline: if it comes first, its handler runs then; after the block it is re-armed with the time it has
    left (``signal.alarm(0)`` here used to cancel it)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return
    start = time.monotonic()
    previous_handler = signal.getsignal(signal.SIGALRM)
    previous_delay, previous_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_first = 0 < previous_delay <= seconds
    outer_fired = []

    def handler(signum, frame):
        if outer_first:  # the outer deadline: hand the signal to the handler that was there
            outer_fired.append(True)
            signal.signal(signal.SIGALRM, previous_handler)
            if callable(previous_handler):
                previous_handler(signum, frame)
            else:
                signal.raise_signal(signal.SIGALRM)
            return
        raise _TimeLimit(f"over the {seconds}s limit for one architecture")

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, previous_delay if outer_first else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0 and not outer_fired:
            left = previous_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), previous_interval)


def _short(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(error: BaseException) -> str:
    """The innermost hf_specdec frame and the innermost frame overall, for a crash's location."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "hf_specdec" in f.filename and "arch_sweep" not in f.filename]
    parts = []
    if ours:
        f = ours[-1]
        parts.append(f"{f.filename.split('hf_specdec/')[-1]}:{f.lineno} {f.name}")
    if frames:
        f = frames[-1]
        parts.append(f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}")
    return " <- ".join(reversed(parts))


def run_mode(mode: str, target, draft, prompt, n: int, spec_config=SPEC_CONFIG, lookahead_config=LOOKAHEAD_CONFIG):
    """One hf_specdec generation through the public API; returns the new tokens."""
    import hf_specdec
    from hf_specdec.drafters.early_exit import EarlyExit

    ids = _prompt_tensor(prompt)
    kwargs = _greedy_kwargs(n, target)
    if mode.startswith("speculative") and spec_config is not None:
        kwargs["spec_config"] = dict(spec_config)
    if mode == "lookahead" and lookahead_config is not None:
        kwargs["lookahead_config"] = dict(lookahead_config)
    with torch.no_grad():
        if mode == "speculative_self":
            out = type(target).generate(target, ids, attention_mask=torch.ones_like(ids),
                                        custom_generate=hf_specdec.speculative_generate, draft_model=target, **kwargs)
        elif mode == "speculative_random":
            out = type(target).generate(target, ids, attention_mask=torch.ones_like(ids),
                                        custom_generate=hf_specdec.speculative_generate, draft_model=draft, **kwargs)
        elif mode == "early_exit":  # not in MODES: run it with --modes early_exit
            out = type(target).generate(target, ids, attention_mask=torch.ones_like(ids),
                                        custom_generate=hf_specdec.speculative_generate,
                                        draft_model=EarlyExit(1), **kwargs)
        elif mode == "lookahead":
            out = type(target).generate(target, ids, attention_mask=torch.ones_like(ids),
                                        custom_generate=hf_specdec.lookahead_generate, lookahead_memory=None,
                                        **kwargs)
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return out[0, ids.shape[1]:].tolist()


def classify(tokens: list[int], plain: list[int] | None, no_cache: list[int]) -> str:
    """exact: equal to plain generate, or to the no-cache reference where plain generate disagrees with it (or
    failed: ``plain`` None)."""
    if tokens == plain or (plain != no_cache and tokens == no_cache):
        return "exact"
    return "mismatch"


def _sweep_one(model_type, config_class, model_class, modes, prompt, n, spec_config=SPEC_CONFIG,
               lookahead_config=LOOKAHEAD_CONFIG) -> list[dict[str, Any]]:
    base = {"arch": model_type, "model_class": getattr(model_class, "__name__", str(model_class))}
    start = time.perf_counter()
    # build
    try:
        if isinstance(config_class, BaseException):
            raise config_class
        if isinstance(model_class, BaseException):
            raise model_class
        config = tiny_config(model_type)
        target = build_model(model_type, model_class, seed=0, config=config)
        draft = build_model(model_type, model_class, seed=1, config=config) if "speculative_random" in modes else None
    except BaseException as error:  # noqa: BLE001
        if isinstance(error, KeyboardInterrupt):
            raise
        return [{**base, "mode": mode, "status": "unbuildable", "error": _short(error), "where": _where(error),
                 "seconds": round(time.perf_counter() - start, 3)} for mode in modes]
    base["params"] = sum(p.numel() for p in target.parameters())
    base["attn"] = getattr(target.config, "_attn_implementation", None)
    base["cache_layers"] = _cache_layer_kinds(target)
    base["trie"] = _reads_tries(target)
    # references
    try:
        plain, no_cache, plain_error = _references(target, prompt, n)
    except BaseException as error:  # noqa: BLE001
        if isinstance(error, KeyboardInterrupt):
            raise
        return [{**base, "mode": mode, "status": "no_reference", "error": _short(error), "where": _where(error),
                 "seconds": round(time.perf_counter() - start, 3)} for mode in modes]
    base["plain_equals_no_cache"] = plain == no_cache
    if plain_error is not None:
        base["plain_error"] = plain_error
    base["distinct_tokens"] = len(set(no_cache))  # 1-2: a degenerate reference that can hide errors
    rows = []
    for mode in modes:
        counter = _ForwardCounter(target, draft)
        mode_start = time.perf_counter()
        row = {**base, "mode": mode}
        try:
            target.__dict__.pop("last_spec_stats", None)
            tokens = run_mode(mode, target, draft, prompt, n, spec_config, lookahead_config)
            row["status"] = classify(tokens, plain, no_cache)
            stats = getattr(target, "last_spec_stats", None)
            stats = stats.get() if hasattr(stats, "get") else stats  # per thread since LastSpecStats
            if stats is not None:  # how much the mode was exercised: draft tokens judged and accepted
                row["drafted"], row["accepted"] = int(stats.drafted), int(stats.accepted)
            if row["status"] == "mismatch":
                row["tokens"], row["plain"], row["no_cache"] = tokens, plain, no_cache
                ref = plain if plain is not None else no_cache
                row["first_diff"] = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b),
                                         min(len(tokens), len(ref)))
        except BaseException as error:  # noqa: BLE001
            if isinstance(error, KeyboardInterrupt):
                raise
            refused = isinstance(error, ValueError) and counter.count == 0
            row["status"] = "refused" if refused else "crash"
            row["error"], row["where"] = _short(error), _where(error)
            if row["status"] == "crash" and base.get("plain_error") == row["error"]:
                row["status"] = "plain_fails"  # transformers' own generate fails the same way, before hf_specdec runs
            if isinstance(error, _TimeLimit):
                counter.close()
                rows.append({**row, "forwards": counter.count, "seconds": round(time.perf_counter() - mode_start, 3)})
                raise
        finally:
            counter.close()
        row["forwards"] = counter.count
        row["seconds"] = round(time.perf_counter() - mode_start, 3)
        rows.append(row)
    return rows


def _reads_tries(model) -> bool | None:
    """Does lookahead verify a trie of guesses (and a Jacobi window) in one forward of this model, or one chain a
    round (``support.tree_refusal``)? None where that cannot be told."""
    try:
        from hf_specdec.support import tree_refusal

        return tree_refusal(model) is None
    except Exception:  # noqa: BLE001 - reported as unknown, the modes' rows say what failed
        return None


def _cache_layer_kinds(model) -> str | None:
    """The layer classes a ``DynamicCache(config=model.config)`` gets, compressed ("DynamicLayer x2, ...")."""
    try:
        from transformers import DynamicCache

        layers = DynamicCache(config=model.config).layers
    except Exception as error:  # noqa: BLE001
        return f"error: {_short(error, 80)}"
    if not layers:
        return "lazy DynamicLayer"
    names = [type(layer).__name__ for layer in layers]
    return ", ".join(f"{name} x{names.count(name)}" for name in _layer_kinds(names))


def run_sweep(architectures: Iterable[str] | None = None, modes: Iterable[str] = MODES, prompt=PROMPT,
              n: int = NEW_TOKENS, time_limit_s: int = ARCH_TIME_LIMIT_S, progress=None,
              spec_config=SPEC_CONFIG, lookahead_config=LOOKAHEAD_CONFIG) -> list[dict[str, Any]]:
    """Rows ``{arch, mode, status, ...}`` for every architecture (all of them when ``architectures`` is None).

    ``spec_config`` / ``lookahead_config``: what the speculative / lookahead modes pass (None: hf_specdec's
    defaults). ``progress(model_type, rows, seconds)`` is called after each architecture.
    """
    modes = tuple(modes)
    known = {model_type: (config_class, model_class)
             for model_type, config_class, model_class in causal_lm_architectures()}
    wanted = list(known) if architectures is None else list(architectures)
    rows: list[dict[str, Any]] = []
    for model_type in wanted:
        if model_type not in known:
            rows.extend({"arch": model_type, "mode": mode, "status": "unbuildable",
                         "error": "not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"} for mode in modes)
            continue
        config_class, model_class = known[model_type]
        arch_start = time.perf_counter()
        done: list[dict[str, Any]] = []
        try:
            with _time_limit(time_limit_s):
                done = _sweep_one(model_type, config_class, model_class, modes, prompt, n, spec_config,
                                  lookahead_config)
        except _TimeLimit as error:
            seen = {row["mode"] for row in done}
            done += [{"arch": model_type, "mode": mode, "status": "crash", "error": _short(error)}
                     for mode in modes if mode not in seen]
        rows.extend(done)
        if progress is not None:
            progress(model_type, done, time.perf_counter() - arch_start)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]], modes: Iterable[str] = MODES) -> str:
    modes = tuple(modes)
    by_arch: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_arch.setdefault(row["arch"], {})[row["mode"]] = row
    width = max([len(a) for a in by_arch] + [4])
    lines = [f"{'arch':<{width}}  " + "  ".join(f"{m:<18}" for m in modes) + "  plain==no_cache  note"]
    for arch, cells in by_arch.items():
        statuses = [cells.get(m, {}).get("status", "-") for m in modes]
        any_row = next(iter(cells.values()))
        same = any_row.get("plain_equals_no_cache")
        notes = sorted({c.get("error", "")[:110] for c in cells.values() if c.get("error")})
        lines.append(f"{arch:<{width}}  " + "  ".join(f"{s:<18}" for s in statuses)
                     + f"  {'' if same is None else same!s:<15}  " + " | ".join(notes))
    return "\n".join(lines)


def counts(rows: list[dict[str, Any]], modes: Iterable[str] = MODES) -> dict[str, dict[str, int]]:
    result: dict[str, dict[str, int]] = {}
    for mode in modes:
        result[mode] = {}
        for row in rows:
            if row["mode"] == mode:
                result[mode][row["status"]] = result[mode].get(row["status"], 0) + 1
    return result


STATUS_WORDS = {"exact": "exact", "refused": "refused", "plain_fails": "plain generate fails too",
                "unbuildable": "tiny model not buildable", "no_reference": "not runnable alone",
                "crash": "CRASH", "mismatch": "MISMATCH"}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], modes: Iterable[str] = MODES) -> str:
    """docs/architectures.md: one row per architecture, each mode's outcome, and the reason of every refusal."""
    modes = tuple(modes)
    by_arch: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_arch.setdefault(row["arch"], {})[row["mode"]] = row
    count = counts(rows, modes)
    lines = [
        "# Architectures: exact, or refused up front",
        "",
        "Generated by `python tests/arch_sweep.py OUT.json --markdown docs/architectures.md` (the same sweep "
        "`tests/test_architectures.py` runs in CI): every causal-LM class transformers "
        f"{meta['transformers']} ships, as a tiny random fp32 model laid out as its published checkpoints are (width "
        "64, 2 layers or one per layer kind; where checkpoints share keys and values between layers, as Gemma 3n's "
        "and Gemma 4's do, one producing and one reading layer per kind; "
        f"sliding window {SLIDING_WINDOW}, so the {len(PROMPT)}-token prompt and {NEW_TOKENS} new tokens run past "
        "it), decoded greedily by hf_specdec and compared token for token with plain `generate` (or, where plain "
        "`generate` disagrees with a full forward from scratch at every step, with that reference). Speculative: "
        "fixed 4 draft tokens a round, the target as its own draft and a random draft of the same architecture; "
        "lookahead: window 4, 3-grams, 4 candidates. Real checkpoints of these families behave the same way; "
        "only their sizes differ.",
        "",
        "Totals: " + "; ".join(f"{mode}: " + ", ".join(f"{n} {STATUS_WORDS.get(k, k)}" for k, n in
                                                         sorted(c.items())) for mode, c in count.items()) + ".",
        "",
        _trie_line(rows),
        "",
        "| architecture | " + " | ".join(modes) + " | why refused |",
        "|---|" + "---|" * len(modes) + "---|",
    ]
    for arch in sorted(by_arch):
        cells = by_arch[arch]
        statuses = [STATUS_WORDS.get(cells.get(m, {}).get("status", "-"), "-") for m in modes]
        statuses = [f"{word} (chains)" if m == "lookahead" and word == "exact" and cells[m].get("trie") is False
                    else word for m, word in zip(modes, statuses)]
        reasons = sorted({c["error"] for c in cells.values() if c.get("error") and c["status"] != "exact"})
        reason = " / ".join(r.replace("|", "/").removeprefix("ValueError: ").removeprefix("Unsupported: ") for r in reasons)
        lines.append(f"| {arch} | " + " | ".join(statuses) + f" | {reason} |")
    return "\n".join(lines) + "\n"


def _trie_line(rows: list[dict[str, Any]]) -> str:
    """How many of lookahead's exact architectures read a trie of guesses in one forward, and how many chains."""
    exact = [r for r in rows if r["mode"] == "lookahead" and r["status"] == "exact"]
    chains = sum(r.get("trie") is False for r in exact)
    return (f"Lookahead reads a trie of guesses and a Jacobi window in one forward on {len(exact) - chains} of its "
            f"{len(exact)} exact architectures; the other {chains} (\"exact (chains)\": no `position_ids` in their "
            "forward, an attention mask or bias of their own, layer types whose masks hf_specdec does not build, or "
            "cache layers that keep one state per row: `support.tree_refusal`) verify the best path of its "
            "candidates, one chain a round, with no Jacobi window (docs/lookahead.md, \"Chains only\").")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json_path", help="where to write the rows as JSON")
    parser.add_argument("--arch", default=None, help="comma-separated model types (default: all)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=int, default=ARCH_TIME_LIMIT_S)
    parser.add_argument("--auto", action="store_true", help="hf_specdec's default (adaptive) configs, not fixed ones")
    parser.add_argument("--markdown", default=None, help="also write the table of docs/architectures.md here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass

    modes = tuple(m for m in args.modes.split(",") if m)
    archs = None if args.arch is None else [a for a in args.arch.split(",") if a]

    def progress(model_type, rows, seconds):
        statuses = " ".join(f"{r['mode']}={r['status']}" for r in rows)
        print(f"[{seconds:6.1f}s] {model_type}: {statuses}", file=sys.stderr, flush=True)

    start = time.perf_counter()
    configs = {"spec_config": None, "lookahead_config": None} if args.auto else {}
    rows = run_sweep(archs, modes, time_limit_s=args.time_limit, progress=progress, **configs)
    elapsed = time.perf_counter() - start
    print(table(rows, modes))
    print()
    print(json.dumps(counts(rows, modes), indent=1))
    unbuildable = sorted({r["arch"] for r in rows if r["status"] == "unbuildable"})
    print(f"unbuildable ({len(unbuildable)}): {', '.join(unbuildable)}")
    print(f"sweep took {elapsed:.1f}s for {len({r['arch'] for r in rows})} architectures")
    import hf_specdec
    import transformers

    meta = {"seconds": round(elapsed, 1), "modes": modes, "hf_specdec": hf_specdec.__file__,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "spec_config": None if args.auto else SPEC_CONFIG, "lookahead_config": None if args.auto else LOOKAHEAD_CONFIG}
    print(f"hf_specdec from {hf_specdec.__file__}")
    with open(args.json_path, "w") as handle:
        json.dump({**meta, "counts": counts(rows, modes), "rows": rows}, handle, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(markdown(rows, meta, modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
