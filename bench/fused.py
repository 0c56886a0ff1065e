"""Fused memory-bound kernels against their peers, in one process on the same inputs (shared/BENCH.md).

- The device-to-device copy bandwidth, y.copy_(x) of 2 GiB bf16 (bytes read + written): the yardstick.
- add + LayerNorm/RMSNorm, bf16, (rows, width) = (16384, 4096), (32768, 1024), (8192, 8192), (65536, 768):
  forward GB/s (bytes = read x, residual, weight; write y, h) and its fraction of the copy bandwidth, and
  forward+backward time for tilewise, eager PyTorch (x + residual, then F.layer_norm / F.rms_norm),
  torch.compile of that, and eager add + Liger Kernel's LayerNorm/RMSNorm (null where liger_kernel is not
  importable). Targets (issue 4): forward >= 85% of copy, forward+backward >= 1.1x the fastest peer, both
  timed with triton.testing.do_bench (the host's time included, as a training step pays it).
- bias + GELU (16384, 3072) and SwiGLU (16384, 2 x 8192): forward GB/s and forward+backward time against
  eager and torch.compile.
- Beside each do_bench figure, `<name>_graph`: the same call timed by do_bench_cudagraph, GPU time only (a
  diagnostic: where it beats the do_bench figure by much, the host limits); and tilewise_host_us, the host
  time of one tilewise call (queued without waiting for the GPU).
- A sweep of the norm launch configs around norm.py's table: the default's neighbours (pipeline stages,
  warps, rows a tile, persistent or one program a tile, chunked), timed GPU-only, while time remains. With
  --sweep: every shape, both kinds, forward and backward, and a second round around each first round's
  best; it prints the best configs in the format of norm.py's _CONFIGS table, ready to paste.
- --model-sweep, alone: the same sweep for the norms as the model runs them (an fp32 residual stream, bf16 x
  and y, fp32 weight, bias and x_bias; LayerNorm) at the e2e shapes (32768 x 768, 16384 x 2048), two rounds;
  it prints entries for norm.py's _FP32_STREAM_CONFIGS and writes fused_model_sweep.json, not fused.json.

Forward+backward, the same for every implementation: a fresh forward, then one autograd.backward from the
same upstream gradients of y AND h (the next block consumes h, so its gradient flows in too), into leaves
x, residual, weight (and bias), all of which get gradients; .grad is reset to None before each call
(grad_to_none), so no implementation pays an accumulation the others skip. Every implementation's outputs
and gradients are checked against an fp32 eager reference before it is timed; a disagreement is recorded
and printed, and its timing kept out of the ratios.

Diagnostics (in the JSON under "diagnostics", not in the table): tilewise's launchers timed alone, the host
time of one forward+backward of tilewise and of eager, the programs an SM each persistent launch used with
the compiled kernel's registers and shared memory, and how many launches took FastLauncher's direct path.

Run on the GPU machine: PYTHONPATH=src python3 bench/fused.py [--quick] [--sweep] [--out DIR]
Writes bench/results/fused.json (and DIR/fused.json); the table is printed last.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from common import RESULTS, allocator_counts, git_commit, write_result

NORM_SHAPES = [(16384, 4096), (32768, 1024), (8192, 8192), (65536, 768)]
MODEL_NORM_SHAPES = [(32768, 768), (16384, 2048)]      # the e2e steps' norms: GPT-2 124M and the 1.3B preset
QUICK_NORM_SHAPES = NORM_SHAPES
GELU_SHAPE = (16384, 3072)
SWIGLU_SHAPE = (16384, 2 * 8192)
EPS = 1e-5
AGREE_TOL = 2e-2          # relative error norm against the fp32 reference; bf16 results sit near 4e-3
FWD_TARGET, FWD_BWD_TARGET = 0.85, 1.1
CONTESTANTS = ["tilewise", "eager", "torch_compile", "liger"]
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also write fused.json into this directory")
    ap.add_argument("--quick", action="store_true", help="a shorter light sweep (the same shapes)")
    ap.add_argument("--sweep", action="store_true",
                    help="the full config sweep: every shape, both kinds, both passes, two rounds")
    ap.add_argument("--model-sweep", action="store_true",
                    help="only the config sweep of the model's norms (fp32 residual stream, x_bias) at the e2e "
                         "shapes; writes fused_model_sweep.json")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no config-sweep work after this many seconds of the run (default 500 with "
                         "--sweep, else 150, 100 with --quick)")
    ap.add_argument("--smoke", action="store_true",
                    help="check this script without a GPU: tiny shapes on CPU through the Triton interpreter, "
                         "host timer; writes nothing under bench/results")
    args = ap.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 500.0 if args.sweep or args.model_sweep else 100.0 if args.quick else 150.0
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported
        os.environ["TILEWISE_OPS"] = "triton"       # the kernels on CPU tensors, not the references
        global NORM_SHAPES, QUICK_NORM_SHAPES, MODEL_NORM_SHAPES, GELU_SHAPE, SWIGLU_SHAPE
        NORM_SHAPES = QUICK_NORM_SHAPES = [(64, 96), (6, 20000)]
        MODEL_NORM_SHAPES = [(16, 768)]
        GELU_SHAPE, SWIGLU_SHAPE = (64, 80), (64, 160)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("bench/fused.py: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    Bench(args).run()
    return 0


def sweep_rows(entries: list) -> list:
    """A table row per (kind, shape, pass) of a sweep: the default config's GB/s and the fastest config's."""
    rows = {}
    for e in entries:
        if "ms" not in e:
            continue
        key = (e["kind"], e["rows"], e["width"], e["pass"])
        row = rows.setdefault(key, {"op": f"add_{e['kind']}", "pass": e["pass"],
                                    "shape": {"rows": e["rows"], "width": e["width"], "stream": e.get("stream")},
                                    "unit": "GB/s", "default_config": None, "default": None, "best_config": None,
                                    "best": 0.0})
        if e["default"]:
            row["default_config"], row["default"] = e["config"], e["GBps"]
        if e["GBps"] > row["best"]:
            row["best_config"], row["best"] = e["config"], e["GBps"]
    for row in rows.values():
        row["best_x_default"] = row["best"] / row["default"] if row["default"] else None
    return list(rows.values())


class Bench:
    def __init__(self, args):
        import torch
        import triton
        import torch.nn.functional as F
        from tilewise import ops
        from tilewise.ops import activation, launch, norm
        self.torch, self.triton, self.F, self.ops = torch, triton, F, ops
        self.norm, self.activation, self.launch = norm, activation, launch
        self.args = args
        self.t0 = time.time()
        self.device = "cpu" if args.smoke else "cuda"
        for name in ("recompile_limit", "cache_size_limit"):  # a recompile per shape; never fall back to eager
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        self.liger = self._import_liger()
        command = "PYTHONPATH=src python3 bench/fused.py" + (" --quick" if args.quick else "") + \
            (" --sweep" if args.sweep else "") + (" --model-sweep" if args.model_sweep else "")
        self.name = "fused_model_sweep.json" if args.model_sweep else "fused.json"
        self.results = {
            "area": "fused", "gpu": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "commit": git_commit(),
            "date": datetime.date.today().isoformat(),
            "peers": {"liger_kernel": self.liger[0] if self.liger else None},
            "notes": "fwd rows: GB/s (higher is better), ratio_best_peer = tilewise / best peer; fwd+bwd rows: "
                     "ms (lower is better), ratio_best_peer = best peer ms / tilewise ms; both from do_bench "
                     "(host included). <name>_graph: do_bench_cudagraph, GPU time only. tilewise_host_us: host "
                     "time of one tilewise call. bytes = every input read once + every output written once. "
                     "fwd+bwd: backward from the gradients of y and h into x, residual, weight and bias.",
            "command": command,
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
        """do_bench: each call's GPU span, with the L2 flushed before it; a host slower than the GPU shows."""
        if self.args.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return self.triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                            return_mode="median")

    def ms_calling_thread(self, fn, grad_to_none=None):
        """ms, with the backward on the calling thread instead of autograd's device worker thread (as the
        tilewise trainer runs it): the same for every contestant, a diagnostic beside the protocol's figure."""
        with self.torch.autograd.set_multithreading_enabled(False):
            return self.ms(fn, grad_to_none)

    def graph_ms(self, fn, grad_to_none=None):
        """do_bench_cudagraph: the calls captured in a CUDA graph and replayed, GPU time only; None when the
        call cannot be captured."""
        if self.args.smoke:
            return self.ms(fn)
        try:
            return self.triton.testing.do_bench_cudagraph(fn, rep=20, grad_to_none=grad_to_none,
                                                          return_mode="median")
        except Exception as e:      # noqa: BLE001 - a peer that cannot be captured gets no graph figure
            print(f"    (no CUDA graph figure: {type(e).__name__}: {str(e)[:120]})")
            return None

    def host_us(self, fn, leaves=(), n=20):
        """Host time of one call, queued without waiting for the GPU: the launch and autograd overhead."""
        torch = self.torch
        n = 1 if self.args.smoke else n
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        fn()
        sync()
        total = 0.0
        for _ in range(n):
            for t in leaves:
                t.grad = None
            start = time.perf_counter()
            fn()
            total += time.perf_counter() - start
        sync()
        return total / n * 1e6

    def elapsed(self):
        return time.time() - self.t0

    def save(self):
        write_result(self.results, self.name, [None if self.args.smoke else RESULTS, self.args.out], default=str)

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
        fwd, both, both_ct, fwd_graph, both_graph, agree = {}, {}, {}, {}, {}, {}
        for name, f in impls.items():
            fwd_graph[name] = both_graph[name] = None
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
                fwd[name] = nbytes / self.ms(lambda: call(f)) / 1e6
                both[name] = self.ms(lambda: step(f), grad_to_none=leaves)
                both_ct[name] = self.ms_calling_thread(lambda: step(f), grad_to_none=leaves)
                graph = self.graph_ms(lambda: call(f))
                fwd_graph[name] = nbytes / graph / 1e6 if graph else None
                both_graph[name] = self.graph_ms(lambda: step(f), grad_to_none=leaves)
            except Exception as e:      # noqa: BLE001 - a peer failing must not end the run
                print(f"  {kind} {rows}x{width} {name}: failed ({type(e).__name__}: {e})")
                fwd[name] = both[name] = agree[name] = None
        host = {"fwd": self.host_us(lambda: call(impls["tilewise"])),
                "fwd+bwd": self.host_us(lambda: step(impls["tilewise"]), leaves)}
        shape = {"rows": rows, "width": width, "dtype": "bf16", "bias": b is not None}
        self.add_rows("add_" + kind, shape, fwd, both, both_ct, agree, fwd_graph, both_graph, host, frac=True)
        try:
            self.norm_diagnostics(kind, x, r, w, b, dy, dh, leaves, impls, step, both)
        except Exception as e:      # noqa: BLE001 - diagnostics never end the run
            print(f"  {kind} {rows}x{width} diagnostics: failed ({type(e).__name__}: {e})")
        if self.liger:
            try:
                self.liger_alone(kind, x, r, w, b)
            except Exception as e:      # noqa: BLE001 - a peer failing must not end the run
                print(f"  {kind} {rows}x{width} liger alone: failed ({type(e).__name__}: {e})")

    def norm_diagnostics(self, kind, x, r, w, b, dy, dh, leaves, impls, step, both):
        """tilewise's launchers alone (do_bench and GPU-only), and the host side of a forward+backward."""
        torch, norm = self.torch, self.norm
        rows, width = x.shape
        is_rms = kind == "rmsnorm"
        bias_dtype = None if b is None else b.dtype
        y, h, stats = norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, torch.bfloat16)

        def fwd():
            return norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, torch.bfloat16)

        def bwd():
            return norm._backward(dy, dh, h, w, stats, is_rms, 0.0, 0, torch.bfloat16, torch.bfloat16, bias_dtype)
        fwd_bytes = (4 * rows * width + width) * x.element_size()
        bwd_bytes = 4 * rows * width * x.element_size()        # read dy, dh, h; write dx (= dresidual)
        # the public op's forward timed again here (is the row's figure an effect of being timed first?) and
        # without autograd (what the graph's building and freeing cost), with the allocator's device calls
        public = (lambda: impls["tilewise"](*leaves)) if b is not None else (lambda: impls["tilewise"](*leaves, None))
        before = allocator_counts() if not self.args.smoke else None
        public_ms = self.ms(public)
        public_alloc = allocator_counts(before) if before is not None else None
        with torch.no_grad():
            public_no_grad_ms = self.ms(public)
        bwd_ms, bwd_graph = self.ms(bwd), self.graph_ms(bwd)
        fwd_graph = self.graph_ms(fwd)
        sums_us = None
        plans = [plan for key, plan in norm._PLANS.items() if key[0] is False and key[2:4] == (width, is_rms)]
        if plans:      # the dweight/dbias sums alone, over as many partial rows as the backward writes
            programs = norm.launch_programs(plans[0].per_wave, plans[0].cfg.waves, -(-rows // plans[0].cfg.block_m))
            part = torch.randn(2, programs, width, device=x.device)
            dw, db = torch.empty_like(w), torch.empty_like(w)
            sums_ms = self.graph_ms(lambda: norm.sum_partials(part, programs, dw, None if b is None else db))
            sums_us = sums_ms * 1e3 if sums_ms else None
        entry = {"op": "add_" + kind, "rows": rows, "width": width, "sums_kernel_us": sums_us,
                 "forward_config": list(norm.forward_config(width, is_rms)),
                 "backward_config": list(norm.backward_config(width, is_rms)),
                 "fwd_launcher_GBps": fwd_bytes / self.ms(fwd) / 1e6,
                 "fwd_launcher_graph_GBps": fwd_bytes / fwd_graph / 1e6 if fwd_graph else None,
                 "fwd_public_again_GBps": fwd_bytes / public_ms / 1e6,
                 "fwd_public_no_grad_GBps": fwd_bytes / public_no_grad_ms / 1e6,
                 "allocator_during_fwd_public": public_alloc,
                 "bwd_launcher_ms": bwd_ms, "bwd_launcher_GBps": bwd_bytes / bwd_ms / 1e6,
                 "bwd_launcher_graph_GBps": bwd_bytes / bwd_graph / 1e6 if bwd_graph else None,
                 "bwd_launcher_frac_copy": bwd_bytes / (bwd_graph or bwd_ms) / 1e6 / self.copy_gbps,
                 "tilewise_fwd_bwd_host_ms": self.host_us(lambda: step(impls["tilewise"]), leaves) / 1e3,
                 "eager_fwd_bwd_host_ms": self.host_us(lambda: step(impls["eager"]), leaves) / 1e3,
                 "tilewise_fwd_bwd_ms": both.get("tilewise")}
        self.results["diagnostics"]["norm"].append(entry)
        print(f"  {kind} {rows}x{width}: launchers alone, GPU only: fwd "
              f"{entry['fwd_launcher_graph_GBps'] or 0:.0f} GB/s, bwd {entry['bwd_launcher_graph_GBps'] or 0:.0f} "
              f"GB/s (dweight/dbias sums {sums_us or 0:.1f} us of it); host "
              f"{entry['tilewise_fwd_bwd_host_ms'] * 1e3:.0f} us a forward+backward (eager "
              f"{entry['eager_fwd_bwd_host_ms'] * 1e3:.0f} us)")

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

    def add_rows(self, op, shape, fwd, both, both_ct, agree, fwd_graph, both_graph, host, frac):
        peers = [k for k in CONTESTANTS if k != "tilewise"]
        fwd_peers = [fwd[k] for k in peers if fwd.get(k) is not None]
        both_peers = [both[k] for k in peers if both.get(k) is not None]
        tw_fwd, tw_both = fwd.get("tilewise"), both.get("tilewise")
        row = {"op": op, "pass": "fwd", "shape": shape, "unit": "GB/s", **{k: fwd.get(k) for k in CONTESTANTS},
               "ratio_best_peer": (tw_fwd / max(fwd_peers)) if tw_fwd and fwd_peers else None}
        if frac:
            row["tilewise_frac_copy"] = tw_fwd / self.copy_gbps if tw_fwd else None
            row["meets_target"] = bool(tw_fwd and tw_fwd / self.copy_gbps >= FWD_TARGET)
        row.update({f"{k}_graph": fwd_graph.get(k) for k in CONTESTANTS})
        row["tilewise_host_us"] = host["fwd"]
        row["max_rel_err_vs_fp32"] = agree
        self.results["rows"].append(row)
        row = {"op": op, "pass": "fwd+bwd", "shape": shape, "unit": "ms", **{k: both.get(k) for k in CONTESTANTS},
               "ratio_best_peer": (min(both_peers) / tw_both) if tw_both and both_peers else None}
        if frac:
            row["meets_target"] = bool(row["ratio_best_peer"] and row["ratio_best_peer"] >= FWD_BWD_TARGET)
        row.update({f"{k}_graph": both_graph.get(k) for k in CONTESTANTS})
        row["tilewise_host_us"] = host["fwd+bwd"]
        ct_peers = [both_ct[k] for k in peers if both_ct.get(k) is not None]
        tw_ct = both_ct.get("tilewise")
        row["tilewise_calling_thread"] = tw_ct
        row["ratio_best_peer_calling_thread"] = (min(ct_peers) / tw_ct) if tw_ct and ct_peers else None
        row["calling_thread_ms"] = dict(both_ct)
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
        fwd, both, both_ct, fwd_graph, both_graph, agree = {}, {}, {}, {}, {}, {}
        for name, f in impls.items():
            fwd_graph[name] = both_graph[name] = None
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
                both_ct[name] = self.ms_calling_thread(lambda: f(*leaves).backward(dy), grad_to_none=leaves)
                graph = self.graph_ms(lambda: f(*leaves))
                fwd_graph[name] = fwd_bytes / graph / 1e6 if graph else None
                both_graph[name] = self.graph_ms(lambda: f(*leaves).backward(dy), grad_to_none=leaves)
            except Exception as e:      # noqa: BLE001
                print(f"  {op} {name}: failed ({type(e).__name__}: {e})")
                fwd[name] = both[name] = agree[name] = None
        host = {"fwd": self.host_us(lambda: tilewise(*leaves)),
                "fwd+bwd": self.host_us(lambda: tilewise(*leaves).backward(dy), leaves)}
        shape = {"rows": rows, "width": width, "dtype": "bf16"}
        self.add_rows(op, shape, fwd, both, both_ct, agree, fwd_graph, both_graph, host, frac=False)
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
            bwd_ms, bwd_graph = self.ms(bwd), self.graph_ms(bwd)
            entry = {"op": op, "rows": rows, "width": width, "bwd_launcher_ms": bwd_ms,
                     "bwd_launcher_GBps": bwd_bytes / bwd_ms / 1e6,
                     "bwd_launcher_graph_GBps": bwd_bytes / bwd_graph / 1e6 if bwd_graph else None,
                     "bwd_launcher_frac_copy": bwd_bytes / (bwd_graph or bwd_ms) / 1e6 / self.copy_gbps,
                     "tilewise_fwd_bwd_host_ms": host["fwd+bwd"] / 1e3}
            self.results["diagnostics"]["activation"].append(entry)
            print(f"  {op}: tilewise backward launcher {entry['bwd_launcher_frac_copy']:.0%} of copy (GPU only), "
                  f"host {host['fwd+bwd']:.0f} us a forward+backward")
        except Exception as e:      # noqa: BLE001 - diagnostics never end the run
            print(f"  {op} diagnostics: failed ({type(e).__name__}: {e})")

    # ---------------------------------------------------------------------------------------- config sweep

    def candidates(self, cfg, rows, width, pass_):
        """cfg's neighbours: pipeline stages, warps (elements a thread), rows a tile (at the same, twice and
        half the elements a thread), persistent in one or two waves or one program a tile, and the chunked kernels
        for wide rows (or, when chunked, other chunk widths)."""
        C = self.norm.Config
        out = [cfg._replace(num_stages=s) for s in (2, 3, 4, 5)]
        out += [cfg._replace(num_warps=w) for w in (cfg.num_warps // 2, cfg.num_warps * 2)]
        if cfg.chunked:
            out += [cfg._replace(block_n=cfg.block_n * 2, num_warps=cfg.num_warps * 2),
                    cfg._replace(block_n=cfg.block_n // 2, num_warps=cfg.num_warps // 2)]
        else:
            out += [cfg._replace(block_m=cfg.block_m * 2, num_warps=cfg.num_warps * 2),
                    cfg._replace(block_m=cfg.block_m * 2),
                    cfg._replace(block_m=cfg.block_m // 2, num_warps=cfg.num_warps // 2),
                    cfg._replace(block_m=cfg.block_m // 2)]
            out += [cfg._replace(waves=w) for w in (0, 1, 2)]
            if width >= 4096:
                out.append(C(1, 2048, 8, True, 3))

        def valid(c):
            if not (1 <= c.num_warps <= 32 and c.block_m >= 1 and c.block_n >= 64):
                return False
            per_thread = c.block_m * c.block_n / (32 * c.num_warps)
            if not c.chunked and not (1 <= per_thread <= 32 and c.block_n >= width):
                return False
            # one program a tile in the backward: that many fp32 partial rows (twice, with a bias)
            return not (pass_ == "bwd" and c.waves == 0 and -(-rows // c.block_m) * width * 8 > (1 << 30))
        return [c for c in dict.fromkeys(out) if c != cfg and valid(c)]

    def sweep(self, kind, rows, width, rounds, model=False):
        """Each pass's default config and its neighbours (and, with rounds=2, the best one's neighbours),
        GPU-only times; every config must reproduce the default's result. False when out of time. model: the
        norm as the model runs it (fp32 residual stream and parameters, an fp32 x_bias, bf16 x and y)."""
        torch, norm = self.torch, self.norm
        is_rms = kind == "rmsnorm"
        g = torch.Generator(device=self.device).manual_seed(1)
        wide = torch.float32 if model else torch.bfloat16       # the residual stream's and parameters' dtype
        mk = lambda *s, t=torch.bfloat16: torch.randn(*s, device=self.device, generator=g).to(t)    # noqa: E731
        x, r, w = mk(rows, width), mk(rows, width, t=wide), mk(width, t=wide)
        b = None if is_rms else mk(width, t=wide)
        xb = mk(width, t=wide) if model else None
        bias_dtype, xb_dtype = (None if b is None else b.dtype), (None if xb is None else xb.dtype)
        dy, dh = mk(rows, width), mk(rows, width, t=wide)
        y0, h, stats = norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, wide, x_bias=xb)
        bwd0 = norm._backward(dy, dh, h, w, stats, is_rms, 0.0, 0, torch.bfloat16, wide, bias_dtype,
                              xb_dtype=xb_dtype)
        n = rows * width
        if model:       # fwd: x (2), r (4) in; y (2), h (4) out. bwd: dy (2), dh (4), h (4) in; dx (2), dr (4)
            fwd_bytes, bwd_bytes = 12 * n, 16 * n
        else:
            fwd_bytes = (4 * n + width) * 2
            bwd_bytes = 4 * n * 2        # read dy, dh, h; write dx (shared with dresidual)
        passes = (
            ("fwd", norm.forward_config(width, is_rms, model), fwd_bytes, (y0, h),
             lambda c: norm._forward(x, r, w, b, is_rms, EPS, 0.0, 0, wide, c, x_bias=xb)[:2]),
            ("bwd", norm.backward_config(width, is_rms, model), bwd_bytes, (bwd0[0], bwd0[2]),
             lambda c: (lambda o: (o[0], o[2]))(norm._backward(dy, dh, h, w, stats, is_rms, 0.0, 0, torch.bfloat16,
                                                                wide, bias_dtype, cfg=c, xb_dtype=xb_dtype))))
        for pass_, default, nbytes, ref, fn in passes:
            measured = {}

            def measure(cfg, default=default, nbytes=nbytes, ref=ref, fn=fn, pass_=pass_):
                entry = {"kind": kind, "rows": rows, "width": width, "pass": pass_, "config": list(cfg),
                         "default": cfg == default, "stream": "fp32" if model else "bf16"}
                try:
                    err = max(self.rel(a, e) for a, e in zip(fn(cfg), ref))    # the default's result
                    if err > 1e-2:
                        entry["error"] = f"result differs from the default config's: {err:.2e}"
                    else:
                        ms = self.graph_ms(lambda: fn(cfg)) or self.ms(lambda: fn(cfg))
                        entry.update(ms=ms, GBps=nbytes / ms / 1e6)
                        measured[cfg] = ms
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a large tile
                    entry["error"] = f"{type(e).__name__}: {e}"[:200]
                self.results["sweep"].append(entry)

            measure(default)
            for round_ in range(rounds):
                best = min(measured, key=measured.get) if measured else default
                if round_ and best == default:
                    break
                for cfg in self.candidates(best, rows, width, pass_):
                    if cfg in measured:
                        continue
                    if self.elapsed() > self.args.budget_s:
                        self.save()
                        return False
                    measure(cfg)
            if measured and default in measured:
                best = min(measured, key=measured.get)
                print(f"  sweep {kind} {rows}x{width} {pass_}: best {self.compact(best)} "
                      f"{nbytes / measured[best] / 1e6:.0f} GB/s, {measured[default] / measured[best]:.2f}x the "
                      f"default {self.compact(default)}", flush=True)
        self.save()
        return True

    @staticmethod
    def compact(cfg):
        return "Config(" + ", ".join(str(v) for v in cfg) + ")"

    def best_configs(self):
        """{(kind, width, pass): (best config, GB/s, gain over the default)} from the sweep entries."""
        best, default = {}, {}
        for e in self.results["sweep"]:
            if "ms" not in e:
                continue
            key = (e["kind"], e["width"], e["pass"])
            if e["default"]:
                default[key] = e["ms"]
            if key not in best or e["ms"] < best[key]["ms"]:
                best[key] = e
        return {k: (self.norm.Config(*e["config"]), e["GBps"], default.get(k, float("nan")) / e["ms"])
                for k, e in best.items()}

    def print_config_table(self):
        """The sweep's best configs as entries of norm.py's _CONFIGS (LayerNorm) and _RMS_CONFIGS."""
        best = self.best_configs()
        if not best:
            return
        print()
        print("sweep: best configs per width, in norm.py's table format (paste into _CONFIGS / _RMS_CONFIGS):")
        widths = sorted({w for _, w, _ in best})
        tables = [("layernorm", "_FP32_STREAM_CONFIGS")] if self.args.model_sweep else \
            [("layernorm", "_CONFIGS"), ("rmsnorm", "_RMS_CONFIGS")]
        for kind, table in tables:
            print(f"  {table}:")
            for width in widths:
                pair = [best.get((kind, width, p)) for p in ("fwd", "bwd")]
                if None in pair:
                    continue
                if kind == "rmsnorm" and all(best.get(("layernorm", width, p), (None,))[0] == c[0]
                                             for p, c in zip(("fwd", "bwd"), pair)):
                    continue        # the same as LayerNorm's: no RMSNorm entry needed
                print(f"    {width}: ({self.compact(pair[0][0])}, {self.compact(pair[1][0])}),"
                      f"    # fwd {pair[0][1]:.0f} GB/s ({pair[0][2]:.2f}x the default), "
                      f"bwd {pair[1][1]:.0f} GB/s ({pair[1][2]:.2f}x)")

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

    def fast_launch_counts(self):
        """Per launcher: launches that took FastLauncher's direct path, and Triton's normal one."""
        out = {}
        for module in (self.norm, self.activation):
            for name, value in vars(module).items():
                if isinstance(value, self.launch.FastLauncher):
                    out[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = {
                        "fast": value.fast_launches, "normal": value.normal_launches}
        return out

    def run(self):
        self.copy_bandwidth()
        if self.args.model_sweep:
            self.results["area"] = "fused_model_sweep"
            done = all(self.sweep("layernorm", rows, width, 2, model=True) for rows, width in MODEL_NORM_SHAPES)
            self.results["rows"] = sweep_rows(self.results["sweep"])
            self.results["sweep_complete"] = done
            self.results["wall_s"] = self.elapsed()
            self.save()
            self.print_config_table()
            return
        shapes = QUICK_NORM_SHAPES if self.args.quick else NORM_SHAPES
        for kind in ("layernorm", "rmsnorm"):
            for rows, width in shapes:
                self.bench_norm(kind, rows, width)
                print(f"  add+{kind} {rows}x{width} done at {self.elapsed():.0f} s", flush=True)
        for op in ("bias_gelu", "swiglu"):
            self.bench_activation(op)
        print(f"  activations done at {self.elapsed():.0f} s")
        self.results["diagnostics"]["launches"] = self.launches()
        self.results["diagnostics"]["fast_launch"] = self.fast_launch_counts()
        self.save()
        plan = [(kind, rows, width) for kind in ("layernorm", "rmsnorm") for rows, width in shapes]
        rounds = 2 if self.args.sweep else 1
        done = all(self.sweep(*job, rounds) for job in (plan[:1] if self.args.smoke else plan))
        self.results["sweep_complete"] = done
        self.results["wall_s"] = self.elapsed()
        self.save()
        self.print_table()

    def print_table(self):
        self.print_config_table()
        print()
        print("tilewise launchers alone, GPU only (bwd: read dy, dh, h; write dx), and host time of a "
              "forward+backward:")
        for d in self.results["diagnostics"]["norm"] + self.results["diagnostics"]["activation"]:
            print(f"  {d['op']:14s} {d['rows']}x{d['width']}: bwd {d['bwd_launcher_frac_copy']:.0%} of copy, "
                  f"host {d['tilewise_fwd_bwd_host_ms'] * 1e3:.0f} us")
        print()
        print(f"copy bandwidth {self.copy_gbps:.0f} GB/s; {self.results['gpu']}, torch {self.results['torch']}, "
              f"triton {self.results['triton']}, commit {self.results['commit'][:10]}")
        print("do_bench (host included; the targets), then GPU only (CUDA graph), then tilewise's host us a call")
        head = f"{'op':14s} {'shape':12s} {'pass':7s} {'unit':5s} " + " ".join(f"{c:>13s}" for c in CONTESTANTS) + \
            f" {'ratio':>6s} {'of copy':>7s} {'target':>6s} |" + " ".join(f"{c[:8]:>9s}" for c in CONTESTANTS) + \
            f" | {'host us':>7s}"
        print(head)
        print("-" * len(head))

        def num(v, spec, width):
            return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(width)
        for row in self.results["rows"]:
            shape = f"{row['shape']['rows']}x{row['shape']['width']}"
            target = row.get("meets_target")
            spec = "13.3f" if row["unit"] == "ms" else "13.0f"
            graph_spec = "9.3f" if row["unit"] == "ms" else "9.0f"
            print(f"{row['op']:14s} {shape:12s} {row['pass']:7s} {row['unit']:5s} "
                  + " ".join(num(row.get(c), spec, 13) for c in CONTESTANTS)
                  + f" {num(row.get('ratio_best_peer'), '6.2f', 6)} {num(row.get('tilewise_frac_copy'), '7.1%', 7)}"
                  + f" {('yes' if target else 'NO') if target is not None else '':>6s} |"
                  + " ".join(num(row.get(f"{c}_graph"), graph_spec, 9) for c in CONTESTANTS)
                  + f" | {num(row.get('tilewise_host_us'), '7.0f', 7)}")


if __name__ == "__main__":
    sys.exit(main())
