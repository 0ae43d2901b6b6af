"""Verification: which draft tokens does the target keep? Pure functions over token ids and probability tensors.

No model, no cache: the loop hands in what the target computed and gets back how many draft tokens survive and
which token comes next. Unless said otherwise the rules are Leviathan et al. 2023, Algorithm 1.

Terms (used everywhere in hf_specdec):

- draft tokens: the k tokens a drafter proposes for one round.
- accepted tokens: the leading draft tokens the target keeps.
- recovered token: when draft token i is rejected, the token emitted in its place, drawn from the residual
  distribution norm(max(0, target_probs_i - draft_probs_i)) (greedy: the target's argmax at i).
- bonus token: when all k draft tokens are accepted, one more token drawn from the target's distribution at the
  position after the last draft token (greedy: its argmax).
- output tokens of a round = accepted tokens + one recovered or bonus token, so a round emits 1..k+1 tokens.

All distributions are the *processed* ones: the same logits processors and warpers (temperature, top-k/p,
repetition penalty, user processors) applied to the draft and to the target, each at its own correct prefix.
``draft_probs`` must be exactly the distribution each draft token was sampled from; a deterministic drafter
(greedy draft model, n-gram pool) passes ``None`` and is treated as one-hot, which keeps sampling lossless.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Verdict(NamedTuple):
    num_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # the recovered token (num_accepted < k) or the bonus token (num_accepted == k)


def verify_greedy(
    draft_token_ids: torch.LongTensor,  # [k]
    target_token_ids: torch.LongTensor,  # [k + 1] argmax of the processed target logits at each position
) -> Verdict:
    """Longest prefix of the draft equal to the target's argmax, plus the target's own next token."""
    k = draft_token_ids.shape[0]
    assert target_token_ids.shape == (k + 1,), f"target_token_ids must be [k+1]={k + 1}, got {tuple(target_token_ids.shape)}"
    mismatch = (draft_token_ids != target_token_ids[:k]).int()
    # cumsum(mismatch) stays 0 exactly over the accepted prefix
    num_accepted = int((mismatch.cumsum(0) == 0).sum())
    return Verdict(num_accepted, int(target_token_ids[num_accepted]))


def verify_sampled(
    draft_token_ids: torch.LongTensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab] distributions the draft tokens were sampled from; None = one-hot
    target_probs: torch.Tensor,  # [k + 1, vocab] processed target distributions
    uniforms: torch.Tensor | None = None,  # [k] U(0,1) draws for the accept tests (drawn here if None)
    generator: torch.Generator | None = None,
) -> Verdict:
    """Rejection sampling: accept draft token i with probability min(1, target/draft), resample on rejection.

    The output token at every position is distributed exactly as ``target_probs`` (Leviathan et al., Thm 1).
    """
    k = draft_token_ids.shape[0]
    assert target_probs.ndim == 2 and target_probs.shape[0] == k + 1, "target_probs must be [k+1, vocab]"
    assert draft_probs is None or draft_probs.shape == (k, target_probs.shape[1]), "draft_probs must be [k, vocab]"
    positions = torch.arange(k, device=target_probs.device)
    target_of_draft = target_probs[positions, draft_token_ids]  # [k]
    if draft_probs is None:
        ratio = target_of_draft  # one-hot draft: accept with probability target(x) / 1
    else:
        draft_of_draft = draft_probs[positions, draft_token_ids]  # [k], > 0 since the token was sampled from it
        ratio = target_of_draft / draft_of_draft
    if uniforms is None:
        uniforms = torch.rand(k, device=target_probs.device, generator=generator)
    accepted = uniforms <= ratio
    num_accepted = int(accepted.int().cumprod(0).sum())

    if num_accepted == k:  # bonus token
        return Verdict(k, _sample(target_probs[k], generator))
    # recovered token, from the residual norm(max(0, target - draft)) at the first rejected position
    target_row = target_probs[num_accepted]
    if draft_probs is None:
        residual = target_row.clone()
        residual[draft_token_ids[num_accepted]] = 0.0
    else:
        residual = (target_row - draft_probs[num_accepted]).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # only reachable through rounding when the two rows are equal
        residual = target_row
    return Verdict(num_accepted, _sample(residual, generator))


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalised non-negative ``weights`` [vocab]."""
    return int(torch.multinomial(weights.float() / weights.sum(), 1, generator=generator))
