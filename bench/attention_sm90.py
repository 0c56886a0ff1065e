"""The Gluon Hopper attention forward (ops/attention_sm90.py) on the H200: correctness first, then speed against
attention.py's Triton forward and torch SDPA (flash, cudnn), forward only, bf16.

Shapes (batch, seqlen, heads, head_dim): (4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64) and the
short ones where the one-program-per-pair grid loses to the Triton kernel, (16, 1024, 32, 64) and (8, 2048, 16,
128), each causal and non-causal. Every config of attention_sm90.CONFIGS for the head_dim is checked and timed
(one GPU run explores the variants: the persistent ones, a fifth element 1, too); a variant that fails to
build, run or match is reported and skipped. The summary gives the best grid and the best persistent config
apart. TFLOP/s: 4 * B * H * N^2 * D per forward, half of it causal.

    PYTHONPATH=src python bench/attention_sm90.py --out DIR       # writes DIR/attention_sm90.json
    python bench/attention_sm90.py --aot-only                      # no GPU: bench/attention_sm90_sass.py
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64), (16, 1024, 32, 64), (8, 2048, 16, 128)]
MAX_REL = 2e-2   # max relative error (max |diff| / max |triton|) a variant may have against the Triton forward


def is_persistent(cfg) -> bool:
    """Whether a config (BM, BN, STAGES[, PINGPONG[, PERSISTENT]]) runs the persistent schedule."""
    return len(cfg) > 4 and bool(cfg[4])


def tflops(b, n, h, d, causal, ms):
    flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return round(flops / (ms * 1e-3) / 1e12, 1)


def max_rel(a, ref):
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def time_ms(triton, fn, rep):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def baselines(torch, F):
    from tilewise.ops import attention

    def triton_forward(q, k, v, c, s):
        with attention.triton_kernels_only():   # flash_attention would race the Gluon kernel itself
            return attention.flash_attention(q, k, v, causal=c, softmax_scale=s, return_lse=True)
    out = {"triton": triton_forward}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return out

    def sdpa(backend):
        def fn(q, k, v, c, s):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=c, scale=s)
        return fn
    out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return out


def run_cell(torch, F, triton, a9, shape, causal, rep, configs):
    b, n, h, d = shape
    cell = {"shape": list(shape), "causal": causal, "results": {}}
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    base = baselines(torch, F)
    with torch.no_grad():
        ref_o, ref_lse = base["triton"](q, k, v, causal, scale)
        for name, fn in base.items():
            try:
                ms = time_ms(triton, lambda: fn(q, k, v, causal, scale), rep)
                cell["results"][name] = {"ms": round(ms, 4), "tflops": tflops(b, n, h, d, causal, ms)}
            except Exception as e:  # noqa: BLE001 - a missing backend is a result, not a crash
                cell["results"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"  {name:24} {cell['results'][name]}", flush=True)
        for cfg in configs:
            name = "gluon_" + "_".join(map(str, cfg))
            r = cell["results"][name] = {"config": list(cfg)}
            try:
                o, lse = a9.forward(q, k, v, causal=causal, softmax_scale=scale, config=cfg)
                torch.cuda.synchronize()
                r["max_rel_o"] = max_rel(o, ref_o)
                r["max_abs_lse"] = (lse - ref_lse).abs().max().item()
                r["nan"] = bool(o.isnan().any().item() or lse.isnan().any().item())
                r["correct"] = (not r["nan"]) and r["max_rel_o"] < MAX_REL and r["max_abs_lse"] < 1e-2
                if r["correct"]:
                    ms = time_ms(triton, lambda: a9.forward(q, k, v, causal=causal, softmax_scale=scale,
                                                            config=cfg), rep)
                    r.update(ms=round(ms, 4), tflops=tflops(b, n, h, d, causal, ms))
            except Exception as e:  # noqa: BLE001 - report the variant and go on
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=3)
            print(f"  {name:24} {r}", flush=True)
    del q, k, v
    torch.cuda.empty_cache()
    return cell


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for attention_sm90.json")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep in ms (default 100)")
    p.add_argument("--aot-only", action="store_true", help="only the ahead-of-time sm_90 build report (no GPU)")
    p.add_argument("--shapes", default=None, metavar="B,N,H,D;...",
                   help="shapes (batch, seqlen, heads, head_dim) instead of SHAPES, e.g. the presets' "
                        "32,1024,12,64;8,2048,16,128")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--configs", default=None, metavar="BM,BN,STAGES[,PINGPONG[,PERSISTENT]];...",
                   help="configs to try instead of attention_sm90.CONFIGS (applied to both head_dims)")
    args = p.parse_args(argv)
    if args.aot_only:
        import attention_sm90_sass
        return attention_sm90_sass.main(["--all-configs"])

    import torch
    import torch.nn.functional as F
    import triton
    import triton.testing
    from common import environment, write_result
    from tilewise.ops import attention_sm90 as a9

    result = {"env": environment(), "available": None, "gluon_error": a9._GLUON_ERROR, "cells": []}
    result["available"] = a9.available("cuda") if torch.cuda.is_available() else False
    print(f"attention_sm90 available: {result['available']} ({a9._GLUON_ERROR or 'Gluon imported'})", flush=True)
    if not result["available"]:
        try:   # say why: the build error, if it is one
            a9.compile_sm90(128, False)
        except Exception as e:  # noqa: BLE001
            result["build_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(result["build_error"])
        write_result(result, "attention_sm90.json", [args.out])
        return 1
    custom = None
    if args.configs:
        custom = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
    shapes = [tuple(int(x) for x in c.split(",")) for c in args.shapes.split(";")] if args.shapes else SHAPES
    for shape in shapes:
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
            print(f"{shape} causal={causal}", flush=True)
            configs = custom or a9.CONFIGS[shape[3]]
            result["cells"].append(run_cell(torch, F, triton, a9, shape, causal, args.rep, configs))
            write_result(result, "attention_sm90.json", [args.out])   # partial results survive a crash
    print("\nTFLOP/s (best correct Gluon config of the grid and of the persistent schedule vs the rest)")
    for cell in result["cells"]:
        res = cell["results"]
        bests = []
        for label, persistent in (("gluon", False), ("persistent", True)):
            timed = [r for k, r in res.items() if k.startswith("gluon") and "tflops" in r
                     and is_persistent(r["config"]) == persistent]
            ran = any(k.startswith("gluon") and is_persistent(r["config"]) == persistent for k, r in res.items())
            best = max(timed, key=lambda r: r["tflops"], default=None)
            if best:
                bests.append(f"{label} {best['tflops']} {tuple(best['config'])}")
            elif ran:
                bests.append(f"{label} none correct")
        others = "  ".join(f"{k} {r.get('tflops', 'err')}" for k, r in res.items() if not k.startswith("gluon"))
        print(f"  {str(tuple(cell['shape'])):22} causal={cell['causal']!s:5}  {'  '.join(bests)}  {others}")
    write_result(result, "attention_sm90.json", [args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
