"""What hf_specdec can run exactly, decided before the first forward: exact, or refused with the reason.

Every rule below is checked by the architecture sweep (tests/test_architectures.py: a tiny random model of every
causal LM transformers ships, each mode against plain ``generate``), and docs/architectures.md is its table.

Verifying a chain of guesses (speculative decoding; lookahead's chain rounds) needs a cache it can roll back: a
``DynamicCache`` whose layers hold one key/value column per token (full or sliding-window attention), or a
``StaticCache`` (``cache_implementation="static"``) whose window, if any, spans it; the model's own causal mask
and positions continue the cache. Reading a trie of guesses and a Jacobi window in one forward
needs, besides, explicit position ids and a 4-D attention mask the model takes as given (``tree_refusal``): where a
model lacks them, lookahead verifies one chain a round instead (docs/lookahead.md), and a draft model's tree
rounds fall back to chains.
"""

from __future__ import annotations

import inspect

from transformers import DynamicCache, GenerationMixin
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

from .backends import backend_named
from .errors import Unsupported  # noqa: F401  (raised here; importers find it here too)
from .encoder_decoder import argument, forward_params, is_encoder_decoder, positions_are_distances

# layer types whose masks a trie forward gives (``KVStore._layer_masks``): an indexed (DSA) layer takes the full
# causal mask, holes hidden from its indexer as from its attention
TREE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "indexed_attention"})
# Architectures whose multi-token forwards over a cache do not match their own one-token decoding (found by the
# sweep; the reason is what the sweep showed). Plain generate() runs them as before.
INEXACT = {
    "cpmant": "its position bias is built for the new tokens only, so a forward over several new tokens on a "
              "cache fails",
    "xlm": "its cached attention mask is built from the new tokens' length, so several new tokens on a cache fail",
    "prophetnet": "it requires position ids 1..n over the whole key length, which a forward over new tokens on a "
                  "cache cannot give",
    "moshi": "its forward over several new tokens differs from its one-token steps (plain generate already "
             "disagrees with a full forward), so tokens verified together are not the ones it would decode",
    "blt": "its forward over several new tokens differs from its one-token steps (a token's byte-group hash "
           "embedding reads the tokens before it in the same forward, zeros in a one-token step, and its global "
           "transformer keeps no cache), so tokens verified together are not the ones it would decode",
    # recurrent models whose layers do not record a state per input (transformers' recurrent_states_to_keep)
    "recurrent_gemma": "it keeps its recurrent and conv states in its own modules, outside the cache, so they "
                       "cannot be rolled back to an accepted guess",
    "zamba": "its Mamba layers record only the last state of a forward over several tokens, so a rejected guess "
             "cannot be rolled back",
    "zaya": "its recurrent state (the last token's delayed values) is recorded only after a whole forward, so a "
            "rejected guess cannot be rolled back",
}


# Classes whose own generate() prepares its inputs and then hands the call, its keyword arguments included
# (custom_generate, the draft model, the memories), to ``GenerationMixin.generate``: hf_specdec runs inside it. Each
# entry says why a call cannot run so, from the model and the call's main input (None: every call can). Whisper's
# hands over a short-form call (one window of audio) whole, and a long-form one (more frames than one window, or
# ``return_timestamps=True``) window by window: each window's call, its decoder prompt the previous windows' text
# (``condition_on_prev_tokens``) and its temperature-fallback reruns, is one hf_specdec call decoding exactly as
# plain's, scores included (tests/test_whisper_long_form.py), so nothing is refused.
ROUTED_GENERATE = {inspect.unwrap(WhisperGenerationMixin.generate): None}


def _generate_of(model):
    """The generate() ``model``'s class defines, through any wrapper that names what it wraps (``__wrapped__``, as
    ``functools.wraps`` sets it)."""
    return inspect.unwrap(type(model).generate)


def check_own_generate(model, inputs) -> None:
    """Raise ``Unsupported`` where ``model``'s class has its own generate() (``ROUTED_GENERATE``) and it would not
    hand this call (main input ``inputs``) to ``GenerationMixin.generate`` with its keyword arguments."""
    check = ROUTED_GENERATE.get(_generate_of(model))
    reason = None if check is None else check(model, inputs)
    if reason is not None:
        raise Unsupported(f"hf_specdec cannot run {type(model).__name__} on this input: {reason}.")


