"""FP8 linear layers: tilewise Fp8Linear (each recipe) against bf16 nn.Linear and torchao Float8Linear (compiled).

Each row is one linear layer's forward + backward (y = x W^T, then dx and dW through torch.autograd.grad, so
nothing accumulates into .grad) at tokens x in -> out, bf16 parameters and activations, no bias, on every
linear shape of shared/BENCH.md (GPT-2 124M, the 1.3B preset, an 8B-class MLP):
- bf16: nn.Linear (cuBLAS);
- tilewise: Fp8Linear, delayed scaling (hybrid E4M3/E5M2), the FP8 weight recast every iteration (one
  micro-batch per optimizer step, the least favourable case for the weight cache);
- tilewise_current: the same with current scaling (an amax pass before each cast);
- tilewise_blockwise: 1x128 block scales on every GEMM operand (torch._scaled_mm block scaling);
- torchao: torchao.float8.convert_to_float8_training (tensorwise dynamic scaling) under torch.compile.
Each figure is do_bench's (host time included: what an eager training step sees), the median over interleaved
rounds that time every method alike (timed_in_rounds); `<name>_graph_ms` in the details is the same call
replayed from a CUDA graph (GPU time only, what a captured step sees), and `host_us_per_iter` the host time
of a call. Also reported: the three GEMMs alone (FP8 _scaled_mm on pre-cast operands, tensorwise and
blockwise, vs bf16 mm), the fused cast kernels' GB/s against a device copy (eager and graphed), and
Fp8State.step() for a GPT-2 124M sized state. Outputs are checked against an fp32 GEMM before anything is
timed.

    PYTHONPATH=src python3 bench/fp8.py --out DIR [--quick] [--sweep] [--diagnose-nan]

--sweep first times every candidate tile of the per-tensor cast and the block cast's warps on the narrow and
wide activation widths (CUDA-graph replays: kernel time only), prints the winners as a paste-ready table,
and runs the rest of the benchmark with them (recorded under "tiles"). --diagnose-nan runs only the NaN
diagnostic (see diagnose_nan) and writes fp8_diagnose.json. The run stays within --budget-s (torchao's
compiles stop at 70% of it, later shapes are skipped past it, both recorded), prints the main table last,
and takes the commit from git or else $TILEWISE_COMMIT.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
from common import RESULTS, allocator_counts, git_commit, write_result

SHAPES = [  # (model, in_features, out_features), tokens 16384 (shared/BENCH.md)
    ("8b", 4096, 14336), ("8b", 14336, 4096),
    ("1.3b", 2048, 6144), ("1.3b", 2048, 2048), ("1.3b", 2048, 8192), ("1.3b", 8192, 2048),
    ("gpt2-124m", 768, 2304), ("gpt2-124m", 768, 768), ("gpt2-124m", 768, 3072), ("gpt2-124m", 3072, 768),
]
QUICK = [("8b", 4096, 14336), ("1.3b", 2048, 8192), ("gpt2-124m", 768, 3072)]
RECIPES = {"tilewise": "delayed", "tilewise_current": "current", "tilewise_blockwise": "blockwise"}
L2_BYTES = 60e6
TOL = {"y": 0.05, "dx": 0.08, "dw": 0.08}  # FP8 relative error norms vs fp32 (tests/fp8 justifies them)
TOL_BF16 = 0.01
SWEEP_WIDTHS = (768, 2048, 4096, 14336)
GELU_WIDTHS = (3072, 8192, 14336)   # the MLP hidden widths, where the down projection casts gelu(x + b)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write fp8.json (or fp8_diagnose.json) into this folder")
    p.add_argument("--quick", action="store_true", help="one shape per model size")
    p.add_argument("--sweep", action="store_true", help="time the cast kernels' tile candidates first, then bench "
                                                        "with the winners")
    p.add_argument("--diagnose-nan", action="store_true", help="only the NaN diagnostic (tiny trainer, per step "
                                                               "and tensor)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    p.add_argument("--rounds", type=int, default=4, help="interleaved timing rounds per shape (see timed_in_rounds)")
    p.add_argument("--budget-s", type=float, default=260.0,
                   help="time budget: past 70%% of it torchao (slow to compile) is skipped for the remaining shapes, "
                        "past all of it the remaining shapes are skipped (both recorded)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the benchmark) or cpu (a smoke run of the script: dims / 16, 256 tokens, host timer)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------------
class Timer:
    """do_bench (host included), do_bench_cudagraph (GPU only) and host time per call; host timers in the
    CPU smoke run."""

    def __init__(self, args):
        self.args, self.cuda = args, args.device == "cuda"
        if self.cuda:
            import triton.testing
            self.testing = triton.testing

    def ms(self, fn, rep=None):
        if not self.cuda:
            return self._host_ms(fn)
        return self.testing.do_bench(fn, warmup=25, rep=rep or self.args.rep, return_mode="median")

    def graph_ms(self, fn):
        """fn's calls captured in a CUDA graph and replayed: GPU time only; None when fn cannot be captured."""
        if not self.cuda:
            return None
        try:
            return self.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a method that cannot be captured gets no graph figure
            print(f"    (no CUDA graph figure: {type(e).__name__}: {str(e).strip()[:160]})", flush=True)
            torch.cuda.synchronize()
            return None

    def host_us(self, fn, n=20):
        """Host time per call with the GPU left to run behind (launch overhead, not kernel time)."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        self.sync()
        return (t1 - t0) / n * 1e6

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    @staticmethod
    def _host_ms(fn):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[1]


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
        # detached: a y kept by the caller would keep its autograd graph, whose AccumulateGrad nodes then
        # belong to the default stream and invalidate a later CUDA-graph capture of fn (torch 2.11)
        return y.detach(), dx, dw
    return fn


def timed_in_rounds(methods, timer, n_rounds):
    """Each method's do_bench median with the backward on autograd's worker thread and on the calling thread
    (as the tilewise trainer runs it), every method alike, in interleaved rounds: each round times every
    method once, starting one method later than the round before, and a method's figure is the median of its
    rounds. Timed one method after another, a figure depends on its place in the run (the GPU's clocks after
    the method before it, or after torchao's compile left it idle). Also returns the per-round figures and
    the caching allocator's cudaMalloc/cudaFree calls and retries during each method's timings."""
    names = list(methods)
    runs = {n: {"worker_thread": [], "calling_thread": []} for n in names}
    allocator = {n: None for n in names}
    for r in range(n_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            before = allocator_counts() if timer.cuda else None
            runs[name]["worker_thread"].append(timer.ms(methods[name]))
            if timer.cuda:
                spent = allocator_counts(before)
                allocator[name] = {k: (allocator[name] or {}).get(k, 0) + v for k, v in spent.items()}
                with torch.autograd.set_multithreading_enabled(False):
                    runs[name]["calling_thread"].append(timer.ms(methods[name]))
    times = {n: statistics.median(runs[n]["worker_thread"]) for n in names}
    times_ct = {n: statistics.median(runs[n]["calling_thread"]) for n in names if runs[n]["calling_thread"]}
    return times, times_ct, runs, allocator


def fmt(v, nd=0):
    return "-" if v is None else f"{v:.{nd}f}"


# ----------------------------------------------------------------------------------------------------
# One shape
# ----------------------------------------------------------------------------------------------------
def bench_shape(model, K, N, M, args, timer, convert_torchao, torchao_why, torchao_allowed):
    from tilewise.fp8 import Fp8Linear

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
    layers = {}
    for name, recipe in RECIPES.items():
        f = Fp8Linear.from_linear(copy.deepcopy(base), recipe=recipe)
        for _ in range(3):  # compile, and fill the delayed history
            runner(f, f.weight, xs, dys)()
            f.fp8_state.step()
        layers[name] = f
        methods[name] = runner(f, f.weight, xs, dys, pre=f.invalidate)
    notes = {}
    if convert_torchao is None:
        notes["torchao"] = f"missing ({torchao_why})"
    elif not torchao_allowed:
        notes["torchao"] = "skipped: time budget"
    else:
        try:
            seq = nn.Sequential(copy.deepcopy(base))
            convert_torchao(seq)
            methods["torchao"] = runner(torch.compile(seq), seq[0].weight, xs, dys)
        except Exception as e:
            notes["torchao"] = f"error: {type(e).__name__}: {e}"

    # outputs agree before anything is timed
    errs, graphs, hosts = {}, {}, {}
    for name, fn in list(methods.items()):
        try:
            fn(0)  # warm: torch.compile compiles here
            y, dx, dw = fn(0)
            e = {"y": rel(y, ref_y), "dx": rel(dx, ref_dx), "dw": rel(dw, ref_dw)}
        except Exception as ex:
            notes[name] = f"error: {type(ex).__name__}: {str(ex)[:300]}"
            methods.pop(name)
            continue
        errs[name] = e
        tol = {k: TOL_BF16 for k in TOL} if name == "bf16" else TOL
        if not all(e[k] < tol[k] for k in tol):
            notes[name] = f"outputs disagree with fp32: {e}"
            methods.pop(name)
    times, times_ct, rounds, allocator = timed_in_rounds(methods, timer, args.rounds)
    for name, fn in methods.items():
        hosts[name] = timer.host_us(fn)
        if name != "torchao":  # a compiled module replays its own way; its eager figure is its real speed
            graphs[name] = timer.graph_ms(fn)

    flops = 6.0 * M * K * N
    tput = {name: flops / (ms * 1e-3) / 1e12 for name, ms in times.items()}
    tw = tput.get("tilewise")
    peers = [tput[p] for p in ("bf16", "torchao") if p in tput]
    best_tw = max((tput[n] for n in RECIPES if n in tput), default=None)
    row = {"shape": {"model": model, "tokens": M, "in": K, "out": N, "pass": "fwd+bwd"}, "unit": "TFLOP/s",
           "tilewise": tw, "tilewise_current": tput.get("tilewise_current"),
           "tilewise_blockwise": tput.get("tilewise_blockwise"), "bf16": tput.get("bf16"),
           "torchao": tput.get("torchao"),
           "ratio_bf16": tw / tput["bf16"] if tw and "bf16" in tput else None,
           "ratio_torchao": tw / tput["torchao"] if tw and "torchao" in tput else None,
           "ratio_best_peer": tw / max(peers) if tw and peers else None,
           "best_recipe_ratio_best_peer": best_tw / max(peers) if best_tw and peers else None,
           "ratio_torchao_calling_thread": (times_ct["torchao"] / times_ct["tilewise"]
                                            if "tilewise" in times_ct and "torchao" in times_ct else None),
           "detail": {"ms": times, "calling_thread_ms": times_ct, "ms_by_round": rounds, "graph_ms": graphs,
                      "host_us_per_iter": hosts,
                      "allocator_during_ms": allocator, "rel_err_vs_fp32": errs,
                      "notes": notes}}
    gemm_row = bench_gemms(model, K, N, M, xs[0].detach(), dys[0], base.weight.detach(), timer)
    if times.get("tilewise"):  # what the casts, scales and launches cost on top of the GEMMs
        gemm_row["fp8_overhead_ms"] = times["tilewise"] - gemm_row["detail"]["ms"]["tilewise"]
    del layers
    return row, gemm_row


def bench_gemms(model, K, N, M, x, dy, w, timer):
    """The three GEMMs on operands cast once: FP8 tensorwise, FP8 1x128 blockwise, bf16."""
    from tilewise.fp8.linear import _gemm_blockwise
    from tilewise.ops.fp8_cast import cast_block, cast_delayed
    dev, bf16 = x.device, torch.bfloat16
    one = torch.ones(1, device=dev)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    x8, x8t = cast_delayed(x, e4, one, None, True, True, roles=("a", "b"))
    w8, w8t = cast_delayed(w, e4, one, None, True, True, roles=("b", "b"))
    dy8, dy8t = cast_delayed(dy * 1000, e5, one, None, True, True, roles=("a", "a"))
    bx = cast_block(x, e4, None, True, True, roles=("a", "b"))
    bw = cast_block(w, e4, None, True, True, roles=("b", "b"))
    bdy = cast_block(dy, e5, None, True, True, roles=("a", "a"))

    def fp8_gemms():
        torch._scaled_mm(x8, w8, scale_a=one, scale_b=one, out_dtype=bf16, use_fast_accum=True)
        torch._scaled_mm(dy8, w8t, scale_a=one, scale_b=one, out_dtype=bf16)
        torch._scaled_mm(dy8t, x8t, scale_a=one, scale_b=one, out_dtype=bf16)

    def block_gemms():
        _gemm_blockwise(bx[0], bw[0], bx[1], bw[1], bf16)
        _gemm_blockwise(bdy[0], bw[2], bdy[1], bw[3], bf16)
        _gemm_blockwise(bdy[2], bx[2], bdy[3], bx[3], bf16)

    def bf16_gemms():
        x @ w.t()
        dy @ w
        dy.t() @ x

    flops = 6.0 * M * K * N
    ms = {"tilewise": timer.ms(fp8_gemms), "bf16": timer.ms(bf16_gemms)}
    try:
        ms["tilewise_blockwise"] = timer.ms(block_gemms)
    except Exception as e:  # noqa: BLE001 - recorded: no block-scaled GEMM on this machine
        ms["tilewise_blockwise"] = None
        print(f"    blockwise GEMMs: {type(e).__name__}: {str(e)[:200]}", flush=True)
    tput = {k: flops / (v * 1e-3) / 1e12 if v else None for k, v in ms.items()}
    row = {"shape": {"model": model, "tokens": M, "in": K, "out": N, "pass": "GEMMs only (fwd, dgrad, wgrad)"},
           "unit": "TFLOP/s", "tilewise": tput["tilewise"], "tilewise_blockwise": tput["tilewise_blockwise"],
           "bf16": tput["bf16"], "detail": {"ms": ms}}
    row["ratio_best_peer"] = row["tilewise"] / row["bf16"]
    return row


# ----------------------------------------------------------------------------------------------------
# The cast kernels: GB/s, and the tile sweep
# ----------------------------------------------------------------------------------------------------
def cast_calls(t, fp8_dtype, kind, tiles=None, warps=None):
    """fn() running one cast pass of Fp8Linear's on t: "x" (copy + transposed copy + amax, delayed), "dy"
    (the same with the bias gradient's column sums), "gelu" (the x cast of gelu(t + bias), the MLP's down
    projection's input), "block" (1x128 block cast, both copies)."""
    from tilewise.ops import fp8_cast as fc
    M, N = t.shape
    dev = t.device
    one = torch.ones(1, device=dev)
    amax = torch.zeros(1, device=dev).view(torch.int32)
    y = torch.empty(M, N, dtype=fp8_dtype, device=dev)
    yt = torch.empty(N, M, dtype=fp8_dtype, device=dev)
    if kind == "block":
        ys = torch.empty(fc.cdiv(N, fc.BLOCK), M, device=dev)
        yts = torch.empty(fc.cdiv(M, fc.BLOCK), N, device=dev)
        return lambda: fc._launch_block_cast(t, y, yt, ys, yts, amax, None, fp8_dtype, warps)  # False: no compile
    sums = torch.empty(N, device=dev) if kind == "dy" else None
    bias = 0.1 * torch.randn(N, device=dev, dtype=t.dtype) if kind == "gelu" else None
    return lambda: fc._launch_cast(t, y, yt, one, None, 0, amax, sums, fp8_dtype, 0, False,
                                   tiles=None if tiles is None else (tiles,), gelu=kind == "gelu", gelu_bias=bias)


def cast_rows(widths, M, timer, copy_gbps):
    """GB/s of each cast pass at each activation width (bytes: x read once, each FP8 copy written once)."""
    rows = []
    for N in widths:
        t = torch.randn(M, N, device=timer.args.device, dtype=torch.bfloat16)
        kinds = [("x", torch.float8_e4m3fn), ("dy", torch.float8_e5m2), ("block", torch.float8_e4m3fn)]
        if N in GELU_WIDTHS:
            kinds.insert(1, ("gelu", torch.float8_e4m3fn))
        for kind, dt in kinds:
            fn = cast_calls(t, dt, kind)
            fn()
            nbytes = t.numel() * (t.element_size() + 2) + (8 * t.numel() // 128 if kind == "block" else 0)
            ms, gms = timer.ms(fn), timer.graph_ms(fn)
            op = {"x": f"cast x -> {dt} + transpose + amax", "gelu": f"cast gelu(x + b) -> {dt} + transpose + amax",
                  "dy": f"cast dy -> {dt} + transpose + amax + col sums",
                  "block": f"1x128 block cast -> {dt} + transpose + scales"}[kind]
            row = {"shape": {"rows": M, "cols": N, "op": op}, "unit": "GB/s", "tilewise": nbytes / (ms * 1e-3) / 1e9,
                   "tilewise_graph": nbytes / (gms * 1e-3) / 1e9 if gms else None, "detail": {"ms": ms, "graph_ms": gms}}
            row["copy_fraction"] = row["tilewise"] / copy_gbps
            row["copy_fraction_graph"] = row["tilewise_graph"] / copy_gbps if gms else None
            rows.append(row)
        del t
    return rows


def sweep(args, timer, deadline):
    """Kernel time (CUDA-graph replays) of every tile candidate of the per-tensor casts and of the block
    cast's warps at SWEEP_WIDTHS; applies the winners (best geometric mean over the widths) to this process
    and returns the record."""
    from tilewise.ops import fp8_cast as fc
    M = args.tokens
    record = {"widths": list(SWEEP_WIDTHS), "rows": M, "ms": {}, "chosen": {}}
    for kind, dt, cands in (("x", torch.float8_e4m3fn, fc._CAST_CONFIGS), ("dy", torch.float8_e5m2, fc._CAST_CONFIGS),
                            ("block", torch.float8_e4m3fn, fc._BLOCK_WARPS_CONFIGS)):
        per, by_name = {}, {str(c): c for c in cands}
        for N in SWEEP_WIDTHS:
            t = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            for c in cands:
                if time.time() > deadline:
                    break
                fn = cast_calls(t, dt, kind, tiles=None if kind == "block" else tuple(c),
                                warps=c if kind == "block" else None)
                try:
                    ms = timer.graph_ms(fn) if fn() else None  # False: the candidate does not compile here
                except Exception as e:  # noqa: BLE001 - a candidate that does not run here is recorded
                    print(f"    sweep {kind} {c} at {N}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    ms = None
                per.setdefault(str(c), {})[N] = ms
            del t
        record["ms"][kind] = per
        complete = {c: v for c, v in per.items() if len(v) == len(SWEEP_WIDTHS) and all(v.values())}
        if not complete:
            continue
        best = {N: min(v[N] for v in complete.values()) for N in SWEEP_WIDTHS}
        score = {c: math.exp(sum(math.log(v[N] / best[N]) for N in SWEEP_WIDTHS) / len(SWEEP_WIDTHS))
                 for c, v in complete.items()}
        winner = min(score, key=score.get)
        record["chosen"][kind] = {"config": winner, "slowdown_vs_best_per_width": score[winner],
                                  "best_per_width": {str(N): min(complete, key=lambda c: complete[c][N])
                                                     for N in SWEEP_WIDTHS}}
        record.setdefault("_candidates", {})[kind] = by_name
    # x's winner is the transposing tile; dy's, the tile of the cast with the column sums
    chosen, cand = record["chosen"], record.pop("_candidates", {})
    for kind, table_key in (("x", "t"), ("dy", "sums")):
        if kind in chosen:
            fc._TILES[table_key] = tuple(cand[kind][chosen[kind]["config"]])
    if "block" in chosen:
        fc._BLOCK_WARPS = int(cand["block"][chosen["block"]["config"]])
    record["applied"] = {"_TILES": {k: list(v) for k, v in fc._TILES.items()}, "_BLOCK_WARPS": fc._BLOCK_WARPS}
    print(f"sweep: applied _TILES = {fc._TILES}, _BLOCK_WARPS = {fc._BLOCK_WARPS} "
          f"(paste into tilewise/ops/fp8_cast.py to keep)", flush=True)
    for kind, per in record["ms"].items():
        print(f"  {kind}: " + "; ".join(f"{c}: " + "/".join(fmt(v[N] * 1e3 if v.get(N) else None) for N in SWEEP_WIDTHS)
                                       for c, v in per.items()) + f"  (us at widths {SWEEP_WIDTHS})", flush=True)
    return record


def copy_bandwidth(timer):
    dev = timer.args.device
    x = torch.randn(2 ** 30 if dev == "cuda" else 2 ** 20, device=dev, dtype=torch.bfloat16)  # 2 GiB on the GPU
    y = torch.empty_like(x)
    ms = timer.ms(lambda: y.copy_(x), rep=200)
    return 4 * x.numel() / (ms * 1e-3) / 1e9


def state_step_us(timer):
    from tilewise.fp8 import Fp8State
    s = Fp8State.for_linears("delayed", [f"h{i}.{n}" for i in range(12) for n in ("qkv", "proj", "fc", "out")],
                             device=timer.args.device)
    s.amax_history[0].uniform_(0.1, 10.0)
    return timer.ms(s.step) * 1e3


# ----------------------------------------------------------------------------------------------------
# The NaN diagnostic
# ----------------------------------------------------------------------------------------------------
def diagnose_nan(args) -> dict:
    """Where does FP8 training go non-finite? Trains the tiny preset at GPU size (d_model 512, 8 heads,
    vocabulary 8192 of synthetic tokens: the configuration that gave NaN from step 2 on) and reports:
    1. torch._scaled_mm's fp32 and bf16 outputs against the dequantized product, on output memory left full
       of NaN (an fp32-output GEMM that reads its output before writing it would show here);
    2. per variant, an instrumented copy of the trainer's step (bf16 autocast, fp32 master weights, fused
       AdamW, clipping, Fp8State.step) that checks every module output, every Fp8Linear input gradient,
       every parameter gradient and parameter, and the FP8 state after each phase, and names the first
       non-finite tensor with the layer's scales. Variants: each recipe; "delayed" also with the GEMMs'
       own fp32 outputs (WIDEN_FP32_RESULTS off, the arithmetic of the failing commit) and under a one-rank
       DistributedDataParallel;
    3. the trainer itself (tilewise.train.train, eager) with each recipe, strategies none and ddp, and
       "delayed" with fp32 GEMM outputs: its loss per step.
    """
    import numpy as np

    import tilewise.fp8.linear as fp8_linear
    from tilewise.data import write_token_shards
    from tilewise.metrics import read_metrics
    from tilewise.train import train

    t0 = time.time()
    dev = args.device
    size = {"model.d_model": 512, "model.n_head": 8} if dev == "cuda" else {"model.d_model": 128, "model.n_head": 4,
                                                                              "model.n_layer": 2}  # a CPU smoke run
    steps = 6 if dev == "cuda" else 2
    report = {"area": "fp8_diagnose", "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke run)",
              "torch": torch.__version__, "commit": git_commit(), "date": datetime.date.today().isoformat()}
    report["scaled_mm_outputs"] = probe_scaled_mm(dev)
    print("scaled_mm outputs:", json.dumps(report["scaled_mm_outputs"]), flush=True)

    variants = [("delayed", True, "none"), ("delayed", False, "none"), ("delayed", False, "ddp"),
                ("delayed", True, "ddp"), ("current", True, "none"), ("blockwise", True, "none")]
    report["instrumented"] = []
    default_widen = fp8_linear.WIDEN_FP32_RESULTS
    for recipe, widen, strategy in variants:
        fp8_linear.WIDEN_FP32_RESULTS = widen
        try:
            res = instrumented_run(recipe, strategy, steps, dev, size)
        except Exception as e:  # noqa: BLE001 - one variant's crash is a finding too
            res = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        finally:
            fp8_linear.WIDEN_FP32_RESULTS = default_widen
        res.update(recipe=recipe, widen_fp32_results=widen, strategy=strategy)
        report["instrumented"].append(res)
        print(f"instrumented {recipe} widen={widen} {strategy}: losses {res.get('losses')} "
              f"first non-finite {res.get('first_non_finite') or res.get('error')}", flush=True)

    work = tempfile.mkdtemp(prefix="fp8diag")
    rng = np.random.default_rng(0)
    x = np.empty(1 << 20, np.int64)
    x[0::2] = rng.zipf(1.3, x.size // 2) % 8191 + 1
    x[1::2] = (x[0::2] * 7) % 8191 + 1
    write_token_shards(os.path.join(work, "data"), {"train": x, "val": x[-(1 << 15):]}, vocab_size=8192, eot_id=0)
    report["trainer"] = []
    for recipe, widen, strategy in [(r, True, s) for r in RECIPES.values() for s in ("none", "ddp")] + [
            ("delayed", False, "ddp"), ("delayed", False, "none")]:
        name = f"{recipe}-{strategy}-{'widen' if widen else 'fp32out'}"
        out = os.path.join(work, name)
        settings = {"data.dir": json.dumps(os.path.join(work, "data")), "train.out_dir": json.dumps(out),
                    "train.max_steps": steps + 2, "train.log_every": 1, "train.eval_every": steps + 2,
                    "train.eval_batches": 1, "train.progress": "false", "checkpoint.every": 0, **size,
                    "fp8.recipe": recipe, "distributed.strategy": strategy, "train.device": dev,
                    "train.cuda_graphs": "false"}
        fp8_linear.WIDEN_FP32_RESULTS = widen
        try:
            from tilewise.config import load_config
            train(load_config("tiny", overrides=[f"{k}={v}" for k, v in settings.items()]))
            losses = [r["loss"] for r in read_metrics(out)]
            res = {"losses": losses, "finite": all(math.isfinite(v) for v in losses)}
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        finally:
            fp8_linear.WIDEN_FP32_RESULTS = default_widen
        res["run"] = name
        report["trainer"].append(res)
        print(f"trainer {name}: {res.get('losses', res.get('error'))}", flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    return report


def probe_scaled_mm(dev) -> list:
    torch.manual_seed(0)
    out = []
    for M, K, N in ((2048, 512, 1536), (2048, 1536, 512)):
        for a_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            a = torch.randn(M, K, device=dev).to(a_dtype)
            b = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
            sa, sb = torch.tensor([0.37], device=dev), torch.tensor([1.9], device=dev)
            want = (a.float() * sa) @ (b.float() * sb).t()
            for out_dtype in (torch.float32, torch.bfloat16):
                junk = torch.full((M * N + (1 << 20),), float("nan"), device=dev)
                del junk  # the output below lands on NaN-filled memory
                y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
                out.append({"shape": [M, K, N], "a": str(a_dtype), "out": str(out_dtype),
                            "finite": bool(torch.isfinite(y).all()), "rel_err": rel(y, want)})
    return out


def instrumented_run(recipe, strategy, steps, dev, size):
    """The trainer's step, with every tensor checked; see diagnose_nan."""
    import torch.distributed as dist

    from tilewise import ops
    from tilewise.config import load_config
    from tilewise.fp8 import Fp8Linear, convert_to_fp8, recipe_from_config
    from tilewise.model import GPT
    from tilewise.train import lr_at, make_optimizer

    cfg = load_config("tiny", overrides=[f"{k}={v}" for k, v in size.items()] + [f"fp8.recipe={recipe}"])
    cfg.model.vocab_size = 8192
    dev = torch.device(dev, 0) if dev == "cuda" else torch.device(dev)
    torch.manual_seed(0)
    model = GPT(cfg.model).to(dev)
    state = convert_to_fp8(model, recipe_from_config(cfg.fp8), skip=lambda n: n.endswith("lm_head"))
    owns_group = False
    step_model = model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        if not dist.is_initialized():
            extra = {"device_id": dev} if dev.type == "cuda" else {}
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, **extra)
            owns_group = True
        import inspect
        no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                   inspect.signature(DistributedDataParallel).parameters else {"broadcast_buffers": False})
        step_model = DistributedDataParallel(model, device_ids=[0] if dev.type == "cuda" else None,
                                             gradient_as_bucket_view=True, **no_sync)  # as tilewise.distributed
    opt = make_optimizer(step_model, cfg, dev)
    names = {m: n for n, m in model.named_modules()}
    findings, last_inputs = [], {}

    def note(step, phase, where, t, extra=None):
        if t is None or not t.is_floating_point():
            return
        finite = bool(torch.isfinite(t).all())
        if not finite:
            findings.append({"step": step, "phase": phase, "where": where, "shape": list(t.shape),
                             "dtype": str(t.dtype), "nan": int(torch.isnan(t).sum()), "inf": int(torch.isinf(t).sum()),
                             **(extra or {})})

    def layer_context(m):
        s = m.fp8_slot
        return {"scale": state.scale[s:s + 3].tolist(), "scale_inv": state.scale_inv[s:s + 3].tolist(),
                "amax_now": state.amax_history[0, s:s + 3].tolist(), "warm": state.warm}

    step_box = [0]

    def fwd_hook(m, inp, out):
        o = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, (tuple, list)) and out else None)
        extra = layer_context(m) if isinstance(m, Fp8Linear) else None
        if isinstance(m, Fp8Linear) and isinstance(inp[0], torch.Tensor):
            x = inp[0]
            last_inputs[m] = x.detach().clone()
            note(step_box[0], "forward input", names[m], x, extra)
            if x.requires_grad:
                x.register_hook(lambda g, m=m: note(step_box[0], "backward dx", names[m], g, layer_context(m)))
        if isinstance(o, torch.Tensor):
            note(step_box[0], "forward output", names[m], o, extra)

    hooks = [m.register_forward_hook(fwd_hook) for m in model.modules() if m is not model]
    losses, grad_norms = [], []
    B, T = cfg.train.batch_size, cfg.model.seq_len
    g = torch.Generator(device="cpu").manual_seed(1)
    try:
        for step in range(steps):
            step_box[0] = step + 1
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            idx = torch.randint(0, 8192, (B, T + 1), generator=g).to(dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = step_model(idx[:, :-1], idx[:, 1:])
            note(step + 1, "loss", "loss", loss)
            loss.backward()
            for n, p in model.named_parameters():
                note(step + 1, "grad", n, p.grad)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for n, p in model.named_parameters():
                note(step + 1, "parameter after optimizer.step", n, p)
            state.step()
            for k in ("scale", "scale_inv", "amax_history"):
                note(step + 1, "Fp8State.step", k, getattr(state, k))
            if bool((state.scale <= 0).any()):
                findings.append({"step": step + 1, "phase": "Fp8State.step", "where": "scale <= 0"})
            losses.append(loss.item())
            grad_norms.append(gn.item())
            if findings:
                break
    finally:
        for h in hooks:
            h.remove()
        if owns_group:
            dist.destroy_process_group()
    first = findings[0] if findings else None
    if first is not None:  # rerun the first offending Fp8Linear's forward with the reference casts
        for m in last_inputs:
            if names[m] == first["where"]:
                with torch.no_grad(), ops.use("reference"), torch.autocast(dev.type, dtype=torch.bfloat16):
                    first["reference_casts_output_finite"] = bool(torch.isfinite(m(last_inputs[m])).all())
    return {"losses": losses, "grad_norms": grad_norms, "first_non_finite": first, "findings": findings[:20],
            "skipped": state.skipped.tolist() if state.skipped.sum().item() else []}


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/fp8.py: needs a CUDA GPU (FP8 GEMMs); use --device cpu for a smoke run of the script",
              file=sys.stderr)
        return 2
    if args.diagnose_nan:
        report = diagnose_nan(args)
        write_result(report, "fp8_diagnose.json", [args.out])
        return 0
    import triton

    from tilewise.ops import fp8_cast
    timer = Timer(args)
    for knob in ("recompile_limit", "cache_size_limit"):  # one compiled graph per shape; keep them all
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    start = time.time()
    shapes = QUICK if args.quick else SHAPES
    if args.device == "cpu":  # dims / 16, rounded up to whole 1x128 blocks
        shapes, args.tokens = [(m, -(-k // 2048) * 128, -(-n // 2048) * 128) for m, k, n in QUICK], 256
    sweep_record = sweep(args, timer, start + 0.3 * args.budget_s) if args.sweep and args.device == "cuda" else None
    convert_torchao, torchao_why = load_torchao()
    copy_gbps = copy_bandwidth(timer)
    rows, gemm_rows, skipped, failed = [], [], [], []
    for model, K, N in shapes:
        if time.time() - start > args.budget_s:
            skipped.append(f"{model} {K}->{N}")
            continue
        try:
            row, grow = bench_shape(model, K, N, args.tokens, args, timer, convert_torchao, torchao_why,
                                    time.time() - start < 0.7 * args.budget_s)
        except Exception as e:  # one broken shape (OOM, a kernel error) must not lose the others' results
            first = (str(e).strip().splitlines() or [""])[0][:300]
            failed.append(f"{model} {K}->{N}: {type(e).__name__}: {first}")
            print(f"  {failed[-1]}", flush=True)
            continue
        rows.append(row)
        gemm_rows.append(grow)
        print(f"  {model} {K}->{N}: " + ", ".join(f"{k} {fmt(row[k])}" for k in (
            "tilewise", "tilewise_current", "tilewise_blockwise", "bf16", "torchao")) +
            f" TFLOP/s ({time.time() - start:.0f} s)", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    widths = sorted({k for _, k, _ in shapes} | {n for _, _, n in shapes})
    # the cast kernels alone run on the GPU only (the smoke run's casts take the reference path)
    crows = cast_rows(widths, args.tokens, timer, copy_gbps) if args.device == "cuda" and \
        time.time() - start < 1.1 * args.budget_s else []
    step_us = state_step_us(timer)

    eight = [r["ratio_bf16"] for r in rows if r["shape"]["model"] == "8b" and r["ratio_bf16"]]
    vs_ao = [r["ratio_torchao"] for r in rows if r["ratio_torchao"] is not None]
    result = {
        "area": "fp8", "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)",
        "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
        "date": datetime.date.today().isoformat(), "tokens": args.tokens, "quick": args.quick,
        "copy_GBps": copy_gbps, "state_step_us_gpt2_124m": step_us,
        "targets": {"min_ratio_bf16_8b": min(eight) if eight else None, "goal_ratio_bf16_8b": 1.3,
                    "min_ratio_torchao": min(vs_ao) if vs_ao else None, "torchao_rows": len(vs_ao),
                    "rows": len(rows)},
        "tiles": {"_TILES": {k: list(v) for k, v in fp8_cast._TILES.items()}, "_BLOCK_WARPS": fp8_cast._BLOCK_WARPS},
        "sweep": sweep_record,
        "command": "TILEWISE_COMMIT=<sha> " + ("QUICK=1 " if args.quick else "") +
                   ("BENCH_ARGS=\"--sweep\" " if args.sweep else "") + "bash bench/h200.sh fp8",
        "skipped_shapes_time_budget": skipped, "failed_shapes": failed,
        "cast_kernel_fallbacks": fp8_cast.fallbacks(),
        # launches that took Triton's normal path (~100 us of host time each) instead of FastLauncher's
        "cast_launches": {name: {"fast": ln.fast_launches, "normal": ln.normal_launches} for name, ln in (
            ("cast", fp8_cast._cast_launcher), ("block", fp8_cast._block_launcher),
            ("amax", fp8_cast._amax_launcher))},
        "seconds": round(time.time() - start, 1),
        "rows": [{k: v for k, v in r.items() if k != "detail"} for r in rows + gemm_rows + crows],
        # per-row detail (times in ms, CUDA-graph ms, host time per iteration, errors vs fp32, notes), in row order
        "details": [r["detail"] for r in rows + gemm_rows + crows],
    }
    write_result(result, "fp8.json", [RESULTS if args.device == "cuda" else None, args.out])
    print_summary(result, rows, gemm_rows, crows)
    return 0


def print_summary(result, rows, gemm_rows, crows):
    print(f"\n{result['gpu']}, torch {result['torch']}, triton {result['triton']}, commit {result['commit']}, "
          f"tokens {result['tokens']}, {result['seconds']:.0f} s; copy {result['copy_GBps']:.0f} GB/s; "
          f"Fp8State.step (144 tensors) {result['state_step_us_gpt2_124m']:.0f} us; tiles {result['tiles']}")
    if result["skipped_shapes_time_budget"]:
        print(f"skipped for the time budget: {', '.join(result['skipped_shapes_time_budget'])}")
    for f in result["failed_shapes"]:
        print(f"failed: {f}")
    if result["cast_kernel_fallbacks"]:
        print(f"cast kernels that did not compile (slower paths used): {result['cast_kernel_fallbacks']}")
    print("\ncast kernels, GB/s eager / graphed (fraction of copy, graphed)")
    for c in crows:
        s = c["shape"]
        print(f"  {s['rows']}x{s['cols']:<6} {s['op']:<56} {c['tilewise']:7.0f} / {fmt(c['tilewise_graph']):>5} "
              f"({fmt(c['copy_fraction_graph'], 2)})")
    for r in rows:
        for k, v in r["detail"]["notes"].items():
            print(f"note {r['shape']['model']} {r['shape']['in']}->{r['shape']['out']} {k}: {v}")
    t = result["targets"]
    print(f"targets: 8B-class vs bf16 min {fmt(t['min_ratio_bf16_8b'], 2)} (goal 1.3); "
          f"vs torchao min {fmt(t['min_ratio_torchao'], 2)} over {t['torchao_rows']}/{t['rows']} shapes (goal > 1)")
    print("\nforward + backward, TFLOP/s (eager ms / CUDA-graph ms); host us per call")
    names = ("bf16", "torchao", "tilewise", "tilewise_current", "tilewise_blockwise")
    print(f"{'model':<10} {'in->out':>12} " + " ".join(f"{n[9:] or n:>20}" if n.startswith("tilewise_") else f"{n:>20}"
                                                      for n in names) + f" {'x bf16':>7} {'x ao':>6} {'FP8 GEMMs':>10}")
    for r, g in zip(rows, gemm_rows):
        s, d = r["shape"], r["detail"]
        cells = []
        for n in names:
            if r.get(n) is None:
                cells.append(f"{'-':>20}")
                continue
            gm = d["graph_ms"].get(n)
            cells.append(f"{fmt(r[n]):>5} ({d['ms'][n]:.2f}/{fmt(gm, 2) if gm else '-'}) {fmt(d['host_us_per_iter'][n]):>4}"
                         .rjust(20))
        print(f"{s['model']:<10} {str(s['in']) + '->' + str(s['out']):>12} " + " ".join(cells) +
              f" {fmt(r['ratio_bf16'], 2):>7} {fmt(r['ratio_torchao'], 2):>6} {fmt(g['tilewise']):>10}")


if __name__ == "__main__":
    sys.exit(main())
