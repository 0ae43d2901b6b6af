"""Distil a cheap drafter for a target: ``distill(target, drafter, prompts, steps=...) -> DistillReport``, and
``hf-specdec distill``.

The recipe is DistillSpec (Zhou et al. 2023, "DistillSpec: Improving Speculative Decoding via Knowledge
Distillation", https://arxiv.org/abs/2310.08461), in its cheapest form:

- **data from the target**: the drafter is trained on the target's own greedy continuations of the prompts
  (DistillSpec's "teacher-generated" data), the text it will be asked to draft, generated once per run;
- **an acceptance-aligned divergence**: one draft token drawn from q and verified against the target's p is
  accepted with probability sum_x min(p(x), q(x)) = 1 - TVD(p, q) (Leviathan et al. 2023, Sec. 3.5), so the
  total variation distance is the loss whose minimum is the best acceptance (DistillSpec, Sec. 3); the forward
  KL(p || q), classical knowledge distillation, is the alternative (it bounds TVD by Pinsker's inequality).
  Greedy decoding accepts a draft token when the drafter's argmax is the target's: greedy agreement measures that.

Terms (used below and in the report):

continuation
    The target's greedy tokens after a prompt: ``continuation_tokens`` of them (fewer when it stops at EOS),
    generated once with their raw logits (``generate(output_logits=True)``: no second target forward) and kept
    in memory and, with an ``output_dir``, in ``teacher.pt`` for the next run or a resumed one.
teacher rows
    The target's next-token log-probabilities at each continuation position (fp32 on CPU). Stored in full
    (fp32, else bf16) when that fits ``teacher_memory_bytes``, else its top ``teacher_top_k`` (fp32 values and
    their ids): ``TeacherFormat``. A top-k loss compares the two distributions coarsened to those k tokens plus
    one bin for the rest, a lower bound of the full TVD / KL (data-processing inequality), exact when the
    target's mass outside its top k is 0.
teacher forcing
    The drafter reads prompt + continuation in one forward and is scored at the positions whose next token the
    target generated: exactly where a draft proposes.
greedy agreement
    The share of those positions where the drafter's argmax is the target's token (held-out prompts).
expected tokens per round at k
    1 + the mean over positions of min(run, k), ``run`` the agreement run from that position: the mean accepted
    length of greedy speculative decoding with k drafts, from teacher forcing (as ``hf-specdec check`` computes
    its ``expected_tokens_measured``), no speculative run needed.
start
    Where the drafter's weights come from (``StartKind``): the draft as given, a draft pruned to fewer decoder
    layers, the target's own first layers (copied: training never touches the target) or a smaller config.

Worked example (the tiny-model test): a random 1-layer Llama started from the config of a random 2-layer target,
120 steps of TVD on 24 prompts x 24 tokens, raises held-out greedy agreement from about 0.01 to above 0.3.
Real-model figures (steps, tokens, minutes, CPU kind) are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import enum
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from .costmodel import agreement_runs, run_length_tokens
from .models.hardware import decoder_layers, resolve_device
from .models.profile import text_config

CHECKPOINT_DIR = "checkpoint"  # output_dir/checkpoint: the latest resumable state (drafter + trainer.pt)
TEACHER_FILE = "teacher.pt"  # output_dir/teacher.pt: the continuations and teacher rows
REPORT_FILE = "distill_report.json"  # output_dir/distill_report.json: DistillReport.to_dict()
TRAINER_FILE = "trainer.pt"
SPEED_MAX_K = 8  # the longest draft the predicted speedup considers (``hf-specdec check``'s)
EXPECTED_KS = tuple(range(1, SPEED_MAX_K + 1))  # the report's expected tokens per round, by k


# ----------------------------------------------------------------------------------------------------------------
# Named kinds
# ----------------------------------------------------------------------------------------------------------------

class DistillLoss(enum.StrEnum):
    """The divergence between the target's p and the drafter's q at each continuation position."""

    TVD = "tvd"  # 0.5 * sum |p - q|: 1 - TVD is the acceptance of one sampled draft token (DistillSpec)
    FORWARD_KL = "forward_kl"  # sum p log(p / q): classical distillation, mass-covering

    @classmethod
    def parse(cls, value: "DistillLoss | str") -> "DistillLoss":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown loss {value!r}: use one of {', '.join(k.value for k in cls)}") from None


class StartKind(enum.StrEnum):
    """Where the drafter's weights come from (``DraftStart``)."""

    DRAFT = "draft"  # the draft model as given, every layer
    DRAFT_SPREAD = "draft_spread"  # N of the draft's decoder layers, evenly spread, first and last kept
    DRAFT_FIRST = "draft_first"  # the draft's first N decoder layers
    TARGET_FIRST = "target_first"  # the target's first N decoder layers + final norm + lm_head, copied
    CONFIG = "config"  # random init: the target's config with N layers (and any overrides)

    @property
    def needs_draft(self) -> bool:
        return self in (StartKind.DRAFT, StartKind.DRAFT_SPREAD, StartKind.DRAFT_FIRST)

    @property
    def trained_weights(self) -> bool:
        """Copied from a trained model (so its embeddings and output layer are frozen by default)?"""
        return self is not StartKind.CONFIG


START_FORMS = "draft, draft_spread:N, draft_first:N, target_first:N or config:N"


@dataclass(frozen=True)
class DraftStart:
    """A start: ``kind`` and ``layers`` (N; None only for ``DRAFT``); ``overrides``: config fields of a
    ``CONFIG`` start (e.g. ``{"hidden_size": 256, "intermediate_size": 512}``).

    >>> DraftStart.parse("draft_spread:12")
    DraftStart(kind=<StartKind.DRAFT_SPREAD: 'draft_spread'>, layers=12, overrides={})
    >>> str(DraftStart.parse("target_first:4"))
    'target_first:4'
    """

    kind: StartKind
    layers: int | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _start_kind(self.kind))
        if self.kind is StartKind.DRAFT:
            if self.layers is not None:
                raise ValueError(f"start 'draft' takes the draft as given, with no layer count: use "
                                 f"draft_spread:{self.layers} or draft_first:{self.layers} to prune it")
        elif isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"start {self.kind.value!r} needs a layer count >= 1, got {self.layers!r} "
                             f"(e.g. {self.kind.value}:4)")
        if self.overrides and self.kind is not StartKind.CONFIG:
            raise ValueError(f"config overrides apply to a 'config' start only, not {self.kind.value!r}")

    @classmethod
    def parse(cls, spec: "DraftStart | str") -> "DraftStart":
        """``"kind"`` or ``"kind:N"`` (see ``START_FORMS``); a ``DraftStart`` is returned as is."""
        if isinstance(spec, DraftStart):
            return spec
        kind, _, layers = str(spec).partition(":")
        if layers and not layers.isdigit():
            raise ValueError(f"start {spec!r}: the layer count must be an integer ({START_FORMS})")
        return cls(_start_kind(kind), int(layers) if layers else None)

    def layer_indices(self, total: int) -> list[int]:
        """The decoder layers of a ``total``-layer model this start keeps (every one for ``draft``; the first
        N for ``config``, whose weights are random).

        >>> DraftStart.parse("draft_spread:3").layer_indices(24)
        [0, 12, 23]
        """
        if self.kind is StartKind.DRAFT:
            return list(range(total))
        return (spread_layers if self.kind is StartKind.DRAFT_SPREAD else first_layers)(total, self.layers)

    def __str__(self) -> str:
        return self.kind.value if self.layers is None else f"{self.kind.value}:{self.layers}"


