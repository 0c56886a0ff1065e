"""Host time per call of each tilewise op, and where it goes: the CPU side of a launch, not the kernel.

A kernel that takes 150 us on the GPU is still slow if its Python wrapper takes 300 us: the GPU waits for
the host. Each op runs forward+backward on shapes small enough that the GPU is never the bottleneck, so the
wall time per call (CUDA synchronized once at the end of each batch of calls) is the host's time; the eager
PyTorch composition of the same computation is the yardstick. Then cProfile shows the costliest functions
of the tilewise calls. A GPT-2 124M training step of the trainer's model gets the same treatment, plus a
torch.profiler breakdown of its GPU time by kernel class.

    PYTHONPATH=src python3 bench/host_overhead.py --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import environment, write_result  # noqa: E402

from tilewise import ops  # noqa: E402


class Doubling(torch.autograd.Function):
    """The smallest Python autograd node: what one costs."""
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def host_us(fn, calls=200, repeats=3):
    """Best of `repeats` mean wall times of `calls` calls, synchronized once per batch."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return round(best, 1)


def profile_top(fn, calls=200, top=25):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def cases(dev):
    bf = torch.bfloat16
    M, N = 256, 768
    x = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    r = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(N, device=dev, dtype=bf, requires_grad=True)
    b = torch.randn(N, device=dev, dtype=bf, requires_grad=True)

    def norm_tw():
        y, h = ops.add_dropout_norm(x, r, w, b)
        torch.autograd.backward((y, h), (y, h))

    def norm_eager():
        h = x + r
        y = F.layer_norm(h, (N,), w, b)
        torch.autograd.backward((y, h), (y, h))

    q = torch.randn(2, 128, 12, 64, device=dev, dtype=bf, requires_grad=True)
    k = torch.randn(2, 128, 12, 64, device=dev, dtype=bf, requires_grad=True)
    v = torch.randn(2, 128, 12, 64, device=dev, dtype=bf, requires_grad=True)

    def attn_tw():
        o = ops.flash_attention(q, k, v, causal=True)
        o.backward(o)

    def attn_eager():
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o.backward(o)

    g = torch.randn(M, 4 * N, device=dev, dtype=bf, requires_grad=True)
    gb = torch.randn(4 * N, device=dev, dtype=bf, requires_grad=True)

    def gelu_tw():
        y = ops.bias_gelu(g, gb)
        y.backward(y)

    def gelu_eager():
        y = F.gelu(g + gb, approximate="tanh")
        y.backward(y)

    hid = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)
    head = torch.randn(8192, N, device=dev, dtype=bf, requires_grad=True)
    tgt = torch.randint(0, 8192, (M,), device=dev)

    def ce_tw():
        ops.linear_cross_entropy(hid, head, tgt).backward()

    def ce_eager():
        F.cross_entropy(F.linear(hid, head).float(), tgt).backward()

    def function_tw():
        y = Doubling.apply(x)
        y.backward(y)

    def function_eager():
        y = x * 2
        y.backward(y)

    out = {"python_autograd_function": (function_tw, function_eager),
           "add_layernorm": (norm_tw, norm_eager), "flash_attention": (attn_tw, attn_eager),
           "bias_gelu": (gelu_tw, gelu_eager), "linear_cross_entropy": (ce_tw, ce_eager)}
    try:
        from tilewise.fp8 import Fp8Linear
        lin = torch.nn.Linear(N, 4 * N, device=dev, dtype=bf)
        f8 = Fp8Linear.from_linear(lin)
        a = torch.randn(M, N, device=dev, dtype=bf, requires_grad=True)

        def fp8_tw():
            y = f8(a)
            y.backward(y)

        def fp8_eager():
            y = lin(a)
            y.backward(y)
        out["fp8_linear"] = (fp8_tw, fp8_eager)
    except Exception as e:  # noqa: BLE001 - report, go on with the others
        print("fp8 case skipped:", type(e).__name__, e)
    return out


def train_step_case(dev):
    """The trainer's GPT-2 124M model at a small batch (2 x 256): host-bound, so wall time ~ host time."""
    from tilewise.config import load_config
    from tilewise.model import GPT
    cfg = load_config("gpt2-124m")
    model = GPT(cfg.model).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 256), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    result = {"area": "host_overhead", **environment(), "unit": "us per forward+backward call", "rows": [],
              "profiles": {}}
    # *_calling_thread: the backward on the calling thread (torch.autograd.set_multithreading_enabled(False))
    # instead of the device's autograd worker thread, which must take the GIL for each Python node.
    single = torch.autograd.set_multithreading_enabled
    for name, (tw, eager) in cases(dev).items():
        row = {"op": name, "tilewise_us": host_us(tw), "eager_us": host_us(eager)}
        with single(False):
            row.update(tilewise_us_calling_thread=host_us(tw), eager_us_calling_thread=host_us(eager))
        result["rows"].append(row)
        result["profiles"][name] = profile_top(tw)
        with single(False):   # which functions the worker thread makes slower
            result["profiles"][name + " (calling thread)"] = profile_top(tw)
        print(row, flush=True)
    step = train_step_case(dev)
    row = {"op": "gpt2_124m_train_step_2x256", "tilewise_us": host_us(step, calls=20)}
    with single(False):
        row["tilewise_us_calling_thread"] = host_us(step, calls=20)
    result["rows"].append(row)
    result["profiles"]["train_step"] = profile_top(step, calls=20, top=40)
    print(result["rows"][-1], flush=True)
    for name, text in result["profiles"].items():
        print(f"\n===== {name}\n{text}")
    write_result(result, "host_overhead.json", [args.out])


if __name__ == "__main__":
    main()
