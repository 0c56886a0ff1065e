"""Where a forward+backward's wall time goes when the GPU is not the bottleneck: a torch.profiler trace of a
few calls, read back as per-thread CPU timelines and GPU idle gaps.

do_bench's figure for a fused op (or an FP8 linear) can exceed both its host time and its GPU time: the GPU
waits for a host that is waiting for something. This script shows what. For each case and each backward
mode (autograd's device worker thread, the default; the calling thread, as the trainer runs it) it runs the
call in a do_bench-like loop (L2 flush, call, no synchronization), traces a few calls, and prints:
- wall time per call, GPU busy time per call, and the GPU's idle gaps over 15 us with the CPU call that
  launched the work after each gap (its thread and the op around it);
- per thread, the top-level CPU ops of one call with their start offsets and durations;
and first, without the profiler, each case's do_bench and CUDA-graph medians in interleaved rounds.

    PYTHONPATH=src python3 bench/host_trace.py --out DIR [--cases norm,rmsnorm,fp8_delayed,fp8_current,fp8_torchao]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import environment, write_result  # noqa: E402

from tilewise import ops  # noqa: E402

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
L2_FLUSH = None


def norm_case(kind, rows, width):
    bf = torch.bfloat16
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=bf)  # noqa: E731
    leaves = [mk(rows, width), mk(rows, width), 1 + 0.2 * mk(width)]
    if kind == "layernorm":
        leaves.append(0.2 * mk(width))
    leaves = [t.requires_grad_() for t in leaves]
    dy, dh = mk(rows, width), mk(rows, width)

    def call():
        for t in leaves:
            t.grad = None
        y, h = ops.add_dropout_norm(*leaves, kind=kind) if kind == "layernorm" else \
            ops.add_dropout_norm(*leaves, None, kind=kind)
        torch.autograd.backward([y, h], [dy, dh])
    return call


def fp8_case(recipe, M=16384, K=4096, N=14336):
    from tilewise.fp8 import Fp8Linear
    bf = torch.bfloat16
    x = torch.randn(M, K, device="cuda", dtype=bf).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=bf) * 1e-3
    lin = Fp8Linear.from_linear(torch.nn.Linear(K, N, bias=False, device="cuda", dtype=bf), recipe=recipe)
    for _ in range(3):
        y = lin(x)
        torch.autograd.grad(y, (x, lin.weight), dy)
        lin.fp8_state.step()

    def call():
        lin.invalidate()   # the weight's cast once per call, as bench/fp8.py times it
        y = lin(x)
        torch.autograd.grad(y, (x, lin.weight), dy)
    return call


def torchao_case(M=16384, K=4096, N=14336):
    """torchao's Float8Linear under torch.compile, as bench/fp8.py times it (its wheel must be installed)."""
    from torchao.float8 import convert_to_float8_training
    bf = torch.bfloat16
    x = torch.randn(M, K, device="cuda", dtype=bf).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=bf) * 1e-3
    seq = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device="cuda", dtype=bf))
    convert_to_float8_training(seq)
    compiled = torch.compile(seq)

    def call():
        y = compiled(x)
        torch.autograd.grad(y, (x, seq[0].weight), dy)
    return call


CASES = {
    "norm": lambda: norm_case("layernorm", 32768, 1024),
    "rmsnorm": lambda: norm_case("rmsnorm", 32768, 1024),
    "fp8_delayed": lambda: fp8_case("delayed"),
    "fp8_current": lambda: fp8_case("current"),
    "fp8_torchao": torchao_case,
}


