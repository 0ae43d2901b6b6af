"""``hf_specdec.distill``: distillation raises a tiny drafter's greedy agreement with its target, a resumed run is
the uninterrupted one, the saved drafter loads and drafts with exact greedy parity, starts copy the right layers,
and unknown names are refused with the valid choices."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hf_specdec
from hf_specdec import distill as distill_module
from hf_specdec.distill import (DistillLoss, DraftStart, StartKind, TeacherRows, build_start, distill, distill_loss,
                                keep_layers)
from hf_specdec.models import load_model
from hf_specdec.models.tiny import char_tokenizer, tiny_model, tiny_model_dir, word_tokenizer

STEPS = 40  # at lr 3e-3 a random 1-layer drafter learns the tiny target's most frequent choices in this budget
RUN = dict(start="config:1", loss="tvd", continuation_tokens=16, batch_size=4, lr=3e-3, progress=False)
NEW = 32


def prompts(count: int = 24, seed: int = 7) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (8,), generator=generator).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def run(teacher, tmp_path_factory):
    """One distillation of a random 1-layer drafter (16 training prompts, 8 held out), saved to a folder."""
    out = tmp_path_factory.mktemp("distilled")
    data = prompts()
    report = distill(teacher, None, data[:16], heldout=data[16:], steps=STEPS, output_dir=out, save_every=20,
                     tokenizer=char_tokenizer(), **RUN)
    return report, out


def test_distillation_raises_greedy_agreement(run):
    report, out = run
    assert report.steps == STEPS and report.tokens == STEPS * 4 * 16  # 4 sequences of 16 continuation tokens
    assert report.train_sequences == 16 and report.heldout_sequences == 8 and report.teacher_format == "full fp32"
    # a random drafter agrees with the target about 1 time in 96; 40 steps lift it on prompts it never saw
    assert report.agreement_before < 0.05
    assert report.agreement_after > report.agreement_before + 0.1, report.summary()
    assert report.tvd_after < report.tvd_before
    assert report.expected_tokens_after[4] > report.expected_tokens_before[4]
    assert report.train_agreement_after > report.train_agreement_before + 0.1
    saved = json.loads((out / distill_module.REPORT_FILE).read_text())
    assert saved == json.loads(json.dumps(report.to_dict())) and "drafter" not in saved


def test_the_report_gives_c_and_the_speedup_the_cost_model_predicts(teacher, run, monkeypatch):
    """c comes from the check's probe and the speedup from the check's prediction. On a virtual clock (a flat 1-s
    target forward, a 0.05-s drafter step) c is exactly 0.05; a drafter that agrees everywhere is predicted to pay
    (k >= 1, above 1x), one that never agrees gets plain decoding (k = 0, 1.0x)."""
    from types import SimpleNamespace

    from hf_specdec import costmodel
    from tests.clock import VirtualClock

    report, _ = run
    assert report.c is not None and report.c > 0 and report.k_before is not None and report.k_after is not None
    assert (report.k_after == 0) == (report.speedup_after == 1.0) and "c = " in report.summary()
    clock = VirtualClock(monkeypatch)
    monkeypatch.setattr(costmodel, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    clock.charge(monkeypatch, teacher, lambda n: 1.0, name="target")
    drafter = build_start(DraftStart.parse("config:1"), teacher, None, seed=0, rows=teacher.config.vocab_size)
    clock.charge(monkeypatch, drafter, lambda n: 0.05, name="draft")
    example = distill_module.Example(torch.arange(24), 8, None)
    every = {"alpha": 1.0, "expected_tokens_measured": {str(k): k + 1.0 for k in range(1, 9)}}
    never = {"alpha": 0.0, "expected_tokens_measured": {str(k): 1.0 for k in range(1, 9)}}
    found = distill_module.predict_speed(teacher, drafter, [example], {"before": never, "after": every})
    assert found["c"] == pytest.approx(0.05)
    assert found["k_before"] == 0 and found["speedup_before"] == 1.0
    assert found["k_after"] >= 1 and found["speedup_after"] > 2.0, found


def test_each_predicted_speedup_is_the_reports_own_figures(run):
    """The report's speedups are its own figures: at the k it gives, its held-out expected tokens per round over
    that round's price in target steps, k c + v(k + 1) (``verify_cost``), 1.0 exactly at k = 0; and no other k of
    its figures beats a k > 0 it gives."""
    report, out = run
    assert report.verify_cost is not None and sorted(report.verify_cost) == list(range(distill_module.SPEED_MAX_K + 1))
    assert report.verify_cost[0] == pytest.approx(1.0)  # a plain step is the unit
    for k, speedup, expected in ((report.k_before, report.speedup_before, report.expected_tokens_before),
                                 (report.k_after, report.speedup_after, report.expected_tokens_after)):
        rates = {j: expected[j] / (j * report.c + report.verify_cost[j]) for j in expected}
        if k == 0:  # no k > 0 pays at these figures
            assert speedup == 1.0 and max(rate for j, rate in rates.items() if j > 0) <= 1.0, rates
        else:
            assert speedup == pytest.approx(rates[k], rel=1e-9), (k, rates)
            assert speedup > 1.0 and speedup == pytest.approx(max(rates.values()), rel=1e-9), (k, rates)
    saved = json.loads((out / distill_module.REPORT_FILE).read_text())
    assert {int(k): v for k, v in saved["verify_cost"].items()} == report.verify_cost


def test_a_drafter_that_pays_gets_the_speedup_of_its_own_figures(teacher, monkeypatch, tmp_path):
    """On a virtual clock (a target forward 1 s whatever its width, any other forward 0.05 s) a drafter that is the
    target's own two layers agrees everywhere: its report gives c = 0.05 exactly, every v(k + 1) = 1, the longest
    k, and the speedup its expected tokens make at that price, (k + 1) / (k c + 1)."""
    from types import SimpleNamespace

    from hf_specdec import costmodel
    from tests.clock import VirtualClock

    clock = VirtualClock(monkeypatch)
    monkeypatch.setattr(costmodel, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    clock.charge(monkeypatch, teacher, lambda n: 1.0, name="target")
    forward = type(teacher).forward

    def drafter_step(model, *args, **kwargs):  # the drafter is built inside distill(): its class is charged
        clock.now += 0.05
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(type(teacher), "forward", drafter_step)  # the teacher's own (instance) forward comes first
    data = prompts()
    report = distill(teacher, None, data[:4], heldout=data[16:], steps=0, output_dir=tmp_path,
                     **{**RUN, "start": "target_first:2"})
    k = distill_module.SPEED_MAX_K
    assert report.agreement_after == 1.0 and report.expected_tokens_after[k] == pytest.approx(k + 1)
    assert report.c == pytest.approx(0.05) and list(report.verify_cost.values()) == pytest.approx([1.0] * (k + 1))
    assert report.k_after == k and report.speedup_after == pytest.approx((k + 1) / (k * 0.05 + 1.0))


def test_zero_steps_leave_the_drafter_as_it_started(teacher, run, tmp_path):
    """The negative control: the same start and data, no steps: the agreement stays where it started."""
    report, out = run
    shutil.copy(out / distill_module.TEACHER_FILE, tmp_path / distill_module.TEACHER_FILE)
    data = prompts()
    idle = distill(teacher, None, data[:16], heldout=data[16:], steps=0, output_dir=tmp_path, **RUN)
    assert idle.agreement_after == idle.agreement_before == report.agreement_before
    assert idle.tokens == 0 and idle.final_loss is None and idle.teacher_s == 0.0


def test_resume_continues_to_the_same_drafter(teacher, run, tmp_path):
    report, out = run
    data = prompts()
    shutil.copy(out / distill_module.TEACHER_FILE, tmp_path / distill_module.TEACHER_FILE)  # same continuations
    half = distill(teacher, None, data[:16], heldout=data[16:], steps=STEPS // 2, output_dir=tmp_path,
                   save_every=10, **RUN)
    assert half.teacher_s == 0.0  # read from teacher.pt, not generated again
    resumed = distill(teacher, None, data[:16], heldout=data[16:], steps=STEPS, output_dir=tmp_path,
                      save_every=10, resume=True, **RUN)
    assert resumed.resumed_from == STEPS // 2 and resumed.steps == STEPS and resumed.tokens == report.tokens
    whole, again = report.drafter.state_dict(), resumed.drafter.state_dict()
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    assert resumed.agreement_after == report.agreement_after
    assert resumed.agreement_before == report.agreement_before  # the start's scores travel with the checkpoint


def test_training_without_the_target_reads_its_cached_continuations(run, tmp_path):
    """target=None (a machine that cannot hold target and training at once): the continuations come from
    teacher.pt, and without one the run is refused before anything is built."""
    report, out = run
    data = prompts()
    with pytest.raises(ValueError, match=r"target=None reads the target's continuations from "
                                         r"output_dir/teacher.pt, but there is none"):
        distill(None, tiny_model("llama", seed=1), data[:16], heldout=data[16:], steps=2, output_dir=tmp_path,
                **{**RUN, "start": "draft_first:1"})
    shutil.copy(out / distill_module.TEACHER_FILE, tmp_path / distill_module.TEACHER_FILE)
    alone = distill(None, tiny_model("llama", seed=1), data[:16], heldout=data[16:], steps=2, output_dir=tmp_path,
                    **{**RUN, "start": "draft_first:1"})
    assert alone.teacher_s == 0.0 and alone.target_params == report.target_params and alone.steps == 2
    assert alone.heldout_sequences == 8 and alone.teacher_format == report.teacher_format
    with pytest.raises(ValueError, match=r"start 'config:1' builds on the target: pass it"):
        distill(None, None, data[:16], heldout=data[16:], steps=2, output_dir=tmp_path, **RUN)


def test_resume_refuses_other_settings(teacher, run, tmp_path):
    _, out = run
    data = prompts()
    shutil.copytree(out, tmp_path / "run")
    with pytest.raises(ValueError, match=r"other settings \(lr: 0\.003 there, 0\.01 now\)"):
        distill(teacher, None, data[:16], heldout=data[16:], steps=STEPS + 5, output_dir=tmp_path / "run",
                resume=True, **{**RUN, "lr": 1e-2})


def test_saved_drafter_loads_and_drafts_with_greedy_parity(teacher, run, monkeypatch):
    """The folder holds a model load_model takes; as generate(assistant_model=) it is exact and drafts (costs
    injected: a draft step 5% of a flat target forward, so drafting pays on any machine)."""
    from tests.clock import VirtualClock

    _, out = run
    draft, _, info = load_model(str(out), dtype="fp32")
    assert info.kind == "pretrained" and draft.config.num_hidden_layers == 1
    assert draft.get_output_embeddings().weight.shape[0] == teacher.config.vocab_size
    model = tiny_model("llama", seed=0)
    prompt = torch.tensor([prompts(25)[24]])  # not one it was trained or scored on
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False)
    hf_specdec.enable(model)
    clock = VirtualClock(monkeypatch)
    clock.charge(monkeypatch, model, lambda n: 1.0, name="target")
    clock.charge(monkeypatch, draft, lambda n: 0.05, name="draft")
    out_ids = model.generate(prompt, assistant_model=draft, max_new_tokens=NEW, do_sample=False,
                             spec_config=hf_specdec.SpecConfig(history_lookup=False))
    assert torch.equal(out_ids, expected)
    stats = model.last_spec_stats.get()
    assert stats.drafted > 0 and stats.accepted > 0, stats.summary()


def test_continuations_batched_by_length_are_the_one_at_a_time_ones():
    from hf_specdec.distill import TeacherFormat, continue_prompts

    model = tiny_model("llama", seed=0)
    data = prompts(5) + [prompts(1, seed=3)[0][:5]]  # five of 8 tokens, one of 5
    fmt = TeacherFormat(None, "float32")
    together, alone = (continue_prompts(model, data, 10, fmt, batch_size=b) for b in (4, 1))
    for a, b in zip(together, alone):
        assert torch.equal(a.ids, b.ids) and a.prompt_len == b.prompt_len
        assert torch.allclose(a.teacher.logprobs, b.teacher.logprobs, atol=1e-5)
    stop = int(alone[0].ids[8 + 3])  # the 4th token of the first continuation ends the text from now on
    model.generation_config.eos_token_id = stop
    cut = continue_prompts(model, data[:4], 10, fmt, batch_size=4)[0]
    assert cut.new_tokens == 1 + alone[0].ids[8:].tolist().index(stop) and int(cut.ids[-1]) == stop
    assert cut.teacher.logprobs.shape[0] == cut.new_tokens


def test_top_k_teacher_rows_train_too(teacher):
    data = prompts(6)
    report = distill(teacher, None, data[:4], heldout=data[4:], steps=10, teacher_memory_bytes=1000,
                     teacher_top_k=8, **{**RUN, "continuation_tokens": 8})
    assert report.teacher_format == "top-8 (+ one bin for the rest) fp32"
    assert report.tvd_after < report.tvd_before


@pytest.mark.parametrize("loss", list(DistillLoss))
def test_top_k_loss_is_a_lower_bound_of_the_full_loss(loss):
    generator = torch.Generator().manual_seed(0)
    teacher_logits, student = torch.randn(32, 50, generator=generator) * 3, torch.randn(32, 50, generator=generator)
    logp = torch.log_softmax(teacher_logits, -1)
    full = distill_loss(student, TeacherRows(logp, None), loss)
    values, ids = logp.topk(10, -1)
    top = distill_loss(student, TeacherRows(values, ids), loss)
    assert bool((top <= full + 1e-6).all()) and bool((top > 0).all())
    exact = distill_loss(student, TeacherRows(*logp.topk(49, -1)), loss)  # all but one token: only that bin
    assert torch.allclose(exact, full, atol=1e-5)


def test_unknown_loss_and_start_are_refused_with_the_choices(teacher):
    with pytest.raises(ValueError, match=r"^unknown loss 'kl': use one of tvd, forward_kl$"):
        distill(teacher, None, prompts(4), loss="kl", progress=False)
    with pytest.raises(ValueError, match=r"^unknown start 'pruned': use one of draft, draft_spread:N, "
                                         r"draft_first:N, target_first:N or config:N$"):
        distill(teacher, None, prompts(4), start="pruned:2", progress=False)
    with pytest.raises(ValueError, match=r"start 'target_first' needs a layer count >= 1, got None"):
        DraftStart.parse("target_first")
    with pytest.raises(ValueError, match=r"needs a draft model to start from"):
        distill(teacher, None, prompts(4), start="draft_spread:1", progress=False)


def test_target_first_copies_the_targets_layers_and_leaves_it_alone(teacher, prompt):
    whole = build_start(DraftStart(StartKind.TARGET_FIRST, 2), teacher)  # every layer: the same function
    assert torch.equal(whole(prompt).logits, teacher(prompt).logits)
    first = build_start(DraftStart.parse("target_first:1"), teacher)
    assert first.config.num_hidden_layers == 1 and teacher.config.num_hidden_layers == 2
    assert torch.equal(first.model.layers[0].mlp.up_proj.weight, teacher.model.layers[0].mlp.up_proj.weight)
    with torch.no_grad():
        first.model.layers[0].mlp.up_proj.weight.add_(1.0)  # a copy: training it never touches the target
    assert not torch.equal(first.model.layers[0].mlp.up_proj.weight, teacher.model.layers[0].mlp.up_proj.weight)


def test_pruned_draft_keeps_spread_layers_and_layer_types():
    draft = tiny_model("qwen2", seed=3, num_hidden_layers=5, use_sliding_window=True, sliding_window=16,
                       max_window_layers=2)
    assert draft.config.layer_types[:3] == ["full_attention", "full_attention", "sliding_attention"]
    pruned = build_start(DraftStart.parse("draft_spread:3"), draft, draft)
    assert pruned.config.num_hidden_layers == 3  # layers 0, 2, 4
    assert pruned.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    for new, old in enumerate((0, 2, 4)):
        assert torch.equal(pruned.model.layers[new].self_attn.q_proj.weight, draft.model.layers[old].self_attn.q_proj.weight)
        assert pruned.model.layers[new].self_attn.layer_idx == new  # caches index the kept layers
    first = keep_layers(draft, [0, 1])
    ids = torch.tensor([[1, 2, 3]])
    for model in (first, pruned):  # a cached decode on the pruned stack is the same as recomputing every step
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
        assert out.shape == (1, 23)
        assert torch.equal(out, model.generate(ids, max_new_tokens=20, do_sample=False, use_cache=False))


def test_draft_vocabulary_is_padded_to_the_targets(teacher):
    small = tiny_model("llama", seed=2, vocab=90)
    drafter = build_start(DraftStart.parse("draft"), teacher, small)
    assert drafter.get_input_embeddings().weight.shape[0] == 96
    assert drafter.get_output_embeddings().weight.shape[0] == 96 and drafter.config.vocab_size == 96
    assert small.get_output_embeddings().weight.shape[0] == 90  # the given draft is untouched


def test_cli_distills_from_a_text_file(tmp_path, capsys):
    from hf_specdec.cli import main

    target = tiny_model_dir(tmp_path / "target", tokenizer=word_tokenizer(), layers=2)
    text = "\n\n".join(["def sort x", "for i in list", "return value if key", "class stack self",
                        "import json path", "print the result"]) + "\n"
    (tmp_path / "prompts.txt").write_text(text)
    out = tmp_path / "drafter"
    code = main(["distill", "--target", str(target), "--start", "target_first:1", "--prompts",
                 str(tmp_path / "prompts.txt"), "--out", str(out), "--steps", "4", "--continuation-tokens", "4",
                 "--dtype", "fp32", "--device", "cpu", "--quiet", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 4 and report["train_sequences"] == 5 and report["heldout_sequences"] == 1
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "checkpoint" / "trainer.pt").is_file() and (out / "teacher.pt").is_file()
    code = main(["distill", "--target", str(target), "--start", "pruned:1", "--prompts", str(tmp_path / "prompts.txt"),
                 "--out", str(out), "--dtype", "fp32", "--quiet"])
    assert code == 2
    assert "unknown start 'pruned': use one of draft, draft_spread:N" in capsys.readouterr().err
