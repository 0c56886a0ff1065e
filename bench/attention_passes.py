"""Where the FP8 and bf16 attention calls' GPU time goes, kernel by kernel (H200).

For each of bench/attention.py's FP8 shapes (d128: 4 x 4096 x 16 and 1 x 16384 x 16, causal and not), one
forward and one backward of flash_attention (bf16) and fp8_flash_attention run CALLS times under
torch.profiler (CUDA activity only) after warm-up; every kernel's GPU microseconds per call are listed, and
beside them the call's do_bench median, so the gap between the kernels' sum and the call's time shows.
What is not the attention kernels themselves is the passes' share (quantization, prep, vectors).

    PYTHONPATH=src python bench/attention_passes.py --out DIR    # writes DIR/attention_passes.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128)]
CALLS = 10


def kernel_us(torch, fn, calls=CALLS):
    """{kernel name: GPU microseconds per call} of fn, from torch.profiler over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return {name: round(us / calls, 1) for name, us in totals.most_common()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="folder for attention_passes.json")
    p.add_argument("--shapes", default=None, metavar="B,N,H,D;...", help="shapes instead of the defaults")
    args = p.parse_args(argv)
    import torch
    import triton
    from common import environment
    from tilewise.ops import flash_attention, fp8_flash_attention

    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    calls = {"bf16": lambda q, k, v, c: flash_attention(q, k, v, causal=c),
             "fp8": lambda q, k, v, c: fp8_flash_attention(q, k, v, causal=c)}
    rows = []
    for batch, seqlen, heads, d in shapes:
        for causal in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(seqlen + causal)
            q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                       .requires_grad_() for _ in range(3))
            dout = torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            for name, fn in calls.items():
                fwd = lambda: fn(q, k, v, causal)  # noqa: E731
                out = fwd()   # tunes and races here
                out.backward(dout, retain_graph=True)

                def bwd():
                    for t in (q, k, v):
                        t.grad = None
                    out.backward(dout, retain_graph=True)
                bwd()
                row = {"shape": {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": d, "causal": causal},
                       "call": name}
                for direction, f in (("fwd", fwd), ("bwd", bwd)):
                    ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
                    kernels = kernel_us(torch, f)
                    row[direction] = {"do_bench_us": round(ms * 1e3, 1),
                                      "kernels_sum_us": round(sum(kernels.values()), 1), "kernels_us": kernels}
                rows.append(row)
                print(json.dumps({"shape": row["shape"], "call": row["call"],
                                  **{d_: {k_: v_ for k_, v_ in row[d_].items() if k_ != "kernels_us"}
                                     for d_ in ("fwd", "bwd")}}), flush=True)
                for d_ in ("fwd", "bwd"):
                    for kname, us in row[d_]["kernels_us"].items():
                        print(f"    {d_} {us:9.1f} us  {kname[:110]}")
                del out
    result = {**environment(), "area": "attention_passes", "command": "PYTHONPATH=src python "
              "bench/attention_passes.py --out DIR", "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_passes.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
