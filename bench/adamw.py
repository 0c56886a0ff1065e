"""AdamW's step over a preset's parameters: tilewise's AdamW (ops/adamw.py) against torch's fused AdamW.

Both as the trainer steps them: fp32 master weights and gradients, decay on matrices, capturable with a
tensor learning rate, the gradients divided by a grad_scale tensor (the folded gradient clipping). Before
timing, one step of each from the same state must agree (relative error of the parameters' change). Then
do_bench of the step (eager, host included) and of its CUDA-graph replay (GPU only), in ms and as GB/s of
the bytes AdamW must move (read parameter, gradient and both moments; write parameter and moments: 28 bytes
a fp32 parameter).

    PYTHONPATH=src python3 bench/adamw.py --out DIR [--configs gpt-1.3b,gpt2-124m]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import environment  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="(accepted for bench/h200.sh; no effect)")
    ap.add_argument("--configs", default="gpt-1.3b,gpt2-124m")
    args = ap.parse_args()
    import triton.testing
    results = {"area": "adamw", **environment(), "command": "PYTHONPATH=src python3 bench/adamw.py", "rows": []}
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
        row = {"config": name, "params": n, "own_tensors": sum(p.numel() >= mine.min_numel for p in my_params),
               "tensors": len(my_params), "rel_diff_of_update": rel}
        nbytes = 28 * n
        for label, opt in (("torch_fused", ref), ("tilewise", mine)):
            ms = triton.testing.do_bench(opt.step, warmup=25, rep=200, return_mode="median")
            graph = triton.testing.do_bench_cudagraph(opt.step, rep=50, return_mode="median")
            row[label] = {"ms": ms, "graph_ms": graph, "GBps": nbytes / ms / 1e6, "graph_GBps": nbytes / graph / 1e6}
        row["speedup_graph"] = row["torch_fused"]["graph_ms"] / row["tilewise"]["graph_ms"]
        row["speedup"] = row["torch_fused"]["ms"] / row["tilewise"]["ms"]
        results["rows"].append(row)
        print(f"{name}: {n / 1e6:.0f}M params ({row['own_tensors']}/{row['tensors']} tensors in tilewise's kernel), "
              f"update rel diff {rel:.1e}; step ms eager / graph: torch fused "
              f"{row['torch_fused']['ms']:.2f} / {row['torch_fused']['graph_ms']:.2f} "
              f"({row['torch_fused']['graph_GBps']:.0f} GB/s), tilewise {row['tilewise']['ms']:.2f} / "
              f"{row['tilewise']['graph_ms']:.2f} ({row['tilewise']['graph_GBps']:.0f} GB/s); "
              f"x{row['speedup_graph']:.2f} graphed", flush=True)
        del ref, mine, ref_params, my_params
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "adamw.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
