"""Attention on the H200: tilewise flash attention against SDPA's flash and cuDNN backends and compiled
FlexAttention, forward and backward, in one process on the same inputs (protocol in shared/BENCH.md).

Shapes: bf16, batch * seqlen = 16384, heads * head_dim = 2048, head_dim 64 and 128, seqlen 1k/4k/16k,
causal and not; and the 1.3B preset's own (seqlen 2048, head_dim 128, causal), last. FLOPs: forward 4*B*H*N*N*D (halved when causal), backward 2.5x forward. Every provider's
output and gradients are checked against SDPA flash before it is timed; one that disagrees is not timed.
The last row is the memory check: forward + backward at seqlen 131072, batch 1, 16 heads, head_dim 128,
peak memory beyond inputs, outputs and gradients (limit 1 GB).

Tuning comes with the measurement: tilewise times its candidate configs on the first call of every
(head_dim, mask, sequence-length class) key, so the JSON's "details" hold, per shape, the chosen config and
the time of every candidate of the three kernels ("tuning"). --sweep (or TILEWISE_BENCH_SWEEP=1) widens the
candidate lists (more compiles: use it with --quick, or a larger --budget). "details" also hold each
provider's host time per call ("host_us"): when it exceeds the timed time, the shape is launch-bound.

FP8 (--fp8 adds it to a run, --fp8-only runs it alone): tilewise's fp8_flash_attention (plain and with the
Hadamard rotation) against tilewise's bf16 kernel at head_dim 128, seqlen 4k and 16k, causal and not
("fp8_rows": TFLOP/s with the same FLOP count as bf16, and fp8 / bf16), and an accuracy table
("fp8_accuracy"): RMSE and relative error of O, dQ, dK, dV against float64 attention for the bf16 kernel,
the naive per-tensor FP8 baseline, FP8 and FP8 + rotation, on Gaussian inputs, inputs with 4 channels per
head x20, and FA3's outliers (N(0,1) + N(0,100) * Bernoulli(0.001)). --fp8-only merges its keys into an
existing results/attention.json, keeping the bf16 rows.

    PYTHONPATH=src python3 bench/attention.py --out DIR [--quick] [--sweep] [--fp8 | --fp8-only]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
from pathlib import Path
from common import RESULTS, git_commit, write_result

AGREE_TOL = 2e-2  # relative error norm between two bf16 attentions (each ~3e-3 from the exact result)
TOKENS, WIDTH = 16384, 2048
DEVICE = "cuda"
# The anchor shapes of shared/BENCH.md come first, so a run that hits --budget still has them.
ALL_SHAPES = [(128, 16384, False), (64, 4096, True), (64, 1024, True), (128, 16384, True), (64, 16384, False),
              (64, 16384, True), (128, 4096, False), (128, 4096, True), (64, 4096, False), (128, 1024, False),
              (128, 1024, True), (64, 1024, False),
              (128, 2048, True)]   # beyond the protocol's list: the 1.3B preset's attention (bench/e2e.py)
QUICK_SHAPES = ALL_SHAPES[:4]
MEMORY_AFTER = 4  # the memory row runs after the anchors, once d128 causal is tuned
PTR_SHAPES = ALL_SHAPES[:1]  # the pointer-load path, beside the default (TMA on sm90), on one anchor
HOST_CALLS = 20
# --sweep: wider candidate lists, (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head_dim class.
# The defaults (tilewise.ops.attention.CONFIGS) are the ones that compile without register spills on sm_90;
# these add neighbours, a few of which spill a little, to see whether any of them wins anyway.
SWEEP = {
    "fwd": {64: [(128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 4, 4), (64, 128, 4, 3),
                 (128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 4)],
            128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (128, 128, 8, 3),
                  (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 2)]},
    "dkdv": {64: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (32, 64, 4, 3),
                  (64, 64, 8, 3), (128, 128, 8, 2)],
             128: [(32, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 4, 5), (32, 64, 4, 2),
                   (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4),
                   (16, 128, 4, 3), (32, 128, 8, 4), (64, 128, 8, 2)]},
    "dq": {64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3),
                (128, 64, 4, 3)],
           128: [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 3),
                 (128, 32, 4, 4), (128, 32, 8, 3), (64, 32, 4, 3), (128, 128, 8, 2)]},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="also write attention.json into this directory")
    p.add_argument("--quick", action="store_true", help="the four anchor shapes and the memory row only")
    p.add_argument("--budget", type=float, default=220.0,
                   help="seconds; shapes not started when it runs out are recorded as skipped (default 220)")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep in ms (default 100)")
    p.add_argument("--no-memory", action="store_true", help="skip the 128k memory row")
    p.add_argument("--sweep", action="store_true", default=os.environ.get("TILEWISE_BENCH_SWEEP", "0") == "1",
                   help="time the wider candidate lists (SWEEP) per shape (also TILEWISE_BENCH_SWEEP=1)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated indices into ALL_SHAPES, e.g. 0,6 (default: all, or the quick ones)")
    p.add_argument("--fp8", action="store_true", help="also time FP8 attention and measure its accuracy")
    p.add_argument("--fp8-only", action="store_true",
                   help="only the FP8 rows and accuracy table (merged into an existing attention.json)")
    p.add_argument("--fp8-shapes", default=None,
                   help="comma-separated indices into FP8_SHAPES, e.g. 3 (default: all, or the quick ones)")
    p.add_argument("--fp8-budget", type=float, default=240.0,
                   help="seconds for the FP8 section; shapes not started when it runs out are skipped")
    return p.parse_args(argv)


def _env(path):
    """The load path of tilewise's kernels: None = its default, 'ptr' = pointer loads (each kernel's default
    config, untimed: a check that the fallback path runs and how fast, without its compile bill)."""
    return {"TILEWISE_ATTN_TMA": "0", "TILEWISE_ATTN_AUTOTUNE": "0"} if path == "ptr" else {}


class _Env:
    def __init__(self, values):
        self.values, self.saved = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def providers(torch, F):
    """name -> (fn(q, k, v, causal) on (B, N, H, D) tensors, env) or a string saying why it is missing."""
    from tilewise.ops import flash_attention
    found = {"tilewise": (lambda q, k, v, c: flash_attention(q, k, v, causal=c), {})}
    found["tilewise_ptr"] = (found["tilewise"][0], _env("ptr"))
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        found["sdpa_flash"] = found["sdpa_cudnn"] = f"missing: {e}"
    else:
        def sdpa(backend):
            def fn(q, k, v, causal):
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=causal)
                return out.transpose(1, 2)
            return fn
        found["sdpa_flash"] = (sdpa(SDPBackend.FLASH_ATTENTION), {})
        found["sdpa_cudnn"] = (sdpa(SDPBackend.CUDNN_ATTENTION), {})
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        found["flex"] = f"missing: {e}"
    else:
        import torch._dynamo
        import torch._functorch.config
        # The timed backward runs with retain_graph=True, which compiled backwards with donated buffers refuse.
        torch._functorch.config.donated_buffer = False
        for name in ("recompile_limit", "cache_size_limit"):  # past 8 shapes it silently runs unfused
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        compiled = torch.compile(flex_attention, dynamic=False)
        masks = {}

        def flex(q, k, v, causal):
            n = q.shape[1]
            mask = None
            if causal:
                if n not in masks:
                    masks[n] = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=q.device)
                mask = masks[n]
            out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask)
            return out.transpose(1, 2)
        found["flex"] = (flex, {})
    return found


def rel_diff(torch, a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_once(fn, q, k, v, causal, dout):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, causal)
    out.backward(dout)
    return [out.detach()] + [t.grad.detach().clone() for t in (q, k, v)]


def time_fwd_bwd(triton, fn, q, k, v, causal, dout, rep):
    """(median forward ms, median backward ms over one retained graph, the forward call, the backward call)."""
    fwd = lambda: fn(q, k, v, causal)  # noqa: E731
    ms_f = triton.testing.do_bench(fwd, warmup=25, rep=rep, return_mode="median")
    bwd = functools.partial(fwd().backward, dout, retain_graph=True)
    ms_b = triton.testing.do_bench(bwd, warmup=25, rep=rep, grad_to_none=[q, k, v], return_mode="median")
    return ms_f, ms_b, fwd, bwd


def host_us(torch, fn, grads=()):
    """Host microseconds per call: HOST_CALLS calls queued without a synchronize (the GPU lags behind, so
    the host never waits on it until the launch queue fills, far beyond these calls)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        for t in grads:
            t.grad = None
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(seconds / HOST_CALLS * 1e6, 1)


