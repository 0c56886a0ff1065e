"""Where a training step's GPU time goes: torch.profiler's kernel trace summed by kind per step.

`summarize_trace` turns a chrome trace's GPU events into ms per step: GEMMs, attention, memory-bound kernels,
the optimizer and communication (NCCL), the busy time (the union of all intervals), idle = wall - busy, and
how much of the communication no compute kernel overlapped (exposed): the figure that says whether a
multi-GPU step waits on its collectives. bench/e2e.py uses it around its own steps; the trainer uses it
through `StepProfiler` (train.profile_steps="A:B": steps A..B-1 of every rank, written to the run folder as
profile_rank{R}.json).
"""
from __future__ import annotations

import json
import os
import re
import tempfile

KINDS = (   # first match wins; what matches none is memory-bound (norms, activations, casts, copies)
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"attn|flash|fmha|sdpa|attention|_bwd_prep", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|lpnorm|foreach", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|splitk|matmul|_mm_|\bmm\b", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "memory_bound"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, t in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], t)
        else:
            merged.append([s, t])
    return [(s, t) for s, t in merged]


def _length(intervals) -> float:
    return sum(t - s for s, t in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_trace(events: list[dict], steps: int) -> dict:
    """The chrome trace's GPU events (kernels, copies, fills; times in microseconds) as ms per step."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"error": "the profiler recorded no GPU activity"}
    by_kind = dict.fromkeys(["gemm", "attention", "memory_bound", "optimizer", "communication"], 0.0)
    by_name: dict[str, float] = {}
    calls: dict[str, int] = {}
    by_launch: dict[tuple, list] = {}   # GEMMs: (name, grid) -> [us, launches]
    everything, comm, compute = [], [], []
    for e in gpu:
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        name = e.get("name", "?")
        kind = kind_of(name)
        by_kind[kind] += dur
        by_name[name] = by_name.get(name, 0.0) + dur
        calls[name] = calls.get(name, 0) + 1
        if kind == "gemm":
            launch = by_launch.setdefault((name, tuple((e.get("args") or {}).get("grid") or ())), [0.0, 0])
            launch[0] += dur
            launch[1] += 1
        everything.append((start, start + dur))
        (comm if kind == "communication" else compute).append((start, start + dur))
    busy = _union(everything)
    comm, compute = _union(comm), _union(compute)
    wall = max(t for _, t in everything) - min(s for s, _ in everything)
    ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731  (trace times are microseconds)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])

    def listing(kernels):
        return [{"name": n[:120], "kind": kind_of(n), "ms": ms(v), "calls": round(calls[n] / steps, 2)}
                for n, v in kernels]
    return {"breakdown_ms": {**{k: ms(v) for k, v in by_kind.items()}, "idle": ms(wall - _length(busy)),
                             "busy": ms(_length(busy)), "wall": ms(wall),
                             "communication_exposed": ms(_length(comm) - _overlap(comm, compute))},
            "top_kernels": listing(ranked[:12]),
            # the many small kinds of kernel between the GEMMs, where a step's time above its floor hides
            "memory_bound_kernels": listing([kv for kv in ranked if kind_of(kv[0]) == "memory_bound"][:30]),
            # GEMMs by (kernel, grid), a kernel launched at two grids listed twice: two steps' GEMMs side by side
            "gemm_launches": [{"name": n[:120], "grid": list(grid), "ms": ms(v), "calls": round(c / steps, 2)}
                              for (n, grid), (v, c) in sorted(by_launch.items(), key=lambda kv: -kv[1][0])[:40]]}


def trace_events(prof) -> list[dict]:
    """A finished torch.profiler.profile's chrome-trace events."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])


def parse_steps(spec: str) -> tuple[int, int] | None:
    """train.profile_steps: "" (off) or "A:B", the steps A..B-1 (0-based, A < B)."""
    if not spec:
        return None
    a, sep, b = spec.partition(":")
    try:
        first, stop = int(a), int(b)
    except ValueError:
        first = stop = -1
    if not sep or first < 0 or stop <= first:
        raise ValueError(f"train.profile_steps={spec!r}; expected 'A:B' with 0 <= A < B, e.g. '10:13'")
    return first, stop


class StepProfiler:
    """Profiles steps [first, stop) of a run (CUDA activity) and writes the summary to `path` when done.

    Call `before(step)` at the top of each step and `after(step)` at its end; both are no-ops outside the
    window. The window synchronizes the device at its edges (only there)."""

    def __init__(self, window: tuple[int, int] | None, path: str, device):
        self.window, self.path, self.device = window, path, device
        self._prof = None

    def before(self, step: int) -> None:
        if self.window is None or step != self.window[0] or self.device.type != "cuda":
            return
        import torch
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize(self.device)
        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.__enter__()

    def after(self, step: int) -> None:
        if self._prof is None or step + 1 != self.window[1]:
            return
        import torch
        torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        summary = summarize_trace(trace_events(prof), self.window[1] - self.window[0])
        summary["steps"] = list(self.window)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)   # another node's rank: not made yet
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, self.path)

    def close(self) -> None:
        """Stop a window the run did not finish (it ended early or failed): nothing is written."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
