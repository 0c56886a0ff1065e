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


def bench_shape(config, layer, rows, k, n, copy):
    """Two table rows: forward+backward ms (do_bench and graph replay) and the bias gradient's GB/s."""
    g = torch.Generator(device="cuda").manual_seed(rows + k + n)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).requires_grad_()
    b = torch.randn(n, device="cuda", generator=g).requires_grad_()
    dy = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    shape = {"config": config, "layer": layer, "rows": rows, "in": k, "out": n}
    contestants = (("autocast_f_linear", F.linear, "reference"), ("tilewise", ops.linear, "auto"))

    def step(fn, mode):
        with ops.use(mode), torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, w, b)
        y.backward(dy)

    dw64 = dy.double().t() @ x.double()
    errors = {}
    for name, fn, mode in contestants:
        w.grad = b.grad = None
        step(fn, mode)
        errors[name] = rel(w.grad, dw64)
    both = {"shape": {**shape, "pass": "fwd+bwd"}, "unit": "ms"}
    for name, fn, mode in contestants:
        both[name] = ms(lambda: step(fn, mode), grad_to_none=[w, b])
    for name, fn, mode in contestants:
        both[name + "_graph"] = graph_ms(lambda: step(fn, mode), grad_to_none=[w, b])
    both["ratio"] = both["autocast_f_linear"] / both["tilewise"]
    both["ratio_graph"] = both["autocast_f_linear_graph"] / both["tilewise_graph"]
    both["dw_rel_err"] = errors

    out = torch.empty(n, dtype=torch.float32, device="cuda")
    ref = dy.double().sum(0)
    column_sums(dy, out)
    sums = {"shape": {**shape, "pass": "bias_grad"}, "unit": "GB/s"}
    for name, fn in (("torch_sum", lambda: dy.sum(0, dtype=torch.float32)),
                     ("column_sums", lambda: column_sums(dy, out))):
        sums[name] = dy.numel() * dy.element_size() / ms(fn) / 1e6
    sums["column_sums_frac_copy"] = sums["column_sums"] / copy
    sums["rel_err"] = {"torch_sum": rel(dy.sum(0, dtype=torch.float32), ref), "column_sums": rel(out, ref)}
    return both, sums


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
        both, sums = bench_shape(*shape, copy)
        rows += [both, sums]
        print(f"{shape[0]:>9} {shape[1]:>4} {shape[2]}x{shape[3]}->{shape[4]}: fwd+bwd F.linear "
              f"{both['autocast_f_linear']:.3f} ms, tilewise {both['tilewise']:.3f} ms ({both['ratio']:.3f}x); "
              f"graphs {both['autocast_f_linear_graph']:.3f} / {both['tilewise_graph']:.3f} ms "
              f"({both['ratio_graph']:.3f}x); dW rel err {both['dw_rel_err']['autocast_f_linear']:.2e} / "
              f"{both['dw_rel_err']['tilewise']:.2e}; bias grad torch.sum {sums['torch_sum']:.0f}, "
              f"column_sums {sums['column_sums']:.0f} GB/s")
    result = {"area": "linear", **environment(), "copy_GBps": copy,
              "command": "TILEWISE_COMMIT=<sha> bash bench/h200.sh linear", "rows": rows}
    write_result(result, "linear.json", [RESULTS, args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