def _start_kind(value: StartKind | str) -> StartKind:
    try:
        return StartKind(value)
    except ValueError:
        raise ValueError(f"unknown start {value!r}: use one of {START_FORMS}") from None


# ----------------------------------------------------------------------------------------------------------------
# Starts: which layers, and the surgery
# ----------------------------------------------------------------------------------------------------------------

def spread_layers(total: int, keep: int) -> list[int]:
    """``keep`` layer indices of ``total``, evenly spread with the first and the last kept (every other layer
    when ``keep`` is half of ``total``, give or take the last).

    >>> spread_layers(24, 12)
    [0, 2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23]
    >>> spread_layers(4, 1), spread_layers(4, 4)
    ([0], [0, 1, 2, 3])
    """
    _check_keep(total, keep)
    if keep == 1:
        return [0]
    return [round(i * (total - 1) / (keep - 1)) for i in range(keep)]


def first_layers(total: int, keep: int) -> list[int]:
    """The first ``keep`` layer indices of ``total``.

    >>> first_layers(24, 3)
    [0, 1, 2]
    """
    _check_keep(total, keep)
    return list(range(keep))


def _check_keep(total: int, keep: int) -> None:
    if not 1 <= keep <= total:
        raise ValueError(f"cannot keep {keep} of {total} decoder layers: use 1..{total}")


def _layer_list_prefix(model) -> str:
    """The state-dict prefix of the decoder-layer ``ModuleList`` ("model.layers" for Llama, "transformer.h")."""
    parent, name = decoder_layers(model)
    parent_name = next(n for n, module in model.named_modules() if module is parent)
    return f"{parent_name}.{name}" if parent_name else name


def cut_config(config, keep: Sequence[int]):
    """A copy of ``config`` with decoder layers ``keep``: the layer count, and every per-layer list
    (``layer_types``) cut to match, so caches and sliding windows follow the kept layers."""
    config = copy.deepcopy(config)
    text = text_config(config)
    total = int(text.num_hidden_layers)
    for name, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == total and not name.startswith("_"):
            setattr(text, name, type(value)(value[i] for i in keep))
    text.num_hidden_layers = len(keep)
    return config


def keep_layers(model, keep: Sequence[int]):
    """A new fp32 model of ``model``'s class holding decoder layers ``keep`` (in that order) and every other
    weight (embeddings, final norm, lm_head) copied: ``model`` is untouched (``cut_config`` for the config)."""
    config = cut_config(model.config, keep)
    prefix = _layer_list_prefix(model) + "."
    new_index = {old: new for new, old in enumerate(keep)}
    state = {}
    for key, tensor in model.state_dict().items():
        if key.startswith(prefix):
            index, rest = key[len(prefix):].split(".", 1)
            if int(index) in new_index:
                state[f"{prefix}{new_index[int(index)]}.{rest}"] = tensor
        else:
            state[key] = tensor
    with torch.random.fork_rng(devices=[]):  # the throwaway init must not move the caller's random stream
        pruned = type(model)(config)
    pruned.load_state_dict(state)
    pruned.generation_config = copy.deepcopy(model.generation_config)
    return pruned.float().eval()


def vocab_rows(model) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def fit_vocab(drafter, rows: int):
    """Give ``drafter`` exactly ``rows`` vocabulary rows (the target's, padding included), in place: the loss
    compares whole next-token distributions, and a draft proposes over the target's ids."""
    if vocab_rows(drafter) != rows:
        drafter.resize_token_embeddings(rows, mean_resizing=False)
    return drafter


def build_start(start: DraftStart, target, draft=None, *, seed: int = 0, rows: int | None = None):
    """The drafter ``start`` describes, as a new fp32 model with the target's vocabulary rows (see ``StartKind``;
    ``rows`` gives them when ``target`` is None, which a ``draft*`` start allows). Neither ``target`` nor
    ``draft`` is modified."""
    if start.kind.needs_draft and draft is None:
        raise ValueError(f"start {str(start)!r} needs a draft model to start from; pass one (or use target_first:N "
                         "or config:N)")
    if start.kind is StartKind.DRAFT:
        drafter = copy.deepcopy(draft).float().eval()
    elif start.kind in (StartKind.DRAFT_SPREAD, StartKind.DRAFT_FIRST):
        drafter = keep_layers(draft, start.layer_indices(int(text_config(draft.config).num_hidden_layers)))
    elif start.kind is StartKind.TARGET_FIRST:
        drafter = keep_layers(target, start.layer_indices(int(text_config(target.config).num_hidden_layers)))
    else:
        config = cut_config(target.config, start.layer_indices(int(text_config(target.config).num_hidden_layers)))
        text = text_config(config)
        for name, value in start.overrides.items():
            if not hasattr(text, name):
                raise ValueError(f"config override {name!r}: {type(text).__name__} has no such field")
            setattr(text, name, value)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = type(target)(config)
        drafter.generation_config = copy.deepcopy(target.generation_config)
        drafter = drafter.float().eval()
    return fit_vocab(drafter, rows if rows is not None else vocab_rows(target))


