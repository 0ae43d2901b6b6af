"""Interleaved, resumable timing loop.

Order: ``for repeat: for seed: for prompt: for mode`` -- every prompt is decoded by all modes back to back, so
slow drift of the machine (thermal, other load) hits every mode alike; repeats are spread over the whole run
rather than bunched. The modes' order changes from prompt to prompt (``interleave.py``: A B C, B C A, C A B and
their mirrors) so that no mode always runs in the same place or right after the same mode. Every mode gets the
same prompt text, tokenizer, max_new_tokens, dtype and seed (the seed is set right before each call).

Each finished generation is appended to ``OUT/rows.jsonl`` at once (flushed), keyed by
``(task, prompt_id, mode, repeat, seed)``; a rerun with the same ``--out`` skips the keys already there.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hf_specdec.harness import warm_up

from .interleave import order

ROWS = "rows.jsonl"


def row_key(row: dict[str, Any]) -> tuple:
    return (row["task"], str(row["prompt_id"]), row["mode"], int(row["repeat"]), int(row["seed"]))


def plan(samples: list, modes: list[str], repeats: int, seeds: list[int]) -> list[tuple[int, int, Any, str]]:
    """The run order: (repeat, seed, sample, mode) tuples, modes innermost (interleaved per prompt), the modes of
    each prompt in the next order of a balanced Latin square (``interleave.order``: over every few prompts each
    mode runs in every position and right after every other mode equally often)."""
    prompts = [(r, seed, s) for r in range(repeats) for seed in seeds for s in samples]
    return [(r, seed, s, m) for i, (r, seed, s) in enumerate(prompts) for m in order(modes, i)]


def read_rows(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(out_dir) / ROWS
    rows = []
    if path.exists():
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a row cut short by a crash: it is simply run again
    return rows


def warmup(generate: Callable[..., dict], samples: list, modes: list[str], rounds: int, max_new_tokens: int) -> None:
    """Untimed calls of every mode on the first prompt (``hf_specdec.harness.warm_up``); a mode that fails
    here is reported and skipped (its timed calls record the error per row)."""
    if not samples:
        return
    failed = warm_up(lambda mode: generate(mode, samples[0], 0, max_new_tokens), modes, rounds)
    for mode, error in failed.items():
        print(f"warning: warm-up of {mode} failed: {error}", file=sys.stderr)


def run(
    generate: Callable[[str, Any, int, int | None], dict[str, Any]],
    samples: list,
    modes: list[str],
    out_dir: str | os.PathLike,
    repeats: int = 1,
    seeds: Iterable[int] = (0,),
    warmup_rounds: int = 1,
    warmup_tokens: int = 16,
    progress: bool = True,
    on_error: str = "record",
) -> list[dict[str, Any]]:
    """Run the plan, skipping keys already in ``OUT/rows.jsonl``; returns all rows (old and new).

    ``generate(mode, sample, seed, max_new_tokens)`` returns the measurement dict of one generation.
    With ``on_error="record"`` a failing call is stored as a row with an ``error`` field (so one broken mode does
    not lose the others' numbers); ``"raise"`` re-raises.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = read_rows(out)
    done = {row_key(r) for r in rows if not r.get("error")}
    rows = [r for r in rows if not r.get("error")]  # failed rows are retried
    todo = [
        (r, seed, s, m)
        for (r, seed, s, m) in plan(samples, modes, repeats, list(seeds))
        if (s.task, str(s.id), m, r, seed) not in done
    ]
    if not todo:
        return rows
    warmup(lambda m, s, seed, n: generate(m, s, seed, n), samples, modes, warmup_rounds, warmup_tokens)
    bar = tqdm(total=len(todo), desc="decoding", unit="gen", disable=not progress)
    path = out / ROWS
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"  # a row cut short by a crash: start a fresh line after it
    else:
        torn = False
    with open(path, "a", encoding="utf-8") as fh:
        if torn:
            fh.write("\n")
        for repeat, seed, sample, mode in todo:
            key = {"task": sample.task, "prompt_id": str(sample.id), "mode": mode, "repeat": repeat, "seed": seed}
            try:
                measured = generate(mode, sample, seed, None)
            except Exception as err:  # noqa: BLE001
                if on_error == "raise":
                    raise
                measured = {"error": f"{type(err).__name__}: {err}"}
            row = {**key, "style": sample.style, **measured}
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            if not row.get("error"):
                rows.append(row)
            bar.set_postfix_str(f"{mode} {sample.id}")
            bar.update(1)
    bar.close()
    return rows
