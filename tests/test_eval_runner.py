"""Runner: interleaved order (every mode per prompt, balanced over prompts), warm-up, error rows, resume after an
interruption."""

import json

import pytest

from eval import runner
from eval.tasks import Sample

SAMPLES = [Sample("t", f"p{i}", f"text {i}", "completion") for i in range(2)]
MODES = ["plain", "b", "c"]


class FakeGen:
    def __init__(self, fail_at=None, broken_mode=None):
        self.calls, self.fail_at, self.broken_mode = [], fail_at, broken_mode

    def __call__(self, mode, sample, seed, max_new_tokens):
        self.calls.append((mode, sample.id, seed, max_new_tokens))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise KeyboardInterrupt  # the run is killed here
        if mode == self.broken_mode:
            raise RuntimeError("mode broken")
        return {"new_tokens": 3, "e2e_s": 0.1, "output_ids": [1, 2, 3]}


def test_order_is_interleaved_per_prompt_with_warmup(tmp_path):
    gen = FakeGen()
    rows = runner.run(gen, SAMPLES, MODES, tmp_path, repeats=2, seeds=[7], warmup_rounds=1, warmup_tokens=4,
                      progress=False)
    warm, timed = gen.calls[:3], gen.calls[3:]
    assert warm == [(m, "p0", 0, 4) for m in MODES]
    # three modes: A B C, B C A, C A B, then the mirrors C B A, ... (eval/interleave.py)
    orders = [["plain", "b", "c"], ["b", "c", "plain"], ["c", "plain", "b"], ["c", "b", "plain"]]
    expected = [(m, s.id, 7, None) for i, s in enumerate(SAMPLES * 2) for m in orders[i]]
    assert timed == expected
    assert [(r["mode"], r["prompt_id"], r["repeat"]) for r in rows] == [
        (m, s.id, i // 2) for i, s in enumerate(SAMPLES * 2) for m in orders[i]]
    assert len(runner.read_rows(tmp_path)) == 12


def test_resume_skips_done_rows(tmp_path):
    gen = FakeGen(fail_at=3 + 4)  # 3 warm-up calls, then die on the 4th timed call
    with pytest.raises(KeyboardInterrupt):
        runner.run(gen, SAMPLES, MODES, tmp_path, repeats=1, warmup_rounds=1, progress=False)
    assert len(runner.read_rows(tmp_path)) == 3
    # a row cut in half by the crash is ignored and redone
    with open(tmp_path / runner.ROWS, "a") as fh:
        fh.write('{"task": "t", "prompt_id"')
    gen2 = FakeGen()
    rows = runner.run(gen2, SAMPLES, MODES, tmp_path, repeats=1, warmup_rounds=0, progress=False)
    assert [(c[0], c[1]) for c in gen2.calls] == [("b", "p1"), ("c", "p1"), ("plain", "p1")]  # p1's order
    keys = [runner.row_key(r) for r in rows]
    assert len(keys) == len(set(keys)) == 6
    # nothing left: a third run decodes nothing (and skips the warm-up)
    gen3 = FakeGen()
    runner.run(gen3, SAMPLES, MODES, tmp_path, repeats=1, progress=False)
    assert gen3.calls == []


def test_broken_mode_is_recorded_and_retried(tmp_path):
    gen = FakeGen(broken_mode="b")
    rows = runner.run(gen, SAMPLES, MODES, tmp_path, repeats=1, warmup_rounds=1, progress=False)
    assert {r["mode"] for r in rows} == {"plain", "c"}
    on_disk = [json.loads(x) for x in (tmp_path / runner.ROWS).read_text().splitlines()]
    assert sum("error" in r for r in on_disk) == 2 and "mode broken" in on_disk[1]["error"]
    gen2 = FakeGen()
    rows = runner.run(gen2, SAMPLES, MODES, tmp_path, repeats=1, warmup_rounds=0, progress=False)
    assert [c[0] for c in gen2.calls] == ["b", "b"] and len(rows) == 6


def test_plan_seeds_and_repeats():
    plan = runner.plan(SAMPLES, ["a", "b"], repeats=2, seeds=[0, 1])
    assert len(plan) == 2 * 2 * 2 * 2
    assert [(r, s, smp.id, m) for r, s, smp, m in plan[:4]] == [
        (0, 0, "p0", "a"), (0, 0, "p0", "b"), (0, 0, "p1", "b"), (0, 0, "p1", "a")]  # b follows a, then a b
