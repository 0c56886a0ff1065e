"""Where the norm op's host time goes on autograd's device worker thread, against the calling thread.

bench/fused.py's forward+backward rows at 32768 x 1024 are host-bound under do_bench, with the backward on
autograd's CUDA worker thread (0.43 ms against 0.20 on the calling thread and 0.17 on the GPU alone, at
6e32b9c). This script splits the op's host time: each case runs 200 forward+backward calls back to back
(CUDA synchronized once), on the worker thread and on the calling thread, and the norm op's own backward
body is timed from inside (perf_counter around its Functions' backward), so the handoff and the body
separate. At 9bc6c82: 379 against 306 us a call, of which the body 84 against 71 us; a no-work Function
135 against 78 us, so the worker thread's extra is mostly the engine's handoff.

Cases: the norm op at a tiny shape and at 32768 x 1024 (LayerNorm, bf16), with its C++ node (norm_node.cpp,
the default) and with its Python node; the Python node with its kernel launches replaced by no-ops (what
launching costs); a Function whose backward only allocates the op's outputs; a
Function whose backward only launches the op's two backward kernels' worth of a tiny kernel; the no-work
Function. First, launch_costs: what one direct launch costs inside a backward, with tensors, with data_ptr
ints, and through Triton 3.6's C entry point, beside allocations, Function.apply against its C base and
check_norm_args (on the calling thread at 3792021: 16.1, 12.3 and 6.7 us for the backward row kernel; a CUDA
torch.empty 5.5; 12.0 against 7.2; 5.0 us). At 32768 x 1024, the op and eager's add + layer_norm also run in a
loop shaped like do_bench's (do_bench_shaped): at 44495b4 bench/fused.py timed the op at 0.637 ms on a host
where the tight loop took 363 us a call, so something in do_bench's loop makes the call slower. spreads runs
do_bench itself and keeps its per-call times' quantiles, before and after a torch.compile'd peer has run in
the process, to see whether a slow median is a stalled mode of some calls or a uniform slowdown.

    PYTHONPATH=src python3 bench/host_threads.py --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import environment, write_result  # noqa: E402
from host_overhead import Doubling, host_us  # noqa: E402

from tilewise import ops  # noqa: E402
from tilewise.ops import launch, native, norm  # noqa: E402

CALLS = 200


def timed(fn, leaves):
    """host_overhead.host_us of fn with the leaves' grads reset before each call."""
    def call():
        for t in leaves:
            t.grad = None
        fn()
    return host_us(call, calls=CALLS)


class BodyClock:
    """Wraps the norm op's backward (AddDropoutNorm's and PreparedAddDropoutNorm's): the median us spent
    inside it per call, wherever it runs (a median, so that a first call's compile does not count)."""
    FUNCTIONS = (norm.AddDropoutNorm, norm.PreparedAddDropoutNorm)

    def __init__(self):
        self.times, self.origs = [], [f.backward for f in self.FUNCTIONS]

    def __enter__(self):
        for function, orig in zip(self.FUNCTIONS, self.origs):
            def backward(ctx, dy, dh, orig=orig):
                t0 = time.perf_counter()
                out = orig(ctx, dy, dh)
                self.times.append(time.perf_counter() - t0)
                return out
            function.backward = staticmethod(backward)
        return self

    def __exit__(self, *exc):
        for function, orig in zip(self.FUNCTIONS, self.origs):
            function.backward = staticmethod(orig)

    def us(self):
        return round(statistics.median(self.times) * 1e6, 1) if self.times else None


def both_threads(name, fn, leaves, rows, clock=False):
    row = {"case": name}
    for label, multi in (("worker", True), ("calling", False)):
        with torch.autograd.set_multithreading_enabled(multi):
            if clock:
                with BodyClock() as c:
                    row[f"{label}_us"] = timed(fn, leaves)
                row[f"{label}_backward_body_us"] = c.us()
            else:
                row[f"{label}_us"] = timed(fn, leaves)
    rows.append(row)
    print(row, flush=True)


class _RunInBackward(torch.autograd.Function):
    """Runs ctx.fn REPEATS times in its backward, where the norm op's backward runs."""
    REPEATS = 10

    @staticmethod
    def forward(ctx, t, fn):
        ctx.fn = fn
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        for _ in range(_RunInBackward.REPEATS):
            ctx.fn()
        return grad, None


