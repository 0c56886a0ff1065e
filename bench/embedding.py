"""Token + position embedding, forward and backward: ops.embedding (one gather-and-add pass; a sorted,
deterministic segment sum for the table's gradient) against torch (F.embedding, the broadcast add, its dense
embedding backward), at the e2e configs' shapes.

Token ids uniform (the e2e bench's random tokens) and Zipf-distributed (exponent 1 over the vocabulary, as
text's roughly are: the most frequent id takes ~9% of the positions), CUDA-graph replay median ms of forward alone
and forward+backward, the table's fp32 gradient set to None each call as the trainer does; both gradients
checked against torch's first.

    PYTHONPATH=src python3 bench/embedding.py --out DIR
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import RESULTS, environment, write_result  # noqa: E402

from tilewise import ops  # noqa: E402

embedding = importlib.import_module("tilewise.ops.embedding")

# (config, batch, seqlen, vocab, width)
SHAPES = [("gpt2-124m", 32, 1024, 50304, 768), ("gpt-1.3b", 8, 2048, 50304, 2048)]


def graph_ms(fn, grad_to_none):
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=50, grad_to_none=grad_to_none, return_mode="median")


def token_ids(batch, seqlen, vocab, kind, g):
    if kind == "uniform":
        return torch.randint(0, vocab, (batch, seqlen), device="cuda", generator=g)
    weights = torch.arange(1, vocab + 1, device="cuda", dtype=torch.float64) ** -1.0
    return torch.multinomial(weights, batch * seqlen, replacement=True, generator=g).view(batch, seqlen)


def bench(config, batch, seqlen, vocab, width, kind):
    g = torch.Generator(device="cuda").manual_seed(batch * seqlen + width)
    idx = token_ids(batch, seqlen, vocab, kind, g)
    w = (0.02 * torch.randn(vocab, width, device="cuda", generator=g)).requires_grad_()
    p = (0.02 * torch.randn(seqlen, width, device="cuda", generator=g)).requires_grad_()
    dx = torch.randn(batch, seqlen, width, device="cuda", generator=g)
    shape = {"config": config, "batch": batch, "seqlen": seqlen, "vocab": vocab, "width": width, "ids": kind}
    row = {"shape": shape, "unit": "ms", "top_id_share": torch.bincount(idx.view(-1)).max().item() / idx.numel()}
    grads = {}
    for name, mode in (("torch", "reference"), ("tilewise", "triton")):
        embedding.TRITON_EMBEDDING = mode == "triton"   # off by default until this and the step measure it

        def forward():
            with ops.use(mode):
                return ops.embedding(idx, w, p)

        def step():
            forward().backward(dx)
        w.grad = p.grad = None
        step()
        grads[name] = (w.grad.clone(), p.grad.clone())
        with torch.no_grad():
            row[name + "_fwd"] = graph_ms(forward, None)
        row[name + "_fwd_bwd"] = graph_ms(step, [w, p])
    row["max_abs_diff"] = max((a - b).abs().max().item() for a, b in zip(grads["torch"], grads["tilewise"]))
    row["speedup_fwd_bwd"] = row["torch_fwd_bwd"] / row["tilewise_fwd_bwd"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write embedding.json into this directory")
    p.add_argument("--quick", action="store_true", help="the GPT-2 124M shape only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/embedding.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for shape in SHAPES[:1] if args.quick else SHAPES:
        for kind in ("uniform", "zipf"):
            r = bench(*shape, kind)
            rows.append(r)
            print(f"{shape[0]:>9} {kind:>7} ids (top id {r['top_id_share']:.1%}): fwd torch {r['torch_fwd']:.3f} "
                  f"tilewise {r['tilewise_fwd']:.3f} ms; fwd+bwd torch {r['torch_fwd_bwd']:.3f} tilewise "
                  f"{r['tilewise_fwd_bwd']:.3f} ms ({r['speedup_fwd_bwd']:.2f}x); max |diff| {r['max_abs_diff']:.1e}")
    result = {"area": "embedding", **environment(), "command": "TILEWISE_COMMIT=<sha> bash bench/h200.sh embedding",
              "rows": rows}
    write_result(result, "embedding.json", [RESULTS, args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
