"""Compiled vs eager verify forward on this machine: the target's forward over a static cache's store, at a few
round widths, eager (``compiled.EAGER``) and compiled (``compiled.CompiledVerify``, one graph per width).

    python bench/compiled_verify.py --out results/compiled_verify               # tiny regime + the pair's shapes
    python bench/compiled_verify.py --models tiny --threads 1 --out results/cv  # the tiny regime only
    python bench/compiled_verify.py --tiny --out /tmp/smoke                     # smoke run (seconds, aot_eager)

A script, not a test; run it on a quiet machine. Models (random weights: a forward's time depends on its shapes
only): ``tiny``, the tiny-model regime of issue 41 (Llama, 4 layers, width 128, fp32); ``draft`` and ``target``,
the shapes of the bundled pair (Qwen2.5-0.5B and Qwen2.5-1.5B; ``--dtype``). For each model, a store with a static
cache of ``--prompt`` + 128 columns reads a prompt of random tokens; then for each number of inputs n
(``--inputs``), one verify forward of n inputs is timed (the forward, then the store forgets what it wrote, as a
rejected round does), eager and compiled in a balanced order (ABBA, repeated ``--reps`` times). The first compiled
forward of each width is timed apart: its compile time (what the first call of a fresh process pays). Reported per
model and n: the width it runs at, median ms eager and compiled, compiled/eager, compile seconds, and whether both
paths pick the same token at every input (argmax).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hf_specdec from this checkout

from hf_specdec.cache import KVStore  # noqa: E402
from hf_specdec.compiled import EAGER, CompiledVerify  # noqa: E402
from hf_specdec.layout import BatchInputs  # noqa: E402

QWEN = dict(vocab_size=151936, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
            tie_word_embeddings=True)
SHAPES = {  # name: (config class, model class, config)
    "tiny": (LlamaConfig, LlamaForCausalLM, dict(vocab_size=1024, hidden_size=128, intermediate_size=256,
                                                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=1024)),
    "draft": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                                  num_attention_heads=14, **QWEN)),  # Qwen2.5-0.5B
    "target": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                                   num_attention_heads=12, **QWEN)),  # Qwen2.5-1.5B
}


def build(name: str, dtype: torch.dtype):
    config_class, model_class, settings = SHAPES[name]
    torch.manual_seed(0)
    config = config_class(**settings, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return model_class(config).to(dtype).eval()


def one_forward(verifier, store: KVStore, n: int, vocab: int) -> tuple[float, torch.Tensor]:
    """Seconds of one verify forward of n inputs (then forgotten: ``discard``), and its tokens (argmax)."""
    batch = BatchInputs(torch.randint(vocab, (1, n), generator=torch.Generator().manual_seed(n)),
                        torch.arange(n)[None], None, None)
    start = time.perf_counter()
    result = verifier.forward(store, batch, logits_at=n)
    seconds = time.perf_counter() - start
    store.discard()
    return seconds, result.logits.argmax(-1)


def bench_model(name: str, args) -> dict:
    model = build(name, args.dtype)
    vocab = model.config.vocab_size
    store = KVStore(model, cache=StaticCache(config=model.config, max_cache_len=args.prompt + 128))
    with torch.inference_mode():
        store.prefill(torch.randint(vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)), None)
    compiled = CompiledVerify(torch.compile(model.__call__, backend=args.backend, dynamic=False,
                                            mode=args.mode if args.backend == "inductor" else None))
    rows = []
    for n in args.inputs:
        with torch.inference_mode():
            eager_seconds, eager_tokens = one_forward(EAGER, store, n, vocab)  # warm-up
            compile_seconds, compiled_tokens = one_forward(compiled, store, n, vocab)  # the graph's compile
            times = {"eager": [], "compiled": []}
            for rep in range(args.reps):  # ABBA
                for mode in (("eager", "compiled", "compiled", "eager") if rep % 2 == 0 else
                             ("compiled", "eager", "eager", "compiled")):
                    seconds, _ = one_forward(EAGER if mode == "eager" else compiled, store, n, vocab)
                    times[mode].append(seconds)
        eager_ms, compiled_ms = (1e3 * statistics.median(times[mode]) for mode in ("eager", "compiled"))
        row = dict(model=name, inputs=n, width=compiled.width(n), eager_ms=eager_ms, compiled_ms=compiled_ms,
                   compiled_over_eager=compiled_ms / eager_ms, compile_s=compile_seconds - eager_ms / 1e3,
                   same_tokens=bool(torch.equal(eager_tokens, compiled_tokens)))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return dict(model=name, parameters=sum(p.numel() for p in model.parameters()), rows=rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,draft,target")
    parser.add_argument("--inputs", default="1,2,3,5,8,9,16", help="inputs per verify forward (n)")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens in the store before the forwards")
    parser.add_argument("--reps", type=int, default=20, help="ABBA repetitions (4 forwards each)")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; --tiny: aot_eager)")
    parser.add_argument("--mode", default=None, help="torch.compile mode, inductor only (max-autotune-no-cudagraphs)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/compiled_verify")
    parser.add_argument("--tiny", action="store_true", help="smoke run: the tiny model, n = 1 and 5, 2 reps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.models, args.inputs, args.reps, args.prompt = "tiny", "1,5", 2, 16
        args.backend = args.backend or "aot_eager"
        args.threads = args.threads or 1
    args.backend = args.backend or "inductor"
    args.dtype = getattr(torch, args.dtype)
    args.inputs = [int(n) for n in args.inputs.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    report = dict(machine=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                  torch=torch.__version__, backend=args.backend, mode=args.mode, dtype=str(args.dtype),
                  prompt=args.prompt, reps=args.reps,
                  models=[bench_model(name, args) for name in args.models.split(",") if name])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compiled_verify.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'compiled_verify.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