# ----------------------------------------------------------------------------------------------------------------
# Teacher rows: what is stored, and the losses over them
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TeacherFormat:
    """How the target's next-token distributions are kept: ``top_k`` None (full rows) or k, in ``dtype``."""

    top_k: int | None
    dtype: str  # "float32" | "bfloat16"

    def __str__(self) -> str:
        kind = "full" if self.top_k is None else f"top-{self.top_k} (+ one bin for the rest)"
        return f"{kind} {'fp32' if self.dtype == 'float32' else 'bf16'}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def choose_teacher_format(positions: int, vocab: int, budget_bytes: int, top_k: int = 64) -> TeacherFormat:
    """Full fp32 rows when ``positions x vocab`` of them fit ``budget_bytes``, else full bf16, else the top
    ``top_k`` in fp32 (values + int64 ids).

    >>> str(choose_teacher_format(24 * 24, 96, 1 << 30))
    'full fp32'
    >>> str(choose_teacher_format(48 * 32, 151_936, 1 << 30))     # 0.93 GB in fp32: fits
    'full fp32'
    >>> str(choose_teacher_format(164 * 32, 151_936, 1 << 30))    # 3.2 GB fp32, 1.6 GB bf16: top-k
    'top-64 (+ one bin for the rest) fp32'
    """
    if positions * vocab * 4 <= budget_bytes:
        return TeacherFormat(None, "float32")
    if positions * vocab * 2 <= budget_bytes:
        return TeacherFormat(None, "bfloat16")
    return TeacherFormat(min(top_k, vocab - 1), "float32")


class TeacherRows(NamedTuple):
    """Teacher rows of some positions: ``logprobs`` [N, K] (K = vocab when ``ids`` is None, else the top k) and
    ``ids`` [N, k] (int64) or None."""

    logprobs: torch.Tensor
    ids: torch.Tensor | None


