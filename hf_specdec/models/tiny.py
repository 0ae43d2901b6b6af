"""Tiny random models and offline tokenizers: the one place tests, the eval smoke run and the demo get them.

Nothing here touches the network; everything is built from a config in well under a second.

- ``tiny_model(arch, seed, vocab, **overrides)``: a 2-layer fp32 Llama / Qwen2 / GPT-2 with random weights;
  same arguments, same weights (many tests depend on the exact random models). ``perturbed_copy`` makes a draft
  that mostly agrees with it; ``char_tokenizer`` maps single characters to ids (stop strings map to tokens
  exactly).
- ``code_tokenizer()``: a BPE trained on ``tiny_corpus.txt`` (a page of Python that ships with the package),
  ChatML chat template; ``tiny_pair()``: a target built on it and a noisy copy as draft, the pair of
  ``hf-specdec demo --tiny``; ``save_tiny_pair(root)``: the same pair as two ``save_pretrained`` directories,
  for the eval smoke run (``python -m hf_specdec.models.tiny /tmp/tiny``).
- ``word_tokenizer``, ``tiny_model_dir``, ``fake_bundle``: fixtures of the ``models`` tests (a saved model
  directory, a fake multi-part bundle of wheels).
"""

from __future__ import annotations

import copy
import hashlib
import string
import sys
import zipfile
from importlib import resources
from pathlib import Path

import torch

from .bundles import Bundle

VOCAB = 96
CODE_VOCAB = 384
DRAFT_NOISE = 0.2  # noise std / each weight tensor's std: the draft is right often, not always (~30% accepted)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ("def return if else for in while import class self print None True False and or not the a of to "
         "is n x y i list int str dict value result key sort merge prime stack json path open").split()
WORD_SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")


# -- random models ----------------------------------------------------------------------------------------------
def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, **overrides):
    """A 2-layer fp32 model with random weights; same seed, same weights. ``overrides`` go to the config."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    no_special = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if arch in ("llama", "qwen2"):
        config_class, model_class = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config,
                                                                                             Qwen2ForCausalLM)
        settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **no_special)
        model = model_class(config_class(**{**settings, **overrides}))
    elif arch == "gpt2":
        settings = dict(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=512, **no_special)
        model = GPT2LMHeadModel(GPT2Config(**{**settings, **overrides}))
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def perturbed_copy(model, scale: float, seed: int = 123, relative: bool = False):
    """A draft that mostly agrees with ``model``: its weights plus Gaussian noise of std ``scale`` (partial
    acceptance), or, with ``relative``, ``scale`` times each weight tensor's own std."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            std = scale
            if relative:
                std = scale * float(parameter.std()) if parameter.numel() > 1 else 0.0
            parameter.add_(torch.randn(parameter.shape, generator=generator) * std)
    return draft


# -- tokenizers -------------------------------------------------------------------------------------------------
def char_tokenizer(vocab: int = VOCAB):
    """Offline tokenizer whose tokens are single distinct characters (so stop strings map to tokens exactly)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation)  # 94 distinct characters
    chars += [chr(0x4E00 + i) for i in range(vocab - len(chars))]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def word_tokenizer(words=WORDS, permute: bool = False):
    """A word-level fast tokenizer; ``permute`` reverses the ids of the ordinary words (a different map)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(words))
    if permute:
        words = words[::-1]
    vocab = {t: i for i, t in enumerate([*WORD_SPECIALS, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def code_corpus() -> str:
    """The page of Python (and a few instructions) the code tokenizer is trained on; it ships with the package."""
    return resources.files(__package__).joinpath("tiny_corpus.txt").read_text(encoding="utf-8")


def code_tokenizer(vocab_size: int = CODE_VOCAB):
    """A BPE (Metaspace pre-tokenizer, ASCII alphabet) trained offline on :func:`code_corpus`, so tokens read
    like code fragments; ChatML chat template, ``<|im_end|>`` ends a turn, ``<|endoftext|>`` pads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation + " \n"),
        show_progress=False,
    )
    backend.train_from_iterator(code_corpus().split("\n\n"), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    return tokenizer


# -- the demo's and the eval smoke run's pair ----------------------------------------------------------------------
def tiny_pair(seed: int = 0, draft_noise: float = DRAFT_NOISE, stop_at_eos: bool = False):
    """``(target, draft, tokenizer)``: a random 2-layer Llama on :func:`code_tokenizer`, and as draft a copy of it
    with relative noise ``draft_noise``, so some rounds accept several draft tokens and some none.

    ``stop_at_eos=False`` (the demo) sets no end-of-sequence token, so every run fills max_new_tokens whatever
    the random weights prefer; ``True`` stops at ``<|im_end|>`` like a chat model.
    """
    tokenizer = code_tokenizer()
    target = tiny_model("llama", seed=seed, vocab=len(tokenizer), max_position_embeddings=2048,
                        pad_token_id=tokenizer.pad_token_id)
    draft = perturbed_copy(target, draft_noise, seed=seed + 1, relative=True)
    eos = tokenizer.eos_token_id if stop_at_eos else None
    for model in (target, draft):
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return target, draft, tokenizer


def save_tiny_pair(root: str | Path) -> tuple[str, str]:
    """Write :func:`tiny_pair` (stopping at ``<|im_end|>``) with its tokenizer to ``root/target`` and
    ``root/draft``; returns the two directories."""
    root = Path(root)
    target, draft, tokenizer = tiny_pair(stop_at_eos=True)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths[0], paths[1]


# -- fixtures of the models tests -----------------------------------------------------------------------------------
def tiny_model_dir(path, *, vocab_size: int | None = None, tokenizer=None, seed: int = 0, layers: int = 2,
                   hidden: int = 32) -> Path:
    """Save a tiny random Llama model and its tokenizer (default :func:`word_tokenizer`) to ``path``;
    ``vocab_size`` above the tokenizer's size adds padding rows."""
    tokenizer = tokenizer or word_tokenizer()
    specials = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    model = tiny_model("llama", seed=seed, vocab=vocab_size or len(tokenizer.get_vocab()), hidden_size=hidden,
                       intermediate_size=2 * hidden, num_hidden_layers=layers, tie_word_embeddings=False, **specials)
    for name, value in specials.items():
        setattr(model.generation_config, name, value)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def fake_bundle(tmp_dir, name: str = "fake-model", parts: int = 3, chunk_bytes: int = 1000,
                member: str | None = None) -> tuple[Bundle, bytes, Path]:
    """A fake multi-part bundle: returns (bundle, the payload its parts carry, wheel dir).

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


if __name__ == "__main__":
    print(*save_tiny_pair(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny"), sep="\n")
