"""Shared fixtures: tiny randomly initialised models built from configs, an offline tokenizer, and the caches.

Every test runs with ``$HF_SPECDEC_CACHE`` pointing at one temporary directory for the session, so that nothing
a test measures or fetches (hardware profiles, bundles, conversions) lands in the user's cache. The tests that
need a real bundle (``network`` / ``slow``) name the user's own cache (``user_cache_dir``: what
``resolve_cache_dir`` says before the tests start), where it is fetched once and then found offline.
"""

from __future__ import annotations

import pytest
import torch

from hf_specdec.models.bundles import CACHE_ENV, resolve_cache_dir
from hf_specdec.models.tiny import VOCAB, char_tokenizer, perturbed_copy, tiny_model  # noqa: F401 (re-exported)


@pytest.fixture(scope="session", autouse=True)
def user_cache_dir(tmp_path_factory):
    """The user's hf_specdec cache (the real bundles); every test meanwhile writes to a session temp cache."""
    user = resolve_cache_dir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("hf_specdec_cache")))
        yield user


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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forwards gain nothing from threads, and on a shared 2-core machine they wait for each other: a module
    that samples thousands of tiny calls runs them on one (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