def cell_inputs(torch, head_dim, seqlen, causal):
    """One protocol cell: its shape record, q, k, v (requiring grad), dout and the forward's FLOPs."""
    heads, batch = WIDTH // head_dim, TOKENS // seqlen
    shape = {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim, "causal": causal}
    gen = torch.Generator(device=DEVICE).manual_seed(seqlen + head_dim + causal)
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    return shape, q, k, v, dout, 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)


def check_then_time(torch, triton, calls, inputs, causal, rep, fwd_flops, tol, host=None):
    """TFLOP/s forward and backward of each (name, fn, env) of calls, timed only after its output and
    gradients agree with the first call's within tol (a call that disagrees or fails is noted, not timed).
    host: a dict that gets each call's host microseconds per forward and backward. Returns
    ({"fwd": {name: TFLOP/s}, "bwd": {...}}, notes, relative differences)."""
    q, k, v, dout = inputs
    results, notes, diffs = {"fwd": {}, "bwd": {}}, {}, {}
    ref = None
    for name, fn, env in calls:
        try:
            with _Env(env):
                got = run_once(fn, q, k, v, causal, dout)  # compiles / autotunes here, before timing
                if ref is None:
                    ref, first = got, name
                else:
                    diff = max(rel_diff(torch, a, b) for a, b in zip(got, ref))
                    diffs[name] = round(diff, 5)
                    if not diff < tol:
                        notes[name] = f"disagrees with {first}: rel diff {diff:.3g}, not timed"
                        continue
                ms_f, ms_b, fwd, bwd = time_fwd_bwd(triton, fn, q, k, v, causal, dout, rep)
                if host is not None:
                    host[name] = {"fwd": host_us(torch, fwd), "bwd": host_us(torch, bwd, [q, k, v])}
                del bwd   # and with it the retained graph
        except Exception as e:  # a backend that cannot run this shape (e.g. cuDNN missing) is recorded
            notes[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            continue
        results["fwd"][name] = fwd_flops / (ms_f * 1e-3) / 1e12
        results["bwd"][name] = 2.5 * fwd_flops / (ms_b * 1e-3) / 1e12
    return results, notes, diffs


def bench_shape(torch, triton, attn, provs, head_dim, seqlen, causal, rep, with_ptr, details):
    shape, q, k, v, dout, fwd_flops = cell_inputs(torch, head_dim, seqlen, causal)
    shape["dtype"] = "bf16"
    seen = {kern: len(rows) for kern, rows in attn.tuning_report().items()}
    names = [n for n in provs if n != "tilewise_ptr" or with_ptr]
    anchor = "sdpa_flash" if not isinstance(provs.get("sdpa_flash"), str) else None
    order = ([anchor] if anchor else []) + [n for n in names if n != anchor]
    missing = {name: provs[name] for name in order if isinstance(provs[name], str)}   # why a peer is absent
    host = {}
    results, notes, diffs = check_then_time(torch, triton, [(n, *provs[n]) for n in order if n not in missing],
                                            (q, k, v, dout), causal, rep, fwd_flops, AGREE_TOL, host)
    notes.update(missing)
    # The keys this shape tuned (new entries of the report): chosen config and candidate times per kernel.
    tuned = {kern: entries[seen.get(kern, 0):] for kern, entries in attn.tuning_report().items()}
    rows = []
    for direction in ("fwd", "bwd"):
        vals = results[direction]
        row = {"shape": {**shape, "pass": direction}, "unit": "TFLOP/s"}
        for name in names:
            row[name] = round(vals[name], 1) if name in vals else None
        mine = vals.get("tilewise")
        peers = {n: x for n, x in vals.items() if not n.startswith("tilewise")}
        for name in ("sdpa_flash", "flex"):
            row[f"ratio_{name}"] = round(mine / peers[name], 3) if mine and name in peers else None
        best = max(peers.items(), key=lambda kv: kv[1]) if peers else None
        row["best_peer"] = best[0] if best else None
        row["ratio_best_peer"] = round(mine / best[1], 3) if mine and best else None
        if diffs:
            row["rel_diff_vs_sdpa_flash"] = diffs
        if notes:
            row["notes"] = notes
        rows.append(row)
        # Details stay out of the rows (the README table shows every row key): host time, tuning.
        kernels = ("fwd",) if direction == "fwd" else ("dkdv", "dq")
        details.append({"shape": row["shape"], "host_us": {n: h[direction] for n, h in host.items()},
                        "tuning": {kern: tuned[kern] for kern in kernels if tuned.get(kern)}})
    return rows


def memory_row(torch):
    """Forward + backward at 128k tokens, causal: peak bytes beyond q, k, v, dout, out, lse, dq, dk, dv."""
    from tilewise.ops import flash_attention
    seqlen, heads, head_dim = 131072, 16, 128
    warm = [torch.randn(1, 16384, heads, head_dim, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)]  # tunes (if not done yet) at 16k, the sequence-length class 128k falls in
    flash_attention(*warm, causal=True).sum().backward()
    del warm
    shape = {"batch": 1, "seqlen": seqlen, "heads": heads, "head_dim": head_dim, "causal": True,
             "dtype": "bf16", "pass": "fwd+bwd"}
    q, k, v = (torch.randn(1, seqlen, heads, head_dim, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    out.backward(dout)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    held = sum(t.numel() * t.element_size() for t in (out, lse, q.grad, k.grad, v.grad))
    extra = (torch.cuda.max_memory_allocated() - base - held) / 2**30
    ok = bool(torch.isfinite(out).all()) and bool(torch.isfinite(q.grad).all())
    return {"shape": shape, "unit": "GiB beyond inputs, outputs and gradients", "tilewise": round(extra, 4),
            "limit": 1.0, "within_limit": extra < 1.0 and ok, "finite": ok, "seconds": round(seconds, 2)}


# ---------------------------------------------------------------------------------------------- FP8

FP8_SHAPES = [(128, 4096, False), (128, 4096, True), (128, 16384, False), (128, 16384, True)]
FP8_QUICK_SHAPES = FP8_SHAPES[:2]
FP8_AGREE_TOL = 0.15  # relative difference of FP8 and bf16 outputs/gradients (each FP8 one ~5-7% from exact)
FP8_ACCURACY_SHAPE = (1, 4096, 8, 128)  # batch, seqlen, heads, head_dim; causal; float64 reference on the GPU
# --sweep: wider FP8 candidate lists (d128), (BLOCK_M, BLOCK_N, num_warps, num_stages).
FP8_SWEEP = {"fp8_fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4),
                         (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3), (64, 64, 4, 3)],
             "fp8_dkdv": [(32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                          (32, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (32, 32, 4, 3)],
             "fp8_dq": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                        (64, 64, 4, 4), (128, 32, 4, 3), (64, 128, 4, 3)]}


def fp8_providers():
    """name -> (fn(q, k, v, causal), env set around its forward and backward)."""
    from tilewise.ops import flash_attention, fp8_flash_attention
    found = {"tilewise": (lambda q, k, v, c: flash_attention(q, k, v, causal=c), {}),
             "tilewise_fp8": (lambda q, k, v, c: fp8_flash_attention(q, k, v, causal=c), {}),
             "tilewise_fp8_rot": (lambda q, k, v, c: fp8_flash_attention(q, k, v, causal=c, rotate=True), {})}
    return found


def bench_fp8_shape(torch, triton, f8, provs, head_dim, seqlen, causal, rep, details):
    """TFLOP/s of the bf16 and FP8 kernels (the FLOPs of bf16 attention; the FP8 calls include their
    quantization passes), after checking each FP8 result against the bf16 kernel's."""
    shape, q, k, v, dout, fwd_flops = cell_inputs(torch, head_dim, seqlen, causal)
    seen = {kern: len(rows) for kern, rows in f8.tuning_report().items()}
    host = {}
    results, notes, diffs = check_then_time(torch, triton, [(n, *p) for n, p in provs.items()], (q, k, v, dout),
                                            causal, rep, fwd_flops, FP8_AGREE_TOL, host)
    tuned = {kern: entries[seen.get(kern, 0):] for kern, entries in f8.tuning_report().items()}
    rows = []
    for direction in ("fwd", "bwd"):
        vals = results[direction]
        row = {"shape": {**shape, "pass": direction}, "unit": "TFLOP/s"}
        for name in provs:
            row[name] = round(vals[name], 1) if name in vals else None
        base = vals.get("tilewise")
        for name in [n for n in provs if n.startswith("tilewise_fp8")]:
            row[f"ratio_{name}"] = round(vals[name] / base, 3) if base and name in vals else None
        if diffs:
            row["rel_diff_vs_bf16"] = diffs
        if notes:
            row["notes"] = notes
        rows.append(row)
        kernels = ("fp8_fwd",) if direction == "fwd" else ("fp8_dkdv", "fp8_dq")
        tuning = {kern: tuned[kern] for kern in kernels if tuned.get(kern)}
        races = [r for r in tuned.get("gluon_vs_triton", []) if r["key"]["pass"] == f"fp8_{direction}"]
        if races:
            tuning["gluon_vs_triton"] = races
        details.append({"shape": row["shape"], "host_us": {n: h[direction] for n, h in host.items()},
                        "tuning": tuning})
    return rows


def fp8_inputs(torch, kind, batch, seqlen, heads, head_dim, seed=0):
    """q, k, v, dout (bf16, on the GPU) of one input class."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, device=DEVICE, generator=gen) for _ in range(4))
    if kind == "channels_x20":  # 4 channels per head, the same in q, k and v, scaled x20
        for h in range(heads):
            ch = torch.randperm(head_dim, device=DEVICE, generator=gen)[:4]
            for t in (q, k, v):
                t[:, :, h, ch] *= 20
    elif kind == "fa3_outliers":  # N(0,1) + N(0,100) * Bernoulli(0.001), elementwise
        for t in (q, k, v):
            t += 10 * torch.randn(shape, device=DEVICE, generator=gen) * (torch.rand(shape, device=DEVICE,
                                                                                    generator=gen) < 1e-3)
    return [t.to(torch.bfloat16) for t in (q, k, v, dout)]


def fp8_accuracy(torch):
    """Errors of O and the three gradients against float64 attention, per method and input class."""
    from tilewise.ops import flash_attention, fp8_flash_attention
    from tilewise.ops.attention import _dense_attention
    from tilewise.ops.fp8_attention import naive_fp8_attention
    batch, seqlen, heads, head_dim = FP8_ACCURACY_SHAPE
    methods = {"bf16": lambda *t: flash_attention(*t, causal=True),
               "naive_per_tensor_fp8": lambda *t: naive_fp8_attention(*t, causal=True),
               "fp8": lambda *t: fp8_flash_attention(*t, causal=True),
               "fp8_rotate": lambda *t: fp8_flash_attention(*t, causal=True, rotate=True)}
    table = []
    for kind in ("gaussian", "channels_x20", "fa3_outliers"):
        q, k, v, dout = fp8_inputs(torch, kind, batch, seqlen, heads, head_dim)
        xs = [t.double().requires_grad_() for t in (q, k, v)]
        out = _dense_attention(*xs, True, head_dim ** -0.5, None)[0]
        out.backward(dout.double())
        ref = [out.detach()] + [x.grad for x in xs]
        del xs, out
        torch.cuda.empty_cache()
        row = {"inputs": kind, "shape": {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim,
                                         "causal": True}, "rmse": {}, "rel": {}}
        for name, fn in methods.items():
            try:
                got = run_once(lambda a, b, c, causal: fn(a, b, c), *[t.clone().requires_grad_() for t in (q, k, v)],
                               True, dout)
            except Exception as e:
                row.setdefault("notes", {})[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                continue
            row["rmse"][name] = {n: float(f"{(x.double() - r).pow(2).mean().sqrt().item():.4g}")
                                 for n, x, r in zip(("o", "dq", "dk", "dv"), got, ref)}
            row["rel"][name] = {n: float(f"{((x.double() - r).norm() / r.norm()).item():.4g}")
                                for n, x, r in zip(("o", "dq", "dk", "dv"), got, ref)}
        naive = row["rmse"].get("naive_per_tensor_fp8", {}).get("o")
        for name in ("fp8", "fp8_rotate"):
            mine = row["rmse"].get(name, {}).get("o")
            row[f"naive_over_{name}_o"] = round(naive / mine, 3) if naive and mine else None
        table.append(row)
        del ref
        torch.cuda.empty_cache()
    return table


def run_fp8(torch, triton, args, t0, on_shape=None):
    """The FP8 section: (rows, accuracy, details). on_shape(rows, details) after each shape: what ran is
    written even if the device call's time runs out before the accuracy table."""
    from tilewise.ops import fp8_attention as f8
    if args.sweep:
        for kern, configs in FP8_SWEEP.items():
            f8.set_candidates(kern, configs, 128)
    provs = fp8_providers()
    rows, details = [], []
    start = time.monotonic()
    shapes = FP8_QUICK_SHAPES if args.quick else FP8_SHAPES
    if args.fp8_shapes:
        shapes = [FP8_SHAPES[int(i)] for i in args.fp8_shapes.split(",")]
    for head_dim, seqlen, causal in shapes:
        if time.monotonic() - start > args.fp8_budget:
            for direction in ("fwd", "bwd"):
                rows.append({"shape": {"batch": TOKENS // seqlen, "seqlen": seqlen, "heads": WIDTH // head_dim,
                                       "head_dim": head_dim, "causal": causal, "pass": direction},
                             "unit": "TFLOP/s", "skipped": f"--fp8-budget {args.fp8_budget:.0f}s spent"})
            continue
        rows += bench_fp8_shape(torch, triton, f8, provs, head_dim, seqlen, causal, args.rep, details)
        print(f"[{time.monotonic() - t0:6.1f}s] fp8 d={head_dim} N={seqlen} causal={causal} done", flush=True)
        torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(rows, details)
    try:
        accuracy = fp8_accuracy(torch)
    except Exception as e:  # the timing rows still reach the JSON
        accuracy = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
    print(f"[{time.monotonic() - t0:6.1f}s] fp8 accuracy done", flush=True)
    return rows, accuracy, details


def fp8_table(rows, accuracy):
    cols = ["tilewise", "tilewise_fp8", "tilewise_fp8_rot"]
    fmt = lambda x, w=10: f"{x:>{w}.1f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    fmr = lambda x: f"{x:>9.2f}" if isinstance(x, (int, float)) else f"{'-':>9}"  # noqa: E731
    lines = ["attention FP8 vs bf16 (tilewise), TFLOP/s",
             f"{'d':>4} {'N':>6} {'causal':>6} {'pass':>5} {'bf16':>10} {'fp8':>10} {'fp8+rot':>10} {'x fp8':>9} {'x rot':>9}"]
    for r in rows:
        s = r["shape"]
        if r.get("skipped"):
            lines.append(f"{s['head_dim']:>4} {s['seqlen']:>6} {str(s['causal']):>6} {s['pass']:>5} skipped")
            continue
        lines.append(f"{s['head_dim']:>4} {s['seqlen']:>6} {str(s['causal']):>6} {s['pass']:>5} "
                     + " ".join(fmt(r.get(c)) for c in cols)
                     + f" {fmr(r.get('ratio_tilewise_fp8'))} {fmr(r.get('ratio_tilewise_fp8_rot'))}")
        for name, note in (r.get("notes") or {}).items():
            lines.append(f"{'':>24}{name}: {note}")
    lines.append("attention FP8 accuracy vs float64, causal, RMSE (relative error) of o / dq / dk / dv")
    for row in accuracy:
        if "error" in row:
            lines.append(f"  failed: {row['error']}")
            continue
        lines.append(f"  {row['inputs']} {row['shape']}: naive/fp8 {row.get('naive_over_fp8_o')}, "
                     f"naive/fp8+rot {row.get('naive_over_fp8_rotate_o')} (output RMSE)")
        for name, errs in row["rmse"].items():
            rel = row["rel"][name]
            lines.append(f"    {name:>22}: " + "  ".join(f"{n} {errs[n]:.3g} ({rel[n]:.3g})" for n in errs))
    return "\n".join(lines)


def table(rows):
    cols = ["tilewise", "tilewise_ptr", "sdpa_flash", "sdpa_cudnn", "flex"]
    head = f"{'d':>4} {'N':>6} {'causal':>6} {'pass':>5} " + " ".join(f"{c:>12}" for c in cols) + \
        f" {'x flash':>8} {'x flex':>8} {'x best':>8}"
    lines = ["attention, bf16, TFLOP/s (x = tilewise / peer)", head]
    fmt = lambda x, w=12: f"{x:>{w}.1f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    fmr = lambda x: f"{x:>8.2f}" if isinstance(x, (int, float)) else f"{'-':>8}"  # noqa: E731
    for r in rows:
        s = r["shape"]
        if r["unit"] != "TFLOP/s":
            if r.get("error"):
                lines.append(f"memory 128k fwd+bwd: failed: {r['error']}")
            else:
                lines.append(f"memory 128k fwd+bwd: {r['tilewise']:.3f} GiB beyond tensors (limit {r['limit']} GiB), "
                             f"{'ok' if r['within_limit'] else 'OVER LIMIT OR NON-FINITE'}, {r['seconds']} s")
            continue
        if r.get("skipped"):
            lines.append(f"{s['head_dim']:>4} {s['seqlen']:>6} {str(s['causal']):>6} {s['pass']:>5} skipped: "
                         f"{r['skipped']}")
            continue
        lines.append(f"{s['head_dim']:>4} {s['seqlen']:>6} {str(s['causal']):>6} {s['pass']:>5} "
                     + " ".join(fmt(r.get(c)) for c in cols)
                     + f" {fmr(r.get('ratio_sdpa_flash'))} {fmr(r.get('ratio_flex'))} {fmr(r.get('ratio_best_peer'))}")
        for name, note in (r.get("notes") or {}).items():
            if s["pass"] == "fwd":
                lines.append(f"{'':>24}{name}: {note}")
    return "\n".join(lines)


def tuning_lines(details):
    """Per shape: the config each tilewise kernel chose and its time against the best other candidate, and
    the host time of one tilewise call."""
    lines = ["tilewise configs chosen (BLOCK_M,BLOCK_N,warps,stages: ms; runner-up), host us per call"]
    for r in details:
        if not r.get("tuning") and not r.get("host_us"):
            continue
        s = r["shape"]
        parts = []
        for kern, entries in r["tuning"].items():
            for e in entries:
                times = sorted((v, c) for c, v in e["ms"].items() if isinstance(v, float))
                failed = sum(1 for v in e["ms"].values() if isinstance(v, str))
                tma = "tma" if e["key"].get("USE_TMA") else "ptr"
                chosen = ",".join(map(str, e["chosen"])) if e["chosen"] else "none"
                best = f"{times[0][0]:.3f}" if times else "-"
                second = f"; {times[1][1]} {times[1][0]:.3f}" if len(times) > 1 else ""
                parts.append(f"{kern}/{tma} {chosen}: {best}{second}" + (f" ({failed} failed)" if failed else ""))
        host = r.get("host_us", {}).get("tilewise")
        parts.append(f"host {host} us" if host is not None else "host -")
        lines.append(f"  d={s['head_dim']} N={s['seqlen']} causal={s['causal']} {s['pass']}: " + " | ".join(parts))
    return lines


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    import triton
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from tilewise.ops import attention as attn
    t0 = time.monotonic()
    if args.fp8_only:
        return main_fp8_only(torch, triton, args, t0)
    if args.sweep:
        for kern, classes in SWEEP.items():
            for head_dim, configs in classes.items():
                attn.set_candidates(kern, configs, head_dim)
    provs = providers(torch, F)
    shapes = QUICK_SHAPES if args.quick else ALL_SHAPES
    if args.shapes:
        shapes = [ALL_SHAPES[int(i)] for i in args.shapes.split(",")]
    rows, details, default_failed = [], [], False
    for i, (head_dim, seqlen, causal) in enumerate(shapes):
        if time.monotonic() - t0 > args.budget:
            for direction in ("fwd", "bwd"):
                rows.append({"shape": {"batch": TOKENS // seqlen, "seqlen": seqlen, "heads": WIDTH // head_dim,
                                       "head_dim": head_dim, "causal": causal, "dtype": "bf16", "pass": direction},
                             "unit": "TFLOP/s", "skipped": f"--budget {args.budget:.0f}s spent"})
            continue
        # The pointer path also runs wherever the default path has failed, so a broken TMA build still
        # leaves numbers for the kernels.
        with_ptr = (head_dim, seqlen, causal) in PTR_SHAPES or default_failed
        new = bench_shape(torch, triton, attn, provs, head_dim, seqlen, causal, args.rep, with_ptr, details)
        default_failed = default_failed or any(r.get("tilewise") is None for r in new)
        rows += new
        print(f"[{time.monotonic() - t0:6.1f}s] d={head_dim} N={seqlen} causal={causal} done", flush=True)
        torch.cuda.empty_cache()
        if i + 1 == MEMORY_AFTER and not args.no_memory:
            try:
                rows.append(memory_row(torch))
            except Exception as e:  # recorded, so the timing rows still reach the JSON
                rows.append({"shape": {"batch": 1, "seqlen": 131072, "heads": 16, "head_dim": 128, "causal": True,
                                       "dtype": "bf16", "pass": "fwd+bwd"},
                             "unit": "GiB beyond inputs, outputs and gradients", "tilewise": None, "limit": 1.0,
                             "within_limit": False, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            torch.cuda.empty_cache()
    result = {"area": "attention", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "seconds": round(time.monotonic() - t0, 1), "sweep": args.sweep,
              "tma_fallbacks": [{"kernel": k, "key": str(key), "error": e} for k, key, e in attn.fallbacks],
              "rows": rows, "details": details}
    fp8 = None
    if args.fp8:
        fp8 = run_fp8(torch, triton, args, t0)
        result.update(fp8_result(torch, triton, fp8, attn))
    write_result(result, "attention.json", [RESULTS, args.out])
    print("\n".join(tuning_lines(details)))
    for k, key, e in attn.fallbacks:
        print(f"TMA fallback: {k} {key}: {e}")
    print(table(rows))
    if fp8 is not None:
        print(fp8_table(fp8[0], fp8[1]))
    return 0


def fp8_result(torch, triton, fp8, attn):
    rows, accuracy, details = fp8
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}
    return {"fp8_env": env, "fp8_rows": rows, "fp8_accuracy": accuracy, "fp8_details": details,
            "fp8_tma_fallbacks": [{"kernel": k, "key": str(key), "error": e} for k, key, e in attn.fallbacks
                                  if k.startswith("fp8")]}


def main_fp8_only(torch, triton, args, t0):
    """The FP8 section alone, merged into the existing results/attention.json (its bf16 rows kept)."""
    from tilewise.ops import attention as attn
    existing = Path(RESULTS) / "attention.json"
    try:
        result = json.loads(existing.read_text())
    except (OSError, ValueError):
        result = {"area": "attention", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": triton.__version__, "commit": git_commit(),
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "rows": []}

    def partial(rows, details):   # accuracy not measured yet
        not_yet = [{"error": "not measured (the run stopped before the accuracy table)"}]
        write_result({**result, **fp8_result(torch, triton, (rows, not_yet, details), attn)}, "attention.json",
                     [RESULTS, args.out])

    fp8 = run_fp8(torch, triton, args, t0, on_shape=partial)
    result.update(fp8_result(torch, triton, fp8, attn))
    write_result(result, "attention.json", [RESULTS, args.out])
    for entry in fp8[2]:
        for kern, keys in entry["tuning"].items():
            for e in keys:
                times = sorted((v, c) for c, v in e["ms"].items() if isinstance(v, float))
                failed = {c: v for c, v in e["ms"].items() if isinstance(v, str)}
                print(f"  {entry['shape']} {kern}: chosen {e['chosen']}, best {times[:3]}"
                      + (f", failed {failed}" if failed else ""))
    print(fp8_table(fp8[0], fp8[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
