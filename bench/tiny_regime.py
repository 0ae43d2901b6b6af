"""The tiny-model regime: forwards cost a fraction of a millisecond, so the host's work between them decides the speed
(a GPU running a compiled forward is in the same regime). Issue 41's preset.

    python bench/tiny_regime.py --out results/tiny_regime      # 256 new tokens, 10 prompts, one thread
    python bench/tiny_regime.py --tiny --out /tmp/smoke         # smoke run: 16 new tokens, 5 prompts

The pair: a tiny Llama target (4 layers, width 128, fp32) whose last 3 layers add nothing (their output projections
are zero, so the residual stream passes through them unchanged: x + 0 is x exactly) and, as draft, a 1-layer model
holding the target's first layer, embeddings, norm and head. The draft therefore agrees with the target on every
token: every round of every speculative mode keeps all it drafts, and the modes differ only in how many rounds
they run and in the host work around the forwards. Forward hooks (pre and post, on each model's decoder and output
layer) time every target and draft forward, so each call's time splits into forwards and the rest ("host").

Modes, interleaved per prompt in the orders of a balanced Latin square (``eval/interleave.py``):

    plain            transformers' greedy ``generate``
    hf_k4            transformers' assisted generation, k = 4 every round (num_assistant_tokens=4, schedule
                     "constant", assistant_confidence_threshold=0)
    hf_default       transformers' assisted generation with its defaults
    specdec_k4       hf_specdec with policy "fixed", k = 4, the same draft
    specdec_default  hf_specdec's defaults (``enable(model)``, ``assistant_model=draft``)
    bare_k4          no library's loop: gpt-fast's speculative step written out by hand over the same forwards
                     (``bare_speculative``: a dynamic cache per model, rollback by cropping, one host read a round).
                     What any loop around these forwards could reach here, measured rather than argued

Each mode decodes one warm-up call first; throughput = total new tokens / total seconds. The report gives, per
mode, tok/s, host seconds, target forwards and host milliseconds per round, whether every output is identical to
plain, and the ratios the issue states bars for: host(specdec_k4) / host(hf_k4), tok/s(specdec_k4) / tok/s(hf_k4),
tok/s(specdec_default) / tok/s(hf_default); and the ceiling of the k = 4 throughput ratio on this machine: hf_specdec's
tokens over its forwards' seconds alone (no host work at all) against transformers' tok/s, which no host work can
beat (the same draft and target forwards on both sides); and the hand-written loop's tok/s over transformers'.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eval/, when run as bench/tiny_regime.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # first_call.py, beside this script

from eval.interleave import balanced, order as run_order  # noqa: E402
import hf_specdec  # noqa: E402
from first_call import machine_of, machine_words, write_report  # noqa: E402

MODES = ("plain", "hf_k4", "hf_default", "specdec_k4", "specdec_default", "bare_k4")
# ``--compiled``: the same k = 4 pair where the user asked for a static cache and a compiled forward on every device
# (the flags plain ``generate`` compiles with): transformers compiles its target forward (its assistant stays eager),
# hf_specdec its verify at fixed widths and the draft's single step; the compile runs in each mode's warm-up call
COMPILED_MODES = ("plain_static", "hf_k4_static", "specdec_k4_static")
VOCAB = 256


def tiny_regime_pair(seed: int = 0):
    """(target, draft): the target's layers 2-4 add zero to the residual stream; the draft is its first layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    return target, draft.eval()


