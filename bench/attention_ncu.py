"""One launch of each Hopper attention kernel under Nsight Compute's profiler range (H200, Firecracker runtime).

Run it under ncu with the range on (the launches before it compile and warm up):
    ncu --clock-control none --profile-from-start off --set full -o OUT/attention python3 bench/attention_ncu.py
then `ncu -i OUT/attention.ncu-rep --page details` (pipe utilization, warp stall reasons, issue slots) and
`--page source --print-source sass --csv` (stall samples per SASS instruction). bench/attention_ncu.sh does both.
Kernels, at d128 (batch, seqlen, heads) from --shape, --causal for the causal case: the Gluon FP8 forward
(fp8_attention_sm90, its default config) and the bf16 Gluon forward (attention_sm90), the Gluon FP8 backward
prototype (fp8_attention_sm90_bwd: its dK/dV and dQ kernels), the bf16 Gluon backward (attention_sm90_bwd) and
the Triton FP8 backward that flash_attention(fp8=True) dispatches (fp8_attention._fp8_backward).
"""
from __future__ import annotations

import argparse
import math


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="4,4096,16", help="batch,seqlen,heads (default 4,4096,16)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--only", default="fp8_fwd,bf16_fwd,fp8_bwd,bf16_bwd",
                   help="comma-separated subset of fp8_fwd, bf16_fwd, fp8_bwd, bf16_bwd (the default) and "
                        "triton_fp8_bwd (it autotunes first)")
    p.add_argument("--fp8-configs", default="",
                   help="fp8_fwd once per fp8_attention_sm90 config, ';'-separated, e.g. '64,128,3,1,0,1;64,128,2,1' "
                        "(default: its default config)")
    args = p.parse_args(argv)
    import torch
    from tilewise.ops import attention_sm90 as a9
    from tilewise.ops import attention_sm90_bwd as b9
    from tilewise.ops import fp8_attention as f8
    from tilewise.ops import fp8_attention_sm90 as g8
    from tilewise.ops import fp8_attention_sm90_bwd as fb

    b, n, h = map(int, args.shape.split(","))
    d, causal = 128, args.causal
    scale = 1.0 / math.sqrt(d)
    left, right = (-1, 0) if causal else (-1, -1)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    k8, v8t, ks, vs = g8.quantize_kv(k, v)
    o8, lse8 = g8.fp8_forward(q, k, v, causal, scale)   # the Gluon kernels alone: no Triton autotuning
    o16, lse16 = a9.forward(q, k, v, causal, scale)
    prep = fb.prepare(dout, q, k, v, o8, lse8)
    fp8_configs = [tuple(map(int, c.split(","))) for c in args.fp8_configs.split(";") if c] or [None]
    launches = {
        "fp8_fwd": lambda: [g8.forward(q, k8, v8t, ks, vs, causal, scale, config=c) for c in fp8_configs],
        "bf16_fwd": lambda: a9.forward(q, k, v, causal, scale),
        "fp8_bwd": lambda: fb.backward(dout, q, k, v, o8, lse8, causal, scale, prepared=prep),
        "bf16_bwd": lambda: b9.backward(dout, q, k, v, o16, lse16, causal=causal, softmax_scale=scale),
        "triton_fp8_bwd": lambda: f8._fp8_backward(dout, q, k, v, o8, lse8, None, None, 0, scale, left, right,
                                                   False),
    }
    chosen = [x for x in args.only.split(",") if x] or list(launches)
    for name in chosen:   # compile and warm up outside the profiler range
        launches[name]()
    torch.cuda.synchronize()
    for name in chosen:
        torch.cuda.profiler.start()
        launches[name]()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"profiled {name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
