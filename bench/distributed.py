"""Every distributed strategy on one GPU: GPT-2 124M training steps through the tilewise trainer.

Each variant is a whole `tilewise.train.train` run in this process (a one-rank NCCL group, as
`torchrun --nproc_per_node=1 -m tilewise train --set distributed.strategy=...` makes), on the same synthetic
tokens from the same initial weights. The peer is the plain single-process trainer (strategy none): a
strategy on one GPU can only cost time (wrapping, hooks, mixed precision casts) or save memory (activation
checkpointing, CPU offload), and these rows say how much. Throughput comes from the trainer's own records
(CUDA synchronized at each log step), over the steps after the first logged interval (warm-up, autotuning);
before the table, each variant's last loss must agree with the plain run's (bf16: 3%, FP8: 6%).

    PYTHONPATH=src python3 bench/distributed.py --out DIR [--quick] [--steps 30]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import RESULTS, environment, write_result  # noqa: E402

VARIANTS = {   # name -> (config overrides, loss tolerance against "none")
    "none": ({}, 0.0),
    "ddp": ({"distributed.strategy": "ddp"}, 0.03),
    "fsdp": ({"distributed.strategy": "fsdp"}, 0.03),
    "fsdp_zero2": ({"distributed.strategy": "fsdp", "distributed.reshard_after_forward": "false"}, 0.03),
    "hsdp": ({"distributed.strategy": "hsdp"}, 0.03),
    "fsdp_ac": ({"distributed.strategy": "fsdp", "distributed.activation_checkpointing": "true"}, 0.03),
    "fsdp_offload": ({"distributed.strategy": "fsdp", "distributed.cpu_offload": "true"}, 0.03),
    "fp8": ({"fp8.recipe": '"delayed"'}, 0.06),
    "ddp_fp8": ({"distributed.strategy": "ddp", "fp8.recipe": '"delayed"'}, 0.06),
    "fsdp_fp8": ({"distributed.strategy": "fsdp", "fp8.recipe": '"delayed"'}, 0.06),
}
QUICK = ("none", "ddp", "fsdp", "fsdp_zero2")
LOG_EVERY = 5


def synthetic_tokens(path: str, tokens: int) -> None:
    """A token folder of GPT-2's vocabulary: Zipf-distributed tokens each followed by its successor."""
    import numpy as np
    from tilewise.data import write_token_shards
    rng = np.random.default_rng(0)
    x = np.empty(tokens, np.int64)
    x[0::2] = rng.zipf(1.3, (tokens + 1) // 2) % 50256 + 1
    x[1::2] = x[0::2][:tokens // 2] % 50256 + 1
    x[rng.random(tokens) < 0.001] = 0
    write_token_shards(path, {"train": x, "val": x[-(1 << 16):]}, vocab_size=50257, eot_id=0)


def run_variant(name: str, data_dir: str, work: str, batch: int, steps: int) -> dict:
    import torch
    from tilewise.config import load_config
    from tilewise.metrics import read_metrics
    from tilewise.train import train
    extra, _ = VARIANTS[name]
    out_dir = os.path.join(work, name)
    overrides = {"data.dir": json.dumps(data_dir), "train.out_dir": json.dumps(out_dir),
                 "train.batch_size": batch, "train.max_steps": steps, "train.warmup_steps": LOG_EVERY,
                 "train.log_every": LOG_EVERY,
                 "train.eval_every": 10 ** 9, "train.eval_batches": 1, "train.progress": "false",
                 "checkpoint.every": 0, **extra}
    cfg = load_config("gpt2-124m", overrides=[f"{k}={v}" for k, v in overrides.items()])
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    summary = train(cfg)
    wall = time.time() - t0
    records = read_metrics(out_dir)
    timed = [r for r in records if r["step"] > LOG_EVERY]   # the first interval holds warm-up and autotuning
    seconds = sum(r["step_ms"] * LOG_EVERY / 1e3 for r in timed)
    tokens = batch * cfg.model.seq_len * LOG_EVERY * len(timed)
    shutil.rmtree(out_dir, ignore_errors=True)   # the final checkpoint: 1.5 GB per variant
    return {"variant": name, "strategy": summary["strategy"], "options": extra,
            "tokens_per_s": round(tokens / seconds), "step_ms": round(1e3 * seconds / (LOG_EVERY * len(timed)), 2),
            "timed_steps": LOG_EVERY * len(timed), "mfu": round(sum(r["mfu"] or 0.0 for r in timed) / len(timed), 4),
            "peak_mem_gb": round(summary["peak_mem_gb"], 2), "final_loss": round(records[-1]["loss"], 4),
            "wall_s": round(wall, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write distributed.json into this directory")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, at batch 8")
    p.add_argument("--steps", type=int, default=30, help="steps per variant (default 30; timed: all after the "
                                                         f"first {LOG_EVERY})")
    p.add_argument("--variants", help=f"comma-separated subset of {', '.join(VARIANTS)}")
    args = p.parse_args()
    if args.steps < 4 * LOG_EVERY + LOG_EVERY:
        p.error(f"--steps {args.steps}: at least {5 * LOG_EVERY} (20 timed steps after {LOG_EVERY} of warm-up)")
    names = args.variants.split(",") if args.variants else list(QUICK if args.quick else VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected names from {', '.join(VARIANTS)}")
    if "none" not in names:
        names.insert(0, "none")
    import torch
    if not torch.cuda.is_available():
        print("bench/distributed.py needs a CUDA GPU", file=sys.stderr)
        return 2
    batch = 8 if args.quick else 32
    work = tempfile.mkdtemp(prefix="tilewise-bench-dist-")
    rows = []
    try:
        data_dir = os.path.join(work, "data")
        synthetic_tokens(data_dir, batch * 1024 * (args.steps + 2) + (1 << 17))
        for name in names:
            try:
                row = run_variant(name, data_dir, work, batch, args.steps)
            except Exception as e:   # one broken variant must not lose the others' numbers
                row = {"variant": name, "error": f"{type(e).__name__}: {e}"[:500]}
            rows.append(row)
            print(f"  {name}: {row}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = next((r for r in rows if r["variant"] == "none" and "error" not in r), None)
    out_rows = []
    for r in rows:
        shape = {"model": "gpt2-124m", "batch": batch, "seqlen": 1024, "variant": r["variant"]}
        if "error" in r or base is None:
            out_rows.append({"shape": shape, "unit": "tokens/s", "tilewise": None, "none": None,
                             "ratio_best_peer": None, **r})
            continue
        tol = VARIANTS[r["variant"]][1]
        r["loss_agrees"] = abs(r["final_loss"] - base["final_loss"]) <= tol * abs(base["final_loss"])
        out_rows.append({"shape": shape, "unit": "tokens/s", "tilewise": r["tokens_per_s"],
                         "none": base["tokens_per_s"], "ratio_best_peer": round(r["tokens_per_s"] /
                                                                                base["tokens_per_s"], 3), **r})
    result = {"area": "distributed", **environment(), "command": "PYTHONPATH=src python3 bench/distributed.py",
              "peers": {"none": "the tilewise trainer without torch.distributed (strategy none)"}, "rows": out_rows}
    write_result(result, "distributed.json", [RESULTS, args.out])
    print(f"\n{'variant':<14} {'tokens/s':>10} {'x none':>7} {'ms/step':>8} {'MFU':>6} {'peak GB':>8} {'loss':>8} "
          f"agrees")
    for r in out_rows:
        if r.get("tilewise") is None:
            print(f"{r['variant']:<14} {'failed':>10}  {r.get('error', 'no baseline')}")
            continue
        print(f"{r['variant']:<14} {r['tokens_per_s']:>10,} {r['ratio_best_peer']:>7.3f} {r['step_ms']:>8.1f} "
              f"{r['mfu']:>6.1%} {r['peak_mem_gb']:>8.2f} {r['final_loss']:>8.4f} {r['loss_agrees']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