def check_cache_implementation(model, kwargs: dict) -> None:
    """Raise ``Unsupported`` before generate() runs anything (an encoder-decoder's encoder included) where the call's
    ``cache_implementation`` asks for a static cache hf_specdec cannot speculate on: an encoder-decoder's, whose
    cross-attention cache generate() makes static too. A decoder-only model's static cache runs in its own buffers
    (``backends.Buffers``; ``cache.check_cache_supported`` refuses one it cannot roll back, also before any
    forward)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    if implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS and is_encoder_decoder(model):
        raise Unsupported(f"hf_specdec cannot run {type(model).__name__} with cache_implementation="
                          f"{implementation!r}: an encoder-decoder's static caches are not supported. Use the default "
                          "dynamic cache (no cache_implementation), or plain generate().")


def takes(model, name: str) -> bool:
    """Does ``model``'s forward take the loop's argument ``name`` (an encoder-decoder's decoder's: ``decoder_*``)?"""
    return argument(model, name) in forward_params(type(model))


def _embeds_positions(model) -> bool:
    """Does the model add a position embedding of its own (transformers names it ``embed_positions``: MBart,
    Marian, TrOCR decoders), which, without position ids, it indexes by cache column? (An ALiBi model such as
    bloom takes no position ids either, but derives its bias from the attention mask.)"""
    return any(name.rsplit(".", 1)[-1] == "embed_positions" for name, _ in model.named_modules())


def cache_layer_kinds(model) -> tuple[str, ...] | None:
    """The layer classes of the ``DynamicCache`` ``generate`` would make for this model (empty: made lazily);
    None when one cannot be made from its config (the model builds its cache its own way)."""
    try:
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError):
        return None
    return tuple(type(layer).__name__ for layer in cache.layers)


def check_supported(model, mode: str, rows: int = 1, role: str = "target") -> None:
    """Raise ``Unsupported`` unless hf_specdec runs ``model`` exactly in ``mode`` ("speculative" or
    "lookahead"), for a batch of ``rows``; ``role``: "target" or "draft" (the wording of the message). Both modes
    need what verifying a chain needs; lookahead on a model that cannot read a trie (``tree_refusal``) runs chains."""
    name = f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"
    alternative = "plain generate()" if mode == "speculative" else "decoding='speculative' with a draft model, or plain generate()"

    def refuse(reason: str) -> None:
        what = "as a draft model" if role == "draft" else f"with decoding='{mode}'"
        raise Unsupported(f"hf_specdec cannot run {name} {what}: {reason}. Use {alternative} for this model.")

    own = _generate_of(model)
    if own is not inspect.unwrap(GenerationMixin.generate) and own not in ROUTED_GENERATE:
        refuse("its class has its own generate() (multi-stream or multimodal decoding), which hf_specdec would bypass")
    if hasattr(type(model), "_supports_default_dynamic_cache") and not type(model)._supports_default_dynamic_cache():
        refuse("it keeps a cache or recurrent state of its own, which cannot roll back rejected guesses")
    params = forward_params(type(model))
    if "past_key_values" not in params and "cache" not in params:
        refuse("it keeps no key/value cache, so guesses cannot be verified on top of the tokens already read")
    model_type = getattr(model.config, "model_type", None)
    if model_type in INEXACT:
        refuse(INEXACT[model_type])
    layer_kinds = cache_layer_kinds(model)
    if layer_kinds is None:
        refuse("its cache is not one generate() builds from its config (a model-specific layout), so hf_specdec "
               "cannot make one it can roll back")
    kinds = set(layer_kinds)
    missing = sorted(kind for kind in kinds if backend_named(kind) is None)
    if missing:
        recurrent = any("Linear" in kind or "Mamba" in kind for kind in missing)
        reason = ("its recurrent (state-space / linear-attention) state cannot be rolled back to the accepted guess"
                  if recurrent else f"its cache layers ({', '.join(missing)}) cannot be rolled back exactly")
        refuse(reason)
    if rows > 1 and not takes(model, "position_ids") and (
            _embeds_positions(model) or (model.config.is_encoder_decoder and not positions_are_distances(model))):
        # (an encoder-decoder's decoder without decoder_position_ids: learned positions by column, BART/Marian; a
        # relative bias by column distance, T5, runs: the store keeps each row's distances, KVStore._alignment)
        refuse(f"it takes no position ids, so a token's position is its cache column (as in plain generate), and the "
               f"{rows} rows of a batch advance by different numbers of tokens per round, which would put a row's "
               "later tokens at other columns than plain's (one prompt at a time works)")
    apart = next((backend_named(kind).rows_apart for kind in sorted(kinds) if backend_named(kind).rows_apart), None)
    if rows > 1 and apart:
        refuse(f"{apart}, and the {rows} rows of a batch advance by different numbers of tokens (one prompt at a "
               "time works)")


def tree_refusal(model) -> str | None:
    """Why ``model`` cannot read a trie of guesses (and a Jacobi window) in one forward, or None when it can: a trie
    needs explicit position ids (its branches sit at their own positions) and a 4-D attention mask the model takes
    as given. A model ``check_supported`` accepts verifies chains either way.

    >>> from hf_specdec.models.tiny import tiny_model
    >>> tree_refusal(tiny_model("llama", seed=0)) is None
    True
    """
    # one state per row: the first reason, as no mask or position ids would help (recurrent layers)
    straight = sorted(kind for kind in set(cache_layer_kinds(model) or ())
                      if backend_named(kind) is not None and not backend_named(kind).branches)
    if straight:
        return f"its cache layers ({', '.join(straight)}) keep one state per row, which cannot follow several branches"
    if not takes(model, "position_ids"):
        return ("it derives positions from the cache length, so the branches of a trie cannot sit at their own "
                "positions")
    if not getattr(type(model), "_supports_attention_backend", False):
        return ("it builds its own attention mask or bias (ALiBi, local attention, learned offsets), so a 4-D tree "
                "mask cannot be given to it")
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
    other = sorted(set(layer_types) - TREE_LAYER_TYPES)
    if other:
        return f"its layers of type {', '.join(other)} take masks hf_specdec does not build"
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    if attention not in ("sdpa", "eager"):
        return (f"attn_implementation={attention!r} cannot take a custom 4-D attention mask (load the model with "
                "attn_implementation='sdpa' or 'eager')")
    return None
