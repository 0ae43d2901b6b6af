"""Offline fixtures for tests: tiny random models with word-level tokenizers, and fake bundle wheels.

Nothing here touches the network; everything is built from a config in a few hundred milliseconds.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from .bundles import Bundle

WORDS = ("def return if else for in while import class self print None True False and or not the a of to "
         "is n x y i list int str dict value result key sort merge prime stack json path open").split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def tiny_tokenizer(words=WORDS, permute: bool = False):
    """A word-level fast tokenizer; ``permute`` reverses the ids of the ordinary words (a different map)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(words))
    if permute:
        words = words[::-1]
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def tiny_model_dir(path, *, vocab_size: int | None = None, tokenizer=None, seed: int = 0, layers: int = 2,
                   hidden: int = 32) -> Path:
    """Save a tiny random Llama model and its tokenizer to ``path``; ``vocab_size`` above the tokenizer's size
    adds padding rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or tiny_tokenizer()
    size = len(tokenizer.get_vocab())
    config = LlamaConfig(
        vocab_size=vocab_size or size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def fake_bundle(tmp_dir, name: str = "fake-model", parts: int = 3, chunk_bytes: int = 1000,
                member: str | None = None) -> tuple[Bundle, dict[str, bytes], Path]:
    """A fake multi-part bundle: returns (bundle, {package: wheel bytes written}, wheel dir).

    Each wheel is a zip holding ``<module>/data/partNN.bin`` (or ``member`` for single-file bundles), like the
    real ones.
    """
    tmp_dir = Path(tmp_dir)
    wheel_dir = tmp_dir / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    payload = bytes((i * 7 + 3) % 251 for i in range(parts * chunk_bytes))
    packages = tuple((f"{name}-part{i}", "0.1.0") for i in range(1, parts + 1))
    for i, (pkg, ver) in enumerate(packages):
        module = pkg.replace("-", "_")
        with zipfile.ZipFile(wheel_dir / f"{module}-{ver}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{module}/__init__.py", "")
            zf.writestr(member or f"{module}/data/part{i + 1:02d}.bin", payload[i * chunk_bytes:(i + 1) * chunk_bytes])
            zf.writestr(f"{module}-{ver}.dist-info/METADATA", f"Name: {pkg}\nVersion: {ver}\n")
    bundle = Bundle(name=name, packages=packages, size=len(payload), sha256=hashlib.sha256(payload).hexdigest(),
                    description="fake bundle for tests", hub_id=f"test/{name}", member=member)
    return bundle, payload, wheel_dir
