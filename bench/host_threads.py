"""Where the norm op's host time goes on autograd's device worker thread, against the calling thread.

bench/fused.py's forward+backward rows at 32768 x 1024 are host-bound under do_bench, with the backward on
autograd's CUDA worker thread (0.43 ms against 0.20 on the calling thread and 0.17 on the GPU alone, at
6e32b9c). This script splits the op's host time: each case runs 200 forward+backward calls back to back
(CUDA synchronized once), on the worker thread and on the calling thread, and the norm op's own backward
body is timed from inside (perf_counter around AddDropoutNorm.backward), so the handoff and the body
separate. At 9bc6c82: 379 against 306 us a call, of which the body 84 against 71 us; a no-work Function
135 against 78 us, so the worker thread's extra is mostly the engine's handoff.

Cases: the norm op at a tiny shape and at 32768 x 1024 (LayerNorm, bf16); the same with its kernel launches
replaced by no-ops (what launching costs); a Function whose backward only allocates the op's outputs; a
Function whose backward only launches the op's two backward kernels' worth of a tiny kernel; the no-work
Function.

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
from host_overhead import host_us  # noqa: E402

from tilewise import ops  # noqa: E402
from tilewise.ops import launch, norm  # noqa: E402

CALLS = 200


def timed(fn, leaves):
    """host_overhead.host_us of fn with the leaves' grads reset before each call."""
    def call():
        for t in leaves:
            t.grad = None
        fn()
    return host_us(call, calls=CALLS)


class BodyClock:
    """Wraps AddDropoutNorm.backward: the median us spent inside it per call, wherever it runs (a median, so
    that a first call's compile does not count)."""

    def __init__(self):
        self.times, self.orig = [], norm.AddDropoutNorm.backward

    def __enter__(self):
        orig = self.orig

        def backward(ctx, dy, dh):
            t0 = time.perf_counter()
            out = orig(ctx, dy, dh)
            self.times.append(time.perf_counter() - t0)
            return out
        norm.AddDropoutNorm.backward = staticmethod(backward)
        return self

    def __exit__(self, *exc):
        norm.AddDropoutNorm.backward = staticmethod(self.orig)

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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    rows = []
    for m, n in ((256, 768), (32768, 1024)):
        x, r = (torch.randn(m, n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        w, b = (torch.randn(n, device=dev, dtype=bf, requires_grad=True) for _ in range(2))
        dy, dh = torch.randn(m, n, device=dev, dtype=bf), torch.randn(m, n, device=dev, dtype=bf)
        leaves = (x, r, w, b)

        def op():
            y, h = ops.add_dropout_norm(x, r, w, b)
            torch.autograd.backward((y, h), (dy, dh))
        both_threads(f"norm {m}x{n}", op, leaves, rows, clock=True)

        # the launches as no-ops: new plans whose direct launches do nothing (the keyed first calls run)
        saved = dict(norm._CALLS)
        real_direct = launch.BoundLauncher.direct
        try:
            norm._CALLS.clear()
            launch.BoundLauncher.direct = lambda self, a: (lambda grid, *rest: None)
            both_threads(f"norm {m}x{n}, launches stubbed", op, leaves, rows, clock=True)
        finally:
            launch.BoundLauncher.direct = real_direct
            norm._CALLS.clear()
            norm._CALLS.update(saved)

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

    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2
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
    launch.BoundLauncher.direct = lambda self, a: (lambda grid, *rest: None)
    try:
        with torch.autograd.set_multithreading_enabled(False):
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
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print(buf.getvalue())
    write_result({"area": "host_threads", **environment(), "unit": "us per forward+backward", "calls": CALLS,
                  "rows": rows, "profile_stubbed_calling_thread": buf.getvalue()}, "host_threads.json", [args.out])


if __name__ == "__main__":
    main()
