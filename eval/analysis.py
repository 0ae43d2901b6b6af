"""Model-side analysis after decoding, cached in OUT/analysis.json: the teacher-forced probe (target margins
over plain greedy output, draft agreement for the oracle bound, per-sample agreement under sampling) and the
harness-measured costs c and v(n) (``hf_specdec.harness.measure_costs``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_specdec.harness import measure_costs
from hf_specdec.harness.margins import teacher_forced

from .report import _first_rows, _load_json

COST_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
COST_REPEATS = 7


def analyze(out: Path, rows, prompt_ids: dict[str, list[int]], target, draft, threshold: float, dtype: str,
            temperature: float, progress: bool = True) -> None:
    """Margins of the target over plain greedy output, teacher-forced draft agreement (oracle), costs, and
    (sampling) each sampled row's draft agreement; ``prompt_ids``: sample id -> the encoded prompt."""
    path = out / "analysis.json"
    analysis = _load_json(path)
    analysis.update(dtype=dtype, tie_threshold=threshold)
    margins = analysis.setdefault("margins", {})
    agreement = analysis.setdefault("draft_agreement", {})
    target_match = analysis.setdefault("target_argmax_matches_plain", {})
    sample_agreement = analysis.setdefault("sample_agreement", {})
    first = {(mode, pid, seed): r for (pid, mode, seed), r in _first_rows(rows).items() if pid in prompt_ids}
    todo = [(k, r) for k, r in first.items() if k[0] == "plain" or (temperature > 0 and draft is not None)]
    bar = tqdm(total=len(todo), desc="analysis", unit="seq", disable=not progress)
    for (mode, pid, seed), r in todo:
        pkey = f"{pid}|{seed}"
        ids = prompt_ids[pid]
        if mode == "plain" and temperature == 0 and pkey not in margins:
            tf = teacher_forced(target, ids, r["output_ids"])
            margins[pkey] = [round(m, 4) for m in tf["margin"]]
            target_match[pkey] = sum(a == b for a, b in zip(tf["argmax"], r["output_ids"])) / max(1, len(tf["argmax"]))
            if draft is not None:
                dtf = teacher_forced(draft, ids, r["output_ids"])
                agreement[pkey] = [a == b for a, b in zip(dtf["argmax"], r["output_ids"])]
        if temperature > 0 and draft is not None and f"{mode}|{pkey}" not in sample_agreement:
            dtf = teacher_forced(draft, ids, r["output_ids"])
            n = max(1, len(r["output_ids"]))
            sample_agreement[f"{mode}|{pkey}"] = sum(a == b for a, b in zip(dtf["argmax"], r["output_ids"])) / n
        bar.update(1)
    bar.close()
    if "costs" not in analysis and prompt_ids:
        prefix = torch.tensor([next(iter(prompt_ids.values()))])  # [1, L] the first sample's prompt
        analysis["costs"] = measure_costs(target, draft, prefix, COST_SIZES, COST_REPEATS)
    path.write_text(json.dumps(analysis))
