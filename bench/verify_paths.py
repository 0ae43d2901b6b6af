"""Which kernel path makes multi-token verification cheapest here (issue 14, item 4): v(n) = t(n) / t(1) of the
target's forward over n new tokens on a 128-token cache, per path, on this CPU.

Paths (each computes the same function up to float rounding):

- ``bf16``: the target in bf16, eager (PyTorch's default CPU kernels: oneDNN for bf16 matmuls);
- ``fp32``: the target in fp32, eager (MKL sgemm for fp32 linear layers);
- ``fp32-onednn``: fp32, every decoder linear layer through oneDNN (``torch._C._nn.mkldnn_linear`` on weights
  reordered once), the path issue 14 measured 1.6-1.8x faster than MKL for 2-16 rows on an AVX2-only EPYC;
- ``--compile``: ``torch.compile`` (Inductor) of a 2-layer proxy of the target's shapes, eager against compiled,
  in bf16 and fp32 (compiling the full model once per shape takes minutes on 2 cores; the proxy says what a
  layer gains).

    python bench/verify_paths.py --json results/verify_paths.json            # real target, three paths
    python bench/verify_paths.py --compile --json results/verify_compile.json

One process, paths measured one after another, each after a warm-up pass, medians of interleaved repeats
(``costmodel.forward_times``). Prints a table and writes JSON with the machine record beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from hf_specdec.costmodel import forward_times
from hf_specdec.harness import machine_record
from hf_specdec.models import load_model


class OneDNNLinear(torch.nn.Module):
    """``y = x W^T + b`` through oneDNN with the weight reordered once (fp32 in, fp32 out)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features
        self.weight = linear.weight.detach().float().to_mkldnn()
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(linear.out_features)
        self.bias = bias.to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn()
        out = torch._C._nn.mkldnn_linear(flat, self.weight, self.bias).to_dense()
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_linears(model: torch.nn.Module) -> int:
    """Swap every decoder nn.Linear (not the tied output layer) for ``OneDNNLinear``; returns how many."""
    head = model.get_output_embeddings()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child is not head:
                setattr(parent, name, OneDNNLinear(child))
                swapped += 1
    return swapped


def curve(model, sizes, repeats) -> dict[int, float]:
    vocab = int(model.get_input_embeddings().weight.shape[0])
    prefix = torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return forward_times(model, prefix, sizes, repeats)


def row(name: str, times: dict[int, float], note: str = "") -> dict:
    return {"path": name, "ms": {n: t * 1e3 for n, t in times.items()},
            "v": {n: t / times[min(times)] for n, t in times.items()}, "note": note}


def real_paths(target: str, sizes, repeats) -> list[dict]:
    rows = []
    model = load_model(target, dtype="bf16", progress=False).model
    rows.append(row("bf16", curve(model, sizes, repeats)))
    del model
    gc.collect()
    model = load_model(target, dtype="fp32", progress=False).model
    rows.append(row("fp32", curve(model, sizes, repeats), "MKL sgemm"))
    ids = torch.randint(0, 1000, (1, 8))
    with torch.inference_mode():
        reference = model(ids).logits.float()
    start = time.perf_counter()
    swapped = onednn_linears(model)
    setup = time.perf_counter() - start
    with torch.inference_mode():
        diff = float((model(ids).logits.float() - reference).abs().max())
    rows.append(row("fp32-onednn", curve(model, sizes, repeats),
                    f"{swapped} linear layers, weights reordered in {setup:.1f} s; max |logit diff| vs MKL {diff:.2e}"))
    return rows


def compiled_paths(target: str, sizes, repeats) -> list[dict]:
    from hf_specdec.models import build_proxy, config_of

    config, _ = config_of(target, progress=False)
    rows = []
    # every (prefill, n) shape compiles once; both proxies share one code object, so without a reset and a higher
    # limit the second proxy would hit dynamo's recompile limit and silently run eager
    torch._dynamo.config.recompile_limit = 64
    for fmt in ("bf16", "fp32"):
        torch._dynamo.reset()
        proxy = build_proxy(config, fmt, layers=2)
        rows.append(row(f"{fmt} proxy eager", curve(proxy, sizes, repeats), "2 decoder layers + head"))
        proxy.forward = torch.compile(proxy.forward, dynamic=False)
        start = time.perf_counter()
        curve(proxy, sizes, 1)  # compile every shape once
        rows.append(row(f"{fmt} proxy compiled", curve(proxy, sizes, repeats),
                        f"torch.compile (Inductor), {time.perf_counter() - start:.0f} s to compile {len(sizes)} shapes"))
        del proxy
        gc.collect()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="bundle:qwen2.5-coder-1.5b-instruct")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="torch.compile on a 2-layer proxy instead")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = (compiled_paths if args.compile else real_paths)(args.target, sizes, args.repeats)
    print(f"{'path':<22} " + " ".join(f"{f't({n}) ms':>10}" for n in sizes) + "  " +
          " ".join(f"{f'v({n})':>6}" for n in sizes[1:]))
    for r in rows:
        print(f"{r['path']:<22} " + " ".join(f"{r['ms'][n]:10.1f}" for n in sizes) + "  " +
              " ".join(f"{r['v'][n]:6.2f}" for n in sizes[1:]) + (f"   {r['note']}" if r["note"] else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_record("cpu", "mixed"), "sizes": sizes, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