def trace(fn, calls=6, keep=3):
    """Chrome-trace events of `calls` do_bench-style calls; the last `keep` are analysed."""
    global L2_FLUSH
    if L2_FLUSH is None:
        L2_FLUSH = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(calls):
            L2_FLUSH.zero_()
            with torch.profiler.record_function(f"call{i}"):
                fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    os.unlink(path)
    marks = sorted((e for e in events if str(e.get("name", "")).startswith("call") and
                    e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    return events, marks[calls - keep:]


def analyse(events, marks):
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime" and "args" in e}
    cpu_ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    start, end = marks[0]["ts"], marks[-1]["ts"] + marks[-1]["dur"]
    # the window: from the first call's start to the GPU's last work launched by the last call
    in_window = [g for g in gpu if g["ts"] >= start]
    gpu_end = max((g["ts"] + g["dur"] for g in in_window), default=end)
    busy = sum(g["dur"] for g in in_window)
    gaps, prev_end = [], None
    for g in in_window:
        if prev_end is not None and g["ts"] - prev_end > 15:
            launch = runtime.get(g.get("args", {}).get("correlation"))
            where = None
            if launch is not None:   # the innermost CPU op around the launch, on its thread
                around = [c for c in cpu_ops
                          if c["tid"] == launch["tid"] and c["ts"] <= launch["ts"] <= c["ts"] + c["dur"]]
                where = min(around, key=lambda c: c["dur"])["name"] if around else None
            gaps.append({"at_us": round(prev_end - start, 1), "idle_us": round(g["ts"] - prev_end, 1),
                         "next": g["name"][:60], "launched_by_tid": launch and launch["tid"],
                         "launch_call": launch and launch["name"], "inside": where})
        prev_end = max(prev_end or 0, g["ts"] + g["dur"])
    n = len(marks)
    last = marks[-1]
    lo, hi = last["ts"], max(last["ts"] + last["dur"], gpu_end)
    threads = {}
    for c in sorted(cpu_ops, key=lambda c: c["ts"]):
        if lo <= c["ts"] <= hi and c["dur"] >= 3:
            outer = [o for o in cpu_ops if o is not c and o["tid"] == c["tid"] and o["ts"] <= c["ts"] and
                     c["ts"] + c["dur"] <= o["ts"] + o["dur"] and lo <= o["ts"]]
            if not outer or (len(outer) == 1 and outer[0] is last):
                threads.setdefault(str(c["tid"]), []).append(
                    f"{c['ts'] - lo:8.1f} +{c['dur']:7.1f}  {c['name'][:70]}")
    return {"wall_us_per_call": round((end - start) / n, 1), "gpu_span_us_per_call": round((gpu_end - start) / n, 1),
            "gpu_busy_us_per_call": round(busy / n, 1), "idle_gaps": gaps, "last_call_threads": threads}


def make_case(name):
    """The case's call, or None (printed) when it cannot be built here (torchao missing)."""
    try:
        return CASES[name]()
    except ImportError as e:
        print(f"== {name}: skipped ({e})", flush=True)
        return None


def rounds(cases: str, n_rounds: int = 4) -> dict:
    """Without the profiler: each case's do_bench median (L2 flushed, host included, the worker thread) and
    CUDA-graph median, the cases interleaved over rounds in a rotating order, so that neither an order nor a
    drift of the GPU's clocks favours one. ms per round, by case."""
    import triton.testing
    fns = {name: make_case(name) for name in cases.split(",")}
    fns = {name: fn for name, fn in fns.items() if fn is not None}
    out = {name: {"ms": [], "graph_ms": []} for name in fns}
    names = list(fns)

    def graph_ms(fn):
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
        except Exception:   # noqa: BLE001 - a compiled module may not capture: no graph figure
            torch.cuda.synchronize()
            return None
    for r in range(n_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name]["ms"].append(triton.testing.do_bench(fns[name], warmup=25, rep=100, return_mode="median"))
            out[name]["graph_ms"].append(graph_ms(fns[name]))
    for name, v in out.items():
        print(f"== {name}: do_bench ms by round {[round(t, 3) for t in v['ms']]}, graphed "
              f"{[t and round(t, 3) for t in v['graph_ms']]}", flush=True)
    fns.clear()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="(accepted for bench/h200.sh; no effect)")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    results = {"area": "host_trace", **environment(), "cases": {}, "do_bench_rounds": rounds(args.cases)}
    for name in args.cases.split(","):
        fn = make_case(name)
        if fn is None:
            continue
        for mode in ("worker_thread", "calling_thread"):
            with torch.autograd.set_multithreading_enabled(mode == "worker_thread"):
                events, marks = trace(fn)
            r = analyse(events, marks)
            results["cases"][f"{name}/{mode}"] = r
            print(f"== {name} ({mode}): wall {r['wall_us_per_call']} us a call, GPU span "
                  f"{r['gpu_span_us_per_call']}, busy {r['gpu_busy_us_per_call']}")
            for g in r["idle_gaps"][:12]:
                print(f"   idle {g['idle_us']:7.1f} us at {g['at_us']:9.1f}: next {g['next']} "
                      f"(launched by tid {g['launched_by_tid']} {g['launch_call']} in {g['inside']})")
            for tid, lines in r["last_call_threads"].items():
                print(f"   thread {tid}:")
                for line in lines[:40]:
                    print("     " + line)
        del fn
        torch.cuda.empty_cache()
    write_result(results, "host_trace.json", [args.out])


if __name__ == "__main__":
    main()
