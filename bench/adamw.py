"""AdamW's step over a preset's parameters: tilewise's AdamW (ops/adamw.py) against torch's fused AdamW.

Both as the trainer steps them: fp32 master weights and gradients, decay on matrices, capturable with a
tensor learning rate, the gradients divided by a grad_scale tensor (the folded gradient clipping). Before
timing, one step of each from the same state must agree (relative error of the parameters' change). Then
do_bench of the step (eager, host included) and of its CUDA-graph replay (GPU only, the table's figure), and
the fraction of the copy bandwidth that the bytes AdamW must move make (read parameter, gradient and both
moments; write parameter and moments: 28 bytes a fp32 parameter). --sweep first times the kernel's launch
configs on single tensors.

    PYTHONPATH=src python3 bench/adamw.py --out DIR [--configs gpt-1.3b,gpt2-124m] [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import environment, write_result  # noqa: E402

from tilewise.config import load_config  # noqa: E402
from tilewise.model import GPT  # noqa: E402
from tilewise.ops.adamw import AdamW  # noqa: E402
from tilewise.train import decay_groups  # noqa: E402


def optimizers(cfg):
    """(torch's, tilewise's) AdamW over two copies of the preset's fp32 parameters with the same gradients."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg.model)
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for p, q in zip(model.parameters(), twin):
        p.grad = torch.randn_like(p) * 1e-3
        q.grad = p.grad.clone()
    lr = torch.tensor(cfg.train.lr, device="cuda")
    kw = dict(lr=lr, betas=(cfg.train.beta1, cfg.train.beta2), fused=True, capturable=True)
    groups = decay_groups(model, cfg.train.weight_decay)
    twin_of = dict(zip(model.parameters(), twin))
    twin_groups = [{**g, "params": [twin_of[p] for p in g["params"]]} for g in groups]
    out = (torch.optim.AdamW(groups, **kw), AdamW(twin_groups, **kw))
    for opt in out:
        opt.grad_scale = torch.tensor([1.5], device="cuda")
    return out, list(model.parameters()), twin


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (read + write bytes) of a 2 GiB tensor, timed as bench/fused.py does
    (do_bench: a graph would replay the copy as a memcpy node, slower here)."""
    import triton.testing
    buffers = [torch.empty(1 << 29, dtype=torch.float32, device="cuda") for _ in range(2)]
    ms = triton.testing.do_bench(lambda: buffers[1].copy_(buffers[0]), warmup=25, rep=100, return_mode="median")
    buffers.clear()
    torch.cuda.empty_cache()
    return 2 * (1 << 29) * 4 / ms / 1e6


def sweep(n: int, copy: float) -> list[dict]:
    """adamw_step_ alone on one fp32 tensor of n elements for each (BLOCK, num_warps): GB/s, CUDA graph."""
    import triton.testing
    from tilewise.ops import adamw as A
    p, g, m, v = (torch.randn(n, device="cuda") for _ in range(4))
    v.abs_()
    step, lr, scale = torch.ones((), device="cuda"), torch.tensor(1e-4, device="cuda"), torch.ones(1, device="cuda")
    old = A._BLOCK, A._WARPS
    out = []
    try:
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)):
            A._BLOCK, A._WARPS = block, warps
            ms = triton.testing.do_bench_cudagraph(
                lambda: A.adamw_step_(p, g, m, v, step, lr, 0.9, 0.95, 1e-8, 0.1, scale), rep=30,
                return_mode="median")
            out.append({"elements": n, "block": block, "num_warps": warps, "ms": ms, "GBps": 28 * n / ms / 1e6,
                        "frac_copy": 28 * n / ms / 1e6 / copy, "default": (block, warps) == old})
            print(f"  sweep n={n}: BLOCK {block}, {warps} warps: {out[-1]['GBps']:.0f} GB/s "
                  f"({out[-1]['frac_copy']:.2f} of copy)", flush=True)
    finally:
        A._BLOCK, A._WARPS = old
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="(accepted for bench/h200.sh; no effect)")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's launch configs on one tensor")
    ap.add_argument("--configs", default="gpt-1.3b,gpt2-124m")
    args = ap.parse_args()
    import triton.testing
    copy = copy_gbps()
    results = {"area": "adamw", **environment(), "copy_GBps": copy,
               "command": "PYTHONPATH=src python3 bench/adamw.py" + (" --sweep" if args.sweep else "")
               + (f" --configs {args.configs}" if args.configs != "gpt-1.3b,gpt2-124m" else ""),
               "rows": [], "sweep": sweep(100_000_000, copy) + sweep(12_582_912, copy) if args.sweep else None}
    for name in args.configs.split(","):
        cfg = load_config(name)
        (ref, mine), ref_params, my_params = optimizers(cfg)
        n = sum(p.numel() for p in ref_params)
        before = [p.detach().clone() for p in ref_params]
        ref.step()
        mine.step()
        change = torch.cat([(p.detach() - b).flatten() for p, b in zip(ref_params, before)])
        diff = torch.cat([(p.detach() - q.detach()).flatten() for p, q in zip(ref_params, my_params)])
        rel = (diff.norm() / change.norm()).item()
        del before, change, diff
        ms, graph = {}, {}
        for label, opt in (("torch_fused", ref), ("tilewise", mine)):
            ms[label] = triton.testing.do_bench(opt.step, warmup=25, rep=200, return_mode="median")
            graph[label] = triton.testing.do_bench_cudagraph(opt.step, rep=50, return_mode="median")
        nbytes = 28 * n
        row = {"shape": {"config": name, "params": n, "tensors": len(my_params),
                         "in_tilewise_kernel": sum(p.numel() >= mine.min_numel for p in my_params)},
               "unit": "ms a step (CUDA graph)", "tilewise": graph["tilewise"], "torch_fused": graph["torch_fused"],
               "ratio_torch_fused": graph["torch_fused"] / graph["tilewise"],
               "tilewise_frac_copy": nbytes / graph["tilewise"] / 1e6 / copy,
               "torch_fused_frac_copy": nbytes / graph["torch_fused"] / 1e6 / copy,
               "tilewise_eager": ms["tilewise"], "torch_fused_eager": ms["torch_fused"],
               "rel_diff_of_update": rel}
        results["rows"].append(row)
        print(f"{name}: {n / 1e6:.0f}M params ({row['shape']['in_tilewise_kernel']}/{len(my_params)} tensors in "
              f"tilewise's kernel), update rel diff {rel:.1e}; a step eager / graph: torch fused "
              f"{ms['torch_fused']:.2f} / {graph['torch_fused']:.2f} ms ({row['torch_fused_frac_copy']:.2f} of "
              f"copy at 28 B a parameter), tilewise {ms['tilewise']:.2f} / {graph['tilewise']:.2f} ms "
              f"({row['tilewise_frac_copy']:.2f}); x{row['ratio_torch_fused']:.2f} graphed", flush=True)
        del ref, mine, ref_params, my_params
        torch.cuda.empty_cache()
    write_result(results, "adamw.json", [args.out])


if __name__ == "__main__":
    main()
