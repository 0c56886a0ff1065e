"""Loss parity: the same model, data and seed trained with bf16 and with each FP8 option, curves in one PNG.

The FP8 issues ask for it: every FP8 recipe within 1.5% of bf16's final val loss after >= 2000 steps, FP8
attention within 1%. Each variant is a whole `tilewise.train.train` run in this process on the real corpus
(the Python standard library, prepared once for the preset's vocabulary), from the same seed, so the runs see
the same initial weights and the same batches. A 10-minute device call fits a few runs: --variants picks
them and --merge keeps the rows and curves of earlier calls (the file is rewritten after every run).

    PYTHONPATH=src python3 bench/convergence.py --out DIR [--preset gpt2-124m] [--steps 2000]
        [--variants bf16,fp8_delayed,...] [--merge bench/results/convergence.json] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import RESULTS, environment, write_result  # noqa: E402

VARIANTS = {   # name -> (config overrides, target: largest relative val-loss gap to bf16, or None)
    "bf16": ({}, None),
    "fp8_delayed": ({"fp8.recipe": '"delayed"'}, 0.015),
    "fp8_current": ({"fp8.recipe": '"current"'}, 0.015),
    "fp8_blockwise": ({"fp8.recipe": '"blockwise"'}, 0.015),
    "attn_fp8": ({"model.attention": '"fp8"'}, 0.01),
    "attn_fp8_rotate": ({"model.attention": '"fp8_rotate"'}, 0.01),
}


def run_variant(name: str, preset: str, steps: int, work: str, device: str, extra: list[str]) -> dict:
    from tilewise.config import load_config
    from tilewise.metrics import read_metrics
    from tilewise.train import train
    overrides, _ = VARIANTS[name]
    out_dir = os.path.join(work, name)
    settings = {"train.out_dir": json.dumps(out_dir), "train.max_steps": steps, "train.progress": "false",
                "train.eval_every": max(1, steps // 10), "checkpoint.every": 0, "train.device": json.dumps(device),
                **overrides}
    cfg = load_config(preset, overrides=[f"{k}={v}" for k, v in settings.items()] + extra)
    t0 = time.time()
    summary = train(cfg)
    records = read_metrics(out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoints"), ignore_errors=True)
    return {"variant": name, "options": overrides, "final_val_loss": summary["final_val_loss"],
            "tokens_per_s": summary["tokens_per_s"], "wall_s": round(time.time() - t0, 1),
            "curve": [[r["step"], r["loss"]] for r in records],
            "val_curve": [[r["step"], r["val_loss"]] for r in records if r.get("val_loss") is not None]}


def judge(runs: dict) -> list[dict]:
    """One row per variant: its final val loss against bf16's, and whether the issue's target holds."""
    base = runs.get("bf16")
    rows = []
    for name, run in runs.items():
        row = {"shape": {"variant": name, "steps": run["steps"], "preset": run["preset"]}, "unit": "val loss",
               "tilewise": run.get("final_val_loss"), "bf16": base["final_val_loss"] if base else None}
        target = VARIANTS[name][1]
        if base and run.get("final_val_loss") is not None and name != "bf16":
            gap = (run["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
            finite = math.isfinite(run["final_val_loss"])
            row.update(rel_gap=round(gap, 5), target=target, meets_target=finite and abs(gap) <= target,
                       same_setup=(run["steps"], run["preset"]) == (base["steps"], base["preset"]))
        if "error" in run:
            row["error"] = run["error"]
        rows.append(row)
    return rows


def plot(runs: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for name, run in runs.items():
        if not run.get("curve"):
            continue
        steps, losses = zip(*run["curve"])
        line, = ax.plot(steps, losses, linewidth=0.8, alpha=0.8, label=f"{name} (val {run['final_val_loss']:.4f})")
        if run.get("val_curve"):
            ax.plot(*zip(*run["val_curve"]), "o", color=line.get_color(), markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token); dots: val")
    ax.set_title("bf16 vs FP8, same model, data and seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="also write convergence.json and convergence.png into this directory")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--variants", default="bf16,fp8_delayed,fp8_current,fp8_blockwise",
                   help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--merge", help="an earlier convergence.json whose runs are kept (same preset and steps)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--set", action="append", default=[], help="extra config overrides, e.g. train.batch_size=8")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected names from {', '.join(VARIANTS)}")
    runs = {}
    if args.merge and os.path.exists(args.merge):
        with open(args.merge) as f:
            runs = {r["variant"]: r for r in json.load(f).get("runs", [])}
    work = tempfile.mkdtemp(prefix="tilewise-convergence-")
    dests = [d for d in (RESULTS if args.device == "cuda" else None, args.out) if d]
    try:
        for name in names:
            try:
                run = run_variant(name, args.preset, args.steps, work, args.device, args.set)
            except Exception as e:   # one failing variant must not lose the others' curves
                run = {"variant": name, "final_val_loss": None, "error": f"{type(e).__name__}: {e}"[:500]}
            runs[name] = {**run, "steps": args.steps, "preset": args.preset}
            print(f"{name}: val {run['final_val_loss']}, {run.get('wall_s')} s {run.get('error', '')}", flush=True)
            result = {"area": "convergence", **environment(), "rows": judge(runs), "runs": list(runs.values()),
                      "command": f"PYTHONPATH=src python3 bench/convergence.py --preset {args.preset} "
                                 f"--steps {args.steps} --variants {','.join(runs)}"
                                 + "".join(f" --set {s}" for s in args.set)}
            write_result(result, "convergence.json", dests)
            for d in dests:
                plot(runs, os.path.join(d, "convergence.png"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for row in judge(runs):
        print(row["shape"]["variant"], row["tilewise"], row.get("rel_gap"), row.get("meets_target"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