class ForwardClock:
    """Seconds spent inside the forwards of the given modules (pre/post hooks), and how many calls."""

    def __init__(self, modules):
        self.seconds, self.calls, self._start = 0.0, 0, None
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._pre))
            self.handles.append(module.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._start = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def reset(self):
        self.seconds, self.calls = 0.0, 0


def parts(model):
    return [model.model, model.lm_head]


def bare_speculative(target, draft, prompt, new_tokens: int, k: int = 4) -> torch.LongTensor:
    """Greedy speculative decoding with nothing but the forwards: gpt-fast's ``speculative_decode`` for one row.

    Each model keeps a ``DynamicCache`` of every token it has read; ``pending`` are the tokens the draft has not
    read yet (the last emitted one, and the last draft token after a round that kept all k). A round: k draft
    steps (the first over ``pending``), one target forward over the last emitted token and the k draft tokens,
    one host read of both models' choices, then each cache cropped to the tokens kept. Forwards run as
    hf_specdec's fast lane runs them (base model, then the output layer) so that the hooks time the same calls.
    """
    from transformers import DynamicCache

    def step(model, cache, ids, start):  # logits [1, n, V] of ids at positions start..
        positions = torch.arange(start, start + ids.shape[1])[None]
        states = model.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).last_hidden_state
        return model.lm_head(states)

    target_cache, draft_cache = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    length = prompt.shape[1]
    first = step(target, target_cache, prompt, 0)[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    step(draft, draft_cache, prompt, 0)
    out, pending = [prompt, first], first
    made = 1
    while made < new_tokens:
        drafted, token = [], pending
        read = draft_cache.get_seq_length()
        for _ in range(k):
            token = step(draft, draft_cache, token, read)[:, -1:].argmax(-1)  # [1, 1]
            read += token.shape[1] if drafted else pending.shape[1]
            drafted.append(token)
        guesses = torch.cat(drafted, dim=1)  # [1, k]
        chosen = step(target, target_cache, torch.cat([out[-1][:, -1:], guesses], dim=1), length).argmax(-1)
        agree = (guesses == chosen[:, :k]).cumprod(dim=1).sum().item()  # the round's one host read
        kept = torch.cat([guesses[:, :agree], chosen[:, agree: agree + 1]], dim=1)  # [1, agree + 1]
        out.append(kept)
        made += agree + 1
        length += agree + 1  # the target read the last token and the agreed guesses; not the bonus
        target_cache.crop(length - target_cache.get_seq_length())  # (5.25's crop takes how many to remove, < 0)
        draft_cache.crop(min(0, length - draft_cache.get_seq_length()))
        pending = kept[:, -2:] if agree == k else kept[:, -1:]
    return torch.cat(out, dim=1)[:, : prompt.shape[1] + new_tokens]


def run_mode(mode: str, target, draft, prompt, new_tokens: int, **flags):
    """The mode's call: (tokens [1, P + new], stats or None)."""
    if mode == "bare_k4":
        return bare_speculative(target, draft, prompt, new_tokens), None
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **flags)
    if mode == "plain":
        return type(target).generate(target, prompt, **greedy), None
    if mode == "hf_k4":
        draft.generation_config.num_assistant_tokens = 4
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        return type(target).generate(target, prompt, assistant_model=draft, **greedy), None
    if mode == "hf_default":  # transformers' own defaults for an assistant
        from transformers import GenerationConfig

        default = GenerationConfig()
        for name in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
            setattr(draft.generation_config, name, getattr(default, name))
        return type(target).generate(target, prompt, assistant_model=draft, **greedy), None
    if mode in COMPILED_MODES:  # the user's flags for a compiled forward, on every device: the same for all three
        greedy.update(cache_implementation="static", compile_config=compile_config())
        if mode == "plain_static":
            return type(target).generate(target, prompt, **greedy), None
        if mode == "hf_k4_static":
            return run_mode("hf_k4", target, draft, prompt, new_tokens, cache_implementation="static",
                            compile_config=greedy["compile_config"])
    spec = {"policy": "fixed", "num_draft_tokens": 4} if mode in ("specdec_k4", "specdec_k4_static") else None
    out = target.generate(prompt, assistant_model=draft, spec_config=spec, **greedy)
    return out, target.last_spec_stats