def per_call_us(fn):
    """us a call of fn inside a backward, on autograd's worker thread and on the calling thread: a
    forward+backward running it REPEATS times less one running a no-op as often, over REPEATS."""
    t = torch.zeros(8, device="cuda", requires_grad=True)
    g = torch.ones(8, device="cuda")
    out = {}
    for label, multi in (("worker", True), ("calling", False)):
        with torch.autograd.set_multithreading_enabled(multi):
            base = host_us(lambda: torch.autograd.backward(_RunInBackward.apply(t, lambda: None), g))
            full = host_us(lambda: torch.autograd.backward(_RunInBackward.apply(t, fn), g))
        out[f"{label}_us"] = round((full - base) / _RunInBackward.REPEATS, 2)
    return out


def launch_costs(rows):
    """What one direct launch and its neighbours cost inside a backward (per_call_us), at shapes small enough
    that the GPU never waits: the backward row kernel (9 pointers) and the partial sums (3) with tensors as
    arguments, with their data_ptr() ints (Triton's C launcher then skips a data_ptr call and a
    cuPointerGetAttribute per pointer), and through the compiled launcher's C entry point (Triton 3.6,
    skipping CudaLauncher.__call__ and the direct launch's checks, timed alone); allocations by torch.empty,
    empty_like and new_empty; Function.apply against its C base and check_norm_args (calling thread)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    m, n = 256, 1024
    h, dy, dh = (torch.randn(m, n, device=dev, dtype=bf) for _ in range(3))
    w = torch.randn(n, device=dev, dtype=bf)
    stats = torch.randn(2, m, device=dev)
    norm._backward(dy, dh, h, w, stats, False, 0.0, 0, bf, bf, bf)        # plans and compiles
    key = (False, h.device, n, False, False, False, bf, 0.0, bf, bf, bf, bf, bf, None)
    plan = norm._PLANS.get(key) or next(v for k, v in norm._PLANS.items() if k[0] is False and k[2] == n)
    programs = norm.launch_programs(plan.per_wave, plan.cfg.waves, norm._cdiv(m, plan.cfg.block_m))
    dx = torch.empty_like(h)
    part = torch.empty((2, programs, n), device=dev)
    dw, db = torch.empty(n, device=dev, dtype=bf), torch.empty(n, device=dev, dtype=bf)
    bwd_args = (dy, dh, h, w, stats, stats, dx, dx, part, m, n, norm._cdiv(m, plan.cfg.block_m), 0, 0, 1.0)
    sums_args = (part, dw, db, programs, n)
    cases = (("bwd kernel", plan.launch, (programs, 1), bwd_args),
             ("partial sums", norm._sum_partials, (norm._cdiv(n, norm._SUM_COLUMNS), 2), sums_args))

    def add(case, fn):
        rows.append({"case": case, **per_call_us(fn)})
        print(rows[-1], flush=True)
    for name, bound, grid, args in cases:
        bound(grid, *args)
        direct = bound.direct(args)
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        compiled = bound.launcher.launch(grid, args, bound.meta, bound.meta_key)
        entry = next(e for e in bound.launcher._entries.values() if getattr(e, "compiled", None) is compiled)
        add(f"{name}: direct launch, tensors", lambda: direct(grid, *args))
        add(f"{name}: direct launch, data_ptr ints", lambda: direct(grid, *ints))
        if entry.c_launch is not None:
            c_launch, stream, g = entry.c_launch, torch.cuda.current_stream().cuda_stream, tuple(grid) + (1,)
            extra = (entry.coop, entry.pdl, None, None, entry.packed_metadata, None, None, None)

            def raw():
                c_launch(g[0], g[1], 1, stream, entry.function, *extra, *ints, *entry.tail)
            add(f"{name}: C launch alone, data_ptr ints", raw)
        add(f"{name}: data_ptr of each tensor argument",
            lambda: [a.data_ptr() for a in args if a.__class__ is torch.Tensor])
    knobs = launch._knob_state()
    fl = norm._bwd_launch
    add("direct launch's checks", lambda: (launch._get_device() != 0 or launch._knob_state() != knobs or
                                           fl.kernel.pre_run_hooks or launch._hooks_installed() or
                                           fl._globals_changed()))
    x = torch.empty((32768, 1024), dtype=bf, device=dev)
    add("torch.empty((32768, 1024), dtype=, device=)", lambda: torch.empty((32768, 1024), dtype=bf, device=dev))
    add("torch.empty_like(x)", lambda: torch.empty_like(x))
    add("x.new_empty((32768, 1024))", lambda: x.new_empty((32768, 1024)))
    add("torch.empty(1024, dtype=, device=)", lambda: torch.empty(1024, dtype=bf, device=dev))
    add("torch.empty_like(w)", lambda: torch.empty_like(w))

    class Passing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, a, b, c):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g, None, None, None
    c_apply = super(torch.autograd.Function, Passing).apply
    t = torch.randn(8, device=dev)
    rows.append({"case": "Function.apply (4 args, no grad)", "calling_us": host_us(lambda: Passing.apply(t, w, w, 1))})
    rows.append({"case": "C apply (4 args, no grad)", "calling_us": host_us(lambda: c_apply(t, w, w, 1))})
    x, r = (torch.randn(32768, 1024, device=dev, dtype=bf) for _ in range(2))
    rows.append({"case": "check_norm_args", "calling_us": host_us(
        lambda: norm.check_norm_args(x, r, w, w, "layernorm", 0.0, None))})
    for row in rows[len(rows) - 3:]:
        print(row, flush=True)


def do_bench_shaped(name, fn, leaves, rows, calls=100):
    """fn inside a loop shaped like triton.testing.do_bench's (grads reset, the 256 MB L2 flush, CUDA
    events around the call): the median host time of the call (perf_counter around fn alone) and the median
    event time, on both threads. Against host_us's tight loop it shows whether the host's time per call
    grows when the GPU and the worker thread idle between calls, as they do under do_bench."""
    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    row = {"case": f"{name}, do_bench-shaped loop"}
    for label, multi in (("worker", True), ("calling", False)):
        with torch.autograd.set_multithreading_enabled(multi):
            host, events = [], []
            for i in range(calls + 10):
                for t in leaves:
                    t.grad = None
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                end.record()
                if i >= 10:
                    host.append(t1 - t0)
                    events.append((start, end))
            torch.cuda.synchronize()
        row[f"{label}_host_us"] = round(statistics.median(host) * 1e6, 1)
        row[f"{label}_event_us"] = round(statistics.median(s.elapsed_time(e) for s, e in events) * 1e3, 1)
    rows.append(row)
    print(row, flush=True)


def do_bench_spread(name, fn, leaves, rows):
    """triton.testing.do_bench's own per-call times of fn (return_mode="all") on both threads: quantiles,
    so a bimodal spread (some calls host-stalled) shows beside the median that bench/fused.py reports."""
    import triton.testing
    row = {"case": f"{name}, do_bench spread"}
    for label, multi in (("worker", True), ("calling", False)):
        with torch.autograd.set_multithreading_enabled(multi):
            times = sorted(triton.testing.do_bench(fn, grad_to_none=leaves, return_mode="all"))
        q = {f"p{int(p * 100)}": round(times[min(len(times) - 1, int(p * len(times)))] * 1e3, 1)
             for p in (0.1, 0.25, 0.5, 0.75, 0.9)}
        row[f"{label}_us"] = q
        row[f"{label}_slow_fraction"] = round(sum(t > 1.5 * times[0] for t in times) / len(times), 3)
    rows.append(row)
    print(row, flush=True)


def spreads(rows, compiled=False):
    """do_bench_spread of the op and of eager at 32768 x 1024, LayerNorm and RMSNorm; with compiled, after a
    torch.compile'd add + norm has been built and run in this process (as bench/fused.py's later rows are)."""
    dev, bf, (m, n) = torch.device("cuda"), torch.bfloat16, (32768, 1024)
    x, r = (torch.randn(m, n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
    dy, dh = torch.randn(m, n, device=dev, dtype=bf), torch.randn(m, n, device=dev, dtype=bf)
    suffix = ", after torch.compile" if compiled else ""
    if compiled:
        def eager_rms(x, r, w):
            h = x + r
            return torch.nn.functional.rms_norm(h, (n,), w), h
        comp = torch.compile(eager_rms)

        def compiled_step():
            y, h = comp(x, r, w)
            torch.autograd.backward((y, h), (dy, dh))
        do_bench_spread(f"torch.compile add + rms_norm {m}x{n}{suffix}", compiled_step, (x, r, w), rows)
    for kind, bias, leaves in (("layernorm", b, (x, r, w, b)), ("rmsnorm", None, (x, r, w))):
        def op():
            y, h = ops.add_dropout_norm(x, r, w, bias, kind=kind)
            torch.autograd.backward((y, h), (dy, dh))
        do_bench_spread(f"norm {kind} {m}x{n}{suffix}", op, leaves, rows)
        if not compiled:
            def eager():
                h = x + r
                y = (torch.nn.functional.layer_norm(h, (n,), w, bias) if kind == "layernorm"
                     else torch.nn.functional.rms_norm(h, (n,), w))
                torch.autograd.backward((y, h), (dy, dh))
            do_bench_spread(f"eager {kind} {m}x{n}", eager, leaves, rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    rows = []
    spreads(rows)
    launch_costs(rows)
    for m, n in ((256, 768), (32768, 1024)):
        x, r = (torch.randn(m, n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        w, b = (torch.randn(n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        dy, dh = torch.randn(m, n, device=dev, dtype=bf), torch.randn(m, n, device=dev, dtype=bf)
        leaves = (x, r, w, b)

        def op():
            y, h = ops.add_dropout_norm(x, r, w, b)
            torch.autograd.backward((y, h), (dy, dh))
        both_threads(f"norm {m}x{n}", op, leaves, rows, clock=True)

        def python_node_op():
            with native.python_nodes():
                op()
        both_threads(f"norm {m}x{n}, Python node", python_node_op, leaves, rows, clock=True)
        if m == 32768:
            do_bench_shaped(f"norm {m}x{n}", op, leaves, rows)

            def eager():
                h = x + r
                y = torch.nn.functional.layer_norm(h, (n,), w, b)
                torch.autograd.backward((y, h), (dy, dh))
            do_bench_shaped(f"eager add + layer_norm {m}x{n}", eager, leaves, rows)

        # the launches as no-ops: new plans whose direct launches do nothing (the keyed first calls run)
        saved = dict(norm._CALLS), dict(norm._PREPARED)
        real_direct = launch.BoundLauncher.direct
        try:
            norm._CALLS.clear()
            norm._PREPARED.clear()
            launch.BoundLauncher.direct = lambda self, a: (lambda grid, *rest: None)
            both_threads(f"norm {m}x{n}, launches stubbed", python_node_op, leaves, rows, clock=True)
        finally:
            launch.BoundLauncher.direct = real_direct
            for table, old in zip((norm._CALLS, norm._PREPARED), saved):
                table.clear()
                table.update(old)

        class Allocating(torch.autograd.Function):
            """The op's outputs and gradients allocated, nothing launched."""
            @staticmethod
            def forward(ctx, x, r, w, b):
                ctx.save_for_backward(w)
                return torch.empty_like(x), torch.empty_like(x)

            @staticmethod
            def backward(ctx, gy, gh):
                (w,) = ctx.saved_tensors
                part = torch.empty((2, 264, w.shape[0]), device=w.device, dtype=torch.float32)
                del part
                return torch.empty_like(gy), None, torch.empty_like(w), torch.empty_like(w)

        def alloc():
            y, h = Allocating.apply(x, r, w, b)
            torch.autograd.backward((y, h), (dy, dh))
        both_threads(f"allocating Function {m}x{n}", alloc, leaves, rows)

    t = torch.randn(256, 768, device=dev, dtype=bf, requires_grad=True)
    both_threads("no-work Function (x * 2)", lambda: torch.autograd.backward(Doubling.apply(t), t.detach()), (t,),
                 rows)

    sums = norm._sum_partials
    part = torch.randn(2, 8, 768, device=dev)
    dw, db = torch.empty(768, device=dev, dtype=bf), torch.empty(768, device=dev, dtype=bf)
    sums((48, 2), part, dw, db, 8, 768)
    direct = sums.direct((part, dw, db, 8, 768))

    class Launching(torch.autograd.Function):
        """Two launches of a tiny kernel in the backward, nothing allocated."""
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            direct((48, 2), part, dw, db, 8, 768)
            direct((48, 2), part, dw, db, 8, 768)
            return grad
    both_threads("launching Function (2 launches)", lambda: torch.autograd.backward(Launching.apply(t), t.detach()),
                 (t,), rows)
    # where the op's own Python goes: cProfile of the stubbed 32768 x 1024 case on the calling thread
    m, n = 32768, 1024
    x, r = (torch.randn(m, n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
    dy, dh = torch.randn(m, n, device=dev, dtype=bf), torch.randn(m, n, device=dev, dtype=bf)

    def op():
        y, h = ops.add_dropout_norm(x, r, w, b)
        torch.autograd.backward((y, h), (dy, dh))
    real_direct = launch.BoundLauncher.direct
    norm._CALLS.clear()
    norm._PREPARED.clear()
    launch.BoundLauncher.direct = lambda self, a: (lambda grid, *rest: None)
    try:
        with torch.autograd.set_multithreading_enabled(False), native.python_nodes():
            for _ in range(20):
                op()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(CALLS):
                for t in (x, r, w, b):
                    t.grad = None
                op()
            prof.disable()
    finally:
        launch.BoundLauncher.direct = real_direct
        norm._CALLS.clear()     # the plans made while stubbed hold the no-op launches
        norm._PREPARED.clear()
    spreads(rows, compiled=True)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print(buf.getvalue())
    write_result({"area": "host_threads", **environment(), "unit": "us per forward+backward", "calls": CALLS,
                  "rows": rows, "profile_stubbed_calling_thread": buf.getvalue()}, "host_threads.json", [args.out])


if __name__ == "__main__":
    main()
