"""FP8 linear layers: tilewise Fp8Linear against bf16 nn.Linear and torchao Float8Linear (torch.compile).

Each row is one linear layer's forward + backward (y = x W^T, then dx and dW through torch.autograd.grad, so
nothing accumulates into .grad) at tokens x in -> out, bf16 parameters and activations, no bias:
- bf16: nn.Linear (cuBLAS);
- tilewise: Fp8Linear, delayed scaling (hybrid E4M3/E5M2), the FP8 weight recast every iteration (one
  micro-batch per optimizer step, the least favourable case for the weight cache);
- tilewise_current: the same with current scaling (an amax pass before each cast);
- torchao: torchao.float8.convert_to_float8_training (tensorwise dynamic scaling) under torch.compile.
Fp8State.step() runs once per optimizer step for the whole model, not per layer: it is timed on its own
(a GPT-2 124M sized state) and reported apart. Also reported: the three GEMMs alone (FP8 _scaled_mm on
pre-cast operands vs bf16 mm), the fused cast kernel's GB/s against a device copy, and each method's
host time per iteration (launch overhead). Outputs are checked against an fp32 GEMM before timing.

    PYTHONPATH=src python3 bench/fp8.py --out DIR [--quick]

It stays within --budget-s (200 s; torchao's compiles stop at 60% of it, later shapes are skipped past it,
both recorded), prints the main table last, and takes the commit from git or else $TILEWISE_COMMIT.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import sys
import time

import torch
import torch.nn as nn
from common import git_commit

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [  # (model, in_features, out_features); the 8B-class first, so a tight time budget keeps them
    ("8b", 4096, 14336), ("8b", 14336, 4096),
    ("1.3b", 2048, 6144), ("1.3b", 2048, 2048), ("1.3b", 2048, 8192), ("1.3b", 8192, 2048),
    ("gpt2-124m", 768, 2304), ("gpt2-124m", 768, 768), ("gpt2-124m", 768, 3072), ("gpt2-124m", 3072, 768),
]
QUICK = [("8b", 4096, 14336), ("1.3b", 2048, 8192), ("gpt2-124m", 768, 3072)]
L2_BYTES = 60e6
TOL = {"y": 0.05, "dx": 0.08, "dw": 0.08}  # FP8 relative error norms vs fp32 (tests/fp8 justifies them)
TOL_BF16 = 0.01


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write fp8.json into this folder")
    p.add_argument("--quick", action="store_true", help="one shape per model size")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="time budget: past 60%% of it torchao (slow to compile) is skipped for the remaining "
                        "shapes, past all of it the remaining shapes are skipped (both recorded)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the benchmark) or cpu (a smoke run of the script: dims / 16, 64 tokens, host timer)")
    return p.parse_args(argv)


def load_torchao():
    """torchao's convert function, or (None, why)."""
    try:
        from torchao.float8 import convert_to_float8_training
        return convert_to_float8_training, None
    except Exception as e:  # ImportError, or a wheel built for another torch
        return None, f"{type(e).__name__}: {e}"


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def runner(module, weight, xs, dys, pre=None):
    """fn() runs forward + backward on the next input set (fn(i): on set i); returns (y, dx, dw)."""
    it = itertools.count()

    def fn(i=None):
        i = next(it) % len(xs) if i is None else i
        if pre is not None:
            pre()
        y = module(xs[i])
        dx, dw = torch.autograd.grad(y, (xs[i], weight), dys[i])
        return y, dx, dw
    return fn


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def host_us(fn, dev, n=20):
    """Host time per call with the GPU left to run behind (launch overhead, not kernel time)."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync(dev)
    return (t1 - t0) / n * 1e6


def host_bench(fn, warmup=0, rep=0, return_mode="median"):
    """The CPU smoke run's stand-in for do_bench: median of 3 host-timed calls, in ms."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def bench_shape(model, K, N, M, args, do_bench, convert_torchao, torchao_why, over_budget):
    from tilewise.fp8 import Fp8Linear
    from tilewise.ops.fp8_cast import cast_delayed

    dev, bf16 = args.device, torch.bfloat16
    torch.manual_seed(0)
    n_sets = 3 if 2 * (M * K + M * N + K * N) < L2_BYTES else 1  # rotate inputs that would sit in L2
    xs = [torch.randn(M, K, device=dev, dtype=bf16).requires_grad_(True) for _ in range(n_sets)]
    dys = [torch.randn(M, N, device=dev, dtype=bf16) * 1e-3 for _ in range(n_sets)]
    base = nn.Linear(K, N, bias=False, device=dev, dtype=bf16)
    with torch.no_grad():
        ref_y = xs[0].detach().float() @ base.weight.float().t()
        ref_dx = dys[0].float() @ base.weight.float()
        ref_dw = dys[0].float().t() @ xs[0].detach().float()

    methods = {"bf16": runner(base, base.weight, xs, dys)}
    fp8 = {}
    for name, recipe in (("tilewise", "delayed"), ("tilewise_current", "current")):
        f = Fp8Linear.from_linear(copy.deepcopy(base), recipe=recipe)
        for i in range(3):  # compile, autotune, and fill the delayed history
            runner(f, f.weight, xs, dys)()
            f.fp8_state.step()
        fp8[name] = f
        methods[name] = runner(f, f.weight, xs, dys, pre=f.invalidate)
    notes = {}
    if convert_torchao is None:
        notes["torchao"] = f"missing ({torchao_why})"
    elif over_budget():
        notes["torchao"] = "skipped: time budget"
    else:
        try:
            seq = nn.Sequential(copy.deepcopy(base))
            convert_torchao(seq)
            methods["torchao"] = runner(torch.compile(seq), seq[0].weight, xs, dys)
        except Exception as e:
            notes["torchao"] = f"error: {type(e).__name__}: {e}"

    # outputs agree before anything is timed
    errs, times, hosts = {}, {}, {}
    for name, fn in list(methods.items()):
        try:
            fn(0)  # warm: torch.compile compiles here
            y, dx, dw = fn(0)
            e = {"y": rel(y, ref_y), "dx": rel(dx, ref_dx), "dw": rel(dw, ref_dw)}
        except Exception as ex:
            notes[name] = f"error: {type(ex).__name__}: {ex}"
            methods.pop(name)
            continue
        errs[name] = e
        tol = {k: TOL_BF16 for k in TOL} if name == "bf16" else TOL
        if not all(e[k] < tol[k] for k in tol):
            notes[name] = f"outputs disagree with fp32: {e}"
            methods.pop(name)
    for name, fn in methods.items():
        times[name] = do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
        hosts[name] = host_us(fn, dev)

    flops = 6.0 * M * K * N
    tput = {name: flops / (ms * 1e-3) / 1e12 for name, ms in times.items()}
    tw = tput.get("tilewise")
    peers = [tput[p] for p in ("bf16", "torchao") if p in tput]
    row = {"shape": {"model": model, "tokens": M, "in": K, "out": N, "pass": "fwd+bwd"}, "unit": "TFLOP/s",
           "tilewise": tw, "tilewise_current": tput.get("tilewise_current"), "bf16": tput.get("bf16"),
           "torchao": tput.get("torchao"),
           "ratio_bf16": tw / tput["bf16"] if tw and "bf16" in tput else None,
           "ratio_torchao": tw / tput["torchao"] if tw and "torchao" in tput else None,
           "ratio_best_peer": tw / max(peers) if tw and peers else None,
           "detail": {"ms": times, "host_us_per_iter": hosts, "rel_err_vs_fp32": errs, "notes": notes}}

    # the three GEMMs alone: FP8 on operands cast once, vs bf16
    f = fp8["tilewise"]
    x, dy, w = xs[0].detach(), dys[0], base.weight.detach()
    one = torch.ones(1, device=dev)
    amax = torch.zeros(1, device=dev)
    x8, x8t = cast_delayed(x, torch.float8_e4m3fn, one, amax, True, True)
    w8, w8t = cast_delayed(w, torch.float8_e4m3fn, one, amax, True, True)
    dy8, dy8t = cast_delayed(dy * 1000, torch.float8_e5m2, one, amax, True, True)

    def fp8_gemms():
        torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=bf16, use_fast_accum=True)
        torch._scaled_mm(dy8, w8t.t(), scale_a=one, scale_b=one, out_dtype=bf16)
        torch._scaled_mm(dy8t, x8t.t(), scale_a=one, scale_b=one, out_dtype=bf16)

    def bf16_gemms():
        x @ w.t()
        dy @ w
        dy.t() @ x

    g8 = do_bench(fp8_gemms, warmup=25, rep=args.rep, return_mode="median")
    g16 = do_bench(bf16_gemms, warmup=25, rep=args.rep, return_mode="median")
    fwd8 = do_bench(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=bf16,
                                             use_fast_accum=True), warmup=25, rep=args.rep, return_mode="median")
    fwd16 = do_bench(lambda: x @ w.t(), warmup=25, rep=args.rep, return_mode="median")
    gemm_row = {"shape": {"model": model, "tokens": M, "in": K, "out": N, "pass": "GEMMs only (fwd, dgrad, wgrad)"},
                "unit": "TFLOP/s", "tilewise": flops / (g8 * 1e-3) / 1e12, "bf16": flops / (g16 * 1e-3) / 1e12,
                "detail": {"fwd_gemm_TFLOPs": {"fp8_scaled_mm": 2 * M * K * N / (fwd8 * 1e-3) / 1e12,
                                               "bf16_mm": 2 * M * K * N / (fwd16 * 1e-3) / 1e12},
                           "ms": {"tilewise": g8, "bf16": g16}}}
    gemm_row["ratio_best_peer"] = gemm_row["tilewise"] / gemm_row["bf16"]
    if tw:  # what the casts, scales and launches cost on top of the GEMMs
        gemm_row["fp8_overhead_ms"] = times["tilewise"] - g8

    # the fused cast kernel on x (E4M3) and on dy (E5M2): copy + transposed copy + amax
    cast_rows = []
    for what, t, dt in (("x", x, torch.float8_e4m3fn), ("dy", dy, torch.float8_e5m2)):
        ms = do_bench(lambda: cast_delayed(t, dt, one, amax, True, True), warmup=25, rep=args.rep,
                      return_mode="median")
        nbytes = t.numel() * (t.element_size() + 2)
        cast_rows.append({"shape": {"rows": t.shape[0], "cols": t.shape[1], "op": f"cast {what} -> {dt} + transpose + amax"},
                          "unit": "GB/s", "tilewise": nbytes / (ms * 1e-3) / 1e9, "detail": {"ms": ms}})
    del f
    return row, gemm_row, cast_rows


