"""Fused memory-bound kernels against their peers, in one process on the same inputs (shared/BENCH.md).

- The device-to-device copy bandwidth, y.copy_(x) of 2 GiB bf16 (bytes read + written): the yardstick.
- add + LayerNorm/RMSNorm, bf16, (rows, width) = (16384, 4096), (32768, 1024), (8192, 8192), (65536, 768):
  forward GB/s (bytes = read x, residual, weight; write y, h) and its fraction of the copy bandwidth, and
  forward+backward time for tilewise, eager PyTorch (x + residual, then F.layer_norm / F.rms_norm),
  torch.compile of that, and eager add + Liger Kernel's LayerNorm/RMSNorm (null where liger_kernel is not
  importable). Targets (issue 4): forward >= 85% of copy, forward+backward >= 1.1x the fastest peer.
- bias + GELU (16384, 3072) and SwiGLU (16384, 2 x 8192): forward GB/s and forward+backward time against
  eager and torch.compile.
- A sweep of tilewise's launch configs around its defaults (LayerNorm, then RMSNorm while time remains),
  to retune forward_config/backward_config from data.

Forward+backward, the same for every implementation: a fresh forward, then one autograd.backward from the
same upstream gradients of y AND h (the next block consumes h, so its gradient flows in too), into leaves
x, residual, weight (and bias), all of which get gradients; .grad is reset to None before each call
(do_bench's grad_to_none), so no implementation pays an accumulation the others skip. Every
implementation's outputs and gradients are checked against an fp32 eager reference before it is timed;
a disagreement is recorded and printed, and its timing kept out of the ratios.

Diagnostics (in the JSON under "diagnostics", not in the table): tilewise's backward launcher timed alone
(GB/s: read dy, dh, h; write dx), the host time of one tilewise forward+backward (the launch and autograd
overhead; if it is near the GPU time, the measurement is launch-bound), and the programs an SM each
persistent launch used, with the compiled kernel's registers and shared memory as the device reported them.

Run on the GPU machine: PYTHONPATH=src python3 bench/fused.py [--quick] [--out DIR]
Writes bench/results/fused.json (and DIR/fused.json); the table is printed last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from common import git_commit

NORM_SHAPES = [(16384, 4096), (32768, 1024), (8192, 8192), (65536, 768)]
QUICK_NORM_SHAPES = [(16384, 4096), (65536, 768)]
GELU_SHAPE = (16384, 3072)
SWIGLU_SHAPE = (16384, 2 * 8192)
EPS = 1e-5
AGREE_TOL = 2e-2          # relative error norm against the fp32 reference; bf16 results sit near 4e-3
FWD_TARGET, FWD_BWD_TARGET = 0.85, 1.1
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also write fused.json into this directory")
    ap.add_argument("--quick", action="store_true", help="two norm shapes; the sweep only while time remains")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no config-sweep work after this many seconds of the run (default 150, "
                         "100 with --quick)")
    ap.add_argument("--smoke", action="store_true",
                    help="check this script without a GPU: tiny shapes on CPU through the Triton interpreter, "
                         "host timer; writes nothing under bench/results")
    args = ap.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 100.0 if args.quick else 150.0
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported
        os.environ["TILEWISE_OPS"] = "triton"       # the kernels on CPU tensors, not the references
        global NORM_SHAPES, QUICK_NORM_SHAPES, GELU_SHAPE, SWIGLU_SHAPE
        NORM_SHAPES = QUICK_NORM_SHAPES = [(64, 96), (6, 20000)]
        GELU_SHAPE, SWIGLU_SHAPE = (64, 80), (64, 160)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("bench/fused.py: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    Bench(args).run()
    return 0


class Bench:
    def __init__(self, args):
        import torch
        import triton
        import torch.nn.functional as F
        from tilewise import ops
        from tilewise.ops import activation, norm
        self.torch, self.triton, self.F, self.ops, self.norm, self.activation = torch, triton, F, ops, norm, activation
        self.args = args
        self.t0 = time.time()
        self.device = "cpu" if args.smoke else "cuda"
        for name in ("recompile_limit", "cache_size_limit"):  # a recompile per shape; never fall back to eager
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        self.liger = self._import_liger()
        self.results = {
            "area": "fused", "gpu": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
            "date": datetime.date.today().isoformat(),
            "peers": {"liger_kernel": self.liger[0] if self.liger else None},
            "notes": "fwd rows: GB/s (higher is better), ratio_best_peer = tilewise / best peer; fwd+bwd rows: "
                     "ms (lower is better), ratio_best_peer = best peer ms / tilewise ms. bytes = every input "
                     "read once + every output written once. fwd+bwd: backward from the gradients of y and "
                     "h into x, residual, weight and bias.",
            "command": "PYTHONPATH=src python3 bench/fused.py" + (" --quick" if args.quick else ""),
            "rows": [], "sweep": [], "diagnostics": {"norm": [], "activation": []},
        }

    # ------------------------------------------------------------------------------------------ plumbing

    def _import_liger(self):
        try:
            import liger_kernel
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        except Exception as e:      # noqa: BLE001 - any import failure means the peer is missing
            print(f"liger_kernel not importable ({type(e).__name__}: {e}); its columns are null")
            return None
        return getattr(liger_kernel, "__version__", "unknown"), LigerLayerNormFunction, LigerRMSNormFunction

    def ms(self, fn, grad_to_none=None):
        if self.args.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return self.triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                            return_mode="median")

    def host_ms(self, fn, leaves=(), n=20):
        """Host time of one call, queued without waiting for the GPU: the launch and autograd overhead."""
        torch = self.torch
        n = 1 if self.args.smoke else n
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        total = 0.0
        for _ in range(n):
            for t in leaves:
                t.grad = None
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        sync()
        return total / n * 1e3

    def elapsed(self):
        return time.time() - self.t0

    def save(self):
        text = json.dumps(self.results, indent=1, default=str)
        paths = [] if self.args.smoke else [os.path.join(HERE, "results", "fused.json")]
        if self.args.out:
            paths.append(os.path.join(self.args.out, "fused.json"))
        for path in paths:
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text + "\n")
            except OSError as e:
                print(f"could not write {path}: {e}")

    @staticmethod
    def rel(a, b):
        a, b = a.float(), b.float()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    # --------------------------------------------------------------------------------------------- copy

    def copy_bandwidth(self):
        torch = self.torch
        n = (1 << 20) if self.args.smoke else (1 << 30)
        x = torch.randn(n, device=self.device, dtype=torch.bfloat16)       # 2 GiB
        y = torch.empty_like(x)
        ms = self.ms(lambda: y.copy_(x))
        gbps = 2 * x.numel() * x.element_size() / ms / 1e6
        del x, y
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.copy_gbps = gbps
        self.results["copy_GBps"] = gbps
        print(f"device-to-device copy: {gbps:.0f} GB/s")

    # ------------------------------------------------------------------------------------------- add+norm

    def norm_impls(self, kind):
        F, ops, torch = self.F, self.ops, self.torch

        if kind == "layernorm":
            def eager(x, r, w, b):
                h = x + r
                return F.layer_norm(h, (h.shape[-1],), w, b, EPS), h
        else:
            def eager(x, r, w, b):
                h = x + r
                return F.rms_norm(h, (h.shape[-1],), w, EPS), h

        def tilewise(x, r, w, b):
            return ops.add_dropout_norm(x, r, w, b, kind=kind, eps=EPS)

        impls = {"tilewise": tilewise, "eager": eager, "torch_compile": torch.compile(eager, dynamic=False)}
        if self.liger:
            _, liger_ln, liger_rms = self.liger
            if kind == "layernorm":
                def liger(x, r, w, b):
                    h = x + r
                    return liger_ln.apply(h, w, b, EPS), h
            else:
                def liger(x, r, w, b):
                    h = x + r
                    return liger_rms.apply(h, w, EPS, 0.0, "llama", False), h
            impls["liger"] = liger
        return impls, eager

    def bench_norm(self, kind, rows, width):
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(rows + width)

        def make(*shape, scale=1.0):
            return (scale * torch.randn(*shape, device=self.device, generator=g)).to(torch.bfloat16)
        x, r = make(rows, width), make(rows, width)
        w, b = 1 + make(width, scale=0.2), make(width, scale=0.2)
        if kind == "rmsnorm":
            b = None
        dy, dh = make(rows, width), make(rows, width)
        leaves = [t.clone().requires_grad_() for t in (x, r, w) + ((b,) if b is not None else ())]
        impls, eager = self.norm_impls(kind)

        ref_in = [t.detach().float().requires_grad_() for t in leaves]
        ref_y, ref_h = eager(*ref_in, *([None] if b is None else []))
        torch.autograd.backward([ref_y, ref_h], [dy.float(), dh.float()])
        ref_out = [ref_y.detach(), ref_h.detach()] + [t.grad for t in ref_in]
        del ref_y, ref_h, ref_in

        def call(f):
            return f(*leaves) if b is not None else f(*leaves, None)

        def step(f):
            y, h = call(f)
            torch.autograd.backward([y, h], [dy, dh])

        nbytes = (4 * rows * width + width) * x.element_size()        # x, residual, weight in; y, h out
        fwd, both, agree = {}, {}, {}
        for name, f in impls.items():
            try:
                for t in leaves:
                    t.grad = None
                y, h = call(f)
                torch.autograd.backward([y, h], [dy, dh])
                got = [y.detach(), h.detach()] + [t.grad for t in leaves]
                assert all(t is not None for t in got), "a leaf got no gradient"
                errs = [self.rel(a, e) for a, e in zip(got, ref_out)]
                agree[name] = max(errs)
                del y, h, got
                if agree[name] > AGREE_TOL:
                    print(f"  {kind} {rows}x{width} {name}: DISAGREES with the fp32 reference "
                          f"(errors y, h, grads: {', '.join(f'{e:.2e}' for e in errs)}); not timed")
                    fwd[name] = both[name] = None
                    continue
                fwd_ms = self.ms(lambda: call(f))
                fwd[name] = nbytes / fwd_ms / 1e6
                both[name] = self.ms(lambda: step(f), grad_to_none=leaves)
            except Exception as e:      # noqa: BLE001 - a peer failing must not end the run
                print(f"  {kind} {rows}x{width} {name}: failed ({type(e).__name__}: {e})")
                fwd[name] = both[name] = agree[name] = None
        if not self.liger:
            fwd["liger"] = both["liger"] = None
        shape = {"rows": rows, "width": width, "dtype": "bf16", "bias": b is not None}
        op = "add_" + kind
        self.add_rows(op, shape, fwd, both, agree, frac=True)
        try:
            self.norm_diagnostics(kind, x, r, w, b, dy, dh, leaves, impls, call, step, both)
        except Exception as e:      # noqa: BLE001 - diagnostics never end the run
            print(f"  {kind} {rows}x{width} diagnostics: failed ({type(e).__name__}: {e})")
        if self.liger:
            try:
                self.liger_alone(kind, x, r, w, b)
            except Exception as e:      # noqa: BLE001 - a peer failing must not end the run
                print(f"  {kind} {rows}x{width} liger alone: failed ({type(e).__name__}: {e})")

    def norm_diagnostics(self, kind, x, r, w, b, dy, dh, leaves, impls, call, step, both):
        """tilewise's backward launcher alone, and the host side of a forward+backward."""
        torch, norm = self.torch, self.norm
        rows, width = x.shape
        is_rms = kind == "rmsnorm"
        y, h, mean, rstd = norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, torch.bfloat16)
        bwd_ms = self.ms(lambda: norm._backward(dy, dh, h, w, mean, rstd, b is not None, is_rms, 0.0, 0,
                                                torch.bfloat16, torch.bfloat16))
        bwd_bytes = 4 * rows * width * x.element_size()        # read dy, dh, h; write dx (= dresidual)
        fwd_ms = self.ms(lambda: norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, torch.bfloat16))
        entry = {"op": "add_" + kind, "rows": rows, "width": width,
                 "forward_config": list(norm.forward_config(width)),
                 "backward_config": list(norm.backward_config(width)),
                 "fwd_launcher_GBps": (4 * rows * width + width) * x.element_size() / fwd_ms / 1e6,
                 "bwd_launcher_ms": bwd_ms, "bwd_launcher_GBps": bwd_bytes / bwd_ms / 1e6,
                 "bwd_launcher_frac_copy": bwd_bytes / bwd_ms / 1e6 / self.copy_gbps,
                 "tilewise_fwd_bwd_host_ms": self.host_ms(lambda: step(impls["tilewise"]), leaves),
                 "eager_fwd_bwd_host_ms": self.host_ms(lambda: step(impls["eager"]), leaves),
                 "tilewise_fwd_bwd_gpu_ms": both.get("tilewise")}
        self.results["diagnostics"]["norm"].append(entry)
        print(f"  {kind} {rows}x{width}: tilewise backward launcher {entry['bwd_launcher_GBps']:.0f} GB/s "
              f"({entry['bwd_launcher_frac_copy']:.0%} of copy), host {entry['tilewise_fwd_bwd_host_ms']:.3f} ms "
              f"a forward+backward")

    def liger_alone(self, kind, x, r, w, b):
        """Liger's norm by itself (read h, weight; write y), the figure shared/BENCH.md quotes."""
        torch = self.torch
        _, liger_ln, liger_rms = self.liger
        h = x + r
        rows, width = h.shape
        f = (lambda: liger_ln.apply(h, w, b, EPS)) if kind == "layernorm" else \
            (lambda: liger_rms.apply(h, w, EPS, 0.0, "llama", False))
        with torch.no_grad():
            ms = self.ms(f)
        gbps = (2 * rows * width + width) * h.element_size() / ms / 1e6
        self.results.setdefault("liger_norm_alone_GBps", {})[f"{kind} {rows}x{width}"] = gbps

    def add_rows(self, op, shape, fwd, both, agree, frac):
        peers = [k for k in fwd if k != "tilewise"]
        fwd_peers = [fwd[k] for k in peers if fwd[k] is not None]
        both_peers = [both[k] for k in peers if both[k] is not None]
        tw_fwd, tw_both = fwd.get("tilewise"), both.get("tilewise")
        row = {"op": op, "pass": "fwd", "shape": shape, "unit": "GB/s", **fwd,
               "ratio_best_peer": (tw_fwd / max(fwd_peers)) if tw_fwd and fwd_peers else None,
               "max_rel_err_vs_fp32": agree}
        if frac:
            row["tilewise_frac_copy"] = tw_fwd / self.copy_gbps if tw_fwd else None
            row["meets_target"] = bool(tw_fwd and tw_fwd / self.copy_gbps >= FWD_TARGET)
        self.results["rows"].append(row)
        row = {"op": op, "pass": "fwd+bwd", "shape": shape, "unit": "ms", **both,
               "ratio_best_peer": (min(both_peers) / tw_both) if tw_both and both_peers else None}
        if frac:
            row["meets_target"] = bool(row["ratio_best_peer"] and row["ratio_best_peer"] >= FWD_BWD_TARGET)
        self.results["rows"].append(row)
        self.save()

    # ---------------------------------------------------------------------------------------- activations

    def bench_activation(self, op):
        torch, F, ops = self.torch, self.F, self.ops
        g = torch.Generator(device=self.device).manual_seed(7)
        if op == "bias_gelu":
            rows, width = GELU_SHAPE
            inputs = [torch.randn(rows, width, device=self.device, generator=g).to(torch.bfloat16),
                      torch.randn(width, device=self.device, generator=g).to(torch.bfloat16)]
            out_width = width

            def eager(x, b):
                return F.gelu(x + b, approximate="tanh")
            tilewise = ops.bias_gelu
            fwd_bytes = (2 * rows * width + width) * 2
        else:
            rows, width = SWIGLU_SHAPE
            inputs = [torch.randn(rows, width, device=self.device, generator=g).to(torch.bfloat16)]
            out_width = width // 2

            def eager(gu):
                gate, up = gu.chunk(2, dim=-1)
                return F.silu(gate) * up
            tilewise = ops.swiglu
            fwd_bytes = (rows * width + rows * out_width) * 2
        dy = torch.randn(rows, out_width, device=self.device, generator=g).to(torch.bfloat16)
        leaves = [t.clone().requires_grad_() for t in inputs]
        ref_in = [t.float().requires_grad_() for t in inputs]
        ref_y = eager(*ref_in)
        ref_y.backward(dy.float())
        ref_out = [ref_y.detach()] + [t.grad for t in ref_in]
        impls = {"tilewise": tilewise, "eager": eager, "torch_compile": torch.compile(eager, dynamic=False)}
        fwd, both, agree = {}, {}, {}
        for name, f in impls.items():
            try:
                for t in leaves:
                    t.grad = None
                y = f(*leaves)
                y.backward(dy)
                agree[name] = max(self.rel(a, e) for a, e in zip([y.detach()] + [t.grad for t in leaves], ref_out))
                del y
                if agree[name] > AGREE_TOL:
                    print(f"  {op} {name}: DISAGREES with the fp32 reference ({agree[name]:.2e}); not timed")
                    fwd[name] = both[name] = None
                    continue
                fwd[name] = fwd_bytes / self.ms(lambda: f(*leaves)) / 1e6
                both[name] = self.ms(lambda: f(*leaves).backward(dy), grad_to_none=leaves)
            except Exception as e:      # noqa: BLE001
                print(f"  {op} {name}: failed ({type(e).__name__}: {e})")
                fwd[name] = both[name] = agree[name] = None
        shape = {"rows": rows, "width": width, "dtype": "bf16"}
        self.add_rows(op, shape, fwd, both, agree, frac=False)
        self.results["rows"][-2]["tilewise_frac_copy"] = (fwd["tilewise"] / self.copy_gbps
                                                           if fwd.get("tilewise") else None)
        try:
            act = self.activation
            if op == "bias_gelu":
                x, b = inputs
                bwd = lambda: act._bias_gelu_backward(dy, x, b)          # noqa: E731
                bwd_bytes = 3 * rows * width * 2                         # read dy, x; write dx
            else:
                bwd = lambda: act._swiglu_backward(dy, inputs[0])        # noqa: E731
                bwd_bytes = (rows * out_width + 2 * rows * width) * 2    # read dy, gate_up; write dgate_up
            bwd_ms = self.ms(bwd)
            entry = {"op": op, "rows": rows, "width": width, "bwd_launcher_ms": bwd_ms,
                     "bwd_launcher_GBps": bwd_bytes / bwd_ms / 1e6,
                     "bwd_launcher_frac_copy": bwd_bytes / bwd_ms / 1e6 / self.copy_gbps,
                     "tilewise_fwd_bwd_host_ms": self.host_ms(lambda: tilewise(*leaves).backward(dy), leaves)}
            self.results["diagnostics"]["activation"].append(entry)
            print(f"  {op}: tilewise backward launcher {entry['bwd_launcher_GBps']:.0f} GB/s "
                  f"({entry['bwd_launcher_frac_copy']:.0%} of copy), host {entry['tilewise_fwd_bwd_host_ms']:.3f} "
                  f"ms a forward+backward")
        except Exception as e:      # noqa: BLE001 - diagnostics never end the run
            print(f"  {op} diagnostics: failed ({type(e).__name__}: {e})")

    # ---------------------------------------------------------------------------------------- config sweep

    def candidates(self, cfg):
        """The default and its neighbours: pipeline stages, warps (elements a thread), rows a tile at the
        same elements a thread, and for wide rows the chunked kernels (and the other way round)."""
        C = self.norm.Config
        out = [cfg]
        for stages in (2, 3, 4, 5):
            out.append(cfg._replace(num_stages=stages))
        if cfg.num_warps < 32:
            out.append(cfg._replace(num_warps=cfg.num_warps * 2))
        if cfg.num_warps > 1:
            out.append(cfg._replace(num_warps=cfg.num_warps // 2))
        if not cfg.chunked:
            if cfg.num_warps < 32:
                out.append(cfg._replace(block_m=cfg.block_m * 2, num_warps=cfg.num_warps * 2))
            if cfg.block_m > 1:
                out.append(cfg._replace(block_m=cfg.block_m // 2, num_warps=max(1, cfg.num_warps // 2)))
            if cfg.block_n >= 4096:
                out.append(C(1, 2048, 8, True, 3))
        else:
            out.append(cfg._replace(block_n=cfg.block_n * 2, num_warps=min(32, cfg.num_warps * 2)))
        return list(dict.fromkeys(out))

    def sweep(self, kind, rows, width):
        torch, norm = self.torch, self.norm
        is_rms = kind == "rmsnorm"
        g = torch.Generator(device=self.device).manual_seed(1)
        mk = lambda *s: torch.randn(*s, device=self.device, generator=g).to(torch.bfloat16)    # noqa: E731
        x, r, w, b = mk(rows, width), mk(rows, width), mk(width), (None if is_rms else mk(width))
        dy, dh = mk(rows, width), mk(rows, width)
        y0, h, mean, rstd = norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, torch.bfloat16)
        dx0 = norm._backward(dy, dh, h, w, mean, rstd, b is not None, is_rms, 0.0, 0, torch.bfloat16,
                             torch.bfloat16)[0]
        fwd_bytes = (4 * rows * width + width) * 2
        bwd_bytes = 4 * rows * width * 2        # read dy, dh, h; write dx (shared with dresidual)
        for pass_, default, fn, nbytes, ref in (
                ("fwd", norm.forward_config(width),
                 lambda c: norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, torch.bfloat16, c), fwd_bytes, y0),
                ("bwd", norm.backward_config(width),
                 lambda c: norm._backward(dy, dh, h, w, mean, rstd, b is not None, is_rms, 0.0, 0,
                                          torch.bfloat16, torch.bfloat16, c), bwd_bytes, dx0)):
            for cfg in self.candidates(default):
                if self.elapsed() > self.args.budget_s:
                    return False
                entry = {"kind": kind, "rows": rows, "width": width, "pass": pass_, "config": list(cfg),
                         "default": cfg == default}
                try:
                    err = self.rel(fn(cfg)[0], ref)     # every config computes the default's result
                    if err > 1e-2:
                        entry["error"] = f"result differs from the default config's: {err:.2e}"
                    else:
                        ms = self.ms(lambda: fn(cfg))
                        entry.update(ms=ms, GBps=nbytes / ms / 1e6)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile
                    entry["error"] = f"{type(e).__name__}: {e}"[:200]
                self.results["sweep"].append(entry)
        self.save()
        return True

    # ---------------------------------------------------------------------------------------------- run

    def launches(self):
        """Programs an SM that each persistent launch used, and what the device compiled."""
        norm, act = self.norm, self.activation
        names = {id(norm._fwd_kernel): "norm fwd", id(norm._bwd_kernel): "norm bwd",
                 id(act._bias_gelu_bwd_kernel): "bias_gelu bwd"}
        out = []
        for key, per_sm in norm._RESIDENT.items():
            info = norm._RESIDENT_INFO.get(key, {})
            out.append({"kernel": names.get(key[0], "?"), "meta": dict(key[2]), "programs_per_sm": per_sm,
                        **info})
        return out

    def run(self):
        self.copy_bandwidth()
        shapes = QUICK_NORM_SHAPES if self.args.quick else NORM_SHAPES
        for kind in ("layernorm", "rmsnorm"):
            for rows, width in shapes:
                self.bench_norm(kind, rows, width)
                print(f"  add+{kind} {rows}x{width} done at {self.elapsed():.0f} s")
        for op in ("bias_gelu", "swiglu"):
            self.bench_activation(op)
        print(f"  activations done at {self.elapsed():.0f} s")
        self.results["diagnostics"]["launches"] = self.launches()
        plan = [(kind, rows, width) for kind in ("layernorm", "rmsnorm") for rows, width in shapes]
        done = all(self.sweep(*job) for job in (plan[:1] if self.args.smoke else plan))
        self.results["sweep_complete"] = done
        self.results["wall_s"] = self.elapsed()
        self.save()
        self.print_table()

    def print_table(self):
        cols = ["tilewise", "eager", "torch_compile", "liger"]
        print()
        print("sweep (best config per shape and pass; default marked *):")
        best = {}
        for e in self.results["sweep"]:
            if "ms" in e:
                key = (e["kind"], e["rows"], e["width"], e["pass"])
                if key not in best or e["ms"] < best[key]["ms"]:
                    best[key] = e
        for (kind, rows, width, pass_), e in best.items():
            default = next((d for d in self.results["sweep"] if d.get("default") and "ms" in d
                            and (d["kind"], d["rows"], d["width"], d["pass"]) == (kind, rows, width, pass_)), None)
            gain = default["ms"] / e["ms"] if default else float("nan")
            print(f"  {kind:9s} {rows:6d}x{width:<5d} {pass_:3s} best {e['config']}{'*' if e['default'] else ''}"
                  f" {e['GBps']:6.0f} GB/s ({gain:.2f}x the default)")
        print()
        print("tilewise launchers alone (bwd: read dy, dh, h; write dx) and host time of a forward+backward:")
        for d in self.results["diagnostics"]["norm"] + self.results["diagnostics"]["activation"]:
            print(f"  {d['op']:14s} {d['rows']}x{d['width']}: bwd {d['bwd_launcher_GBps']:6.0f} GB/s "
                  f"({d['bwd_launcher_frac_copy']:.0%} of copy), host {d['tilewise_fwd_bwd_host_ms']:.3f} ms")
        print()
        print(f"copy bandwidth {self.copy_gbps:.0f} GB/s; {self.results['gpu']}, torch {self.results['torch']}, "
              f"triton {self.results['triton']}, commit {self.results['commit'][:10]}")
        head = f"{'op':14s} {'shape':12s} {'pass':7s} {'unit':5s} " + " ".join(f"{c:>13s}" for c in cols) + \
            f" {'ratio':>6s} {'of copy':>7s} {'target':>6s}"
        print(head)
        print("-" * len(head))

        def num(v, spec, width):
            return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(width)
        for row in self.results["rows"]:
            shape = f"{row['shape']['rows']}x{row['shape']['width']}"
            target = row.get("meets_target")
            print(f"{row['op']:14s} {shape:12s} {row['pass']:7s} {row['unit']:5s} "
                  + " ".join(num(row.get(c), "13.3f" if row["unit"] == "ms" else "13.0f", 13) for c in cols)
                  + f" {num(row.get('ratio_best_peer'), '6.2f', 6)} {num(row.get('tilewise_frac_copy'), '7.1%', 7)}"
                  + f" {('yes' if target else 'NO') if target is not None else '':>6s}")


if __name__ == "__main__":
    sys.exit(main())
