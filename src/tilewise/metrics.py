"""What a run records: metrics.jsonl (one object per logged step), summary.json, loss.png, and the console.

Only rank 0 writes and prints; the other ranks get a Metrics whose methods do nothing.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

# Dense bf16 tensor-core peaks (datasheet), for MFU. Matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


class Metrics:
    def __init__(self, run_dir: str, *, enabled: bool = True, total_steps: int = 0, start_step: int = 0,
                 progress: bool = True, append: bool = False):
        self.run_dir, self.enabled = run_dir, enabled
        self.start = time.time()
        self._bar = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if append else "w")
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=sys.stderr, leave=True)

    def log(self, record: dict) -> None:
        """Append one record to metrics.jsonl and show its headline numbers on the progress bar."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is not None:
            shown = {k: record[k] for k in ("loss", "val_loss", "tokens_per_s") if record.get(k) is not None}
            self._bar.set_postfix({k: (f"{v:.3f}" if k != "tokens_per_s" else f"{v:,.0f}") for k, v in shown.items()},
                                  refresh=False)
            self._bar.n = record["step"]
            self._bar.refresh()

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._file.close()


def write_json(path: str, data: dict) -> None:
    """Write JSON atomically: a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(run_dir: str, title: str = "") -> str:
    """loss.png beside metrics.jsonl: the train loss per logged step and the val loss per evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val", linewidth=1.5, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or os.path.basename(os.path.abspath(run_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(run_dir, "loss.png")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
