"""Shared fixtures: tiny randomly initialised models built from configs, and an offline tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, **overrides):
    """A 2-layer fp32 model with random weights; same seed, same weights."""
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             eos_token_id=None, bos_token_id=None, pad_token_id=None, **overrides)
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             eos_token_id=None, bos_token_id=None, pad_token_id=None, **overrides)
        model = Qwen2ForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                            eos_token_id=None, bos_token_id=None, pad_token_id=None, **overrides)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def perturbed_copy(model, scale: float, seed: int = 123):
    """A draft that mostly agrees with ``model``: its weights plus noise (partial acceptance)."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return draft


def char_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """Offline tokenizer whose tokens are single distinct characters (so stop strings map to tokens exactly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    import string

    chars = list(string.ascii_letters + string.digits + string.punctuation)  # 94 distinct characters
    chars += [chr(0x4E00 + i) for i in range(vocab - len(chars))]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="session")
def target():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="session")
def random_draft():
    return tiny_model("llama", seed=1)


@pytest.fixture(scope="session")
def close_draft(target):
    return perturbed_copy(target, scale=0.02)


@pytest.fixture
def prompt():
    return torch.tensor([[5, 17, 42, 8, 23, 61, 2, 9]])