def copy_bandwidth(do_bench, dev):
    x = torch.randn(2 ** 30 if dev == "cuda" else 2 ** 20, device=dev, dtype=torch.bfloat16)  # 2 GiB on the GPU
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=200, return_mode="median")
    n = x.numel()
    del x, y
    return 4 * n / (ms * 1e-3) / 1e9


def state_step_us(do_bench, dev):
    from tilewise.fp8 import Fp8State
    s = Fp8State.for_linears("delayed", [f"h{i}.{n}" for i in range(12) for n in ("qkv", "proj", "fc", "out")],
                             device=dev)
    s.amax_history[0].uniform_(0.1, 10.0)
    return do_bench(s.step, warmup=25, rep=100, return_mode="median") * 1e3


def fmt(v, nd=0):
    return "-" if v is None else f"{v:.{nd}f}"


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/fp8.py: needs a CUDA GPU (FP8 GEMMs); use --device cpu for a smoke run of the script",
              file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from tilewise.ops.fp8_cast import fallbacks
    if args.device == "cpu":
        do_bench = host_bench

    for knob in ("recompile_limit", "cache_size_limit"):  # one compiled graph per shape; keep them all
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    start = time.time()
    over_budget = lambda: time.time() - start > 0.6 * args.budget_s  # for torchao's compiles
    convert_torchao, torchao_why = load_torchao()
    shapes = QUICK if args.quick else SHAPES
    if args.device == "cpu":
        shapes, args.tokens = [(m, k // 16, n // 16) for m, k, n in QUICK], 64
    copy_gbps = copy_bandwidth(do_bench, args.device)
    rows, gemm_rows, cast_rows, skipped, failed = [], [], [], [], []
    for model, K, N in shapes:
        if time.time() - start > args.budget_s:
            skipped.append(f"{model} {K}->{N}")
            continue
        try:
            row, grow, crows = bench_shape(model, K, N, args.tokens, args, do_bench, convert_torchao, torchao_why,
                                           over_budget)
        except Exception as e:  # one broken shape (OOM, a kernel error) must not lose the others' results
            first = (str(e).strip().splitlines() or [""])[0][:300]
            failed.append(f"{model} {K}->{N}: {type(e).__name__}: {first}")
            print(f"  {failed[-1]}", flush=True)
            continue
        rows.append(row)
        gemm_rows.append(grow)
        for c in crows:
            c["copy_fraction"] = c["tilewise"] / copy_gbps
        cast_rows += crows
        print(f"  {model} {K}->{N}: tilewise {fmt(row['tilewise'])}, bf16 {fmt(row['bf16'])}, "
              f"torchao {fmt(row['torchao'])} TFLOP/s ({time.time() - start:.0f} s)", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    step_us = state_step_us(do_bench, args.device)

    eight = [r["ratio_bf16"] for r in rows if r["shape"]["model"] == "8b" and r["ratio_bf16"]]
    vs_ao = [r["ratio_torchao"] for r in rows if r["ratio_torchao"] is not None]
    result = {
        "area": "fp8", "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)", "torch": torch.__version__, "triton": triton.__version__,
        "commit": git_commit(), "date": datetime.date.today().isoformat(), "tokens": args.tokens,
        "quick": args.quick, "copy_GBps": copy_gbps, "state_step_us_gpt2_124m": step_us,
        "targets": {"min_ratio_bf16_8b": min(eight) if eight else None, "goal_ratio_bf16_8b": 1.3,
                    "min_ratio_torchao": min(vs_ao) if vs_ao else None,
                    "torchao_rows": len(vs_ao), "rows": len(rows)},
        "command": "PYTHONPATH=src python3 bench/fp8.py" + (" --quick" if args.quick else ""),
        "skipped_shapes_time_budget": skipped, "failed_shapes": failed, "cast_kernel_fallbacks": fallbacks(),
        "seconds": round(time.time() - start, 1),
        "rows": [{k: v for k, v in r.items() if k != "detail"} for r in rows + gemm_rows + cast_rows],
        # per-row detail (times in ms, host time per iteration, errors vs fp32, notes), in row order
        "details": [r["detail"] for r in rows + gemm_rows + cast_rows],
    }
    text = json.dumps(result, indent=1)
    targets = ([os.path.join(HERE, "results")] if args.device == "cuda" else []) + ([args.out] if args.out else [])
    for d in targets:
        try:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "fp8.json"), "w") as fh:
                fh.write(text)
        except OSError as e:
            print(f"bench/fp8.py: could not write {d}/fp8.json: {e}", file=sys.stderr)

    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}, commit {result['commit']}, "
          f"tokens {args.tokens}, {result['seconds']:.0f} s; copy {copy_gbps:.0f} GB/s; "
          f"Fp8State.step (144 tensors) {step_us:.0f} us")
    if skipped:
        print(f"skipped for the time budget: {', '.join(skipped)}")
    for f in failed:
        print(f"failed: {f}")
    if result["cast_kernel_fallbacks"]:
        print(f"cast kernels that did not compile (slower paths used): {result['cast_kernel_fallbacks']}")
    print("\ncast kernel (copy + transposed copy + amax), GB/s (fraction of copy)")
    for c in cast_rows:
        s = c["shape"]
        print(f"  {s['rows']}x{s['cols']:<6} {s['op']:<48} {c['tilewise']:7.0f} ({c['copy_fraction']:.2f})")
    for r in rows:
        for k, v in r["detail"]["notes"].items():
            print(f"note {r['shape']['model']} {r['shape']['in']}->{r['shape']['out']} {k}: {v}")
    t = result["targets"]
    print(f"targets: 8B-class vs bf16 min {fmt(t['min_ratio_bf16_8b'], 2)} (goal 1.3); "
          f"vs torchao min {fmt(t['min_ratio_torchao'], 2)} over {t['torchao_rows']}/{t['rows']} shapes (goal > 1)")
    print("\nforward + backward, TFLOP/s (ms); host us/iter")
    hdr = f"{'model':<10} {'in->out':>12} {'bf16':>12} {'torchao':>12} {'tilewise':>12} {'tw current':>12} " \
          f"{'x bf16':>7} {'x ao':>6} {'fp8 GEMMs':>10} {'overhead ms':>11}  host us (bf16/ao/tw)"
    print(hdr)
    for r, g in zip(rows, gemm_rows):
        s, ms, h = r["shape"], r["detail"]["ms"], r["detail"]["host_us_per_iter"]
        cell = lambda k: f"{fmt(r[k])} ({ms[k]:.2f})" if r[k] is not None else "-"
        print(f"{s['model']:<10} {str(s['in']) + '->' + str(s['out']):>12} {cell('bf16'):>12} {cell('torchao'):>12} "
              f"{cell('tilewise'):>12} {cell('tilewise_current'):>12} {fmt(r['ratio_bf16'], 2):>7} "
              f"{fmt(r['ratio_torchao'], 2):>6} {fmt(g['tilewise']):>10} {fmt(g.get('fp8_overhead_ms'), 3):>11}  "
              f"{fmt(h.get('bf16'))}/{fmt(h.get('torchao'))}/{fmt(h.get('tilewise'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
