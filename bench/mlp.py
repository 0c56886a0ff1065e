"""The GELU MLP layer: cuBLASLt's fused epilogues (ops.mlp.GeluMLP) against the unfused chain the model runs
by default (ops.linear, ops.bias_gelu, ops.linear), and a biased linear's gradient with the bias from the
weight-gradient GEMM (BGRADB) against column_sums' pass.

At the e2e configs' shapes (rows = batch x sequence), in one process on the GPU, bf16 autocast, fp32 leaves
with their gradients set to None each call (as the trainer zeroes them):
- mlp: forward alone and forward+backward, CUDA-graph replay median ms (the trainer's captured step), and
  every output's relative error against float64 of the same bf16 operands, both ways;
- qkv: ops.linear forward+backward with cublaslt.GEMMS off and on (the bias gradient from BGRADB), graph
  replay ms, db's error.
A shape where a fused call fell back to torch ops (cuBLASLt had no algorithm) says so in "fallbacks".

    PYTHONPATH=src python3 bench/mlp.py --out DIR
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import RESULTS, environment, write_result  # noqa: E402

from tilewise import ops  # noqa: E402

mlp = importlib.import_module("tilewise.ops.mlp")
cublaslt = importlib.import_module("tilewise.ops.cublaslt")

# (config, rows, d_model, ff): the e2e configs' MLPs; (config, rows, d_model, 3 d_model): their QKV linears
MLP_SHAPES = [("gpt2-124m", 32768, 768, 3072), ("gpt-1.3b", 16384, 2048, 8192)]
QKV_SHAPES = [("gpt2-124m", 32768, 768, 2304), ("gpt-1.3b", 16384, 2048, 6144)]


def graph_ms(fn, grad_to_none):
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=50, grad_to_none=grad_to_none, return_mode="median")


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def float64_mlp(x, w_up, b_up, w_down, dy):
    """y and the four gradients of the bf16-rounded operands, in float64."""
    leaves = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in (x, w_up, b_up, w_down)]
    xs, wu, bu, wd = leaves
    y = F.gelu(xs @ wu.t() + bu, approximate="tanh") @ wd.t()
    y.backward(dy.double())
    return [y.detach()] + [t.grad for t in leaves]


def bench_mlp(config, rows, d, ff):
    g = torch.Generator(device="cuda").manual_seed(rows + d)
    x = torch.randn(rows, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w_up = (torch.randn(ff, d, device="cuda", generator=g) / d ** 0.5).requires_grad_()
    b_up = (0.5 * torch.randn(ff, device="cuda", generator=g)).requires_grad_()
    w_down = (torch.randn(d, ff, device="cuda", generator=g) / ff ** 0.5).requires_grad_()
    dy = torch.randn(rows, d, device="cuda", generator=g).to(torch.bfloat16)
    leaves = [x, w_up, b_up, w_down]

    def forward(fused):
        mlp.CUBLASLT_MLP = fused
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return ops.gelu_mlp(x, w_up, b_up, w_down)

    def step(fused):
        forward(fused).backward(dy)

    ref = float64_mlp(x, w_up, b_up, w_down, dy)
    row = {"shape": {"config": config, "rows": rows, "d_model": d, "ff": ff, "pass": "mlp"}, "unit": "ms",
           "rel_err": {}, "fallbacks": []}
    for name, fused in (("chain", False), ("fused", True)):
        for t in leaves:
            t.grad = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = forward(fused)
            y.backward(dy)
        row["fallbacks"] += [str(w.message) for w in caught if "cuBLASLt" in str(w.message)]
        row["rel_err"][name] = dict(zip(("y", "dx", "dw_up", "db_up", "dw_down"),
                                        (rel(t, r) for t, r in zip([y] + [p.grad for p in leaves], ref))))
        with torch.no_grad():
            row[name + "_fwd"] = graph_ms(lambda: forward(fused), None)
        row[name + "_fwd_bwd"] = graph_ms(lambda: step(fused), leaves)
    mlp.CUBLASLT_MLP = False
    row["speedup_fwd"] = row["chain_fwd"] / row["fused_fwd"]
    row["speedup_fwd_bwd"] = row["chain_fwd_bwd"] / row["fused_fwd_bwd"]
    return row


def bench_qkv(config, rows, d, n):
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, d, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, d, device="cuda", generator=g) / d ** 0.5).requires_grad_()
    b = torch.randn(n, device="cuda", generator=g).requires_grad_()
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)

    def step(on):
        cublaslt.GEMMS = on
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = ops.linear(x, w, b)
        y.backward(dy)

    row = {"shape": {"config": config, "rows": rows, "in": d, "out": n, "pass": "qkv fwd+bwd"}, "unit": "ms",
           "db_rel_err": {}}
    db64 = dy.double().sum(0)
    for name, on in (("column_sums", False), ("bgradb", True)):
        w.grad = b.grad = None
        step(on)
        row["db_rel_err"][name] = rel(b.grad, db64)
        row[name] = graph_ms(lambda: step(on), [w, b])
    cublaslt.GEMMS = False
    row["speedup"] = row["column_sums"] / row["bgradb"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write mlp.json into this directory")
    p.add_argument("--quick", action="store_true", help="the GPT-2 124M shapes only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/mlp.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for shape in MLP_SHAPES[:1] if args.quick else MLP_SHAPES:
        r = bench_mlp(*shape)
        rows.append(r)
        print(f"{shape[0]:>9} mlp {shape[1]}x{shape[2]}->{shape[3]}: fwd chain {r['chain_fwd']:.3f} fused "
              f"{r['fused_fwd']:.3f} ms ({r['speedup_fwd']:.3f}x); fwd+bwd chain {r['chain_fwd_bwd']:.3f} fused "
              f"{r['fused_fwd_bwd']:.3f} ms ({r['speedup_fwd_bwd']:.3f}x); errors {r['rel_err']}"
              + (f"; FALLBACKS {r['fallbacks']}" if r["fallbacks"] else ""))
    for shape in QKV_SHAPES[:1] if args.quick else QKV_SHAPES:
        r = bench_qkv(*shape)
        rows.append(r)
        print(f"{shape[0]:>9} qkv {shape[1]}x{shape[2]}->{shape[3]}: column_sums {r['column_sums']:.3f} bgradb "
              f"{r['bgradb']:.3f} ms ({r['speedup']:.3f}x); db errors {r['db_rel_err']}")
    result = {"area": "mlp", **environment(), "command": "TILEWISE_COMMIT=<sha> bash bench/h200.sh mlp",
              "rows": rows}
    write_result(result, "mlp.json", [RESULTS, args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
