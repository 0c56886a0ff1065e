"""Why a 25 ms timing can pick the wrong attention config: every d128 forward candidate at one shape (batch 4,
seqlen 4096, 16 heads, non-causal: the one cell of issue 3 that fell short of FlexAttention), timed round
after round with do_bench at rep 25 ms (the tuner's old timing) and 100 ms (the benchmark's), with compiled
FlexAttention between rounds, and the SM clock, power and temperature read after each timing.

    PYTHONPATH=src python3 bench/attention_clocks.py --out DIR     (writes DIR/attention_clocks.json)
"""
import argparse
import json
import os
import subprocess

import torch
import triton
from torch.nn.attention.flex_attention import flex_attention

from tilewise.ops import attention, flash_attention

BATCH, SEQLEN, HEADS, HEAD_DIM = 4, 4096, 16, 128
CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4)]


def clocks() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    q, k, v = [torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3)]
    flops = 4 * BATCH * HEADS * SEQLEN * SEQLEN * HEAD_DIM
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    tflops, log = {}, []
    for rnd in range(args.rounds):
        for cfg in CONFIGS:
            attention.set_candidates("fwd", [cfg], head_dim=HEAD_DIM)   # one candidate: chosen untimed
            fwd = lambda: flash_attention(q, k, v, causal=False)  # noqa: E731
            fwd()
            torch.cuda.synchronize()
            for rep in (25, 100):
                ms = triton.testing.do_bench(fwd, warmup=25, rep=rep, return_mode="median")
                tflops.setdefault(f"{cfg}/rep{rep}", []).append(round(flops / ms / 1e9, 1))
                log.append({"round": rnd, "config": list(cfg), "rep_ms": rep, "ms": round(ms, 4), "after": clocks()})
        ms = triton.testing.do_bench(lambda: flex(qt, kt, vt), warmup=25, rep=100, return_mode="median")
        tflops.setdefault("flex/rep100", []).append(round(flops / ms / 1e9, 1))
        log.append({"round": rnd, "config": "flex", "rep_ms": 100, "ms": round(ms, 4), "after": clocks()})
    for name, values in tflops.items():
        print(f"{name:26s} TFLOP/s {values}")
    with open(os.path.join(args.out, "attention_clocks.json"), "w") as f:
        json.dump({"shape": [BATCH, SEQLEN, HEADS, HEAD_DIM], "tflops": tflops, "log": log}, f, indent=1)


if __name__ == "__main__":
    main()