def teacher_rows(logits: torch.Tensor, fmt: TeacherFormat) -> TeacherRows:
    """Teacher rows of raw target logits [N, V] in ``fmt`` (on CPU)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if fmt.top_k is None:
        return TeacherRows(logprobs.to(fmt.torch_dtype).cpu(), None)
    values, ids = logprobs.topk(fmt.top_k, dim=-1)
    return TeacherRows(values.cpu(), ids.cpu())


def distill_loss(student_logits: torch.Tensor,  # [N, V] the drafter's raw logits
                 teacher: TeacherRows,  # [N, K] rows of the same positions
                 loss: DistillLoss) -> torch.Tensor:  # [N] per-position loss
    """TVD or forward KL per position; with top-k rows, over the k tokens plus one bin for the rest.

    >>> p = TeacherRows(torch.tensor([[0.75, 0.25]]).log(), None)
    >>> round(float(distill_loss(torch.zeros(1, 2), p, DistillLoss.TVD)), 4)          # q = (0.5, 0.5)
    0.25
    >>> round(float(distill_loss(torch.zeros(1, 2), p, DistillLoss.FORWARD_KL)), 4)   # .75 ln 1.5 + .25 ln .5
    0.1308
    >>> top1 = TeacherRows(torch.tensor([[0.75]]).log(), torch.tensor([[0]]))     # p = (.75, .2, .05), top-1 kept
    >>> round(float(distill_loss(torch.zeros(1, 3), top1, DistillLoss.TVD)), 4)   # the full TVD too, here
    0.4167
    """
    logq = torch.log_softmax(student_logits.float(), dim=-1)
    logp = teacher.logprobs.float()
    if teacher.ids is None:
        if loss is DistillLoss.TVD:
            return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
        return (logp.exp() * (logp - logq)).sum(-1)
    logq_k = logq.gather(-1, teacher.ids)
    p_k, q_k = logp.exp(), logq_k.exp()
    p_rest = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    if loss is DistillLoss.TVD:
        q_rest = (1.0 - q_k.sum(-1)).clamp(min=0.0)
        return 0.5 * ((p_k - q_k).abs().sum(-1) + (p_rest - q_rest).abs())
    logq_rest = logq.scatter(-1, teacher.ids, float("-inf")).logsumexp(-1)
    rest = torch.where(p_rest > 0, torch.xlogy(p_rest, p_rest) - p_rest * logq_rest.clamp(min=-1e4),
                       torch.zeros_like(p_rest))
    return (p_k * (logp - logq_k)).sum(-1) + rest


def expected_tokens(matches: Sequence[Sequence[bool]], k: int) -> float:
    """Mean tokens per round of greedy speculative decoding with ``k`` drafts, from per-position agreement
    (``costmodel.run_length_tokens``, as ``hf-specdec check`` computes it).

    >>> expected_tokens([[True, True, False, True]], 2)    # runs 2, 1, 0, 1; rounds fit at the first three
    2.0
    """
    return run_length_tokens([agreement_runs(row) for row in matches], k)


def batch_indices(step: int, count: int, batch_size: int, seed: int) -> list[int]:
    """The sequences of training step ``step``: a fresh seeded permutation of ``count`` per epoch, read in order
    (so a resumed run reads what an uninterrupted one would).

    >>> batch_indices(0, 4, 3, seed=0) + batch_indices(1, 4, 3, seed=0)[:1]  # one epoch, then the next begins
    [0, 1, 3, 2]
    """
    orders: dict[int, list[int]] = {}
    out = []
    for g in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(g, count)
        if epoch not in orders:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            orders[epoch] = torch.randperm(count, generator=generator).tolist()
        out.append(orders[epoch][i])
    return out


# ----------------------------------------------------------------------------------------------------------------
# The data: continuations of the target, generated once
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Example:
    """One prompt and the target's continuation: ``ids`` [P + t] (prompt then continuation), ``prompt_len`` P,
    ``teacher`` rows of the t continuation positions."""

    ids: torch.Tensor
    prompt_len: int
    teacher: TeacherRows

    @property
    def new_tokens(self) -> int:
        return int(self.ids.shape[0]) - self.prompt_len


def encode_prompts(prompts: Sequence[str | Sequence[int]], tokenizer, max_prompt_tokens: int | None
                   ) -> list[list[int]]:
    """Token ids of each prompt (text is tokenized with the tokenizer's usual special tokens), the last
    ``max_prompt_tokens`` kept."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("text prompts need tokenizer= (the target's)")
            ids = tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("a prompt has no tokens")
        out.append(ids[-max_prompt_tokens:] if max_prompt_tokens else ids)
    return out


@torch.no_grad()
def continue_prompts(target, prompts: Sequence[Sequence[int]], new_tokens: int, fmt: TeacherFormat, *,
                     pad_token_id: int | None = None, batch_size: int = 8,
                     progress: Callable[[int], None] | None = None) -> list[Example]:
    """The target's greedy continuation of each prompt (plain ``generate``) with its teacher rows, taken from the
    logits ``generate`` computed anyway. Prompts of one length are continued together, up to ``batch_size`` rows
    of one ``generate`` with no padding (the same greedy tokens, up to float rounding of batched matmuls); others
    one at a time. A row that ends at EOS is cut after it."""
    device = next(target.parameters()).device
    eos = target.generation_config.eos_token_id
    eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    examples: list[Example | None] = [None] * len(prompts)
    done = 0
    for length, indices in by_length.items():
        for first in range(0, len(indices), batch_size):
            chunk = indices[first:first + batch_size]
            ids = torch.tensor([list(prompts[i]) for i in chunk], device=device)
            out = type(target).generate(target, ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=new_tokens, return_dict_in_generate=True, output_logits=True,
                                        pad_token_id=pad_token_id, temperature=None, top_p=None, top_k=None)
            logits = torch.stack(out.logits, dim=1)  # [b, steps, V]
            for row, i in enumerate(chunk):
                new = out.sequences[row, length:].tolist()
                end = next((j + 1 for j, token in enumerate(new) if token in eos), len(new))
                examples[i] = Example(out.sequences[row, :length + end].cpu(), length,
                                      teacher_rows(logits[row, :end], fmt))
            done += len(chunk)
            if progress is not None:
                progress(done)
    return examples


def _prompts_key(prompts: Sequence[Sequence[int]], train: int, new_tokens: int) -> str:
    """The data without the target: prompt ids, where training ends and held-out begins, the length."""
    text = json.dumps({"prompts": [list(p) for p in prompts], "train": train, "new_tokens": new_tokens})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _data_key(target, prompts_key: str, fmt: TeacherFormat) -> str:
    """What the teacher depends on: the target (config and a weight checksum), the data, the format."""
    weight = target.get_input_embeddings().weight
    text = json.dumps({"config": target.config.to_dict(), "weights": float(weight.detach().float().sum()),
                       "data": prompts_key, "format": dataclasses.asdict(fmt)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Teacher:
    """The target's continuations of the training and the held-out prompts, with its rows (``Example``);
    ``key``: target + prompts + length + format (a checkpoint records it); ``vocab_rows`` and ``target_params``:
    the target's, so training needs no target in memory; ``seconds``: generating them (0.0 when read)."""

    train: tuple[Example, ...]
    heldout: tuple[Example, ...]
    format: TeacherFormat
    key: str
    prompts_key: str
    vocab_rows: int
    target_params: int
    seconds: float = 0.0

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"key": self.key, "prompts_key": self.prompts_key, "vocab_rows": self.vocab_rows,
                    "target_params": self.target_params, "format": dataclasses.asdict(self.format),
                    "train": len(self.train),
                    "examples": [(e.ids, e.prompt_len, e.teacher.logprobs, e.teacher.ids)
                                 for e in (*self.train, *self.heldout)]}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Teacher | None":
        if not path.is_file():
            return None
        data = torch.load(path, weights_only=True)
        examples = tuple(Example(ids, plen, TeacherRows(lp, tid)) for ids, plen, lp, tid in data["examples"])
        return cls(examples[: data["train"]], examples[data["train"]:], TeacherFormat(**data["format"]), data["key"],
                   data["prompts_key"], data["vocab_rows"], data["target_params"])


def _split(prompts, heldout, tokenizer, max_prompt_tokens) -> tuple[list[list[int]], list[list[int]]]:
    train = encode_prompts(prompts, tokenizer, max_prompt_tokens)
    if heldout is not None:
        return train, encode_prompts(heldout, tokenizer, max_prompt_tokens)
    if len(train) < 2:
        raise ValueError("distill needs at least 2 prompts (one is held out), or heldout= prompts")
    cut = len(train) - max(1, len(train) // 5)
    return train[:cut], train[cut:]


def prepare_teacher(target, prompts: Sequence[str | Sequence[int]], *, tokenizer=None,
                    heldout: Sequence[str | Sequence[int]] | None = None, continuation_tokens: int = 32,
                    max_prompt_tokens: int | None = None, teacher_memory_bytes: int = 1 << 30,
                    teacher_top_k: int = 64, output_dir: str | Path | None = None, progress: bool = True) -> Teacher:
    """The target's continuations of ``prompts`` (and ``heldout``; without them the last fifth of ``prompts``,
    at least one) with their teacher rows, read from ``output_dir/teacher.pt`` when it holds this target's
    continuations of the same prompts and length, else generated (and written there).

    ``target`` None reads them without the target (a machine that cannot hold target and training together:
    continue the prompts once with the target, then train in another process): ``output_dir/teacher.pt`` must
    hold continuations of the same prompts and length."""
    train_ids, heldout_ids = _split(prompts, heldout, tokenizer, max_prompt_tokens)
    all_ids = [*train_ids, *heldout_ids]
    prompts_key = _prompts_key(all_ids, len(train_ids), continuation_tokens)
    path = None if output_dir is None else Path(output_dir) / TEACHER_FILE
    cached = Teacher.load(path) if path is not None else None
    if target is None:
        if cached is None or cached.prompts_key != prompts_key:
            why = "there is none" if cached is None else "it holds continuations of other prompts or lengths"
            raise ValueError(f"target=None reads the target's continuations from output_dir/{TEACHER_FILE}, but "
                             f"{why} ({path}); run once with the target (prepare_teacher or distill) first")
        _log(progress, f"target continuations read from {path}")
        return cached
    rows = vocab_rows(target)
    fmt = choose_teacher_format(len(all_ids) * continuation_tokens, rows, teacher_memory_bytes, teacher_top_k)
    key = _data_key(target, prompts_key, fmt)
    if cached is not None and cached.key == key:
        _log(progress, f"target continuations read from {path}")
        return cached
    bar = _Progress(len(all_ids), 0, progress, "target continuations")
    t0 = time.perf_counter()
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = pad if pad is not None else target.generation_config.pad_token_id
    examples = continue_prompts(target, all_ids, continuation_tokens, fmt, pad_token_id=pad, progress=bar.update)
    bar.close()
    teacher = Teacher(tuple(examples[: len(train_ids)]), tuple(examples[len(train_ids):]), fmt, key, prompts_key,
                      rows, sum(p.numel() for p in target.parameters()), time.perf_counter() - t0)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        teacher.save(path)
    return teacher


# ----------------------------------------------------------------------------------------------------------------
# Teacher-forced batches
# ----------------------------------------------------------------------------------------------------------------

class Batch(NamedTuple):
    input_ids: torch.Tensor  # [B, L] left-padded prompt + continuation minus its last token
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L] positions as an unpadded row has them
    valid: torch.Tensor  # [B, T] bool: the last T positions that predict a continuation token
    labels: torch.Tensor  # [B, T] the target's token there (0 where not valid)
    teacher: TeacherRows  # [B * T, K] rows, zeros where not valid

    @property
    def keep(self) -> int:
        return int(self.valid.shape[1])


def make_batch(examples: Sequence[Example], device: torch.device | str) -> Batch:
    """Left-pad so the continuation positions of every row are the last T columns (one ``logits_to_keep``)."""
    rows = [e.ids[:-1] for e in examples]
    length, keep = max(r.shape[0] for r in rows), max(e.new_tokens for e in examples)
    k = examples[0].teacher.logprobs.shape[-1]
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    valid = torch.zeros(len(rows), keep, dtype=torch.bool)
    labels = torch.zeros(len(rows), keep, dtype=torch.long)
    logprobs = torch.zeros(len(rows), keep, k, dtype=examples[0].teacher.logprobs.dtype)
    ids = None if examples[0].teacher.ids is None else torch.zeros(len(rows), keep, k, dtype=torch.long)
    for b, (row, e) in enumerate(zip(rows, examples)):
        input_ids[b, length - row.shape[0]:] = row
        mask[b, length - row.shape[0]:] = 1
        t = e.new_tokens
        valid[b, keep - t:] = True
        labels[b, keep - t:] = e.ids[e.prompt_len:]
        logprobs[b, keep - t:] = e.teacher.logprobs
        if ids is not None:
            ids[b, keep - t:] = e.teacher.ids
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    teacher = TeacherRows(logprobs.reshape(-1, k).to(device), None if ids is None else ids.reshape(-1, k).to(device))
    return Batch(input_ids.to(device), mask.to(device), position_ids.to(device), valid.to(device),
                 labels.to(device), teacher)


def _student_logits(drafter, batch: Batch) -> torch.Tensor:
    """[B, T, V] the drafter's logits at the last T positions (only those go through the output layer)."""
    out = drafter(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  use_cache=False, logits_to_keep=batch.keep)
    return out.logits[:, -batch.keep:]


class Score(NamedTuple):
    matches: list[list[bool]]  # per example: drafter argmax == the target's token, per continuation position
    tvd: float  # mean TVD over the positions (coarsened to the top k with top-k rows: a lower bound)

    @property
    def agreement(self) -> float:
        flat = [m for row in self.matches for m in row]
        return sum(flat) / len(flat) if flat else 0.0

    def expected(self, ks: Sequence[int] = EXPECTED_KS) -> dict[int, float]:
        return {k: expected_tokens(self.matches, k) for k in ks}

    def acceptance(self) -> dict:
        """What ``compat.predict`` reads: the agreement and the run-length tokens per round at k = 1..8."""
        return {"alpha": self.agreement, "expected_tokens_measured": {str(k): v for k, v in self.expected().items()}}


@torch.no_grad()
def score(drafter, examples: Sequence[Example], device, batch_size: int = 4) -> Score:
    """Greedy agreement and mean TVD of ``drafter`` against the teacher over ``examples``."""
    matches, total, count = [], 0.0, 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = make_batch(chunk, device)
        logits = _student_logits(drafter, batch)
        agree = (logits.argmax(-1) == batch.labels) & batch.valid
        for b, e in enumerate(chunk):
            matches.append(agree[b, batch.keep - e.new_tokens:].tolist())
        flat = batch.valid.reshape(-1)
        tvd = distill_loss(logits.reshape(-1, logits.shape[-1])[flat],
                           TeacherRows(batch.teacher.logprobs[flat],
                                       None if batch.teacher.ids is None else batch.teacher.ids[flat]),
                           DistillLoss.TVD)
        total, count = total + float(tvd.sum()), count + int(flat.sum())
    return Score(matches, total / count if count else 0.0)


# ----------------------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DistillReport:
    """What a run did and what it gained. Agreement, TVD and expected tokens are over the held-out prompts'
    continuations (``train_agreement_*`` over the training ones); ``tokens``: continuation positions trained on
    (summed over steps), ``input_tokens``: every token the drafter read in training; ``wall_s``: training
    seconds (a resumed run adds its checkpoint's), ``teacher_s``: generating the continuations (0 when cached).
    ``c``: one drafter step over one target step, measured on this machine after training (the drafter in fp32,
    as trained; ``hf-specdec check``'s probe); ``speedup_before`` / ``speedup_after``: greedy speculative decoding's
    speedup over plain decoding that the cost model predicts from that c, the target's measured v(n) and the
    held-out run lengths before / after training, at the draft length ``k_before`` / ``k_after`` it picks
    (``compat.predict`` and ``drafting_row``, as ``hf-specdec check`` predicts; 1.0 and k = 0 where drafting does
    not pay); ``verify_cost``: what that prediction priced a round's target forward at, v(k + 1) in target steps
    per k (so a speedup is ``expected_tokens[k] / (k c + verify_cost[k])``); None without the target in memory or
    with ``speed=False``.
    ``drafter``: the trained model (not in ``to_dict``); with an ``output_dir`` it is also saved there."""

    loss: str
    start: str
    steps: int
    tokens: int
    input_tokens: int
    wall_s: float
    teacher_s: float
    teacher_format: str
    continuation_tokens: int
    train_sequences: int
    heldout_sequences: int
    device: str
    drafter_params: int
    target_params: int
    agreement_before: float
    agreement_after: float
    tvd_before: float
    tvd_after: float
    expected_tokens_before: dict[int, float]
    expected_tokens_after: dict[int, float]
    train_agreement_before: float
    train_agreement_after: float
    final_loss: float | None
    c: float | None = None
    speedup_before: float | None = None
    speedup_after: float | None = None
    k_before: int | None = None
    k_after: int | None = None
    verify_cost: dict[int, float] | None = None
    resumed_from: int | None = None
    output_dir: str | None = None
    drafter: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "drafter"}
        for key in ("expected_tokens_before", "expected_tokens_after", "verify_cost"):
            if data[key] is not None:
                data[key] = {str(k): v for k, v in data[key].items()}
        return data

    def summary(self) -> str:
        k = max(self.expected_tokens_after)
        share = self.drafter_params / max(1, self.target_params)
        return (f"{self.start} drafter ({self.drafter_params / 1e6:.1f}M params, {share:.3f} of the target), "
                f"{self.loss}, {self.steps} steps, {self.tokens} tokens, {self.wall_s / 60:.1f} min "
                f"on {self.device}: held-out greedy agreement {self.agreement_before:.3f} -> {self.agreement_after:.3f}"
                f", TVD {self.tvd_before:.3f} -> {self.tvd_after:.3f}, expected tokens per round at k={k} "
                f"{self.expected_tokens_before[k]:.2f} -> {self.expected_tokens_after[k]:.2f}"
                + ("" if self.c is None else
                   f"; c = {self.c:.3f}, predicted speedup {self.speedup_before or 1.0:.2f}x (k={self.k_before}) "
                   f"-> {self.speedup_after or 1.0:.2f}x (k={self.k_after})"))


# ----------------------------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------------------------

class _Progress:
    """tqdm when it is installed, else a plain line on stderr every twentieth of the run."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str) -> None:
        self.total, self.done, self.enabled, self.desc = total, initial, enabled, desc
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, desc=desc, file=sys.stderr)

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(done - self.done)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
        elif done == self.total or done * 20 // self.total != self.done * 20 // self.total:
            print(f"[hf_specdec] {self.desc} {done}/{self.total} {note}", file=sys.stderr, flush=True)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(f"[hf_specdec] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------

def _save_checkpoint(output_dir: Path, drafter, optimizer, state: dict[str, Any]) -> None:
    """Write the latest checkpoint next to the old one, then swap (an interrupted save keeps the old one)."""
    final, tmp = output_dir / CHECKPOINT_DIR, output_dir / f"{CHECKPOINT_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    drafter.save_pretrained(tmp)
    torch.save({**state, "optimizer": optimizer.state_dict()}, tmp / TRAINER_FILE)
    old = output_dir / f"{CHECKPOINT_DIR}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(output_dir: Path, settings: dict[str, Any]):
    """``(drafter, trainer state)`` of the latest checkpoint, or None; refused when it was trained with other
    settings (continuing it under these would not be the run it started)."""
    path = output_dir / CHECKPOINT_DIR
    if not (path / TRAINER_FILE).is_file():  # a save interrupted between its two renames left it as .old
        path = output_dir / f"{CHECKPOINT_DIR}.old"
    if not (path / TRAINER_FILE).is_file():
        return None
    from .models.refs import from_pretrained

    state = torch.load(path / TRAINER_FILE, weights_only=True)
    differ = sorted(k for k in settings if state["settings"].get(k) != settings[k])
    if differ:
        shown = ", ".join(f"{k}: {state['settings'].get(k)!r} there, {settings[k]!r} now" for k in differ)
        raise ValueError(f"resume=True: the checkpoint in {path} was trained with other settings ({shown}); "
                         "resume with the same ones, or use another output_dir (or resume=False to start over)")
    drafter = from_pretrained(str(path), dtype=torch.float32)
    return drafter.eval(), state


# ----------------------------------------------------------------------------------------------------------------
# distill
# ----------------------------------------------------------------------------------------------------------------

def _freeze(drafter, freeze_embeddings: bool) -> list[torch.nn.Parameter]:
    for p in drafter.parameters():
        p.requires_grad_(True)
    if freeze_embeddings:
        drafter.get_input_embeddings().weight.requires_grad_(False)
        drafter.get_output_embeddings().weight.requires_grad_(False)
    return [p for p in drafter.parameters() if p.requires_grad]


@torch.no_grad()
def predict_speed(target, drafter, examples: Sequence[Example], acceptance: Mapping[str, dict | None],
                  context_tokens: int = 100) -> dict[str, Any]:
    """c of ``drafter`` against ``target`` (measured here, on top of ``context_tokens`` of the examples' text), and
    for each named ``acceptance`` (``Score.acceptance``) the speedup and k the cost model predicts: the
    ``DistillReport`` fields ``c``, ``verify_cost``, ``speedup_<name>``, ``k_<name>``."""
    from .models.compat import costs_over, drafting_row, predict  # the check's probe and prediction

    text = torch.cat([e.ids for e in examples])
    prefix = text.repeat(-(-context_tokens // text.shape[0]))[:context_tokens].unsqueeze(0)
    was_training = drafter.training
    drafter.eval()
    cost = costs_over(target, drafter, prefix, max_k=SPEED_MAX_K)
    drafter.train(was_training)
    found: dict[str, Any] = {"c": cost["c"], "verify_cost": {int(k): v for k, v in cost["verify_cost"].items()}}
    for name, measured in acceptance.items():
        if measured is not None:  # a checkpoint written before these were kept has none
            row = drafting_row(cost, predict(cost, measured, SPEED_MAX_K))
            found[f"speedup_{name}"] = 1.0 if row is None else row["speedup_measured"]
            found[f"k_{name}"] = 0 if row is None else row["k"]
    return found


def distill(target, drafter, prompts: Sequence[str | Sequence[int]], *, steps: int = 200,
            start: DraftStart | str = "draft", loss: DistillLoss | str = DistillLoss.TVD, tokenizer=None,
            heldout: Sequence[str | Sequence[int]] | None = None, continuation_tokens: int = 32,
            max_prompt_tokens: int | None = None, batch_size: int = 4, lr: float | None = None,
            warmup_steps: int = 10, freeze_embeddings: bool | None = None, teacher_memory_bytes: int = 1 << 30,
            teacher_top_k: int = 64, output_dir: str | Path | None = None, save_every: int = 50,
            resume: bool = False, seed: int = 0, device: str = "auto", progress: bool = True,
            speed: bool = True) -> DistillReport:
    """Train a drafter for ``target`` on the target's own continuations of ``prompts``; see the module docstring.

    ``drafter``: the draft model a ``draft*`` start begins from (not modified; None for ``target_first:N`` /
    ``config:N``); ``start``: a ``DraftStart`` or its text (``START_FORMS``); ``loss``: ``DistillLoss`` or its
    name. ``prompts`` and ``heldout``: text (``tokenizer``, the target's, needed) or token ids; without
    ``heldout`` the last fifth of ``prompts`` (at least one) is held out. ``continuation_tokens`` greedy tokens
    per prompt, the last ``max_prompt_tokens`` of each prompt kept.

    Training: AdamW (betas 0.9, 0.95, no weight decay), ``lr`` after a linear warm-up of ``warmup_steps``
    (default 1e-4 for starts copied from trained weights, 1e-3 for a random ``config`` start), gradients clipped
    at 1.0, ``batch_size`` sequences a step, fp32 weights (bf16 autocast on CUDA). ``freeze_embeddings``
    (default: for copied starts) keeps the embeddings and output layer fixed. ``device``: "auto" is CUDA when
    available; the target runs where it is.

    With ``output_dir``: the continuations are cached in ``teacher.pt`` (reused when target, prompts and
    length match; ``target=None`` trains a ``draft*`` start from them without the target in memory, see
    ``prepare_teacher``), the latest checkpoint is written every ``save_every`` steps to ``checkpoint/`` (``resume=True``
    continues from it, refusing other settings; ``steps`` may grow), and the trained drafter is saved to
    ``output_dir`` itself with the tokenizer (``load_model(output_dir)`` and ``generate(assistant_model=)``
    take it) beside ``distill_report.json``. With the target in memory and ``speed``, the report also gives c and
    the predicted speedup before and after (``DistillReport``).
    """
    loss = DistillLoss.parse(loss)
    start = DraftStart.parse(start)
    for name, value, low in (("steps", steps, 0), ("batch_size", batch_size, 1), ("continuation_tokens",
                             continuation_tokens, 1), ("save_every", save_every, 1), ("warmup_steps", warmup_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is invalid: use an int >= {low}")
    if resume and output_dir is None:
        raise ValueError("resume=True needs the output_dir= of the run to resume")
    if target is None and not start.kind.needs_draft:
        raise ValueError(f"start {str(start)!r} builds on the target: pass it (target=None trains a draft* start "
                         f"from cached continuations)")
    if target is None and output_dir is None:
        raise ValueError(f"target=None reads the target's continuations from output_dir/{TEACHER_FILE}: pass "
                         "output_dir=")
    if start.kind.needs_draft and drafter is None:
        raise ValueError(f"start {str(start)!r} needs a draft model to start from; pass one (or use target_first:N "
                         "or config:N)")
    lr = lr if lr is not None else (1e-4 if start.kind.trained_weights else 1e-3)
    freeze = start.kind.trained_weights if freeze_embeddings is None else freeze_embeddings
    device = torch.device(resolve_device(device))
    out = Path(output_dir) if output_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    # -- the data: generated once, cached ----------------------------------------------------------------------
    data = prepare_teacher(target, prompts, tokenizer=tokenizer, heldout=heldout,
                           continuation_tokens=continuation_tokens, max_prompt_tokens=max_prompt_tokens,
                           teacher_memory_bytes=teacher_memory_bytes, teacher_top_k=teacher_top_k,
                           output_dir=out, progress=progress)
    rows, key, fmt = data.vocab_rows, data.key, data.format
    train = [e for e in data.train if e.new_tokens > 0]
    held = [e for e in data.heldout if e.new_tokens > 0]
    if not train or not held:
        raise ValueError("the target produced no continuation tokens for any training (or held-out) prompt "
                         "(EOS at once?)")

    # -- the drafter: a checkpoint, or the start ---------------------------------------------------------------
    settings = {"loss": loss.value, "start": str(start), "lr": lr, "batch_size": batch_size, "seed": seed,
                "warmup_steps": warmup_steps, "freeze_embeddings": freeze, "data": key}
    loaded = _load_checkpoint(out, settings) if resume else None
    if loaded is not None:
        model, state = loaded
        fit_vocab(model, rows)
        _log(progress, f"resuming from step {state['step']} ({out / CHECKPOINT_DIR})")
    else:
        if resume:
            _log(progress, f"resume=True but no checkpoint in {out}: starting at step 0")
        model = build_start(start, target, drafter, seed=seed, rows=rows)
        state = None
    model.to(device)
    params = _freeze(model, freeze)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        before, train_before = state["before"], state["train_before"]
        step, tokens, input_tokens, wall = state["step"], state["tokens"], state["input_tokens"], state["wall_s"]
        last_loss, resumed_from = state["last_loss"], state["step"]
    else:
        held_score, train_score = score(model, held, device), score(model, train, device)
        before = {"agreement": held_score.agreement, "tvd": held_score.tvd, "expected": held_score.expected(),
                  "acceptance": held_score.acceptance()}
        train_before = train_score.agreement
        step, tokens, input_tokens, wall, last_loss, resumed_from = 0, 0, 0, 0.0, None, None

    # -- training ----------------------------------------------------------------------------------------------
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and
                torch.cuda.is_bf16_supported() else None)
    bar = _Progress(steps, min(step, steps), progress, "distill")
    t0 = time.perf_counter()
    while step < steps:
        batch = make_batch([train[i] for i in batch_indices(step, len(train), batch_size, seed)], device)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr
        with autocast if autocast is not None else contextlib.nullcontext():
            logits = _student_logits(model, batch)
        flat = batch.valid.reshape(-1)
        teacher = TeacherRows(batch.teacher.logprobs[flat],
                              None if batch.teacher.ids is None else batch.teacher.ids[flat])
        value = distill_loss(logits.reshape(-1, logits.shape[-1])[flat], teacher, loss).mean()
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        tokens += int(flat.sum())
        input_tokens += int(batch.attention_mask.sum())
        last_loss = float(value.detach())
        elapsed = wall + time.perf_counter() - t0
        bar.update(step, f"{loss.value} {last_loss:.4f}, {tokens / max(elapsed, 1e-9):.0f} tok/s")
        if out is not None and (step % save_every == 0 or step == steps):
            _save_checkpoint(out, model, optimizer, {
                "step": step, "tokens": tokens, "input_tokens": input_tokens, "wall_s": elapsed,
                "last_loss": last_loss, "before": before, "train_before": train_before, "settings": settings})
    bar.close()
    wall += time.perf_counter() - t0

    # -- after -------------------------------------------------------------------------------------------------
    held_score, train_score = score(model, held, device), score(model, train, device)
    predicted = (predict_speed(target, model, held, {"before": before.get("acceptance"),
                                                     "after": held_score.acceptance()})
                 if speed and target is not None else {})
    report = DistillReport(
        loss=loss.value, start=str(start), steps=step, tokens=tokens, input_tokens=input_tokens, wall_s=wall,
        teacher_s=data.seconds, teacher_format=str(fmt), continuation_tokens=continuation_tokens,
        train_sequences=len(train), heldout_sequences=len(held), device=str(device),
        drafter_params=sum(p.numel() for p in model.parameters()),
        target_params=data.target_params,
        agreement_before=before["agreement"], agreement_after=held_score.agreement, tvd_before=before["tvd"],
        tvd_after=held_score.tvd, expected_tokens_before={int(k): v for k, v in before["expected"].items()},
        expected_tokens_after=held_score.expected(), train_agreement_before=train_before,
        train_agreement_after=train_score.agreement, final_loss=last_loss, resumed_from=resumed_from, **predicted,
        output_dir=None if out is None else str(out), drafter=model)
    if out is not None:
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        (out / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report



# ----------------------------------------------------------------------------------------------------------------
# Prompt sources and ``hf-specdec distill``
# ----------------------------------------------------------------------------------------------------------------

def split_prompts(text: str) -> list[str]:
    """A text file's prompts: one per paragraph (blank-line separated); a file without blank lines, one per line.

    >>> split_prompts("def a():\\n    pass\\n\\n\\nclass B:\\n")
    ['def a():\\n    pass\\n', 'class B:\\n']
    >>> split_prompts("import os\\nimport re\\n")
    ['import os\\n', 'import re\\n']
    """
    lines = text.splitlines(keepends=True)
    if not any(not line.strip() for line in lines):
        return [line if line.endswith("\n") else line + "\n" for line in lines]
    prompts, current = [], []
    for line in lines:
        if line.strip():
            current.append(line)
        elif current:
            prompts.append("".join(current))
            current = []
    if current:
        prompts.append("".join(current))
    return prompts


def read_prompt_source(source: str, tokenizer, limit: int | None = None) -> list[list[int]]:
    """Token ids of the prompts ``source`` names: an eval task (``humaneval``, ``humaneval_chat``,
    ``humaneval_edit``, ``jsonl:PATH`` or a ``.jsonl`` path: ``eval.tasks.load_task``, as ``python -m eval run``
    reads them; chat prompts rendered with the chat template) or a text file (``split_prompts``); the first
    ``limit``."""
    path = Path(source)
    if source.endswith(".jsonl") and not source.startswith("jsonl:"):
        source = f"jsonl:{source}"
    if source.startswith("jsonl:") or not path.is_file():
        try:
            from eval.tasks import load_task
        except ModuleNotFoundError as err:
            if err.name != "eval":
                raise
            raise ValueError(f"prompts {source!r}: eval tasks need the repository's eval package (run from the "
                             "hf_specdec checkout), or pass a text file (one prompt per paragraph)") from None
        samples = load_task(source, tokenizer, limit=limit)
        return [tokenizer(s.text, add_special_tokens=s.style != "chat").input_ids for s in samples]
    prompts = split_prompts(path.read_text(encoding="utf-8"))[:limit or None]
    if not prompts:
        raise ValueError(f"prompts {source!r}: the file holds no prompt")
    return [tokenizer(p).input_ids for p in prompts]


def cmd_distill(args: argparse.Namespace) -> int:
    from .models import load_model
    from .models.compat import tokenizer_compatibility

    try:
        loss, start = DistillLoss.parse(args.loss), DraftStart.parse(args.start)
        if start.kind.needs_draft and not args.draft:
            raise ValueError(f"--start {start} starts from a draft: pass --draft")
        target, tokenizer, _ = load_model(args.target, dtype=args.dtype, device=args.target_device)
        draft = None
        if start.kind.needs_draft:
            draft, draft_tokenizer, _ = load_model(args.draft, dtype="fp32")
            match = tokenizer_compatibility(tokenizer, draft_tokenizer, vocab_rows(target), vocab_rows(draft))
            if not match["compatible"]:
                raise ValueError(f"the draft cannot learn this target: {match['reason']}")
        prompts = read_prompt_source(args.prompts, tokenizer, args.limit)
        heldout = read_prompt_source(args.heldout, tokenizer, args.heldout_limit) if args.heldout else None
        report = distill(target, draft, prompts, steps=args.steps, start=start, loss=loss, tokenizer=tokenizer,
                         heldout=heldout, continuation_tokens=args.continuation_tokens,
                         max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, lr=args.lr,
                         output_dir=args.out, save_every=args.save_every, resume=args.resume, seed=args.seed,
                         device=args.device, progress=not args.quiet, speed=not args.no_speed)
    except (OSError, ValueError) as err:
        print(f"hf-specdec: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0


def register(subparsers) -> None:
    """Add ``distill`` to the top-level parser's ``subparsers`` (hf_specdec/cli.py)."""
    p = subparsers.add_parser(
        "distill", help="train a small drafter on the target's own continuations (DistillSpec: TVD or KL)",
        description="Trains a drafter that shares the target's tokenizer on the target's greedy continuations of "
                    "prompts, teacher-forced, with total variation (1 - TVD is the acceptance of a sampled draft "
                    "token) or forward KL; reports held-out greedy agreement and expected tokens per round before "
                    "and after, and saves a drafter that --draft / generate(assistant_model=) take. Exit 0: done, "
                    "2: usage error.")
    p.add_argument("--target", required=True, help="target reference (bundle name, hub id, dir, .gguf)")
    p.add_argument("--draft", default=None, help="draft reference, for the draft* starts")
    p.add_argument("--start", default="draft", help=f"{START_FORMS} (default draft)")
    p.add_argument("--loss", default=DistillLoss.TVD.value, help=f"{', '.join(k.value for k in DistillLoss)} "
                                                                 "(default tvd)")
    p.add_argument("--prompts", required=True, help="humaneval, humaneval_chat, humaneval_edit, jsonl:PATH, a .jsonl "
                                                   "file or a text file (one prompt per paragraph)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts")
    p.add_argument("--heldout", default=None, help="held-out prompts, in --prompts' forms (default: the last fifth "
                                                   "of --prompts)")
    p.add_argument("--heldout-limit", type=int, default=None)
    p.add_argument("--out", required=True, help="output folder: the drafter, checkpoint/, teacher.pt, report")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--continuation-tokens", type=int, default=32, help="greedy target tokens per prompt")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="keep each prompt's last N tokens")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=None, help="default 1e-4 (copied starts) or 1e-3 (config start)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="the target's dtype (auto, bf16, fp16, fp32); the drafter "
                                                   "trains in fp32")
    p.add_argument("--target-device", default="cpu", help="where the target runs (cpu, cuda, auto)")
    p.add_argument("--device", default="auto", help="where the drafter trains (auto: CUDA when available)")
    p.add_argument("--no-speed", action="store_true", help="skip measuring c and predicting the speedup before / "
                   "after (about 50 timed forwards of the target)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_distill)
