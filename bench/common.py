"""What the benchmark scripts share: the environment record of a results file, its writing, and the plain
PyTorch GPT.

The plain GPT is what a strong PyTorch user writes (nn.LayerNorm, nn.Linear, SDPA, tied embeddings); its
parameter layout (fused qkv, tied head) lets it start from a tilewise model's weights.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


def git_commit() -> str:
    """TILEWISE_COMMIT when set (the GPU machine's copy of the tree may carry a stale .git), else HEAD's sha."""
    if os.environ.get("TILEWISE_COMMIT"):
        return os.environ["TILEWISE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """gpu, torch, triton, commit and date, the header of every results file."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton_version, "commit": git_commit(),
            "date": datetime.date.today().isoformat()}


RESULTS = os.path.join(HERE, "results")   # the committed results files


def write_result(result: dict, name: str, folders, default=None) -> None:
    """result as indented JSON in folder/name for each of folders (None and "" skipped), through a temporary
    file renamed over the old one, so a run stopped mid-write never leaves half a results file. A folder
    that cannot be written is reported on stderr and the others still are. default: json.dumps's, for
    values JSON has no type for."""
    text = json.dumps(result, indent=1, default=default) + "\n"
    for folder in filter(None, folders):
        path = os.path.join(folder, name)
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        except OSError as e:
            print(f"could not write {path}: {e}", file=sys.stderr)


def allocator_counts(before: dict | None = None) -> dict | None:
    """The caching allocator's cudaMalloc and cudaFree calls and allocation retries so far (a cudaFree
    synchronizes the device), or their increase since `before`; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    now = {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    return now if before is None else {k: now[k] - before[k] for k in now}


class GpuClocks:
    """SM clock and board power sampled by `nvidia-smi -lms` while the block runs: whether a timing ran at
    full clock or power-capped (a kernel timed inside a training step can run slower than alone).
    summary(): median and minimum SM MHz and median watts of the samples, None without nvidia-smi or samples."""

    QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]

    def __init__(self, period_ms: int = 100):
        self.period_ms, self.proc, self.text = period_ms, None, ""

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(self.QUERY + [f"-lms={self.period_ms}"], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.text = self.proc.communicate(timeout=5)[0]
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.text = self.proc.communicate()[0]
        return False

    def summary(self) -> dict | None:
        return summarize_clocks(self.text)


def summarize_clocks(text: str) -> dict | None:
    """nvidia-smi's 'MHz, W' lines (first GPU's column order as GpuClocks.QUERY) -> the summary, or None."""
    mhz, watts = [], []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            mhz.append(float(parts[0]))
            watts.append(float(parts[1]))
        except (IndexError, ValueError):
            continue
    if not mhz:
        return None
    mid = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"sm_mhz_median": mid(mhz), "sm_mhz_min": min(mhz), "power_w_median": mid(watts), "samples": len(mhz)}


class PlainBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 in plain PyTorch; forward returns the mean cross-entropy."""

    def __init__(self, vocab=50304, seq_len=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(PlainBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
