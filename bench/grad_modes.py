"""A forward under ``torch.no_grad`` (plain ``generate``'s mode) against ``torch.inference_mode`` (hf_specdec's
decoding loop, ``hf_specdec/ordinary.py``), on this machine: what the loop's mode saves per forward.

    python bench/grad_modes.py --out results/grad_modes          # the tiny-regime pair, 1 thread
    python bench/grad_modes.py --tiny --out /tmp/smoke            # smoke run (seconds)

A script, not a test; run it on a quiet machine. The pair of ``bench/tiny_regime.py`` (a 4-layer target, a 1-layer
draft, width 128, fp32), where a forward is hundreds of small ops and autograd's per-tensor bookkeeping is a share
of its time. Each model keeps one dynamic cache per mode, read from the same 32-token prompt; then, for ``--steps``
steps, each mode runs one forward (the draft one token, the target ``--inputs`` tokens: a k = 4 verify), in
alternating order (ABBA), the forward and its output layer timed together, as hf_specdec's fast lane runs them.
Repeated ``--reps`` times from a fresh cache. Reported per model: ms per forward in each mode, inference/no_grad.
Both modes run the same kernels: the logits are compared bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from first_call import machine_of, machine_words, write_report  # noqa: E402
from tiny_regime import VOCAB, tiny_regime_pair  # noqa: E402

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def forward(model, cache, ids: torch.LongTensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1])[None]
    states = model.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).last_hidden_state
    return model.lm_head(states).float()


def measure(model, inputs: int, steps: int, reps: int, prompt: torch.LongTensor) -> dict:
    seconds = dict.fromkeys(MODES, 0.0)
    same = True
    tokens = torch.randint(1, VOCAB, (1, inputs), generator=torch.Generator().manual_seed(inputs))
    for rep in range(reps):
        caches = {}
        for name, mode in MODES.items():
            caches[name] = DynamicCache(config=model.config)
            with mode():
                forward(model, caches[name], prompt, 0)
        for step in range(steps):
            order = list(MODES) if (rep + step) % 2 == 0 else list(MODES)[::-1]
            logits = {}
            for name in order:
                with MODES[name]():
                    begin = time.perf_counter()
                    logits[name] = forward(model, caches[name], tokens, prompt.shape[1] + step * inputs)
                    seconds[name] += time.perf_counter() - begin
            same = same and torch.equal(logits["no_grad"], logits["inference_mode"])
    count = steps * reps
    ms = {name: total / count * 1e3 for name, total in seconds.items()}
    return {"inputs": inputs, "ms_no_grad": ms["no_grad"], "ms_inference_mode": ms["inference_mode"],
            "inference_over_no_grad": ms["inference_mode"] / ms["no_grad"], "same_logits": same}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/grad_modes")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--inputs", type=int, default=5, help="the target's inputs per forward (k + 1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="smoke run: 4 steps, 2 repetitions")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps, args.reps = 4, 2
    torch.set_num_threads(args.threads)
    target, draft = tiny_regime_pair()
    prompt = torch.randint(1, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    rows = {"draft": measure(draft, 1, args.steps, args.reps, prompt),
            "target": measure(target, args.inputs, args.steps, args.reps, prompt)}
    machine = machine_of("float32")
    report = {"machine": machine, "args": vars(args), "models": rows}
    lines = [f"Forward under no_grad against inference_mode, tiny-regime pair, {args.steps} steps x {args.reps} "
             f"repetitions; {machine_words(machine)}", "",
             "| model | inputs | ms no_grad | ms inference_mode | inference / no_grad | same logits |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {row['inputs']} | {row['ms_no_grad']:.3f} | {row['ms_inference_mode']:.3f} | "
              f"{row['inference_over_no_grad']:.3f} | {row['same_logits']} |" for name, row in rows.items()]
    table = "\n".join(lines)
    print(table)
    write_report(args.out, "grad_modes", report, table)
    return report


if __name__ == "__main__":
    main()
