"""Task loading (a few HumanEval problems, chat/edit styles, JSONL) and turning outputs into programs."""

import json

import pytest

from eval.sandbox import Limits, run_program
from eval.tasks import build_program, extract_code, load_task, truncate_completion


class FakeTokenizer:
    chat_template = "chatml"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages) + "<|assistant|>"


TOK = FakeTokenizer()
LIMITS = Limits(timeout_s=5, cpu_s=5)


def test_humaneval_completion_style():
    samples = load_task("humaneval", TOK, limit=3)
    assert [s.id for s in samples] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert samples[0].text == samples[0].problem["prompt"] and samples[0].style == "completion"


def test_humaneval_chat_and_edit_styles():
    chat = load_task("humaneval_chat", TOK, limit=2)
    assert chat[0].text.startswith("<|user|>") and chat[0].problem["prompt"] in chat[0].text
    edit = load_task("humaneval_edit", TOK, limit=2)
    p = edit[1].problem
    assert (p["prompt"] + p["canonical_solution"]) in edit[1].text
    assert "type hints" in edit[1].text and f"`{p['entry_point']}`" in edit[1].text
    assert edit[1].style == "chat"


def test_no_chat_template_falls_back_to_plain_frame():
    class Bare:
        chat_template = None

    assert load_task("humaneval_chat", Bare(), limit=1)[0].text.startswith("User: ")


def test_jsonl_task(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "def f():", "id": "x"}, {"prompt": "hello", "chat": True}, {"prompt": "third"}]) + "\n")
    samples = load_task(f"jsonl:{path}", TOK, limit=2)
    assert [s.id for s in samples] == ["x", "p/2"]
    assert samples[0].text == "def f():" and samples[1].text.startswith("<|user|>hello")
    assert build_program(samples[0], "anything") is None
    path.write_text('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n')
    with pytest.raises(ValueError, match="duplicate"):
        load_task(f"jsonl:{path}", TOK)
    with pytest.raises(ValueError, match="unknown task"):
        load_task("mbpp", TOK)


def test_truncation_and_extraction():
    assert truncate_completion("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert truncate_completion("    return 1\n# test\nprint(1)") == "    return 1"
    answer = "Sure:\n```python\ndef f():\n    return 1\n```\nand\n```python\nx = 2\n```"
    assert extract_code(answer) == "def f():\n    return 1\n"
    assert extract_code("```\ny = 1\n```") == "y = 1\n"
    assert extract_code("no fences") == "no fences"


def test_canonical_solutions_pass_and_wrong_ones_fail():
    comp = load_task("humaneval", TOK, limit=2)[1]
    good = comp.problem["canonical_solution"] + "\n\ndef junk():\n    raise SystemExit(1)\n"
    assert run_program(build_program(comp, good), LIMITS).passed
    assert not run_program(build_program(comp, "    return []\n"), LIMITS).passed

    edit = load_task("humaneval_edit", TOK, limit=1)[0]
    code = edit.problem["prompt"] + edit.problem["canonical_solution"]
    assert run_program(build_program(edit, f"Here it is:\n```python\n{code}```\n"), LIMITS).passed
    renamed = code.replace(f"def {edit.problem['entry_point']}(", "def renamed(")
    assert not run_program(build_program(edit, f"```python\n{renamed}```"), LIMITS).passed
