"""Shared fixtures: tiny randomly initialised models built from configs, and an offline tokenizer."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.models.tiny import VOCAB, char_tokenizer, perturbed_copy, tiny_model  # noqa: F401 (re-exported)


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
