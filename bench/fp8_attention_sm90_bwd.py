"""The Gluon FP8 Hopper attention backward (ops/fp8_attention_sm90_bwd.py) on the H200: correctness first, then
speed against fp8_attention.py's Triton FP8 backward and attention_sm90_bwd.py's bf16 Gluon backward.

Shapes (batch, seqlen, heads, head_dim): (4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64), each
causal and non-causal. The FP8 backwards consume one FP8 forward's outputs (fp8_attention._fp8_forward's o,
lse); the bf16 Gluon backward those of attention.py's bf16 forward. Timings (do_bench, median):
- triton_fp8: fp8_attention._fp8_backward (its prep and quantization passes included, as a caller pays);
- gluon_bf16: attention_sm90_bwd.backward (attention.py's prep kernel included);
- gluon_fp8_<kind>_<cfg>: each config of fp8_attention_sm90_bwd.CONFIGS, checked against the Triton FP8
  backward on the same inputs (the other kernel at its default), then its kernel alone timed on prepare()'s
  operands (launch_dkdv / launch_dq); a variant that fails to build, run or match is reported and skipped;
- gluon_fp8: the whole backward (prepare()'s passes included) with the fastest config pair, and
  gluon_fp8_kernels: the two kernels alone at that pair; prep_passes: prepare() alone.
TFLOP/s: the backward counted as 2.5x the forward's 4 * B * H * N^2 * D (half of it causal), as
bench/attention_sm90_bwd.py counts it. The summary prints the FP8 Gluon backward's ratio to the bf16 Gluon
backward (the goal: >= 1.15).

    PYTHONPATH=src python bench/fp8_attention_sm90_bwd.py --out DIR    # writes DIR/fp8_attention_sm90_bwd.json
    python bench/fp8_attention_sm90_bwd.py --aot-only [--out DIR]      # no GPU: sm_90a builds, SASS checks

--aot-only compiles every (kernel, head_dim, config, causal, gradient dtype) ahead of time for sm_90a with the
installed Triton's ptxas (needs Gluon's Hopper API as Triton 3.6 has it; no GPU is touched) and reports
registers, spills, shared memory, E4M3 wgmma (SASS QGMMA ... E4M3.E4M3) count and the consumer loops' mix
(bench/attention_sm90_sass.py's build_report). Exit status 1 when a build fails, spills or has no E4M3 wgmma.
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

SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64)]
# A variant must match the Triton FP8 backward on the same inputs (max |diff| / max |triton| per gradient):
# the same E4M3 operands and scale rules, only rescale points and rare E4M3 roundings differ.
MAX_REL = 3e-2
GRADS = ("dq", "dk", "dv")


# ------------------------------------------------------------------------------------------ AOT / SASS

def aot_report(kind: str, d: int, causal: bool, dtype: str, cfg) -> dict:
    from attention_sm90_sass import build_report
    from tilewise.ops import fp8_attention_sm90_bwd as fb
    r = build_report({"kernel": kind, "head_dim": d, "causal": causal, "dtype": dtype, "config": list(cfg)},
                     lambda: fb.compile_sm90(kind, d, causal, dtype, tuple(cfg)))
    if "error" not in r:
        r["ok"] = r["ok"] and r["fp8_wgmma"] > 0 and r["wgmma"] == 0
    return r


def aot_main(kinds, head_dims, dtypes, as_json, out_dir) -> int:
    os.environ.pop("TRITON_INTERPRET", None)   # the interpreter cannot compile
    from tilewise.ops import fp8_attention_sm90_bwd as fb
    if fb._fp8_bwd_dkdv_sm90 is None:
        print(f"no Gluon Hopper API in this Triton: {fb._GLUON_ERROR}")
        return 1
    out, bad = [], 0
    for kind in kinds:
        for d in head_dims:
            for cfg in fb.CONFIGS[kind][d]:
                for causal in (False, True):
                    for dtype in dtypes:
                        r = aot_report(kind, d, causal, dtype, cfg)
                        out.append(r)
                        bad += not r.get("ok", False)
                        if as_json:
                            continue
                        head = f"{kind:4} d{d} {str(tuple(cfg)):15} causal={causal!s:5} {dtype}"
                        if "error" in r:
                            print(f"{head}  FAILED {r['error']}")
                            continue
                        loops = "; ".join(f"{l['instructions']} ins, {l['wgmma']} wgmma, {l['wgmma_waits']} waits, "
                                          f"{l['mufu_ex2']} ex2, {l['bar_sync']} bar" for l in r["loops"][:2])
                        print(f"{head}  regs {r['registers']:3} spills {r['spill_instructions']} stack {r['stack']} "
                              f"smem {r['shared_bytes']} E4M3 wgmma {r['fp8_wgmma']} (A in regs {r['wgmma_reg_a']}, "
                              f"non-FP8 {r['wgmma']}) setmaxnreg {r['setmaxnreg']}  consumer loops: {loops}",
                              flush=True)
    if as_json:
        print(json.dumps(out))
    print(f"{len(out) - bad}/{len(out)} builds ok (no spills, E4M3 wgmma only)")
    if out_dir:
        from common import environment, write_result
        write_result({"env": environment(), "aot": out}, "fp8_attention_sm90_bwd_aot.json", [out_dir])
    return 1 if bad else 0


# ------------------------------------------------------------------------------------------ GPU bench

def tflops(b, n, h, d, causal, ms):
    flops = 2.5 * 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return round(flops / (ms * 1e-3) / 1e12, 1)


def max_rel(a, ref):
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def time_ms(triton, fn, rep):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _timed(res, name, triton, fn, rep, shape, causal, **extra):
    b, n, h, d = shape
    r = res.setdefault(name, {})
    r.update(extra)
    try:
        ms = time_ms(triton, fn, rep)
        r.update(ms=round(ms, 4), tflops=tflops(b, n, h, d, causal, ms))
    except Exception as e:  # noqa: BLE001 - a failing variant or baseline is a result, not a crash
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc(limit=3)
    print(f"  {name:30} {r}", flush=True)
    return r


def run_cell(torch, triton, mods, shape, causal, rep, configs):
    f8, fb, att, b9 = mods
    b, n, h, d = shape
    cell = {"shape": list(shape), "causal": causal, "results": {}}
    res = cell["results"]
    q, k, v, dout = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    left, right = (-1, 0) if causal else (-1, -1)
    with torch.no_grad():
        o, lse = f8._fp8_forward(q, k, v, None, 0, scale, left, right, False)

        def triton_fp8():
            with att.triton_kernels_only():   # not the Gluon kernels _fp8_backward may race them against
                return f8._fp8_backward(dout, q, k, v, o, lse, None, None, 0, scale, left, right, False)
        ref = triton_fp8()
        _timed(res, "triton_fp8", triton, triton_fp8, rep, shape, causal,
               note="fp8_attention._fp8_backward on its Triton kernels, prep and quantization passes included")
        if b9.available("cuda"):
            o16, lse16 = att.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
            _timed(res, "gluon_bf16", triton,
                   lambda: b9.backward(dout, q, k, v, o16, lse16, causal=causal, softmax_scale=scale),
                   rep, shape, causal, note="attention_sm90_bwd.backward (bf16), prep included")
            del o16, lse16
        else:
            res["gluon_bf16"] = {"error": f"attention_sm90_bwd unavailable: {b9._GLUON_ERROR}"}
        prep = fb.prepare(dout, q, k, v, o, lse)
        _timed(res, "prep_passes", triton, lambda: fb.prepare(dout, q, k, v, o, lse), rep, shape, causal,
               note="prepare(): attention.py's prep, the Q, dO, K, V quantization passes")
        res["prep_passes"].pop("tflops", None)
        best = {}
        for kind in ("dkdv", "dq"):
            for cfg in configs[kind][d]:
                name = f"gluon_fp8_{kind}_" + "_".join(map(str, cfg))
                r = res[name] = {"config": list(cfg)}
                try:
                    kw = {"dkdv_config": cfg} if kind == "dkdv" else {"dq_config": cfg}
                    grads = fb.backward(dout, q, k, v, o, lse, causal, scale, prepared=prep, **kw)
                    torch.cuda.synchronize()
                    r["max_rel_vs_triton_fp8"] = {g: round(max_rel(x, y), 5) for g, x, y in zip(GRADS, grads, ref)}
                    r["nan"] = any(bool(x.isnan().any().item()) for x in grads)
                    r["correct"] = (not r["nan"]) and max(r["max_rel_vs_triton_fp8"].values()) < MAX_REL
                    if r["correct"]:
                        if kind == "dkdv":
                            dk, dv = torch.empty_like(k), torch.empty_like(v)
                            fn = lambda: fb.launch_dkdv(prep, q, k, dk, dv, causal, scale, cfg)  # noqa: E731
                        else:
                            dq = torch.empty_like(q)
                            fn = lambda: fb.launch_dq(prep, q, k, dq, causal, scale, cfg)  # noqa: E731
                        r["kernel_ms"] = round(time_ms(triton, fn, rep), 4)
                        if kind not in best or r["kernel_ms"] < best[kind][1]:
                            best[kind] = (cfg, r["kernel_ms"])
                except Exception as e:  # noqa: BLE001 - report the variant and go on
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc(limit=3)
                print(f"  {name:30} {r}", flush=True)
        if "dkdv" in best and "dq" in best:
            cd, cq = best["dkdv"][0], best["dq"][0]
            pair = {"dkdv_config": list(cd), "dq_config": list(cq)}
            _timed(res, "gluon_fp8", triton,
                   lambda: fb.backward(dout, q, k, v, o, lse, causal, scale, dkdv_config=cd, dq_config=cq),
                   rep, shape, causal, note="prepare() and both kernels", **pair)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

            def kernels():
                fb.launch_dkdv(prep, q, k, dk, dv, causal, scale, cd)
                fb.launch_dq(prep, q, k, dq, causal, scale, cq)
            _timed(res, "gluon_fp8_kernels", triton, kernels, rep, shape, causal, note="both kernels alone", **pair)
        else:
            res["gluon_fp8"] = {"error": "no correct config of one of the kernels"}
    del q, k, v, dout, o, lse, ref, prep
    torch.cuda.empty_cache()
    return cell


def summary(cells):
    print("\nbackward TFLOP/s: FP8 Gluon (fastest pair; with passes / kernels alone) vs Triton FP8 and bf16 Gluon")
    for cell in cells:
        res = cell.get("results", {})
        g, gk = res.get("gluon_fp8", {}), res.get("gluon_fp8_kernels", {})
        bf16, tri = res.get("gluon_bf16", {}).get("tflops"), res.get("triton_fp8", {}).get("tflops")
        head = f"  {str(tuple(cell['shape'])):22} causal={cell['causal']!s:5}"
        if "tflops" not in g:
            print(f"{head}  gluon_fp8 {g.get('error', 'err')}  triton_fp8 {tri}  gluon_bf16 {bf16}")
            continue
        ratio = round(g["tflops"] / bf16, 3) if bf16 else None
        cell["best"] = {"dkdv_config": g.get("dkdv_config"), "dq_config": g.get("dq_config"),
                        "tflops": g["tflops"], "kernels_tflops": gk.get("tflops"), "ratio_vs_bf16_gluon": ratio,
                        "ratio_vs_triton_fp8": round(g["tflops"] / tri, 3) if tri else None}
        print(f"{head}  gluon_fp8 {g['tflops']} / {gk.get('tflops')} ({g.get('dkdv_config')}, {g.get('dq_config')})"
              f"  triton_fp8 {tri}  gluon_bf16 {bf16}  FP8/bf16-Gluon {ratio}")


def _configs(defaults, spec):
    """CONFIGS with the kinds `spec` names ('dkdv:64,64,3,1;...') replaced, for every head_dim."""
    if not spec:
        return defaults
    chosen = {}
    for item in spec.split(";"):
        kind, _, cfg = item.partition(":")
        chosen.setdefault(kind.strip(), []).append(tuple(int(x) for x in cfg.split(",")))
    return {kind: ({d: chosen[kind] for d in by_d} if kind in chosen else by_d) for kind, by_d in defaults.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for fp8_attention_sm90_bwd.json (--aot-only: _aot.json)")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep in ms (default 100)")
    p.add_argument("--aot-only", action="store_true", help="only the ahead-of-time sm_90a build report (no GPU)")
    p.add_argument("--kernels", default="dkdv,dq", help="--aot-only: kernels to build")
    p.add_argument("--head-dims", default="128,64", help="--aot-only: head dims to build")
    p.add_argument("--dtypes", default="bf16,fp16", help="--aot-only: gradient dtypes to build")
    p.add_argument("--json", action="store_true", help="--aot-only: one JSON list on the last line")
    p.add_argument("--shapes", default=None, metavar="B,N,H,D;...", help="shapes instead of the three defaults")
    p.add_argument("--configs", default=None, metavar="KIND:A,B,STAGES,P_SMEM;...",
                   help="configs to time instead of fp8_attention_sm90_bwd.CONFIGS, e.g. 'dkdv:64,64,3,1;dq:64,64,3,1' "
                        "(a kind not named keeps its CONFIGS; head_dim from each shape)")
    args = p.parse_args(argv)
    if args.aot_only:
        return aot_main(args.kernels.split(","), [int(x) for x in args.head_dims.split(",")], args.dtypes.split(","),
                        args.json, args.out)

    import torch
    import triton
    import triton.testing
    from common import environment, write_result
    from tilewise.ops import attention as att
    from tilewise.ops import attention_sm90_bwd as b9
    from tilewise.ops import fp8_attention as f8
    from tilewise.ops import fp8_attention_sm90_bwd as fb

    result = {"env": environment(), "available": None, "gluon_error": fb._GLUON_ERROR, "cells": [],
              "flops": "backward = 2.5 x 4*B*H*N^2*D (x0.5 causal)"}
    result["available"] = fb.available("cuda") if torch.cuda.is_available() else False
    print(f"fp8_attention_sm90_bwd available: {result['available']} ({fb._GLUON_ERROR or 'Gluon imported'})",
          flush=True)
    if not result["available"]:
        for kind in ("dkdv", "dq"):
            try:   # say why: the build error, if it is one
                fb.compile_sm90(kind, 128, False)
            except Exception as e:  # noqa: BLE001
                result[f"build_error_{kind}"] = f"{type(e).__name__}: {str(e)[:2000]}"
                print(result[f"build_error_{kind}"])
        write_result(result, "fp8_attention_sm90_bwd.json", [args.out])
        return 1
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    for shape in shapes:
        for causal in (False, True):
            print(f"{shape} causal={causal}", flush=True)
            try:
                result["cells"].append(run_cell(torch, triton, (f8, fb, att, b9), shape, causal, args.rep,
                                                _configs(fb.CONFIGS, args.configs)))
            except Exception as e:  # noqa: BLE001 - a cell that crashes (OOM, a baseline) is reported
                traceback.print_exc(limit=3)
                result["cells"].append({"shape": list(shape), "causal": causal,
                                        "error": f"{type(e).__name__}: {str(e)[:300]}"})
            write_result(result, "fp8_attention_sm90_bwd.json", [args.out])   # partial results survive a crash
    summary(result["cells"])
    write_result(result, "fp8_attention_sm90_bwd.json", [args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
