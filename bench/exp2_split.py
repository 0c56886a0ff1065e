"""The Gluon forwards' softmax exponentials split between MUFU.EX2 and a polynomial (gluon_sm90.exp2_split), on
the H200.

An SM's MUFU issues 16 exp2 a clock. For the FP8 forward's (64 x 128) score tile that is 512 clocks, as long as
its two E4M3 wgmmas take at the tensor cores' peak, so a forward near FP8 rates waits on MUFU; in bf16 the
exponentials take half the wgmmas' time. EXP2_POLY = k sends k of every 4 exponentials to a degree-3
polynomial on the FMA and integer pipes (9 instructions instead of one MUFU.EX2).

For the FP8 (fp8_attention_sm90) and bf16 (attention_sm90) Gluon forwards at their default configs, d128, each
shape causal and not: the outputs of EXP2_POLY = 1 and 2 against EXP2_POLY = 0 on the same inputs (max |diff| /
max |o|, the lse's max |diff|), the error of each against a float64 reference on the first (batch, head) slice
(RMSE over the reference's RMS), then all timed alternately, twice each (do_bench medians; FP8 on prepared
K/V: the kernel alone).

    PYTHONPATH=src python bench/exp2_split.py --out DIR     # writes DIR/exp2_split.json
"""
from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

SHAPES = [(4, 4096, 16), (1, 16384, 16), (8, 2048, 16)]
POLYS = (0, 1, 2)
MAX_REL = 1e-2      # against EXP2_POLY = 0: the polynomial's 8.6e-5 relative error, then E4M3/bf16 roundings of P
REF_ROWS = 2048     # the float64 reference's query rows (of the first batch and head)


def reference_error(q, k, v, o, causal, scale):
    """RMSE of o's first (batch, head) slice over its first REF_ROWS rows, against float64 softmax(q k^T) v,
    divided by the reference's RMS."""
    import torch
    n = q.shape[1]
    rows = min(REF_ROWS, n)
    q64, k64, v64 = (t[0, :, 0].double() for t in (q, k, v))
    s = (q64[:rows] @ k64.T) * scale
    if causal:
        s = s.masked_fill(torch.ones(rows, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    ref = torch.softmax(s, dim=-1) @ v64
    err = (o[0, :rows, 0].double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    return err.item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rep", type=int, default=60, help="do_bench rep in ms")
    p.add_argument("--kernels", default="fp8,bf16", help="comma-separated: fp8, bf16")
    args = p.parse_args(argv)
    import torch
    import triton
    from common import environment, write_result
    from tilewise.ops import attention_sm90 as a9
    from tilewise.ops import fp8_attention_sm90 as g8

    d = 128
    rows, ok = [], True
    for b, n, h in SHAPES:
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            scale = 1.0 / math.sqrt(d)
            k8, v8t, ks, vs = g8.quantize_kv(k, v)
            kernels = {"fp8": (g8, lambda: g8.forward(q, k8, v8t, ks, vs, causal, scale)),
                       "bf16": (a9, lambda: a9.forward(q, k, v, causal, scale))}
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            for name in args.kernels.split(","):
                mod, fn = kernels[name]
                outs, ms = {}, {poly: [] for poly in POLYS}
                for poly in POLYS:
                    mod.EXP2_POLY = poly
                    outs[poly] = fn()
                torch.cuda.synchronize()
                o0, l0 = outs[0]
                row = {"kernel": name, "shape": [b, n, h, d], "causal": causal,
                       "ref_rel_rmse": {poly: round(reference_error(q, k, v, outs[poly][0], causal, scale), 6)
                                        for poly in POLYS}}
                for poly in POLYS[1:]:
                    o1, l1 = outs[poly]
                    rel = ((o1.float() - o0.float()).abs().max() / o0.float().abs().max()).item()
                    lse = (l1 - l0).abs().max().item()
                    good = rel < MAX_REL and lse < MAX_REL and not o1.isnan().any().item()
                    ok &= good
                    row[f"poly{poly}"] = {"max_rel_vs_mufu": round(rel, 6), "lse_max_diff": round(lse, 6),
                                          "correct": good}
                for _ in range(2):
                    for poly in POLYS:
                        mod.EXP2_POLY = poly
                        ms[poly].append(triton.testing.do_bench(fn, warmup=20, rep=args.rep, return_mode="median"))
                mod.EXP2_POLY = 0
                row["tflops"] = {poly: [round(flops / t / 1e9, 1) for t in ms[poly]] for poly in POLYS}
                row["speedup"] = {poly: round(min(ms[0]) / min(ms[poly]), 4) for poly in POLYS[1:]}
                rows.append(row)
                print(row, flush=True)
    result = {"area": "exp2_split", **environment(), "rows": rows}
    if args.out:
        write_result(result, "exp2_split.json", [args.out])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
