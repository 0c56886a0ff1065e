"""The Gluon FP8 Hopper attention forward (ops/fp8_attention_sm90.py) on the H200: correctness first, then speed
against fp8_attention.py's Triton FP8 forward and attention_sm90.py's bf16 Gluon forward, forward only.

Shapes (batch, seqlen, heads, head_dim): (4, 4096, 16, 128) and (1, 16384, 16, 128), each causal and
non-causal (--shapes adds others). Every config of fp8_attention_sm90.CONFIGS for the head_dim is checked
against the Triton FP8 forward on the same inputs and timed; a variant that fails to build, run or match
is reported and skipped. Timings (do_bench, median):
- gluon_fp8_<cfg> "kernel": the Gluon kernel alone on prepared inputs (K/V already quantized: what replaces
  the `_fp8_fwd` launch inside fp8_attention._fp8_forward);
- gluon_fp8_<cfg> "with_pass": fp8_attention_sm90.fp8_forward, the K/V quantization passes included (what a
  caller pays for q, k, v in bf16); "kv_pass" alone is timed once per cell;
- triton_fp8: fp8_attention._fp8_forward (its K/V passes included, as a caller pays);
- gluon_bf16: attention_sm90.forward (bf16, no pass).
TFLOP/s: 4 * B * H * N^2 * D per forward, half of it causal. The summary prints the best FP8 Gluon config's
ratio to the bf16 Gluon forward (the project's target: >= 1.4 at head_dim 128, seqlen >= 4096).

    PYTHONPATH=src python bench/fp8_attention_sm90.py --out DIR     # writes DIR/fp8_attention_sm90.json
    python bench/fp8_attention_sm90.py --aot-only                    # no GPU: sm_90a builds, SASS checks

--aot-only compiles every (head_dim, config, causal, dtype) ahead of time for sm_90a with the installed
Triton's ptxas (needs Gluon's Hopper API as Triton 3.6 has it; no GPU is touched) and reports registers,
spills, E4M3 wgmma (SASS QGMMA ... E4M3.E4M3) count, setmaxnreg, shared memory and the consumer loops' mix.
Exit status 1 when a build fails, spills or has no E4M3 wgmma.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128)]
# A variant must match the Triton FP8 forward on the same inputs: max |diff| / max |o| and max |diff| of the
# lse (the two compute the same thing; only accumulation order and rare P roundings differ).
MAX_REL = 2e-2
MAX_LSE = 1e-2


# ------------------------------------------------------------------------------------------ AOT / SASS

def aot_report(d: int, causal: bool, dtype: str, cfg) -> dict:
    from attention_sm90_sass import build_report
    from tilewise.ops import fp8_attention_sm90 as f9
    r = build_report({"head_dim": d, "causal": causal, "dtype": dtype, "config": list(cfg)},
                     lambda: f9.compile_sm90(d, causal, dtype, tuple(cfg)))
    if "error" not in r:
        r["ok"] = r["ok"] and r["fp8_wgmma"] > 0
    return r


def aot_main(head_dims, dtypes, as_json) -> int:
    os.environ.pop("TRITON_INTERPRET", None)   # the interpreter cannot compile
    from tilewise.ops import fp8_attention_sm90 as f9
    out, bad = [], 0
    for d in head_dims:
        for cfg in f9.CONFIGS[d]:
            for causal in (False, True):
                for dtype in dtypes:
                    r = aot_report(d, causal, dtype, cfg)
                    out.append(r)
                    bad += not r.get("ok", False)
                    if as_json:
                        continue
                    head = f"d{d} {str(tuple(cfg)):14} causal={causal!s:5} {dtype}"
                    if "error" in r:
                        print(f"{head}  FAILED {r['error']}")
                        continue
                    loops = "; ".join(f"{l['instructions']} ins, {l['wgmma']} wgmma, {l['wgmma_waits']} waits, "
                                      f"{l['mufu_ex2']} ex2, {l['bar_sync']} bar, {l['shfl']} shfl"
                                      for l in r["loops"][:2])
                    print(f"{head}  regs {r['registers']:3} spills {r['spill_instructions']} stack {r['stack']} "
                          f"smem {r['shared_bytes']} E4M3 wgmma {r['fp8_wgmma']} (A in regs {r['wgmma_reg_a']}, "
                          f"non-FP8 {r['wgmma']}) setmaxnreg {r['setmaxnreg']}  consumer loops: {loops}",
                          flush=True)
    if as_json:
        print(json.dumps(out))
    print(f"{len(out) - bad}/{len(out)} builds ok (no spills, E4M3 wgmma present)")
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------ GPU bench

def tflops(b, n, h, d, causal, ms):
    flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return round(flops / (ms * 1e-3) / 1e12, 1)


def max_rel(a, ref):
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def time_ms(triton, fn, rep):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _timed(cell, name, triton, fn, rep, shape, causal, **extra):
    b, n, h, d = shape
    r = cell["results"].setdefault(name, {})
    r.update(extra)
    try:
        ms = time_ms(triton, fn, rep)
        r.update(ms=round(ms, 4), tflops=tflops(b, n, h, d, causal, ms))
    except Exception as e:  # noqa: BLE001 - a failing baseline is a result, not a crash
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"  {name:28} {r}", flush=True)
    return r


def run_cell(torch, triton, mods, shape, causal, rep, configs):
    f8, f9, a9 = mods
    b, n, h, d = shape
    cell = {"shape": list(shape), "causal": causal, "results": {}}
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    left, right = (-1, 0) if causal else (-1, -1)
    with torch.no_grad():
        def triton_fp8():
            with f8.attn.triton_kernels_only():   # not the Gluon kernel _fp8_forward may race it against
                return f8._fp8_forward(q, k, v, None, 0, scale, left, right, False)
        ref_o, ref_lse = triton_fp8()
        _timed(cell, "triton_fp8", triton, triton_fp8, rep, shape, causal,
               note="fp8_attention._fp8_forward on its Triton kernel, K/V passes included")
        if a9.available("cuda"):
            _timed(cell, "gluon_bf16", triton, lambda: a9.forward(q, k, v, causal=causal, softmax_scale=scale),
                   rep, shape, causal, note="attention_sm90.forward")
        else:
            cell["results"]["gluon_bf16"] = {"error": f"attention_sm90 unavailable: {a9._GLUON_ERROR}"}
        k8, v8t, ks, vs = f9.quantize_kv(k, v)
        v8t_permuted = f9.quantize_kv(k, v, permuted=True)[1]   # for the P_SMEM=3 configs
        try:
            ms = time_ms(triton, lambda: f9.quantize_kv(k, v), rep)
            cell["results"]["kv_pass"] = {"ms": round(ms, 4), "note": "fp8_attention's K and V passes alone"}
        except Exception as e:  # noqa: BLE001
            cell["results"]["kv_pass"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  {'kv_pass':28} {cell['results']['kv_pass']}", flush=True)
        for cfg in configs:
            name = "gluon_fp8_" + "_".join(map(str, cfg))
            r = cell["results"][name] = {"config": list(cfg)}
            try:
                permuted = f9._config(d, cfg)[3] == f9.P_PERMUTED
                vt = v8t_permuted if permuted else v8t
                o, lse = f9.forward(q, k8, vt, ks, vs, causal, scale, config=cfg, v_permuted=permuted)
                torch.cuda.synchronize()
                r["max_rel_o_vs_triton_fp8"] = max_rel(o, ref_o)
                r["max_abs_lse_vs_triton_fp8"] = (lse - ref_lse).abs().max().item()
                r["nan"] = bool(o.isnan().any().item() or lse.isnan().any().item())
                r["correct"] = (not r["nan"] and r["max_rel_o_vs_triton_fp8"] < MAX_REL
                                and r["max_abs_lse_vs_triton_fp8"] < MAX_LSE)
                if r["correct"]:
                    ms = time_ms(triton, lambda: f9.forward(q, k8, vt, ks, vs, causal, scale, config=cfg,
                                                            v_permuted=permuted), rep)
                    r["kernel"] = {"ms": round(ms, 4), "tflops": tflops(b, n, h, d, causal, ms)}
                    ms = time_ms(triton, lambda: f9.fp8_forward(q, k, v, causal, scale, config=cfg), rep)
                    r["with_pass"] = {"ms": round(ms, 4), "tflops": tflops(b, n, h, d, causal, ms)}
            except Exception as e:  # noqa: BLE001 - report the variant and go on
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=3)
            print(f"  {name:28} {r}", flush=True)
    del q, k, v, k8, v8t, v8t_permuted
    torch.cuda.empty_cache()
    return cell


def summary(cells):
    print("\nTFLOP/s: best correct FP8 Gluon config (kernel alone / with K/V passes) vs the Triton FP8 forward "
          "(passes included) and the bf16 Gluon forward")
    for cell in cells:
        res = cell["results"]
        fp8 = [r for key, r in res.items() if key.startswith("gluon_fp8") and "kernel" in r]
        best = max(fp8, key=lambda r: r["kernel"]["tflops"], default=None)
        bf16 = res.get("gluon_bf16", {}).get("tflops")
        tri = res.get("triton_fp8", {}).get("tflops")
        head = f"  {str(tuple(cell['shape'])):20} causal={cell['causal']!s:5}"
        if best is None:
            print(f"{head}  no correct FP8 Gluon config   triton_fp8 {tri}  gluon_bf16 {bf16}")
            continue
        kt, wt = best["kernel"]["tflops"], best["with_pass"]["tflops"]
        ratio = f"{kt / bf16:.3f} / {wt / bf16:.3f}" if bf16 else "n/a"
        cell["best"] = {"config": best["config"], "kernel_tflops": kt, "with_pass_tflops": wt,
                        "ratio_vs_bf16_gluon_kernel": round(kt / bf16, 3) if bf16 else None,
                        "ratio_vs_bf16_gluon_with_pass": round(wt / bf16, 3) if bf16 else None}
        print(f"{head}  gluon_fp8 {kt} / {wt} {tuple(best['config'])}  triton_fp8 {tri}  gluon_bf16 {bf16}  "
              f"FP8/bf16-Gluon {ratio}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for fp8_attention_sm90.json")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep in ms (default 100)")
    p.add_argument("--aot-only", action="store_true", help="only the ahead-of-time sm_90a build report (no GPU)")
    p.add_argument("--head-dims", default="128,64", help="--aot-only: head dims to build")
    p.add_argument("--dtypes", default="bf16,fp16", help="--aot-only: Q/O dtypes to build")
    p.add_argument("--json", action="store_true", help="--aot-only: one JSON list on the last line")
    p.add_argument("--configs", default=None, metavar="BM,BN,STAGES;...",
                   help="configs to try instead of fp8_attention_sm90.CONFIGS")
    p.add_argument("--shapes", default=None, metavar="B,N,H,D;...", help="shapes instead of the default two")
    p.add_argument("--kv-block", type=int, default=None,
                   help="rows a K/V scale covers (fp8_attention.KV_BLOCK, 128 on the GPU), for this run")
    args = p.parse_args(argv)
    if args.aot_only:
        return aot_main([int(x) for x in args.head_dims.split(",")], args.dtypes.split(","), args.json)

    import torch
    import triton
    import triton.testing
    from common import environment, write_result
    from tilewise.ops import attention_sm90 as a9
    from tilewise.ops import fp8_attention as f8
    from tilewise.ops import fp8_attention_sm90 as f9

    if args.kv_block:   # both modules read these at call time: the passes' scale blocks and the kernel's
        f8.KV_BLOCK = f9.KV_BLOCK_GPU = args.kv_block
    result = {"env": environment(), "available": None, "gluon_error": f9._GLUON_ERROR, "kv_block": f8.KV_BLOCK,
              "cells": []}
    result["available"] = f9.available("cuda") if torch.cuda.is_available() else False
    print(f"fp8_attention_sm90 available: {result['available']} ({f9._GLUON_ERROR or 'Gluon imported'})", flush=True)
    if not result["available"]:
        try:   # say why: the build error, if it is one
            f9.compile_sm90(128, False)
        except Exception as e:  # noqa: BLE001
            result["build_error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(result["build_error"])
        write_result(result, "fp8_attention_sm90.json", [args.out])
        return 1
    custom = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")] if args.configs else None
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    for shape in shapes:
        for causal in (False, True):
            print(f"{shape} causal={causal}", flush=True)
            configs = custom or f9.CONFIGS[shape[3]]
            result["cells"].append(run_cell(torch, triton, (f8, f9, a9), shape, causal, args.rep, configs))
            write_result(result, "fp8_attention_sm90.json", [args.out])   # partial results survive a crash
    summary(result["cells"])
    write_result(result, "fp8_attention_sm90.json", [args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
