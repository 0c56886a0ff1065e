"""Cross-entropy and fused linear + cross-entropy: tilewise against eager PyTorch, torch.compile and Liger.

Cases (bf16, forward + backward, mean over targets with 1 in 9 ignored):
- plain cross-entropy on (16384, 50304) logits: tilewise.ops.cross_entropy, F.cross_entropy eager and
  compiled, Liger's LigerCrossEntropyLoss (which writes its gradient over its input; it gets its own copy);
- linear + cross-entropy at tokens x hidden x vocab = 16384 x 768 x 50304 and 8192 x 2048 x 50304:
  tilewise.ops.linear_cross_entropy, the unfused path F.cross_entropy(F.linear(h, W), t) eager and under
  torch.compile, Liger's LigerFusedLinearCrossEntropyLoss.
Before timing, each one's loss and gradients are compared with the eager path (relative error norm below
2e-2, the bf16 head's own error is ~4e-3); one that disagrees is not timed. Time: triton.testing.do_bench
median of whole forward+backward steps (grads reset each step). Peak: torch.cuda.max_memory_allocated
during one step beyond what was allocated before it (the inputs), the input gradients included. Plain
cross-entropy also gets GB/s (bytes: the forward reads the logits, the backward reads them and writes the
gradient) against the device-to-device copy measured in the same run.
Targets (issue 4): fused peak at most 25% of the unfused eager path's at 16384 x 768 x 50304, and time no
worse than torch.compile of the unfused path.

--sweep picks the defaults (details under "sweep" in the JSON, a table printed before the main one):
- the row kernel alone at 16384 x 50304 bf16 for each RowConfig candidate, as the plain op launches it
  (forward, then backward into a new gradient) and as the fused path does (one launch, forward and
  backward), with its registers and spills as compiled here;
- linear+CE at 16384 x 768 x 50304 for chunk rows 2048 / 4096 / 8192 / 16384 against those candidates,
  peak memory beside time; `picked` is the fastest within 25% of the unfused eager peak (the target), and
  the same chunk sizes at 8192 x 2048 with the default launch and the picked one.
Those results change CHUNK_BYTES and WIDE_ROWS in src/tilewise/ops/cross_entropy.py.

    PYTHONPATH=src python3 bench/cross_entropy.py --out DIR [--quick] [--sweep]
"""
from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F
from common import RESULTS, git_commit, write_result

AREA = "cross_entropy"
VOCAB = 50304
AGREE = 2e-2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write cross_entropy.json into this folder")
    p.add_argument("--quick", action="store_true", help="plain CE and the 16384 x 768 fused case only")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time in ms")
    p.add_argument("--sweep", action="store_true", help="time row-kernel launches and chunk sizes (picks defaults)")
    return p.parse_args(argv)


def load_peers():
    """Liger's losses when importable, else the reason they are missing."""
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
        return LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss, None
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is missing
        return None, None, f"{type(e).__name__}: {e}"


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_once(fn, leaves):
    for t in leaves:
        t.grad = None
    loss = fn()
    loss.backward()
    return loss.detach().float(), [t.grad.clone() for t in leaves]


def peak_gb(fn, leaves):
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in leaves:
        t.grad = None
    return peak / 1e9


def time_ms(fn, leaves, rep):
    from triton.testing import do_bench

    def step():
        fn().backward()

    return do_bench(step, warmup=25, rep=rep, grad_to_none=leaves, return_mode="median")


def copy_gbps(rep):
    from triton.testing import do_bench
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=rep, return_mode="median")
    gbps = 2 * x.numel() * x.element_size() / ms / 1e6
    del x, y
    torch.cuda.empty_cache()
    return gbps


