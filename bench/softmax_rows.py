"""The Gluon forwards' softmax row reductions, tree against chain, on the H200 (bench/attention_ncu.py's profile
found the FP8 forward's row-max FMNMX chain its most stalled instructions).

For the FP8 (fp8_attention_sm90) and bf16 (attention_sm90) Gluon forwards at their default configs, d128,
(4, 4096, 16) and (1, 16384, 16), causal and not: the output with TREE_ROWS=True (gluon_sm90.row_max /
row_sum) against TREE_ROWS=False (gl.max / gl.sum, the kernels as measured before) on the same inputs (max
|diff| / max |o| and the lse's max |diff|: only the float32 summation order of l differs), then both timed
alternately, twice each (do_bench medians; FP8 on prepared K/V: the kernel alone).

    PYTHONPATH=src python bench/softmax_rows.py --out DIR     # writes DIR/softmax_rows.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

SHAPES = [(4, 4096, 16), (1, 16384, 16)]
MAX_REL = 1e-2   # the two reduction orders agree far closer than this; a wrong tree would not


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rep", type=int, default=60, help="do_bench rep in ms")
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
            for name, (mod, fn) in kernels.items():
                outs, ms = {}, {False: [], True: []}
                for tree in (False, True):
                    mod.TREE_ROWS = tree
                    outs[tree] = fn()
                torch.cuda.synchronize()
                (o0, l0), (o1, l1) = outs[False], outs[True]
                rel = ((o1.float() - o0.float()).abs().max() / o0.float().abs().max()).item()
                lse = (l1 - l0).abs().max().item()
                good = rel < MAX_REL and lse < MAX_REL and not o1.isnan().any().item()
                ok &= good
                for _ in range(2):
                    for tree in (False, True):
                        mod.TREE_ROWS = tree
                        ms[tree].append(triton.testing.do_bench(fn, warmup=20, rep=args.rep, return_mode="median"))
                mod.TREE_ROWS = True
                row = {"kernel": name, "shape": [b, n, h, d], "causal": causal, "max_rel_vs_chain": round(rel, 6),
                       "lse_max_diff": round(lse, 6), "correct": good,
                       "chain_tflops": [round(flops / t / 1e9, 1) for t in ms[False]],
                       "tree_tflops": [round(flops / t / 1e9, 1) for t in ms[True]]}
                row["speedup"] = round(min(ms[False]) / min(ms[True]), 4)
                rows.append(row)
                print(row, flush=True)
    result = {"area": "softmax_rows", **environment(), "rows": rows}
    if args.out:
        write_result(result, "softmax_rows.json", [args.out])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
