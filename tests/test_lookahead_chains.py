"""Lookahead on models that cannot read a trie in one forward runs chains only, token-identical to plain generate.

Bloom takes no position ids (it derives positions from the cache length) and builds its own ALiBi bias; GPT-Neo
takes position ids but builds its own (local attention) mask: neither can read a trie of guesses or a Jacobi window
in one forward (``support.tree_refusal``). Lookahead decides that once per call and verifies one chain a round (the
best path of its candidates, no window), as speculative mode verifies a draft model's chain. The memories are
seeded with flat costs (``modes()`` in tests/test_inputs.py) so guessing pays from the first round on any machine.
"""

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, GPTNeoConfig, GPTNeoForCausalLM

import hf_specdec
from hf_specdec.layout import merge_candidates
from hf_specdec.policy import Planner
from hf_specdec.round import Candidate, Offer, RowView, SourceKind
from hf_specdec.support import tree_refusal

NEW = 24
WINDOW = {"window": 4, "ngram": 3}  # a fixed Jacobi window: a model that reads trees gets 7 extra inputs a round


def bloom():
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=2)).eval()


def gpt_neo():
    torch.manual_seed(0)
    config = GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global"], 2]],
                          max_position_embeddings=128)
    return GPTNeoForCausalLM(config).eval()


def quiet(model):
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, name, None)
    return hf_specdec.enable(model)


def seeded_memory():
    memory = hf_specdec.LookaheadMemory()
    memory.seed({n: 1.0 for n in range(1, 65)})  # t(n) flat: every guess pays
    return memory


def prompts(batch):
    """A prompt that repeats itself (prompt lookup finds it); for two rows, a second one 3 tokens shorter,
    left-padded."""
    phrase = [5, 17, 23, 42, 8, 61, 30, 12]
    ids = torch.tensor([phrase * 3])
    if batch == 1:
        return ids, None
    second = torch.tensor([[0, 0, 0] + (phrase * 3)[3:]])
    return torch.cat([ids, second]), torch.cat([torch.ones(1, 24), torch.tensor([[0] * 3 + [1] * 21])]).long()


@pytest.mark.parametrize("build", [bloom, gpt_neo], ids=["bloom", "gpt_neo"])
def test_models_that_read_no_trie_are_named_with_the_reason(build):
    assert tree_refusal(build()) is not None
    if build is bloom:
        assert tree_refusal(build()).startswith("it derives positions from the cache length")


class MaskDims:
    """The number of dimensions of the attention mask each forward of ``model`` is given (0: none)."""

    def __init__(self, model):
        self.dims: list[int] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        self.dims.append(0 if mask is None else mask.dim())


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("build", [bloom, gpt_neo], ids=["bloom", "gpt_neo"])
def test_chain_rounds_equal_plain_generate(build, batch):
    model = quiet(build())
    ids, mask = prompts(batch)
    flags = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    expected = type(model).generate(model, ids, **flags)
    masks = MaskDims(model)
    out = model.generate(ids, decoding="lookahead", lookahead_memory=seeded_memory(), lookahead_config=WINDOW,
                         **flags)
    stats = model.last_spec_stats
    assert torch.equal(out, expected)
    assert stats.mode == "lookahead" and stats.accepted > 0 and stats.lookup_accepted > 0
    assert stats.tree_rounds == 0  # no round branched
    assert set(masks.dims) <= {0, 2}, masks.dims  # no trie and no window: never a 4-D mask
    if batch == 1:  # each forward read the last token and one chain (a window of 4 x 2 would add 7 inputs)
        widths = [n for n, times in stats.verify_time_by_tokens.items() for _ in times]
        assert sum(widths) == stats.forwards + stats.drafted


def test_a_one_path_offer_is_planned_as_one_chain_without_a_window():
    """The planner sizes a one-path offer with its usual cost model: the best path of the candidates, no window."""
    planner = Planner.lookahead(hf_specdec.LookaheadConfig(window=4, ngram=3))
    for n in range(1, 65):
        planner.estimates.forward.observe(n, 1.0)
    candidates = (Candidate((7, 8, 9), (SourceKind.HISTORY, 0)), Candidate((7, 5), (SourceKind.POOL, 0)),
                  Candidate((3, 4), (SourceKind.RECYCLE, 0)))
    view = RowView(0, torch.tensor([1, 2, 7]), 16)
    trie, chain = (planner.plan([view], [Offer(candidates=candidates, one_path=one)])[0] for one in (False, True))
    assert trie.window == (4, 3) and len({c.tokens[0] for c in trie.candidates}) > 1
    assert chain.window == (1, 2)
    path = merge_candidates(chain.candidates, max_nodes=64)  # what the drafter proposes: one chain
    assert path.tokens == (7, 8, 9) and path.parents == (-1, 0, 1)