def measure(impls, rep):
    """impls: name -> (zero-arg loss fn or None, its input leaves, note); "eager" is the one compared with.
    Returns name -> dict(ms, gb, err, note)."""
    out = {}
    ref_loss, ref_grads = run_once(impls["eager"][0], impls["eager"][1])
    for name, (fn, leaves, note) in impls.items():
        res = {"ms": None, "gb": None, "err": None, "note": note}
        out[name] = res
        if fn is None:
            continue
        try:
            loss, grads = run_once(fn, leaves)  # compiles on its first call
            err = max([rel(loss, ref_loss)] + [rel(g, r) for g, r in zip(grads, ref_grads)])
            res["err"] = err
            del loss, grads
            if not err < AGREE:
                res["note"] = f"disagrees with eager (relative error {err:.3g}); not timed"
                continue
            res["gb"] = peak_gb(fn, leaves)
            res["ms"] = time_ms(fn, leaves, rep)
        except Exception as e:  # noqa: BLE001 - a failing peer is recorded, the others still run
            res["note"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        for t in leaves:
            t.grad = None
        torch.cuda.empty_cache()
    return out


def rows_for(shape, res, extra=None):
    peers = [k for k in res if k != "tilewise"]
    ms = {k: res[k]["ms"] for k in res}
    gb = {k: res[k]["gb"] for k in res}
    tw_ms, tw_gb = ms["tilewise"], gb["tilewise"]
    best_ms = min([ms[k] for k in peers if ms[k] is not None], default=None)
    best_gb = min([gb[k] for k in peers if gb[k] is not None], default=None)
    notes = {k: res[k]["note"] for k in res if res[k]["note"]}
    errs = {k: res[k]["err"] for k in res}
    time_row = {"shape": shape, "unit": "ms", **ms,
                "ratio_best_peer": best_ms / tw_ms if tw_ms and best_ms else None,
                "speedup_vs": {k: ms[k] / tw_ms for k in peers if tw_ms and ms[k]},
                "rel_err_vs_eager": errs, "notes": notes}
    mem_row = {"shape": shape, "unit": "GB", **gb,
               "ratio_best_peer": best_gb / tw_gb if tw_gb and best_gb else None,
               "fraction_of": {k: tw_gb / gb[k] for k in peers if tw_gb and gb[k]}}
    if extra:
        time_row.update(extra)
    return [time_row, mem_row]


def cross_entropy_case(ops, liger_ce, liger_missing, rep, copy_bw):
    rows, vocab = 16384, VOCAB
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (2 * torch.randn(rows, vocab, device="cuda", generator=gen)).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    target[::9] = -100

    def unfused(x, t):
        return F.cross_entropy(x, t)

    compiled = torch.compile(unfused, dynamic=False)
    leaves = [logits]
    impls = {
        "tilewise": (lambda: ops.cross_entropy(logits, target), leaves, None),
        "eager": (lambda: unfused(logits, target), leaves, None),
        "torch_compile": (lambda: compiled(logits, target), leaves, None),
        "liger": (None, [], f"missing: {liger_missing}"),
    }
    if liger_ce is not None:
        liger_x = logits.detach().clone().requires_grad_()
        loss_mod = liger_ce()
        impls["liger"] = (lambda: loss_mod(liger_x, target), [liger_x], "own copy of the logits (it overwrites them)")
    res = measure(impls, rep)
    extra = {}
    if res["tilewise"]["ms"]:
        gbps = 3 * rows * vocab * 2 / res["tilewise"]["ms"] / 1e6
        extra = {"tilewise_GBps": gbps, "copy_GBps": copy_bw, "fraction_of_copy": gbps / copy_bw}
    shape = {"op": "cross_entropy", "rows": rows, "vocab": vocab, "dtype": "bf16"}
    return rows_for(shape, res, extra)


def linear_case(ops, liger_flce, liger_missing, tokens, width, rep):
    vocab = VOCAB
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(tokens, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda", generator=gen) / width ** 0.5).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    target[::9] = -100

    def unfused(h, w, t):
        return F.cross_entropy(F.linear(h, w), t)

    compiled = torch.compile(unfused, dynamic=False)
    leaves = [hidden, weight]
    impls = {
        "tilewise": (lambda: ops.linear_cross_entropy(hidden, weight, target), leaves, None),
        "eager": (lambda: unfused(hidden, weight, target), leaves, None),
        "torch_compile": (lambda: compiled(hidden, weight, target), leaves, None),
        "liger": (None, [], f"missing: {liger_missing}"),
    }
    if liger_flce is not None:
        loss_mod = liger_flce()
        impls["liger"] = (lambda: loss_mod(weight, hidden, target), leaves, None)
    res = measure(impls, rep)
    shape = {"op": "linear_cross_entropy", "tokens": tokens, "hidden": width, "vocab": vocab, "dtype": "bf16"}
    out = rows_for(shape, res)
    tw, eager, comp = res["tilewise"], res["eager"], res["torch_compile"]
    targets = {}
    if tw["gb"] and eager["gb"]:
        targets["peak_fraction_of_unfused_eager"] = tw["gb"] / eager["gb"]
        targets["peak_target_met"] = tw["gb"] <= 0.25 * eager["gb"]
    if tw["ms"] and comp["ms"]:
        targets["time_vs_compile"] = tw["ms"] / comp["ms"]
        targets["time_target_met"] = tw["ms"] <= comp["ms"]
    out[0]["targets"] = targets
    from tilewise.ops.cross_entropy import default_chunk_rows, default_row_config
    out[0]["tilewise_defaults"] = {"chunk_rows": default_chunk_rows(tokens, vocab, 2),
                                   "row_config": str(default_row_config(vocab))}
    return out


# ------------------------------------------------------------------------------------------------- sweep

# Row-kernel launches for vocab 50304 (the gpu tests check each one against float64 at this width).
SWEEP_CONFIGS = [(4096, 8, 0), (4096, 4, 0), (8192, 16, 0), (4096, 8, 2), (4096, 8, 4), (8192, 16, 1),
                 (65536, 32, 0), (65536, 16, 0)]
SWEEP_CHUNKS = [2048, 4096, 8192, 16384]


def kernel_stats(handle):
    """Registers and spills of a launched kernel, as Triton loaded it (None where this Triton has none)."""
    return {"n_regs": getattr(handle, "n_regs", None), "n_spills": getattr(handle, "n_spills", None)}


def sweep_row_kernel(rep, copy_bw):
    """Each candidate launch at 16384 x 50304 bf16: the plain op's two launches and the fused path's one."""
    from triton.testing import do_bench

    from tilewise.ops.cross_entropy import RowConfig, ce_rows, default_row_config
    rows, vocab = 16384, VOCAB
    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = (2 * torch.randn(rows, vocab, device="cuda", generator=gen)).bfloat16()
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    target[::9] = -100
    scale = torch.full((1,), 1.0 / rows, device="cuda")
    ref = logits.float().requires_grad_()
    ref_loss = F.cross_entropy(ref, target, reduction="none")
    ref_loss.backward(torch.where(target != -100, 1.0 / rows, 0.0))
    loss, lse = torch.empty(rows, device="cuda"), torch.empty(rows, device="cuda")
    grad = torch.empty_like(logits)
    kw = dict(ignore_index=-100, z_loss=0.0)
    results = []
    for block_v, warps, per_sm in SWEEP_CONFIGS:
        cfg = RowConfig(block_v, warps, per_sm)
        res = {"config": str(cfg)}
        results.append(res)
        try:
            fwd = ce_rows(logits, target, loss=loss, lse=lse, config=cfg, **kw)
            bwd = ce_rows(logits, target, lse=lse, grad=grad, scale=scale, config=cfg, **kw)
            res["err"] = max(rel(loss, ref_loss), rel(grad, ref.grad))
            res["fwd"], res["bwd"] = kernel_stats(fwd), kernel_stats(bwd)
            both = ce_rows(logits, target, loss=loss, lse=lse, grad=grad, scale=scale, config=cfg, **kw)
            res["err"] = max(res["err"], rel(loss, ref_loss), rel(grad, ref.grad))
            res["fwd+bwd"] = kernel_stats(both)
            if not res["err"] < AGREE:
                res["note"] = "disagrees with eager; not timed"
                continue

            def two_launches():
                ce_rows(logits, target, loss=loss, lse=lse, config=cfg, **kw)
                ce_rows(logits, target, lse=lse, grad=grad, scale=scale, config=cfg, **kw)

            def one_launch():
                ce_rows(logits, target, loss=loss, lse=lse, grad=grad, scale=scale, config=cfg, **kw)

            res["ms_two_launches"] = do_bench(two_launches, warmup=25, rep=rep, return_mode="median")
            res["ms_one_launch"] = do_bench(one_launch, warmup=25, rep=rep, return_mode="median")
            # Bytes the fused path's launch must move: the logits read once, the gradient written once.
            gbps = 2 * rows * vocab * 2 / res["ms_one_launch"] / 1e6
            res["one_launch_GBps"], res["one_launch_fraction_of_copy"] = gbps, gbps / copy_bw
        except Exception as e:  # noqa: BLE001 - a launch that fails to compile or run is recorded
            res["note"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        print(f"  row kernel {res['config']}: two launches {res.get('ms_two_launches', float('nan')):.3f} ms, "
              f"one launch {res.get('ms_one_launch', float('nan')):.3f} ms {res.get('note', '')}", flush=True)
    timed = [r for r in results if "ms_one_launch" in r]
    best = lambda key: min(timed, key=lambda r: r[key])["config"] if timed else None  # noqa: E731
    return {"shape": {"rows": rows, "vocab": vocab, "dtype": "bf16"}, "default": str(default_row_config(vocab)),
            "results": results, "fastest_two_launches": best("ms_two_launches"),
            "fastest_one_launch": best("ms_one_launch")}


def sweep_linear(tokens, width, rep, eager_peak_gb, configs, chunks):
    """linear+CE at each (chunk rows, launch): ms, peak GB and its fraction of the unfused eager peak."""
    from tilewise.ops.cross_entropy import RowConfig, linear_cross_entropy_fused
    vocab = VOCAB
    gen = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(tokens, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, width, device="cuda", generator=gen) / width ** 0.5).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    target[::9] = -100
    leaves = [hidden, weight]
    ref_loss, ref_grads = run_once(lambda: F.cross_entropy(F.linear(hidden, weight), target), leaves)
    results = []
    for chunk in chunks:
        for c in configs:
            cfg = None if c is None else RowConfig(*c)
            res = {"chunk_rows": chunk, "config": "default" if cfg is None else str(cfg), "config_args": c}
            results.append(res)

            def fn(chunk=chunk, cfg=cfg):
                return linear_cross_entropy_fused(hidden, weight, target, chunk_rows=chunk, row_config=cfg)
            try:
                loss, grads = run_once(fn, leaves)
                res["err"] = max([rel(loss, ref_loss)] + [rel(g, r) for g, r in zip(grads, ref_grads)])
                del loss, grads
                if not res["err"] < AGREE:
                    res["note"] = "disagrees with eager; not timed"
                    continue
                res["gb"] = peak_gb(fn, leaves)
                res["fraction_of_eager_peak"] = res["gb"] / eager_peak_gb
                res["ms"] = time_ms(fn, leaves, rep)
            except Exception as e:  # noqa: BLE001 - out of memory at a big chunk is a result too
                res["note"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
            for t in leaves:
                t.grad = None
            torch.cuda.empty_cache()
            print(f"  linear+CE {tokens}x{width} chunk {chunk} {res['config']}: {res.get('ms', float('nan')):.3f} ms, "
                  f"{res.get('gb', float('nan')):.3f} GB {res.get('note', '')}", flush=True)
    within = [r for r in results if r.get("ms") and r["fraction_of_eager_peak"] <= 0.25]
    picked = min(within, key=lambda r: r["ms"]) if within else None
    return {"shape": {"tokens": tokens, "hidden": width, "vocab": vocab, "dtype": "bf16"},
            "eager_peak_gb": eager_peak_gb, "results": results,
            "picked": None if picked is None else {k: picked[k] for k in ("chunk_rows", "config", "config_args",
                                                                          "ms", "gb")}}


def eager_peak(tokens, width):
    """Peak GB of the unfused eager path's forward+backward, the reference of the 25% target."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(tokens, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(VOCAB, width, device="cuda", generator=gen) / width ** 0.5).bfloat16().requires_grad_()
    target = torch.randint(0, VOCAB, (tokens,), device="cuda", generator=gen)
    fn = lambda: F.cross_entropy(F.linear(hidden, weight), target)  # noqa: E731
    run_once(fn, [hidden, weight])
    return peak_gb(fn, [hidden, weight])


def run_sweep(args, copy_bw):
    print("sweep: row kernel", flush=True)
    out = {"row_kernel": sweep_row_kernel(args.rep, copy_bw)}
    torch.cuda.empty_cache()
    print("sweep: linear+CE 16384 x 768", flush=True)
    from tilewise.ops.cross_entropy import RowConfig, default_row_config
    configs = [None] + [c for c in SWEEP_CONFIGS if RowConfig(*c) != default_row_config(VOCAB)]  # None: default
    first = sweep_linear(16384, 768, args.rep, eager_peak(16384, 768), configs, SWEEP_CHUNKS)
    out["linear_16384x768"] = first
    if not args.quick:
        torch.cuda.empty_cache()
        picked = first["picked"]["config_args"] if first["picked"] else None
        more = [None] + ([tuple(picked)] if picked else [])
        print("sweep: linear+CE 8192 x 2048", flush=True)
        out["linear_8192x2048"] = sweep_linear(8192, 2048, args.rep, eager_peak(8192, 2048), more, SWEEP_CHUNKS)
    return out


def print_sweep(sweep):
    rk = sweep["row_kernel"]
    print(f"row kernel, {rk['shape']}: default {rk['default']}")
    print(f"{'config':<58} {'2 launches':>10} {'1 launch':>9} {'of copy':>8} {'regs':>5} {'spills':>6} {'err':>8}")
    for r in rk["results"]:
        st = r.get("fwd+bwd") or {}
        cells = [f"{r[k]:.3f}" if r.get(k) is not None else "-" for k in ("ms_two_launches", "ms_one_launch",
                                                                          "one_launch_fraction_of_copy")]
        err = f"{r['err']:.2g}" if r.get("err") is not None else "-"
        print(f"{r['config']:<58} {cells[0]:>10} {cells[1]:>9} {cells[2]:>8} {str(st.get('n_regs', '-')):>5} "
              f"{str(st.get('n_spills', '-')):>6} {err:>8} {r.get('note', '')}")
    for key in ("linear_16384x768", "linear_8192x2048"):
        if key not in sweep:
            continue
        lin = sweep[key]
        print(f"\nlinear+CE {lin['shape']} (eager peak {lin['eager_peak_gb']:.2f} GB); picked: {lin['picked']}")
        print(f"{'chunk':>6} {'config':<58} {'ms':>7} {'GB':>6} {'of eager':>8}")
        for r in lin["results"]:
            ms = f"{r['ms']:.3f}" if r.get("ms") else "-"
            gb = f"{r['gb']:.3f}" if r.get("gb") else "-"
            frac = f"{r['fraction_of_eager_peak']:.3f}" if r.get("fraction_of_eager_peak") else "-"
            print(f"{r['chunk_rows']:>6} {r['config']:<58} {ms:>7} {gb:>6} {frac:>8} {r.get('note', '')}")
    print()


def print_table(rows):
    names = ["tilewise", "eager", "torch_compile", "liger"]
    head = f"{'case':<34} {'unit':<4} " + " ".join(f"{n:>13}" for n in names) + f" {'best peer/tw':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        s = r["shape"]
        case = (f"CE {s['rows']}x{s['vocab']}" if s["op"] == "cross_entropy"
                else f"linear+CE {s['tokens']}x{s['hidden']}x{s['vocab']}")
        cells = " ".join(f"{r[n]:>13.3f}" if r.get(n) is not None else f"{'-':>13}" for n in names)
        ratio = f"{r['ratio_best_peer']:>12.2f}" if r.get("ratio_best_peer") else f"{'-':>12}"
        print(f"{case:<34} {r['unit']:<4} {cells} {ratio}")
    print("ms: forward+backward median; GB: peak beyond the inputs; best peer/tw > 1: tilewise ahead")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/cross_entropy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from tilewise import ops

    torch._dynamo.config.recompile_limit = 64
    liger_ce, liger_flce, liger_missing = load_peers()
    copy_bw = copy_gbps(args.rep)
    rows = cross_entropy_case(ops, liger_ce, liger_missing, args.rep, copy_bw)
    shapes = [(16384, 768)] if args.quick else [(16384, 768), (8192, 2048)]
    for tokens, width in shapes:
        rows += linear_case(ops, liger_flce, liger_missing, tokens, width, args.rep)
        torch.cuda.empty_cache()

    flags = (" --quick" if args.quick else "") + (" --sweep" if args.sweep else "")
    result = {"area": AREA, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "command": "PYTHONPATH=src python3 bench/cross_entropy.py" + flags,
              "quick": args.quick, "copy_GBps": copy_bw,
              "missing": {"liger_kernel": liger_missing} if liger_missing else {}, "rows": rows}
    write_result(result, f"{AREA}.json", [RESULTS, args.out])  # before the sweep: a sweep cut short by a timeout keeps the table
    if args.sweep:
        result["sweep"] = run_sweep(args, copy_bw)
        write_result(result, f"{AREA}.json", [RESULTS, args.out])
        print_sweep(result["sweep"])
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
