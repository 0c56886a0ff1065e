"""The Gluon Hopper attention backward (ops/attention_sm90_bwd.py) on the H200: correctness first, then speed
against attention.py's Triton backward and torch SDPA's (flash, cudnn), backward only, bf16.

Shapes (batch, seqlen, heads, head_dim): (4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64), each
causal and non-causal. Both tilewise backwards consume the same saved forward outputs (attention.py's o and
lse): the Gluon one through attention_sm90_bwd.backward (attention.py's prep kernel, then the Gluon dK/dV and
dQ kernels), the Triton one through attention.py's launcher `_attn_backward` (prep, `_attn_bwd_dkdv`,
`_attn_bwd_dq`), so both time the same work. Every config of attention_sm90_bwd.CONFIGS is timed per kernel
(launch_dkdv, launch_dq, launch_dkdv_dq on the prep's lse2 / delta), then the whole backward with the fastest
pair ("gluon", dq_mode "split") and with the fastest dkdv_dq config ("gluon_atomic": zeroed float32 dq_acc, the
kernel, the cast into dq; "atomic_dq_overhead" times the zeroing and the cast alone); a variant that fails to
build, run or match is printed and skipped. SDPA has no standalone backward here: its time is
(forward + backward) - forward, each timed with do_bench. TFLOP/s: the backward counted as 2.5x the forward's
4 * B * H * N^2 * D (half of it causal), as bench/attention.py counts it.

    PYTHONPATH=src python bench/attention_sm90_bwd.py --out DIR    # writes DIR/attention_sm90_bwd.json
    PYTHONPATH=src python bench/attention_sm90_bwd.py --shapes "8,2048,16,128;32,1024,12,64"   # GPT-1.3B, 124M
    PYTHONPATH=src python bench/attention_sm90_bwd.py --fused-qkv --causal yes   # the model's q, k, v views
    python bench/attention_sm90_bwd.py --aot-only                  # no GPU: bench/attention_sm90_bwd_sass.py
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

SHAPES = [(4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64)]
MAX_REL = 2e-2   # max relative error (max |diff| / max |triton|) a variant may have against the Triton backward


def tflops(b, n, h, d, causal, ms):
    flops = 2.5 * 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
    return round(flops / (ms * 1e-3) / 1e12, 1)


def max_rel(a, ref):
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def time_ms(triton, fn, rep, grad_to_none=None):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def sdpa_backward_ms(torch, F, triton, backend, q, k, v, dout, causal, scale, rep):
    """(forward + backward) - forward of SDPA with `backend`, in the (batch, heads, seqlen, d) layout."""
    from torch.nn.attention import sdpa_kernel
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2).contiguous()

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    def fwd_bwd():
        fwd().backward(dt)
    fwd_bwd()
    ms_f = time_ms(triton, fwd, rep)
    ms_fb = time_ms(triton, fwd_bwd, rep, grad_to_none=[qt, kt, vt])
    return ms_fb - ms_f, ms_f


def run_cell(torch, F, triton, b9, att, shape, causal, rep, configs, fused_qkv=False):
    b, n, h, d = shape
    cell = {"shape": list(shape), "causal": causal, "fused_qkv": fused_qkv, "results": {}}
    res = cell["results"]
    if fused_qkv:   # the model's layout: views of one (batch, seqlen, 3 heads, d) projection output
        q, k, v = torch.randn(b, n, 3 * h, d, dtype=torch.bfloat16, device="cuda").split([h, h, h], dim=2)
        dout = torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda")
    else:
        q, k, v, dout = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    right = 0 if causal else -1
    with torch.no_grad():
        o, lse = att.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
        def triton_bwd():
            with att.triton_kernels_only():   # not the Gluon backward _attn_backward may race it against
                return att._attn_backward(dout, q, k, v, o, lse, None, None, 0, scale, -1, right)
        ref = triton_bwd()
        ms = time_ms(triton, triton_bwd, rep)
        res["triton"] = {"ms": round(ms, 4), "tflops": tflops(b, n, h, d, causal, ms)}
        print(f"  {'triton':28} {res['triton']}", flush=True)
    try:
        from torch.nn.attention import SDPBackend
        backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    except ImportError as e:
        backends = {}
        res["sdpa"] = {"error": f"ImportError: {e}"}
    for name, backend in backends.items():
        try:
            ms, ms_f = sdpa_backward_ms(torch, F, triton, backend, q, k, v, dout, causal, scale, rep)
            res[name] = {"ms": round(ms, 4), "fwd_ms": round(ms_f, 4), "tflops": tflops(b, n, h, d, causal, ms),
                         "how": "fwd+bwd minus fwd"}
        except Exception as e:  # noqa: BLE001 - a missing backend is a result, not a crash
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(f"  {name:28} {res[name]}", flush=True)

    with torch.no_grad():
        # lse2 / delta as the Gluon backward makes them, for the per-kernel timings
        lse2, delta = att._backward_prep(dout, o, lse, None, None, b, n, n, h, 0)
        best = {}
        for kind in ("dkdv", "dq", "dkdv_dq"):
            for cfg in configs.get(kind, {}).get(d, []):
                name = f"gluon_{kind}_" + "_".join(map(str, cfg))
                r = res[name] = {"config": list(cfg)}
                try:
                    kw = {"dkdv": {"dkdv_config": cfg}, "dq": {"dq_config": cfg},
                          "dkdv_dq": {"dq_mode": "atomic", "dkdv_dq_config": cfg}}[kind]
                    grads = b9.backward(dout, q, k, v, o, lse, causal=causal, softmax_scale=scale, **kw)
                    torch.cuda.synchronize()
                    r["max_rel"] = {g: round(max_rel(x, y), 5) for g, x, y in zip(("dq", "dk", "dv"), grads, ref)}
                    r["nan"] = any(bool(x.isnan().any().item()) for x in grads)
                    r["correct"] = (not r["nan"]) and max(r["max_rel"].values()) < MAX_REL
                    if r["correct"]:
                        if kind == "dkdv":
                            dk, dv = torch.empty_like(k), torch.empty_like(v)
                            fn = lambda: b9.launch_dkdv(q, k, v, dout, dk, dv, lse2, delta, causal, scale, cfg)  # noqa: E731,E501
                        elif kind == "dkdv_dq":   # the kernel alone (dq_acc adds up over the runs: same time)
                            dk, dv = torch.empty_like(k), torch.empty_like(v)
                            acc = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
                            fn = lambda: b9.launch_dkdv_dq(  # noqa: E731
                                q, k, v, dout, dk, dv, acc, lse2, delta, causal, scale, cfg)
                        else:
                            dq = torch.empty_like(q)
                            fn = lambda: b9.launch_dq(q, k, v, dout, dq, lse2, delta, causal, scale, cfg)  # noqa: E731
                        r["kernel_ms"] = round(time_ms(triton, fn, rep), 4)
                        if kind not in best or r["kernel_ms"] < best[kind][1]:
                            best[kind] = (cfg, r["kernel_ms"])
                except Exception as e:  # noqa: BLE001 - report the variant and go on
                    r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc(limit=3)
                print(f"  {name:28} {r}", flush=True)
        if "dkdv" in best and "dq" in best:
            cd, cq = best["dkdv"][0], best["dq"][0]
            r = res["gluon"] = {"dkdv_config": list(cd), "dq_config": list(cq)}
            try:
                fn = lambda: b9.backward(dout, q, k, v, o, lse, causal=causal, softmax_scale=scale,  # noqa: E731
                                         dkdv_config=cd, dq_config=cq)
                ms = time_ms(triton, fn, rep)
                r.update(ms=round(ms, 4), tflops=tflops(b, n, h, d, causal, ms),
                         vs_triton=round(res["triton"]["ms"] / ms, 3))
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=3)
            print(f"  {'gluon (best pair)':28} {r}", flush=True)
        else:
            res["gluon"] = {"error": "no correct config of one of the kernels"}
        if "dkdv_dq" in best:
            ca = best["dkdv_dq"][0]
            r = res["gluon_atomic"] = {"dkdv_dq_config": list(ca)}
            try:
                fn = lambda: b9.backward(dout, q, k, v, o, lse, causal=causal, softmax_scale=scale,  # noqa: E731
                                         dq_mode="atomic", dkdv_dq_config=ca)
                ms = time_ms(triton, fn, rep)
                r.update(ms=round(ms, 4), tflops=tflops(b, n, h, d, causal, ms),
                         vs_triton=round(res["triton"]["ms"] / ms, 3))
                if "ms" in res["gluon"]:
                    r["vs_split"] = round(res["gluon"]["ms"] / ms, 3)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc(limit=3)
            print(f"  {'gluon atomic (best)':28} {r}", flush=True)
            dq = torch.empty_like(q)

            def overhead():   # what dq_mode="atomic" adds around its kernel
                acc = torch.zeros(b, h, n, d, dtype=torch.float32, device=q.device)
                dq.copy_(acc.transpose(1, 2))
            res["atomic_dq_overhead"] = {"ms": round(time_ms(triton, overhead, rep), 4)}
            print(f"  {'atomic dq zero + cast':28} {res['atomic_dq_overhead']}", flush=True)
        else:
            res["gluon_atomic"] = {"error": "no correct dkdv_dq config"}
    del q, k, v, dout, o, lse, ref
    torch.cuda.empty_cache()
    return cell


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="folder for attention_sm90_bwd.json")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep in ms (default 100)")
    p.add_argument("--aot-only", action="store_true", help="only the ahead-of-time sm_90 build report (no GPU)")
    p.add_argument("--shapes", default=None, metavar="B,N,H,D;...", help="shapes instead of the three defaults")
    p.add_argument("--fused-qkv", action="store_true",
                   help="q, k, v as views of one (B, N, 3H, D) tensor, the model's layout (default: three tensors)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both", help="which cells to run")
    args = p.parse_args(argv)
    if args.aot_only:
        import attention_sm90_bwd_sass
        return attention_sm90_bwd_sass.main(["--all-configs"])

    import torch
    import torch.nn.functional as F
    import triton
    import triton.testing
    from common import environment, write_result
    from tilewise.ops import attention as att
    from tilewise.ops import attention_sm90_bwd as b9

    result = {"env": environment(), "available": None, "gluon_error": b9._GLUON_ERROR, "cells": [],
              "flops": "backward = 2.5 x 4*B*H*N^2*D (x0.5 causal)",
              "sdpa": "standalone backward not reachable: (fwd+bwd) - fwd"}
    result["available"] = b9.available("cuda") if torch.cuda.is_available() else False
    print(f"attention_sm90_bwd available: {result['available']} ({b9._GLUON_ERROR or 'Gluon imported'})",
          flush=True)
    if not result["available"]:
        for kind in ("dkdv", "dq", "dkdv_dq"):
            try:   # say why: the build error, if it is one
                b9.compile_sm90(kind, 128, False)
            except Exception as e:  # noqa: BLE001
                result[f"build_error_{kind}"] = f"{type(e).__name__}: {str(e)[:2000]}"
                print(result[f"build_error_{kind}"])
        write_result(result, "attention_sm90_bwd.json", [args.out])
        return 1
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    for shape in shapes:
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
            print(f"{shape} causal={causal}", flush=True)
            try:
                result["cells"].append(run_cell(torch, F, triton, b9, att, shape, causal, args.rep, b9.CONFIGS,
                                                args.fused_qkv))
            except Exception as e:  # noqa: BLE001 - a cell that crashes (OOM, a baseline) is reported
                traceback.print_exc(limit=3)
                result["cells"].append({"shape": list(shape), "causal": causal,
                                        "error": f"{type(e).__name__}: {str(e)[:300]}"})
            write_result(result, "attention_sm90_bwd.json", [args.out])   # partial results survive a crash
    print("\nbackward TFLOP/s (Gluon with its fastest config pair, Gluon atomic with its fastest config, the rest)")
    for cell in result["cells"]:
        res = cell.get("results", {})
        others = "  ".join(f"{k} {r.get('tflops', 'err')}" for k, r in res.items()
                           if not k.startswith(("gluon", "atomic_dq")))
        g, a = res.get("gluon", {}), res.get("gluon_atomic", {})
        print(f"  {str(tuple(cell['shape'])):22} causal={cell['causal']!s:5}  gluon {g.get('tflops', 'err')} "
              f"({g.get('dkdv_config')}, {g.get('dq_config')})  atomic {a.get('tflops', 'err')} "
              f"({a.get('dkdv_dq_config')})  {others}")
    write_result(result, "attention_sm90_bwd.json", [args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
