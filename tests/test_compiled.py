"""The compiled verify (``hf_specdec/compiled.py``): the target's forward over a static cache, compiled at a few
fixed widths, where plain ``generate`` would compile its own forward.

On this CPU the graphs compile with a counting backend (``GraphCounter``: dynamo's capture, then the captured graph
run as it is, so every forward's numbers are eager ones): the capture, the padding to a width, the masks and the
static buffers all run as they would under inductor or CUDA graphs, and the counter shows which forwards ran
compiled and how many graphs there were. Checked: greedy identical to plain ``generate`` and to hf_specdec's eager
path (fp32; speculative and lookahead; one prompt and a padded batch of two; every call drafted and ran compiled
verifies), sampling has the target's distribution on the compiled path (chi-square, as in tests/test_sampling.py),
a draft model's single step compiled at width 1, the width chosen for a round, and when a call compiles
(transformers' criterion: ``compile_config`` on every device, a static cache, no ``disable_compile``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import CompileConfig, DynamicCache, GenerationConfig, StaticCache

import hf_specdec
from hf_specdec import compiled
from hf_specdec.cache import KVStore, Recording
from hf_specdec.compiled import EAGER, Buckets, CompiledVerify, compile_config_for, padded, verifier_for
from hf_specdec.layout import BatchInputs
from hf_specdec.models.tiny import perturbed_copy, tiny_model
from hf_specdec.stats import last_spec_stats
from tests.test_cache_in import BATCH, BATCH_MASK, PROMPT, assert_drafted, mode
from tests.test_sampling import (NEW as SAMPLED_NEW, PROMPT as SAMPLED_PROMPT, SAMPLING, assert_fits,
                                 exact_distribution, processors, sampling_model, speculative)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NEW = 24
MODES = ["speculative", "lookahead"]
DRAWS = 600


class GraphCounter:
    """A torch.compile backend that runs each captured graph as it is, counting the graphs and their calls. A
    ``CompileConfig`` deep-copies its backend (``to_dict``): the copy is the counter itself."""

    def __init__(self) -> None:
        self.graphs, self.calls = 0, 0

    def __deepcopy__(self, memo) -> "GraphCounter":
        return self

    def __call__(self, graph, example_inputs, **options):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return graph.forward(*args)

        return run


def counting_config(counter: GraphCounter) -> CompileConfig:
    """A ``compile_config`` that compiles on every device (transformers' flag), with the counting backend."""
    config = CompileConfig(backend=counter, mode=None, fullgraph=True)  # fullgraph: Llama's forward is one graph
    config._compile_all_devices = True
    return config


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    """Graphs of this module only, and room for all of them (each width and batch size is one)."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def pair():
    model = tiny_model("llama", seed=0)
    return hf_specdec.enable(model), perturbed_copy(model, 0.05, relative=True)


@pytest.fixture(scope="module")
def counter():
    return GraphCounter()


def plain(model, ids, **kwargs):
    return type(model).generate(model, ids, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                                **kwargs)


def ours(model, ids, name, draft, **kwargs):
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="static", **kwargs,
                         **mode(name, draft))
    assert_drafted(model, name)
    return out


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
@pytest.mark.parametrize("name", MODES)
def test_greedy_is_plains_and_the_eager_paths(pair, counter, name, batch):
    model, draft = pair
    ids, given = (BATCH, dict(attention_mask=BATCH_MASK)) if batch else (PROMPT, {})
    reference = plain(model, ids, **given)
    calls = counter.calls
    eager = ours(model, ids, name, draft, **given)
    assert counter.calls == calls, "no compile_config on a CPU: eager"
    out = ours(model, ids, name, draft, compile_config=counting_config(counter), **given)
    assert counter.calls > calls, "the verify forwards ran compiled"
    assert torch.equal(out, reference) and torch.equal(eager, reference)


def test_a_second_call_reuses_the_graphs(pair, counter):
    model, draft = pair
    ours(model, PROMPT, "speculative", draft, compile_config=counting_config(counter))
    graphs, calls = counter.graphs, counter.calls
    ours(model, PROMPT, "speculative", draft, compile_config=counting_config(counter))
    assert counter.graphs == graphs and counter.calls > calls


def test_sampling_on_the_compiled_path_has_the_targets_distribution():
    """The perturbed draft of tests/test_sampling.py, fixed k = 4; each call's verifies run compiled (a static
    cache passed in, with room for every width's padding)."""
    target = sampling_model()
    draft = perturbed_copy(target, 0.01)
    exact = exact_distribution(target, SAMPLED_PROMPT, SAMPLED_NEW, processors(**SAMPLING))
    counter = GraphCounter()
    config = counting_config(counter)
    torch.manual_seed(5)
    counts, accepted = Counter(), 0
    for _ in range(DRAWS):
        calls = counter.calls
        cache = StaticCache(config=target.config, max_cache_len=32)
        out = target.generate(SAMPLED_PROMPT, do_sample=True, max_new_tokens=SAMPLED_NEW, cache=cache,
                              compile_config=config, **SAMPLING, **speculative(draft, num_draft_tokens=4))
        assert counter.calls > calls
        key = tuple(out[0, SAMPLED_PROMPT.shape[1]:].tolist())
        counts[key] += 1
        accepted += last_spec_stats(target).accepted
    assert accepted > 0
    assert_fits(counts, exact)


def test_a_draft_models_single_step_compiled(pair):
    """Width 1 over a store with a static cache: the draft's step (``CompiledVerify.draft_step``), greedy token by
    token, is plain's greedy continuation."""
    model, _ = pair
    counter = GraphCounter()
    step = CompiledVerify.draft_step(torch.compile(model.__call__, backend=counter, dynamic=False, fullgraph=True))
    store = KVStore(model, cache=StaticCache(config=model.config, max_cache_len=64))
    token = int(store.prefill(PROMPT, None).logits[0, -1].argmax())
    tokens = [token]
    for _ in range(NEW - 1):
        result = step.forward(store, BatchInputs(torch.tensor([[token]]), torch.zeros(1, 1, dtype=torch.long),
                                                 None, None), logits_at=1)
        store.keep(result.slots.tolist())
        token = int(result.logits[0, -1].argmax())
        tokens.append(token)
    reference = type(model).generate(model, PROMPT, max_new_tokens=NEW, do_sample=False)
    assert tokens == reference[0, PROMPT.shape[1]:].tolist()
    assert counter.graphs == 1 and counter.calls == NEW - 1


def test_the_width_of_a_round():
    buckets = Buckets()
    assert [buckets.width(n) for n in (1, 3, 5, 17, 32, 33, 64, 65)] == [1, 4, 8, 32, 32, 64, 64, None]
    verify = CompiledVerify(lambda **kwargs: None, Buckets((2, 4)))
    assert [verify.width(n) for n in (1, 3, 4, 5)] == [2, 4, 4, 5]  # past the widest: its own (eager)
    assert EAGER.width(5) == 5
    model = tiny_model("llama")
    store = KVStore(model, cache=StaticCache(config=model.config, max_cache_len=16))
    store.prefill(PROMPT[:, :8], None)
    assert verify.runs(store, 3, Recording())  # 8 columns held of 16: a width of 4 fits
    assert not verify.runs(store, 5, Recording())  # wider than every width
    assert not verify.runs(store, 3, Recording(hidden_states=True))  # recorded: eager
    assert not KVStore(model).buffers and not verify.runs(KVStore(model), 1, Recording())  # a dynamic cache


def test_padding_to_a_width():
    trie = BatchInputs(torch.tensor([[4, 5, 6]]), torch.tensor([[0, 1, 1]]), None,
                       torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool))
    wide = padded(trie, 4)
    assert wide.valid.tolist() == [[True, True, True, False]]
    assert wide.inner[0].tolist() == [[True, False, False, False], [True, True, False, False],
                                      [True, False, True, False], [False, False, False, True]]


def test_when_a_call_compiles(pair):
    """As plain ``generate`` decides (transformers' ``_valid_auto_compile_criteria``): on a CPU only where the
    ``compile_config`` asks for every device; a static cache; not with ``disable_compile``."""
    model, _ = pair
    static = StaticCache(config=model.config, max_cache_len=32)
    asked = CompileConfig(backend="aot_eager", mode=None)
    everywhere = counting_config(GraphCounter())
    assert compile_config_for(model, GenerationConfig(), static) is None  # a CPU, nothing asked: eager
    assert compile_config_for(model, GenerationConfig(compile_config=asked), static) is None  # (as plain)
    config = compile_config_for(model, GenerationConfig(compile_config=everywhere), static)
    assert config is not None and config.dynamic is False and config.backend is everywhere.backend
    assert compile_config_for(model, GenerationConfig(compile_config=everywhere), DynamicCache()) is None
    assert compile_config_for(model, GenerationConfig(compile_config=everywhere, disable_compile=True),
                              static) is None
    assert verifier_for(model, GenerationConfig(), static) is EAGER
    assert isinstance(verifier_for(model, GenerationConfig(compile_config=everywhere), static),
                      compiled.CompiledVerify)