def compile_config():
    """What a user sets to compile the decoding forward on a CPU too (transformers' ``CompileConfig``, asked for on
    every device): inductor, one graph per shape (``dynamic=False``), no CUDA graphs here."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True
    return config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/tiny_regime")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=None,
                        help="default: twice the number of modes, which balances the order fully (an odd number of "
                             "modes needs 2n orders)")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tiny", action="store_true", help="smoke run: 16 new tokens, 5 prompts")
    parser.add_argument("--compiled", action="store_true",
                        help=f"the modes {', '.join(COMPILED_MODES)} (static cache, compiled forwards; no forward "
                             f"hooks: a hook inside a compiled graph would time nothing)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.new_tokens, args.prompts = 16, 5
    if args.prompts is None:
        args.prompts = 2 * len(args.modes.split(","))
    if args.compiled and args.modes == ",".join(MODES):
        args.modes = ",".join(COMPILED_MODES)
        # each mode has its own copy of the pair: one model's compiled forward serves every mode that calls it,
        # and one mode's shapes (transformers' verify of 1..5 inputs, recompiled with dynamic shapes) would make
        # the graphs another mode runs; and room for every graph of every copy
        torch._dynamo.config.recompile_limit = 256
        torch._dynamo.config.accumulated_recompile_limit = 1024
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    target, draft = tiny_regime_pair()
    hf_specdec.enable(target)
    pairs = {mode: (target, draft) for mode in modes}
    if args.compiled:
        pairs = {mode: (hf_specdec.enable(copy.deepcopy(target)), copy.deepcopy(draft)) for mode in modes}
    clocks = {"target": ForwardClock([] if args.compiled else parts(target)),
              "draft": ForwardClock([] if args.compiled else parts(draft))}
    generator = torch.Generator().manual_seed(1)
    # never the padding id 0 in a prompt: plain generate() would mask it as padding, and the hand-written loop
    # reads every token
    prompts = [torch.randint(1, VOCAB, (1, args.prompt_length), generator=generator) for _ in range(args.prompts)]
    totals = {mode: dict(tokens=0, seconds=0.0, target_s=0.0, draft_s=0.0, target_forwards=0, identical=0)
              for mode in modes}
    with torch.inference_mode():
        for mode in modes:  # one warm-up call each
            run_mode(mode, *pairs[mode], prompts[0], args.new_tokens)
        for index, prompt in enumerate(prompts):
            reference = type(target).generate(target, prompt, max_new_tokens=args.new_tokens,
                                              min_new_tokens=args.new_tokens, do_sample=False)
            for mode in run_order(modes, index):
                for clock in clocks.values():
                    clock.reset()
                start = time.perf_counter()
                out, _ = run_mode(mode, *pairs[mode], prompt, args.new_tokens)
                seconds = time.perf_counter() - start
                row = totals[mode]
                row["tokens"] += out.shape[1] - prompt.shape[1]
                row["seconds"] += seconds
                row["target_s"] += clocks["target"].seconds
                row["draft_s"] += clocks["draft"].seconds
                row["target_forwards"] += clocks["target"].calls // 2  # decoder + head per forward
                row["identical"] += int(torch.equal(out, reference))
    for row in totals.values():
        row["tok_s"] = row["tokens"] / row["seconds"]
        row["host_s"] = row["seconds"] - row["target_s"] - row["draft_s"]
        rounds = max(1, row["target_forwards"] - args.prompts)  # forwards after each call's prefill
        row["host_ms_per_round"] = 1000 * row["host_s"] / rounds
    ratios = {}
    if {"specdec_k4", "hf_k4"} <= set(modes):
        ratios["host_specdec_k4_over_hf_k4"] = totals["specdec_k4"]["host_s"] / totals["hf_k4"]["host_s"]
        ratios["tok_s_specdec_k4_over_hf_k4"] = totals["specdec_k4"]["tok_s"] / totals["hf_k4"]["tok_s"]
        # the most the k = 4 ratio could be on this machine: hf_specdec's forwards alone, with no host work at all
        spec = totals["specdec_k4"]
        ratios["ceiling_tok_s_specdec_k4_over_hf_k4"] = (spec["tokens"] / (spec["target_s"] + spec["draft_s"])
                                                         / totals["hf_k4"]["tok_s"])
    if {"bare_k4", "hf_k4"} <= set(modes):  # what a loop with next to no host work reaches here
        ratios["tok_s_bare_k4_over_hf_k4"] = totals["bare_k4"]["tok_s"] / totals["hf_k4"]["tok_s"]
    if {"specdec_k4_static", "hf_k4_static"} <= set(modes):
        ratios["tok_s_specdec_k4_static_over_hf_k4_static"] = (totals["specdec_k4_static"]["tok_s"]
                                                               / totals["hf_k4_static"]["tok_s"])
    if {"specdec_default", "hf_default"} <= set(modes):
        ratios["tok_s_specdec_default_over_hf_default"] = (totals["specdec_default"]["tok_s"]
                                                           / totals["hf_default"]["tok_s"])
    machine = machine_of("float32")
    lines = [f"Tiny-model regime, {args.prompts} prompts x {args.new_tokens} new tokens, greedy, "
             f"{machine_words(machine)}; balanced order: {balanced(modes, args.prompts)}", "",
             "| mode | tok/s | host s | target s | draft s | target forwards | host ms / round | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, row in totals.items():
        lines.append(f"| {mode} | {row['tok_s']:.0f} | {row['host_s']:.3f} | {row['target_s']:.3f} | "
                     f"{row['draft_s']:.3f} | {row['target_forwards']} | {row['host_ms_per_round']:.2f} | "
                     f"{row['identical']}/{args.prompts} |")
    lines += [""] + [f"{name}: {value:.3f}" for name, value in ratios.items()]
    table = "\n".join(lines)
    print(table)
    report = dict(machine=machine, args=vars(args), modes=totals, ratios=ratios,
                  identical_to_plain=all(row["identical"] == args.prompts for row in totals.values()))
    write_report(args.out, "tiny_regime", report, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
