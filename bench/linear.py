"""The bf16 linear layer with an fp32 master weight: tilewise's MasterWeightLinear against F.linear under
autocast, and the bias gradient's column sums against torch's sum.

At the linear shapes of the e2e configs (rows = batch x sequence), in one process on the GPU:
- forward+backward of x @ W^T + b under bf16 autocast, W and b fp32 leaves with their gradients set to
  None each call (as the trainer zeroes them), for F.linear (autocast's casts, its bf16 weight gradient
  widened and copied into the weight's layout) and ops.linear (the GEMM writes dW in fp32): do_bench median
  ms (host included: a layer whose GEMMs take less than its Python shows the host) and the CUDA-graph replay
  (GPU only, as the trainer's captured step runs); both weight gradients against float64 first;
- the bias gradient alone, dy.sum(0) of bf16 dy into fp32: torch.sum against ops.fp8_cast.column_sums, in
  GB/s (bytes: dy read once) and as a fraction of the device-to-device copy bandwidth of the same run.

    PYTHONPATH=src python3 bench/linear.py --out DIR
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from adamw import copy_gbps  # noqa: E402
from common import RESULTS, environment, write_result  # noqa: E402

from tilewise import ops  # noqa: E402
from tilewise.ops.fp8_cast import column_sums  # noqa: E402

# (config, layer, rows, in_features, out_features): the e2e configs' linears with a bias
SHAPES = [("gpt-1.3b", "qkv", 16384, 2048, 6144), ("gpt-1.3b", "proj", 16384, 2048, 2048),
          ("gpt-1.3b", "down", 16384, 8192, 2048), ("gpt2-124m", "qkv", 32768, 768, 2304),
          ("gpt2-124m", "proj", 32768, 768, 768), ("gpt2-124m", "down", 32768, 3072, 768)]


def ms(fn, grad_to_none=None):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")


def graph_ms(fn, grad_to_none=None):
    """The calls captured in a CUDA graph and replayed: GPU time only, without the host's launches."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=50, grad_to_none=grad_to_none, return_mode="median")


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def bench_shape(config, layer, rows, k, n):
    g = torch.Generator(device="cuda").manual_seed(rows + k + n)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).requires_grad_()
    b = torch.randn(n, device="cuda", generator=g).requires_grad_()
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)

    def step(fn, mode):
        with ops.use(mode), torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, w, b)
        y.backward(dy)

    dw64 = dy.double().t() @ x.double()
    errors = {}
    for name, fn, mode in (("autocast_f_linear", F.linear, "reference"), ("tilewise", ops.linear, "auto")):
        w.grad = b.grad = None
        step(fn, mode)
        errors[name] = {"dw_rel_err": rel(w.grad, dw64), "dw_dtype": str(w.grad.dtype),
                        "dw_contiguous": w.grad.is_contiguous()}
    contestants = (("autocast_f_linear", F.linear, "reference"), ("tilewise", ops.linear, "auto"))
    times = {name: ms(lambda: step(fn, mode), grad_to_none=[w, b]) for name, fn, mode in contestants}
    graph_times = {name: graph_ms(lambda: step(fn, mode), grad_to_none=[w, b]) for name, fn, mode in contestants}

    out = torch.empty(n, dtype=torch.float32, device="cuda")
    ref = dy.double().sum(0)
    column_sums(dy, out)
    sums_err = {"torch_sum": rel(dy.sum(0, dtype=torch.float32), ref), "column_sums": rel(out, ref)}
    sums_ms = {"torch_sum": ms(lambda: dy.sum(0, dtype=torch.float32)),
               "column_sums": ms(lambda: column_sums(dy, out))}
    return {"config": config, "layer": layer, "rows": rows, "in": k, "out": n, "fwd_bwd_ms": times,
            "speedup": times["autocast_f_linear"] / times["tilewise"], "fwd_bwd_graph_ms": graph_times,
            "speedup_graph": graph_times["autocast_f_linear"] / graph_times["tilewise"], "weight_grad": errors,
            "bias_grad_ms": sums_ms, "bias_grad_GBps": {m: dy.numel() * 2 / t / 1e6 for m, t in sums_ms.items()},
            "bias_grad_rel_err": sums_err}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write linear.json into this directory")
    p.add_argument("--quick", action="store_true", help="the first two shapes only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s")
    rows = []
    for shape in SHAPES[:2] if args.quick else SHAPES:
        r = bench_shape(*shape)
        r["bias_grad_frac_copy"] = {m: v / copy for m, v in r["bias_grad_GBps"].items()}
        rows.append(r)
        t, s = r["fwd_bwd_ms"], r["bias_grad_GBps"]
        gt = r["fwd_bwd_graph_ms"]
        print(f"{r['config']:>9} {r['layer']:>4} {r['rows']}x{r['in']}->{r['out']}: fwd+bwd F.linear "
              f"{t['autocast_f_linear']:.3f} ms, tilewise {t['tilewise']:.3f} ms ({r['speedup']:.3f}x); graphs "
              f"{gt['autocast_f_linear']:.3f} / {gt['tilewise']:.3f} ms ({r['speedup_graph']:.3f}x); "
              f"dW rel err {r['weight_grad']['autocast_f_linear']['dw_rel_err']:.2e} / "
              f"{r['weight_grad']['tilewise']['dw_rel_err']:.2e}; bias grad torch.sum {s['torch_sum']:.0f}, "
              f"column_sums {s['column_sums']:.0f} GB/s")
    result = {"area": "linear", **environment(), "copy_GBps": copy,
              "command": "TILEWISE_COMMIT=<sha> bash bench/h200.sh linear", "rows": rows}
    write_result(result, "linear.json", [RESULTS, args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
