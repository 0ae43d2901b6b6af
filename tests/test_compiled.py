"""The compiled verify (``hf_specdec/compiled.py``): the target's forward over a static cache, compiled at a few
fixed widths, where plain ``generate`` would compile its own forward.

On this CPU the graphs compile with a counting backend (``GraphCounter``: dynamo's capture, then the captured graph
run as it is, so every forward's numbers are eager ones): the capture, the padding to a width, the masks and the
static buffers all run as they would under inductor or CUDA graphs, and the counter shows which forwards ran
compiled and how many graphs there were. Checked: greedy identical to plain ``generate`` and to hf_specdec's eager
path (fp32; speculative and lookahead; one prompt and a padded batch of two; every call drafted and ran compiled
verifies), sampling has the target's distribution on the compiled path (chi-square, as in tests/test_sampling.py),
a draft model's single step compiled at width 1, on its own and in a call whose verify compiles (the draft's graphs
told apart from the target's by the parameters they read; greedy plain's, sampled the target's distribution; a
dynamic-cache call steps eagerly), the width chosen for a round, and when a call and its draft compile
(transformers' criterion: ``compile_config`` on every device, a static cache, no ``disable_compile``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (CompileConfig, DynamicCache, GenerationConfig, StaticCache, T5Config,
                          T5ForConditionalGeneration)

import hf_specdec
from hf_specdec import compiled
from hf_specdec.backends import Buffers
from hf_specdec.cache import KVStore, Recording
from hf_specdec.compiled import EAGER, Buckets, CompiledVerify, compile_config_for, padded, verifier_for
from hf_specdec.layout import BatchInputs
from hf_specdec.models.tiny import perturbed_copy, tiny_model
from hf_specdec.stats import last_spec_stats
from tests.test_cache_in import BATCH, BATCH_MASK, PROMPT, _mistral, assert_drafted, mode
from tests.test_sampling import (NEW as SAMPLED_NEW, PROMPT as SAMPLED_PROMPT, SAMPLING, assert_fits,
                                 exact_distribution, processors, sampling_model, speculative)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NEW = 24
MODES = ["speculative", "lookahead"]
DRAWS = 600


class GraphCounter:
    """A torch.compile backend that runs each captured graph as it is, counting the graphs and their calls, and
    per graph the calls and the tensors it reads (its inputs' storage, parameters included: dynamo passes a
    module's parameters in as inputs), so that ``calls_of(model)`` counts the calls of the graphs of ``model``'s
    forward. A ``CompileConfig`` deep-copies its backend (``to_dict``): the copy is the counter itself."""

    def __init__(self) -> None:
        self.graphs, self.calls = 0, 0
        self.read: list[frozenset[int]] = []  # per graph: the data pointers of its inputs
        self.graph_calls: list[int] = []  # per graph: its calls

    def __deepcopy__(self, memo) -> "GraphCounter":
        return self

    def __call__(self, graph, example_inputs, **options):
        index = self.graphs
        self.graphs += 1
        self.read.append(frozenset(t.data_ptr() for t in example_inputs if isinstance(t, torch.Tensor)))
        self.graph_calls.append(0)

        def run(*args):
            self.calls += 1
            self.graph_calls[index] += 1
            return graph.forward(*args)

        return run

    def calls_of(self, model) -> int:
        """Calls of the graphs that read ``model``'s parameters (its forward's, or its base model's)."""
        weights = {parameter.data_ptr() for parameter in model.parameters()}
        return sum(calls for read, calls in zip(self.read, self.graph_calls) if read & weights)


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
    cache passed in, with room for every width's padding), and so do the draft's sampled steps."""
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
    assert accepted > 0 and counter.calls_of(draft) > 0
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


@pytest.mark.parametrize("rows", ["one", "batch", "narrowed"])
def test_a_draft_models_steps_compile_where_the_verify_does(pair, counter, rows):
    """Where the call's verify compiles, the draft model's store has a static cache and its one-token steps run
    through the draft's own compiled call (``CompiledVerify.for_draft``): the draft's graphs are called, every call
    drafts, greedy is plain's (one prompt, a left-padded batch of two). "narrowed": a draft asked to score a
    narrowed vocabulary (``draft_vocab_size``) steps compiled over its whole one (its own forward's output layer)."""
    model, draft = pair
    ids, given = (BATCH, dict(attention_mask=BATCH_MASK)) if rows == "batch" else (PROMPT, {})
    spec = mode("speculative", draft)
    if rows == "narrowed":
        spec["spec_config"] = {**spec["spec_config"], "draft_vocab_size": 32}  # of 96 ids
    reference = plain(model, ids, **given)
    calls = counter.calls_of(draft)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="static",
                         compile_config=counting_config(counter), **given, **spec)
    assert_drafted(model, "speculative")
    assert counter.calls_of(draft) > calls, "the draft's steps ran compiled"
    assert torch.equal(out, reference)


def test_a_dynamic_cache_call_steps_its_draft_eagerly(pair):
    """No static cache: the verify runs eagerly (as plain's forward would), and so does the draft: no graphs."""
    model, draft = pair
    counter = GraphCounter()
    out = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False, compile_config=counting_config(counter),
                         **mode("speculative", draft))
    assert_drafted(model, "speculative")
    assert counter.graphs == 0 and counter.calls == 0
    assert torch.equal(out, type(model).generate(model, PROMPT, max_new_tokens=NEW, do_sample=False))


def test_a_drafts_step_runner(pair):
    """A compiled verify's draft steps: width 1, the verify's config, over a static cache of the call's columns
    (none where the store could not speculate on one: sliding-window layers narrower than the call); an eager
    verify's, an encoder-decoder draft's: eager, over the store's dynamic cache."""
    model, draft = pair
    static = StaticCache(config=model.config, max_cache_len=32)
    verifier = verifier_for(model, GenerationConfig(compile_config=counting_config(GraphCounter())), static)
    step = verifier.for_draft(draft)
    assert step.buckets.widths == (1, 2) and step.config.dynamic is False and step.config.backend is \
        verifier.config.backend
    cache = step.store_cache(draft, 40)
    assert type(cache) is StaticCache and Buffers.of(cache.layers).width == 40
    windowed = _mistral()  # sliding_window=8
    assert step.store_cache(windowed, 8) is not None and step.store_cache(windowed, 40) is None
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                                             decoder_start_token_id=0))
    assert verifier.for_draft(t5) is EAGER
    assert EAGER.for_draft(draft) is EAGER and EAGER.store_cache(draft, 40) is None
    assert verifier_for(model, GenerationConfig(), static).for_draft(draft) is EAGER  # a CPU, nothing asked


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
