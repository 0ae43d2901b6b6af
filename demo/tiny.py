"""A tiny, fully offline model pair for `python demo/app.py --tiny` and the demo tests.

Nothing is downloaded. The tokenizer is a small BPE trained in a fraction of a second on a few lines of Python
with the `tokenizers` library (so tokens read like code fragments, not byte soup). The target is a randomly
initialised 2-layer Llama; the draft is a copy of it with a little Gaussian noise on every weight, so the draft
agrees with the target often but not always. That is exactly what the demo needs to show: some rounds accept
several draft tokens, some accept none. The text itself is gibberish: the weights are random.
"""

from __future__ import annotations

import copy
import string

import torch

TINY_VOCAB_SIZE = 384
TINY_SEED = 0
TINY_DRAFT_NOISE = 0.2  # noise std / each weight tensor's std: the draft is right often, not always (~30% accepted)

_CORPUS = '''
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b

def is_palindrome(text: str) -> bool:
    cleaned = [c.lower() for c in text if c.isalnum()]
    return cleaned == cleaned[::-1]

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

def binary_search(values: list[int], target: int) -> int:
    lo, hi = 0, len(values) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if values[mid] == target:
            return mid
        if values[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1

import json
with open("data.json") as f:
    data = json.load(f)
print(sorted(data, key=lambda row: row["name"]))
Write a Python function that reverses a linked list. Explain the time complexity.
'''


def build_tiny_tokenizer():
    """A PreTrainedTokenizerFast (BPE, Metaspace pre-tokenizer) trained offline on a few lines of code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=list(string.ascii_letters + string.digits + " \n()[]{}:;,.=+-*/<>_'\"#!?%&|\\^~`@$"),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def build_tiny_pair(seed: int = TINY_SEED, draft_noise: float = TINY_DRAFT_NOISE):
    """Return ``(target, draft, tokenizer)``: random tiny Llama target, a noisy copy as draft, the offline tokenizer.

    The end-of-sequence token is not used as a stop (``eos_token_id=None``), so every run fills max_new_tokens
    whatever the random weights prefer.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    target = LlamaForCausalLM(config).eval()
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in draft.parameters():
            std = float(param.std()) if param.numel() > 1 else 0.0
            if std > 0:
                param.add_(torch.randn(param.shape, generator=generator) * std * draft_noise)
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = None
    return target, draft, tokenizer
