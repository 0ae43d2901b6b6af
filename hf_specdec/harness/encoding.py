"""The one prompt encoding: a chat turn or a completion prompt, length caps with notes.

- A chat prompt (``chat=True``) is one user turn rendered by the tokenizer's chat template, or, for a tokenizer
  without one, by a plain ``User: ...\\nAssistant:`` frame (:func:`chat_text`). The rendering already holds
  the special tokens it needs, so none are added when tokenizing it.
- A completion prompt (``chat=False``) gets the tokenizer's usual special tokens (e.g. BOS), as a user's own
  ``tokenizer(text)`` call would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncodedPrompt:
    input_ids: torch.LongTensor  # [1, L] the model input
    text: str  # what was tokenized (the chat rendering for a chat prompt)
    notes: tuple[str, ...] = ()  # what the caps cut, for the user to see


def chat_text(tokenizer, message: str) -> str:
    """One user turn, rendered with the chat template (generation prompt added), else a plain frame."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
    return f"User: {message}\nAssistant:"


def encode_prompt(tokenizer, text: str, *, chat: bool = False, add_special_tokens: bool | None = None,
                  max_chars: int | None = None, max_tokens: int | None = None,
                  device: torch.device | str | None = None) -> EncodedPrompt:
    """Token ids of the model input for ``text``.

    ``chat``: ``text`` is a user message, rendered by :func:`chat_text`. ``add_special_tokens``: default
    ``not chat``; pass False for text that is already a chat rendering. ``max_chars`` cuts the text before
    rendering, ``max_tokens`` keeps the last tokens; each cut adds a note.
    """
    notes = []
    if max_chars is not None and len(text) > max_chars:
        text = text[:max_chars]
        notes.append(f"prompt cut to {max_chars} characters")
    if chat:
        text = chat_text(tokenizer, text)
    special = not chat if add_special_tokens is None else add_special_tokens
    input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=special)["input_ids"]
    if max_tokens is not None and input_ids.shape[1] > max_tokens:
        input_ids = input_ids[:, -max_tokens:]
        notes.append(f"prompt cut to its last {max_tokens} tokens")
    if device is not None:
        input_ids = input_ids.to(device)
    return EncodedPrompt(input_ids, text, tuple(notes))
