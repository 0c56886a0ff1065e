"""Multi-GPU measurements (issue 10): scaling, sharded checkpoints across world sizes, and loss agreement.

Every measurement is a torchrun launch, the way users start the trainer (`torchrun --nproc_per_node=N -m tilewise
train --preset gpt-1.3b --set ...`); this process plans the launches, watches the checkpoint folder and reads what
the runs write (metrics.jsonl, summary.json). All runs read the same synthetic tokens (Zipf tokens each followed by
its successor, written once as a token folder). Three parts:

scaling      the preset (gpt-1.3b: 8 rows x 2048 tokens per GPU) with ddp and fsdp, bf16 and FP8 (delayed
             scaling), on every count of --gpus the machine has (1 among them): tokens/s per GPU over the steps
             after the first logged interval (warm-up, autotuning), its ratio to 1 GPU, peak memory (rank 0).
             The peer, plain_fsdp2, is bench/multigpu_baseline.py: bench/common.py's plain GPT at the same size,
             fully_shard per block, each block compiled, launched the same way on the same counts.
checkpoint   fsdp on N GPUs (the largest count), saving every E steps (checkpoint.every) and logging every step.
             The trainer saves right after it logs a step and times each step from the previous log, so the
             blocked time of a save = the next step's time - the median step without a save before it. Time to
             durable = from the moment step_X.tmp appears (rank 0 makes it as the save starts) to the moment
             step_X does (the commit's rename), polled every few ms. Then the checkpoint of step 2E is resumed
             (`--resume`) with N/2 and with 1 GPU, same global batch (grad_accum to fit), and the losses of the
             next steps are compared with the N-GPU run's (constant learning rate after warm-up, so a shorter
             resumed run follows the same schedule).
correctness  a 200-step run on N GPUs (fsdp, ddp; 1 row of 2048 per GPU) against one GPU without
             torch.distributed on the same global batch (train.batch_size is global; the one GPU takes it in one
             micro-batch where it fits, as evaluation reads batch_size // grad_accum rows and both runs must see
             the same val rows): final train and val losses, their relative differences, the largest difference
             along the logged trajectory.

Every launch gets the NVLink-multicast-off variables (MULTICAST_OFF, from the device tool's KINDS.md). A launch
that fails or runs out of time becomes a row with its error and the rest go on. --budget-s bounds the whole
script: a launch that cannot get min_launch_s of it is skipped, and multigpu.json is rewritten after every
launch, so a device call of 10 minutes returns what ran. --merge FILE keeps an earlier file's rows that this
call does not measure again (one part per device call, then merge).

    PYTHONPATH=src python3 bench/multigpu.py --out DIR [--quick] [--gpus 1,2,4,8] [--device cpu]
        [--parts scaling,checkpoint,correctness] [--variants fsdp,plain_fsdp2,...] [--budget-s 540] [--merge FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "src")
sys.path.insert(0, SRC)
sys.path.insert(0, HERE)
from common import RESULTS, git_commit, write_result  # noqa: E402

# Set in every launched process (and this one): NVLink multicast off in NCCL, PyTorch and NVSHMEM. A program that
# uses multicast can put the host's shared GPUs out of service for a day or more (the device tool's KINDS.md).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

PARTS = ("scaling", "checkpoint", "correctness")
PEER = "plain_fsdp2"
SCALING_VARIANTS = {   # name -> (strategy, precision); the order is the order of measurement
    "fsdp": ("fsdp", "bf16"), PEER: ("fsdp", "bf16"), "fsdp_fp8": ("fsdp", "fp8"),
    "ddp": ("ddp", "bf16"), "ddp_fp8": ("ddp", "fp8"),
}
CORRECTNESS_VARIANTS = ("fsdp", "ddp", "fsdp_fp8", "ddp_fp8")
CHECKPOINT_METRICS = {"blocked_first_s": "s", "blocked_s": "s", "durable_s": "s", "write_GBps": "GB/s"}  # -> unit
SCALING_GOAL = 0.90            # fsdp tokens/s per GPU at 8 GPUs over 1 GPU (the project's goal)
READY_MARK = " parameters, vocab"   # the trainer's first line, printed once the model (and a resumed state) is ready


@dataclasses.dataclass
class Settings:
    """What one device kind runs: the GPU defaults measure, the CPU ones only exercise the same flow."""
    device: str                   # cuda | cpu
    preset: str
    rows_per_gpu: int
    log_every: int                # scaling: the first logged interval is warm-up, the rest is timed
    steps: int                    # scaling: timed steps (a multiple of log_every)
    variants: tuple
    ckpt_every: int               # checkpoint: E
    resume_steps: int             # checkpoint: steps run after a resume and compared
    correctness_preset: str
    correctness_rows_per_gpu: int
    correctness_steps: int
    correctness_variants: tuple
    resume_tolerance: float       # relative loss difference after a resume that still agrees
    correctness_tolerance: float  # relative final-loss difference that still agrees
    launch_timeout_s: float
    min_launch_s: float           # a launch is skipped when less of the budget than this is left
    collective_timeout_s: int     # distributed.timeout_s: a hung rank ends its launch well before the budget


def settings_for(device: str, quick: bool) -> Settings:
    if device == "cpu":
        return Settings(device="cpu", preset="tiny", rows_per_gpu=4, log_every=2, steps=4,
                        variants=("fsdp", PEER), ckpt_every=2, resume_steps=2, correctness_preset="tiny",
                        correctness_rows_per_gpu=4, correctness_steps=20, correctness_variants=("fsdp",),
                        resume_tolerance=1e-4, correctness_tolerance=1e-3, launch_timeout_s=180, min_launch_s=15,
                        collective_timeout_s=60)
    return Settings(device="cuda", preset="gpt-1.3b", rows_per_gpu=8, log_every=5, steps=20,
                    variants=("fsdp", PEER) if quick else tuple(SCALING_VARIANTS), ckpt_every=20 if quick else 50,
                    resume_steps=5, correctness_preset="gpt-1.3b", correctness_rows_per_gpu=1,
                    correctness_steps=50 if quick else 200,
                    correctness_variants=("fsdp",) if quick else ("fsdp", "ddp"),
                    resume_tolerance=1e-2, correctness_tolerance=2e-2, launch_timeout_s=480, min_launch_s=90,
                    collective_timeout_s=300)


# ------------------------------------------------------------------------------------------------
# Launching: torchrun with the multicast-off environment, a deadline, and timestamps of marked lines
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Launch:
    code: int | None          # exit status (None: stopped at its deadline)
    seconds: float
    output: str               # the last lines of stdout and stderr together
    marks: dict               # marker -> seconds from the start to the first line that held it
    timed_out: bool = False


def launch_env(device: str) -> dict:
    env = dict(os.environ)
    env.update(MULTICAST_OFF)
    # src only: bench/ holds modules with common names (tables, common, ...); the peer's worker adds it itself.
    env["PYTHONPATH"] = os.pathsep.join([SRC] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"   # the ranks share few cores: more threads only wait for each other
    return env


_current: subprocess.Popen | None = None   # the launch in flight, stopped if this script is stopped


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun (it ends its workers), then SIGKILL to its process group after a grace period."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def torchrun(nproc: int, target: list[str], *, timeout: float, device: str, marks=(READY_MARK,)) -> Launch:
    """`torchrun --standalone --nproc_per_node=nproc *target`, stopped after timeout seconds."""
    global _current
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]
    start = time.monotonic()
    proc = subprocess.Popen(command, env=launch_env(device), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    _current = proc
    lines: deque[str] = deque(maxlen=300)
    seen: dict[str, float] = {}

    def read():
        for line in proc.stdout:
            lines.append(line)
            for m in marks:
                if m not in seen and m in line:
                    seen[m] = time.monotonic() - start
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
    finally:
        _current = None
    reader.join(timeout=10)
    return Launch(code=None if timed_out else proc.returncode, seconds=time.monotonic() - start,
                  output="".join(lines), marks=seen, timed_out=timed_out)


def failure_of(launch: Launch, timeout: float) -> str:
    """One line saying why a launch failed: its deadline, else the most telling line of its output."""
    if launch.timed_out:
        return f"timed out after {timeout:.0f} s (stopped)"
    lines = [line.strip() for line in launch.output.splitlines() if line.strip()]
    # The trainer's own report (a CLI error, or "rank N of W failed"), the first one: the root cause. Else the
    # last exception line of a worker's traceback (torchrun's ChildFailedError only says that a worker failed).
    reports = [line for line in lines if re.search(r"tilewise[\w ]*: (error|rank \d+ of \d+ failed)", line)]
    exceptions = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)
                  and "ChildFailedError" not in line]
    telling = reports[:1] or exceptions[-1:] or lines[-1:]
    return f"exit {launch.code}: {telling[0][:300] if telling else 'no output'}"


class Budget:
    """The script's time budget: each launch gets what is left (less a reserve to write results), if enough."""

    def __init__(self, seconds: float, reserve_s: float = 15.0):
        self.deadline = time.monotonic() + seconds if seconds > 0 else None
        self.reserve_s = reserve_s

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic() - self.reserve_s

    def timeout_for(self, cap: float, minimum: float) -> float | None:
        """The launch's timeout, or None when less than `minimum` seconds are left."""
        left = self.left()
        return None if left < minimum else min(cap, left)


class SkipLaunch(Exception):
    """A launch not started (the budget is spent): its rows record why."""


# ------------------------------------------------------------------------------------------------
# Data and runs of the trainer
# ------------------------------------------------------------------------------------------------

def synthetic_tokens(path: str, tokens: int, vocab: int) -> None:
    """A token folder: Zipf-distributed tokens each followed by its successor, eot (0) now and then."""
    import numpy as np
    from tilewise.data import write_token_shards
    rng = np.random.default_rng(0)
    x = np.empty(tokens, np.int64)
    x[0::2] = rng.zipf(1.3, (tokens + 1) // 2) % (vocab - 1) + 1
    x[1::2] = x[0::2][:tokens // 2] % (vocab - 1) + 1
    x[rng.random(tokens) < 0.001] = 0
    write_token_shards(path, {"train": x, "val": x[-(1 << 18):]}, vocab_size=vocab, eot_id=0)


def precision_label(precision: str, device: str) -> str:
    """What a variant computes in: train.dtype auto is fp32 on CPU, so "bf16" variants run fp32 there."""
    return "fp32" if precision == "bf16" and device == "cpu" else precision


def grad_accum_for(global_rows: int, world: int, rows_per_gpu: int) -> int:
    """The fewest micro-batches that split global_rows over world ranks in whole rows of at most rows_per_gpu."""
    if min(global_rows, world, rows_per_gpu) < 1:
        raise ValueError(f"grad_accum_for: global_rows={global_rows}, world={world}, rows_per_gpu={rows_per_gpu}; "
                         f"expected positive integers")
    for accum in range(1, global_rows + 1):
        if global_rows % (world * accum) == 0 and global_rows // (world * accum) <= rows_per_gpu:
            return accum
    raise ValueError(f"grad_accum_for: {global_rows} rows cannot be split evenly over {world} ranks")


def trainer_target(preset: str, data_dir: str, out_dir: str, overrides: dict, *, resume: bool = False) -> list[str]:
    """The torchrun target `-m tilewise train --preset P --set k=v ...` (strings as TOML strings)."""
    items = {"data.dir": json.dumps(data_dir), "train.out_dir": json.dumps(out_dir), "train.progress": "false",
             **overrides}
    target = ["-m", "tilewise", "train", "--preset", preset]
    for key, value in items.items():
        target += ["--set", f"{key}={value}"]
    return target + (["--resume"] if resume else [])


def read_run(out_dir: str) -> tuple[list[dict], dict]:
    """(metrics.jsonl records, summary.json) of a finished run."""
    from tilewise.metrics import read_metrics
    with open(os.path.join(out_dir, "summary.json")) as f:
        return read_metrics(out_dir), json.load(f)


def throughput(records: list[dict], log_every: int, global_rows: int, seq: int, gpus: int,
               last_step: int | None = None) -> dict:
    """Tokens/s per GPU over the records after the first (warm-up) interval (up to last_step: the profiled
    interval after it is not timed), from the trainer's step_ms."""
    timed = [r for r in records if r["step"] > log_every and (last_step is None or r["step"] <= last_step)]
    if not timed:
        raise ValueError(f"no logged steps after the first {log_every} (warm-up): nothing was timed")
    seconds = sum(r["step_ms"] * log_every / 1e3 for r in timed)
    steps = log_every * len(timed)
    mfu = None   # each record's MFU is over its interval: weighted by the intervals' times
    if all(r.get("mfu") is not None for r in timed):
        mfu = sum(r["mfu"] * r["step_ms"] for r in timed) / sum(r["step_ms"] for r in timed)
    return {"tokens_per_s_per_gpu": global_rows * seq * steps / seconds / gpus, "step_ms": 1e3 * seconds / steps,
            "timed_steps": steps, "mfu": mfu, "final_loss": timed[-1]["loss"]}


def read_profile(out_dir: str, rank: int) -> dict:
    path = os.path.join(out_dir, f"profile_rank{rank}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"error": f"{os.path.basename(path)}: {type(e).__name__}: {e}"}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


class Bench:
    """One script run: settings, the work folder, the budget, the rows, and the results file after each launch."""

    def __init__(self, s: Settings, args, work: str, counts: list[int]):
        self.s, self.args, self.work, self.counts = s, args, work, counts
        self.budget = Budget(args.budget_s)
        self.rows: list[dict] = []
        self.gpu_name = "cpu" if s.device == "cpu" else None
        self.not_measured: list[str] = []
        self._data: dict[str, str] = {}

    # ---------------------------------------------------------------------------- plumbing
    def data_dir(self, preset: str) -> str:
        """The synthetic token folder for the preset's vocabulary (made once; rows of any length are cut from it)."""
        from tilewise.config import load_config
        cfg = load_config(preset)
        key = f"{cfg.data.vocab_size}"
        if key not in self._data:
            path = os.path.join(self.work, f"data-{key}")
            rows = max(self.counts) * max(self.s.rows_per_gpu, self.s.correctness_rows_per_gpu)
            steps = max(self.s.log_every + self.s.steps, 4 * self.s.ckpt_every, self.s.correctness_steps)
            tokens = min(1 << 24, max(1 << 19, rows * (cfg.model.seq_len + 1) * steps))
            synthetic_tokens(path, tokens, cfg.data.vocab_size)
            self._data[key] = path
        return self._data[key]

    def run(self, nproc: int, target: list[str], what: str) -> tuple[Launch, float]:
        """Launch within the budget; SkipLaunch if it is spent. Prints one line when the launch ends."""
        timeout = self.budget.timeout_for(self.s.launch_timeout_s, self.s.min_launch_s)
        if timeout is None:
            raise SkipLaunch(f"skipped: {max(0, self.budget.left()):.0f} s of the time budget left")
        print(f"  {what}, {nproc} {'processes' if self.s.device == 'cpu' else 'GPUs'} ...", end=" ", flush=True)
        launch = torchrun(nproc, target, timeout=timeout, device=self.s.device)
        print(f"{'ok' if launch.code == 0 else failure_of(launch, timeout)} ({launch.seconds:.0f} s)", flush=True)
        return launch, timeout

    def common_overrides(self) -> dict:
        return {"train.device": json.dumps(self.s.device), "distributed.timeout_s": self.s.collective_timeout_s}

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        write_results(self.rows, self.args, self.header(), self.not_measured)

    def header(self) -> dict:
        import torch
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        return {"gpu": self.gpu_name or "unknown", "torch": torch.__version__, "triton": triton_version,
                "commit": git_commit(), "date": datetime.date.today().isoformat()}

    def error_row(self, shape: dict, unit: str, error: str, launch: Launch | None = None) -> dict:
        row = {"shape": shape, "unit": unit, "tilewise": None, "error": error[:400]}
        if launch is not None:
            row["details"] = {"log_tail": launch.output[-3000:]}
        return row

    # ---------------------------------------------------------------------------- scaling
    def scaling(self, variants: list[str]) -> None:
        # Each variant on 1 GPU and on the most first (its scaling ratio), then on the counts between.
        firsts = sorted({min(self.counts), max(self.counts)})
        plan = [(v, n) for v in variants for n in firsts]
        plan += [(v, n) for v in variants for n in self.counts if n not in firsts]
        for variant, gpus in plan:
            self.add(self.scaling_one(variant, gpus))

    def scaling_shape(self, variant: str, gpus: int) -> dict:
        from tilewise.config import load_config
        strategy, precision = SCALING_VARIANTS[variant]
        precision = precision_label(precision, self.s.device)
        return {"part": "scaling", "model": self.s.preset, "rows_per_gpu": self.s.rows_per_gpu,
                "seqlen": load_config(self.s.preset).model.seq_len, "variant": variant, "strategy": strategy,
                "precision": precision, "gpus": gpus}

    def scaling_one(self, variant: str, gpus: int) -> dict:
        shape = self.scaling_shape(variant, gpus)
        unit = "tokens/s per GPU"
        out_dir = os.path.join(self.work, f"scaling-{variant}-{gpus}")
        try:
            if variant == PEER:
                return self.scaling_peer(shape, out_dir, gpus)
            strategy, precision = SCALING_VARIANTS[variant]
            s, global_rows = self.s, self.s.rows_per_gpu * gpus
            timed_end = s.log_every + s.steps
            overrides = {**self.common_overrides(), "distributed.strategy": strategy, "train.batch_size": global_rows,
                         "train.max_steps": timed_end, "train.log_every": s.log_every,
                         "train.eval_every": 10 ** 9, "train.eval_batches": 1, "checkpoint.every": 0,
                         "checkpoint.keep": 1, "checkpoint.at_end": "false"}
            if self.args.profile:   # one more interval, its middle steps profiled (untimed: the profiler costs)
                overrides["train.max_steps"] = timed_end + s.log_every
                overrides["train.profile_steps"] = json.dumps(f"{timed_end + 1}:{timed_end + s.log_every}")
            if precision == "fp8":
                overrides["fp8.recipe"] = json.dumps("delayed")
            launch, timeout = self.run(gpus, trainer_target(s.preset, self.data_dir(s.preset), out_dir, overrides),
                                       f"scaling {variant}")
            if launch.code != 0:
                return self.error_row(shape, unit, failure_of(launch, timeout), launch)
            records, summary = read_run(out_dir)
            self.gpu_name = self.gpu_name or summary.get("device")
            t = throughput(records, s.log_every, global_rows, shape["seqlen"], gpus, last_step=timed_end)
            row = {"shape": shape, "unit": unit, "tilewise": round(t["tokens_per_s_per_gpu"]), PEER: None,
                   "ratio_best_peer": None, "scaling": None, "step_ms": round(t["step_ms"], 2),
                   "mfu": None if t["mfu"] is None else round(t["mfu"], 4),
                   "peak_mem_gb": round(summary["peak_mem_gb"], 2), "final_loss": round(t["final_loss"], 4),
                   "timed_steps": t["timed_steps"], "wall_s": round(launch.seconds, 1)}
            if self.args.profile:   # GPU ms per step by kind, each rank's (tilewise.profile)
                row["details"] = {"profile": [read_profile(out_dir, r) for r in range(gpus)]}
            return row
        except SkipLaunch as e:
            return self.error_row(shape, unit, str(e))
        except Exception as e:   # one broken variant must not lose the others' rows
            return self.error_row(shape, unit, f"{type(e).__name__}: {e}")
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)   # the final checkpoint: 15.8 GB at 1.3B

    def scaling_peer(self, shape: dict, out_dir: str, gpus: int) -> dict:
        s = self.s
        os.makedirs(out_dir, exist_ok=True)
        result_path = os.path.join(out_dir, "baseline.json")
        target = [os.path.join(HERE, "multigpu_baseline.py"), "--preset", s.preset, "--rows-per-gpu",
                  str(s.rows_per_gpu), "--warmup", str(s.log_every), "--steps", str(s.steps), "--device", s.device,
                  "--data", self.data_dir(s.preset), "--timeout-s", str(s.collective_timeout_s), "--out", result_path]
        launch, timeout = self.run(gpus, target, f"scaling {PEER}")
        unit = "tokens/s per GPU"
        if launch.code != 0:
            return self.error_row(shape, unit, failure_of(launch, timeout), launch)
        with open(result_path) as f:
            r = json.load(f)
        self.gpu_name = self.gpu_name or r.get("device")
        return {"shape": shape, "unit": unit, "tilewise": None, PEER: round(r["tokens_per_s_per_gpu"]),
                "ratio_best_peer": None, "scaling": None, "step_ms": round(r["step_ms"], 2),
                "mfu": None if r["mfu"] is None else round(r["mfu"], 4), "peak_mem_gb": round(r["peak_mem_gb"], 2),
                "final_loss": round(r["final_loss"], 4), "timed_steps": r["timed_steps"],
                "wall_s": round(launch.seconds, 1), "details": {"compile": r["compile"], "params": r["params"]}}

    # ---------------------------------------------------------------------------- checkpoint
    def checkpoint(self) -> None:
        """Save on N GPUs (the rows of CHECKPOINT_METRICS), then resume step 2E on N/2 and on 1 GPU."""
        from tilewise.config import load_config
        s, n = self.s, max(self.counts)
        every, resume_from = s.ckpt_every, 2 * s.ckpt_every
        base = {"part": "checkpoint", "model": s.preset, "strategy": "fsdp", "rows_per_gpu": s.rows_per_gpu,
                "seqlen": load_config(s.preset).model.seq_len}
        save_shape = {**base, "gpus": n, "every": every}
        resume_shapes = {m: {**base, "saved_gpus": n, "gpus": m, "metric": "resume_loss_rel_diff",
                             "from_step": resume_from, "steps": s.resume_steps}
                         for m in sorted({max(1, n // 2), 1}, reverse=True)}
        out_dir = os.path.join(self.work, f"checkpoint-save-{n}")
        # Constant learning rate after warm-up (min_lr_ratio 1): a resumed run that stops earlier sees the same rates.
        overrides = {**self.common_overrides(), "distributed.strategy": "fsdp", "train.batch_size": s.rows_per_gpu * n,
                     "train.max_steps": 4 * every, "train.warmup_steps": s.log_every, "train.min_lr_ratio": 1.0,
                     "train.log_every": 1, "train.eval_every": 10 ** 9, "train.eval_batches": 1,
                     "checkpoint.every": every, "checkpoint.keep": 3}
        launch, why = None, None
        try:
            data_dir = self.data_dir(s.preset)
            with CheckpointWatcher(os.path.join(out_dir, "checkpoints")) as watcher:
                launch, timeout = self.run(n, trainer_target(s.preset, data_dir, out_dir, overrides),
                                           f"checkpoint: fsdp saving every {every} steps")
            if launch.code != 0:
                why = failure_of(launch, timeout)
            else:
                records, summary = read_run(out_dir)
                self.gpu_name = self.gpu_name or summary.get("device")
                save_rows = self.save_rows(save_shape, records, watcher, out_dir, launch)
        except SkipLaunch as e:
            why = str(e)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        if why:
            for m, unit in CHECKPOINT_METRICS.items():
                self.rows.append(self.error_row({**save_shape, "metric": m}, unit, why, launch))
            for shape in resume_shapes.values():
                self.rows.append(self.error_row(shape, "max relative loss difference", f"not resumed: saving {why}"))
            self.write()
            shutil.rmtree(out_dir, ignore_errors=True)
            return
        self.rows += save_rows
        self.write()
        ckpt_root = os.path.join(out_dir, "checkpoints")
        for name in os.listdir(ckpt_root):   # only the checkpoint to resume from stays on disk
            if name.startswith("step_") and name != step_dir(resume_from):
                shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)
        try:
            for m, shape in resume_shapes.items():
                self.add(self.resume(shape, out_dir, data_dir, overrides, records, launch.marks.get(READY_MARK)))
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    def save_rows(self, save_shape: dict, records: list[dict], watcher, out_dir: str, launch: Launch) -> list[dict]:
        s = self.s
        every = s.ckpt_every
        saves = save_timings(records, watcher, every, 4 * every, s.log_every)
        saves = trainer_save_stats(out_dir, saves)
        gb = dir_bytes(os.path.join(out_dir, "checkpoints", step_dir(4 * every))) / 1e9
        steady = [x["blocked_s"] for x in saves[1:] if x["blocked_s"] is not None]
        durable = [x["durable_s"] for x in saves if x["durable_s"] is not None]
        durable_s = statistics.median(durable) if durable else None
        values = {"blocked_first_s": saves[0]["blocked_s"], "blocked_s": statistics.median(steady) if steady else None,
                  "durable_s": durable_s, "write_GBps": gb / durable_s if durable_s else None}
        rows = []
        for m, unit in CHECKPOINT_METRICS.items():
            row = {"shape": {**save_shape, "metric": m}, "unit": unit,
                   "tilewise": None if values[m] is None else round(values[m], 3), "GB": round(gb, 2)}
            if m == "blocked_s":
                # a save still writing when the next one starts makes that one wait: its blocked time includes it
                row["includes_wait"] = any(saves[i - 1]["next_save_waits"] for i in range(1, len(saves))
                                           if saves[i]["blocked_s"] is not None)
                row["details"] = {"saves": saves, "step_ms_without_save": saves[0]["step_ms_without_save"],
                                  "ready_s": launch.marks.get(READY_MARK)}
            if values[m] is None:
                row["error"] = "not observed (a save faster than the folder's polling, or no step after it)"
            rows.append(row)
        return rows

    def resume(self, shape: dict, saved_dir: str, data_dir: str, saved_overrides: dict, saved_records: list[dict],
               saved_ready: float | None) -> dict:
        """Resume the saved run's checkpoint of step shape["from_step"] on shape["gpus"] GPUs, same global batch,
        and compare the next steps' losses with the saved run's."""
        s, start, gpus = self.s, shape["from_step"], shape["gpus"]
        unit = "max relative loss difference"
        out_dir = os.path.join(self.work, f"checkpoint-resume-{gpus}")
        try:
            link_tree(os.path.join(saved_dir, "checkpoints", step_dir(start)),
                      os.path.join(out_dir, "checkpoints", step_dir(start)))
            global_rows = saved_overrides["train.batch_size"]
            overrides = {**saved_overrides, "train.max_steps": start + s.resume_steps, "checkpoint.every": 0,
                         "checkpoint.at_end": "false",
                         "train.grad_accum": grad_accum_for(global_rows, gpus, s.rows_per_gpu)}
            launch, timeout = self.run(gpus, trainer_target(s.preset, data_dir, out_dir, overrides, resume=True),
                                       f"checkpoint: resume step {start}")
            if launch.code != 0:
                return self.error_row(shape, unit, failure_of(launch, timeout), launch)
            records, summary = read_run(out_dir)
            saved = {r["step"]: r["loss"] for r in saved_records}
            pairs = [(r["loss"], saved[r["step"]]) for r in records if r["step"] in saved]
            if len(pairs) != s.resume_steps:
                raise ValueError(f"the resumed run logged steps {[r['step'] for r in records]}, expected "
                                 f"{start + 1}..{start + s.resume_steps}")
            worst = max(rel_diff(a, b) for a, b in pairs)
            ready = launch.marks.get(READY_MARK)
            return {"shape": shape, "unit": unit, "tilewise": float(f"{worst:.3g}"),
                    "agrees": worst <= s.resume_tolerance, "grad_accum": overrides["train.grad_accum"],
                    "wall_s": round(launch.seconds, 1),
                    "load_s": None if summary.get("load_s") is None else round(summary["load_s"], 2),
                    "details": {"losses": [[round(a, 5), round(b, 5)] for a, b in pairs],
                                "ready_s": None if ready is None else round(ready, 2),
                                "saved_run_ready_s": None if saved_ready is None else round(saved_ready, 2),
                                "note": "load_s: the trainer's restore of the checkpoint (rank 0's summary.json); "
                                        "ready_s: from the launch to the trainer's first line, printed after it"}}
        except SkipLaunch as e:
            return self.error_row(shape, unit, str(e))
        except Exception as e:
            return self.error_row(shape, unit, f"{type(e).__name__}: {e}")
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)

    # ---------------------------------------------------------------------------- correctness
    def correctness(self, variants: list[str]) -> None:
        from tilewise.config import load_config
        s, n = self.s, max(self.counts)
        preset = s.correctness_preset
        global_rows = s.correctness_rows_per_gpu * n
        base = {"part": "correctness", "model": preset, "steps": s.correctness_steps, "global_batch": global_rows,
                "seqlen": load_config(preset).model.seq_len}
        unit = "final train loss"
        if n < 2:
            for v in variants:
                self.add(self.error_row({**base, "variant": v, "gpus": n}, unit, "needs 2 or more GPUs"))
            return
        log_every = max(1, s.correctness_steps // 20)
        common = {**self.common_overrides(), "train.batch_size": global_rows, "train.max_steps": s.correctness_steps,
                  "train.warmup_steps": max(1, s.correctness_steps // 10), "train.log_every": log_every,
                  "train.eval_every": max(1, s.correctness_steps // 2), "train.eval_batches": 2,
                  "checkpoint.every": 0, "checkpoint.keep": 1, "checkpoint.at_end": "false"}
        references: dict[str, list[dict] | str] = {}   # precision -> the one-GPU records, or why there are none

        def reference(precision: str):
            if precision not in references:
                out_dir = os.path.join(self.work, f"correctness-ref-{precision}")
                # The same micro-batch of global_rows as the N-GPU run (it fits where a scaling GPU's rows do):
                # evaluation reads batches of batch_size // grad_accum rows, so both runs see the same val rows.
                accum = grad_accum_for(global_rows, 1, max(s.rows_per_gpu, s.correctness_rows_per_gpu)
                                       if s.device == "cuda" else global_rows)
                overrides = {**common, "distributed.strategy": "none", "train.grad_accum": accum}
                if precision == "fp8":
                    overrides["fp8.recipe"] = json.dumps("delayed")
                try:
                    launch, timeout = self.run(1, trainer_target(preset, self.data_dir(preset), out_dir, overrides),
                                               f"correctness: reference ({precision_label(precision, s.device)}, "
                                               f"no torch.distributed)")
                    references[precision] = (read_run(out_dir)[0] if launch.code == 0
                                             else "reference: " + failure_of(launch, timeout))
                except SkipLaunch as e:
                    references[precision] = f"reference {e}"
                except Exception as e:
                    references[precision] = f"reference: {type(e).__name__}: {e}"
                finally:
                    shutil.rmtree(out_dir, ignore_errors=True)
            return references[precision]

        for variant in variants:
            strategy, precision = SCALING_VARIANTS[variant]
            shape = {**base, "variant": variant, "gpus": n}
            out_dir = os.path.join(self.work, f"correctness-{variant}")
            try:
                ref = reference(precision)
                overrides = {**common, "distributed.strategy": strategy,
                             "train.grad_accum": grad_accum_for(global_rows, n, s.correctness_rows_per_gpu)}
                if precision == "fp8":
                    overrides["fp8.recipe"] = json.dumps("delayed")
                launch, timeout = self.run(n, trainer_target(preset, self.data_dir(preset), out_dir, overrides),
                                           f"correctness: {variant}")
                if launch.code != 0:
                    self.add(self.error_row(shape, unit, failure_of(launch, timeout), launch))
                    continue
                records, summary = read_run(out_dir)
                self.gpu_name = self.gpu_name or summary.get("device")
                if isinstance(ref, str):
                    row = {"shape": shape, "unit": unit, "tilewise": round(records[-1]["loss"], 4), "error": ref}
                else:
                    row = {"shape": shape, "unit": unit, **compare_runs(records, ref, s.correctness_tolerance)}
                row["wall_s"] = round(launch.seconds, 1)
                self.add(row)
            except SkipLaunch as e:
                self.add(self.error_row(shape, unit, str(e)))
            except Exception as e:
                self.add(self.error_row(shape, unit, f"{type(e).__name__}: {e}"))
            finally:
                shutil.rmtree(out_dir, ignore_errors=True)


def compare_runs(records: list[dict], reference: list[dict], tolerance: float) -> dict:
    """The N-GPU run's final train and val losses beside the one-GPU run's, and how far they differ."""
    ref = {r["step"]: r for r in reference}
    common = [r for r in records if r["step"] in ref]
    if not common or records[-1]["step"] != reference[-1]["step"]:
        raise ValueError(f"the runs logged different steps ({records[-1]['step'] if records else None} vs "
                         f"{reference[-1]['step'] if reference else None} last)")
    last, ref_last = records[-1], reference[-1]
    val = [r for r in records if r.get("val_loss") is not None]
    ref_val = [r for r in reference if r.get("val_loss") is not None]
    loss_rel = rel_diff(last["loss"], ref_last["loss"])
    out = {"tilewise": round(last["loss"], 4), "one_gpu": round(ref_last["loss"], 4),
           "loss_rel_diff": float(f"{loss_rel:.3g}"),
           "max_rel_diff": float(f"{max(rel_diff(r['loss'], ref[r['step']]['loss']) for r in common):.3g}"),
           "val_loss": round(val[-1]["val_loss"], 4) if val else None,
           "one_gpu_val_loss": round(ref_val[-1]["val_loss"], 4) if ref_val else None}
    out["val_rel_diff"] = (float(f"{rel_diff(val[-1]['val_loss'], ref_val[-1]['val_loss']):.3g}")
                           if val and ref_val else None)
    out["agrees"] = loss_rel <= tolerance and (out["val_rel_diff"] is None or out["val_rel_diff"] <= tolerance)
    out["learned"] = round(reference[0]["loss"] - ref_last["loss"], 3)   # the comparison is not of noise
    return out


# ------------------------------------------------------------------------------------------------
# Checkpoint timings from the outside: the folder's names over time, the trainer's per-step records
# ------------------------------------------------------------------------------------------------

def step_dir(step: int) -> str:
    from tilewise.checkpoint.manifest import step_name
    return step_name(step)


class CheckpointWatcher:
    """Polls a checkpoints folder from a thread: when each name (step_X.tmp, step_X) first appeared."""

    def __init__(self, root: str, interval_s: float = 0.005):
        self.root, self.interval_s = root, interval_s
        self.first_seen: dict[str, float] = {}
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._halt.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._halt.is_set():
            try:
                names = os.listdir(self.root)
            except OSError:
                names = []
            now = time.monotonic()
            for name in names:
                self.first_seen.setdefault(name, now)
            self._halt.wait(self.interval_s)

    def durable_s(self, step: int) -> float | None:
        """From step_X.tmp's appearance to step_X's (None if either went unseen)."""
        name = step_dir(step)
        tmp, final = self.first_seen.get(name + ".tmp"), self.first_seen.get(name)
        return None if tmp is None or final is None or final < tmp else final - tmp


def save_timings(records: list[dict], watcher, every: int, max_steps: int, warmup: int) -> list[dict]:
    """Per save: blocked_s = the next step's time - the median step time without a save before it (the trainer
    saves after logging a step, and times a step from the previous log); durable_s from the watcher."""
    ms = {r["step"]: r["step_ms"] for r in records}
    saves = list(range(every, max_steps + 1, every))
    after_save = {k + 1 for k in saves}
    plain = [v for step, v in ms.items() if step > warmup and step not in after_save]
    typical = statistics.median(plain) if plain else None
    out = []
    for k in saves:
        blocked = None
        if typical is not None and k + 1 in ms:
            blocked = (ms[k + 1] - typical) / 1e3
        durable = watcher.durable_s(k)
        out.append({"step": k, "blocked_s": None if blocked is None else round(blocked, 4),
                    "durable_s": None if durable is None else round(durable, 4),
                    "step_ms_without_save": None if typical is None else round(typical, 2),
                    # the next save waits for this one if it is not durable by then: its blocked time includes that
                    "next_save_waits": None if durable is None or typical is None
                    else durable > every * typical / 1e3})
    return out


def trainer_save_stats(run_dir: str, saves: list[dict]) -> list[dict]:
    """The trainer's own figures (rank 0's checkpoints.jsonl: blocked_s from save() to its return, durable_s to
    the commit) replace the estimates above where the run wrote them; the estimates stay beside them."""
    path = os.path.join(run_dir, "checkpoints.jsonl")
    if not os.path.exists(path):
        return saves
    with open(path) as f:
        own = {r["step"]: r for r in map(json.loads, f) if "step" in r}
    out = []
    for x in saves:
        r = own.get(x["step"])
        if r is not None:
            x = {**x, "blocked_s_estimate": x["blocked_s"], "durable_s_watcher": x["durable_s"],
                 "blocked_s": round(r["blocked_s"], 4),
                 "durable_s": round(r["durable_s"], 4) if r.get("durable_s") is not None else x["durable_s"],
                 "source": "trainer"}
        out.append(x)
    return out


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def link_tree(src: str, dst: str) -> None:
    """A checkpoint directory (flat: manifest and shard files) hard-linked elsewhere; copied across devices."""
    os.makedirs(dst)
    for name in os.listdir(src):
        try:
            os.link(os.path.join(src, name), os.path.join(dst, name))
        except OSError:
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


# ------------------------------------------------------------------------------------------------
# Results: ratios filled in over all rows (merged ones too), the file, the table
# ------------------------------------------------------------------------------------------------

def row_key(row: dict) -> str:
    return json.dumps(row["shape"], sort_keys=True)


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """The new rows, plus the old rows whose shape was not measured again; in a stable reading order."""
    keys = {row_key(r) for r in new}
    rows = [r for r in old if row_key(r) not in keys] + new
    variant_order = {v: i for i, v in enumerate(SCALING_VARIANTS)}

    metric_order = {m: i for i, m in enumerate(CHECKPOINT_METRICS)}

    def order(r):   # scaling and correctness by variant, then GPUs; checkpoint: the saves, then resumes by GPUs
        sh = r["shape"]
        return (PARTS.index(sh["part"]) if sh.get("part") in PARTS else len(PARTS),
                variant_order.get(sh.get("variant"), len(variant_order)),
                metric_order.get(sh.get("metric"), len(metric_order)), -sh.get("gpus", 0) if "saved_gpus" in sh
                else sh.get("gpus", 0))
    return sorted(rows, key=order)


def value_of(row: dict) -> float | None:
    """A row's measurement: the peer's rows hold theirs in the peer's column."""
    return row.get(PEER) if row["shape"].get("variant") == PEER else row.get("tilewise")


def fill_ratios(rows: list[dict]) -> None:
    """Scaling rows: their ratio to the same variant on 1 GPU, and tilewise's ratio to the peer at that count."""
    scaling = [r for r in rows if r["shape"].get("part") == "scaling" and value_of(r) is not None]

    def context(r):   # what two compared rows must share
        return tuple(r["shape"].get(k) for k in ("model", "rows_per_gpu", "seqlen"))

    def find(variant, gpus, ctx):
        return next((o for o in scaling if o["shape"]["variant"] == variant and o["shape"]["gpus"] == gpus
                     and context(o) == ctx), None)
    for r in scaling:
        sh, ctx = r["shape"], context(r)
        one = find(sh["variant"], 1, ctx)
        r["scaling"] = round(value_of(r) / value_of(one), 3) if one else None
        if sh["variant"] == PEER:
            continue
        peer = find(PEER, sh["gpus"], ctx)
        r[PEER] = value_of(peer) if peer else None
        r["ratio_best_peer"] = round(r["tilewise"] / r[PEER], 3) if peer else None
        if sh["strategy"] == "fsdp" and sh["gpus"] == 8:
            r["meets_goal"] = None if r["scaling"] is None else r["scaling"] >= SCALING_GOAL


def write_results(rows: list[dict], args, header: dict, not_measured: list[str]) -> dict:
    old, commands = [], []
    if args.merge and os.path.exists(args.merge):
        with open(args.merge) as f:
            earlier = json.load(f)
        old = earlier.get("rows", [])
        commands = earlier.get("commands") or [f"{earlier.get('commit', '?')}: {earlier['command']}"]
    commands = commands + [f"{header['commit']}: {command_line(args)}"]
    merged = merge_rows(old, [dict(r) for r in rows])
    fill_ratios(merged)
    result = {"area": "multigpu", **header, "command": command_line(args), "commands": commands,
              "peers": {PEER: "plain PyTorch: bench/common.py's GPT, FSDP2 fully_shard per block and root, each block "
                              "torch.compile'd, bf16 parameters, fp32 reduction, fused AdamW "
                              "(bench/multigpu_baseline.py)"},
              "multicast_off": MULTICAST_OFF, "not_measured": not_measured, "rows": merged}
    # a CPU smoke run never replaces the GPU results
    write_result(result, "multigpu.json", [args.out, RESULTS if args.device == "cuda" else None])
    return result


def command_line(args) -> str:
    argv = list(args.argv)
    if "--out" in argv and argv.index("--out") + 1 < len(argv):
        argv[argv.index("--out") + 1] = "DIR"
    return "PYTHONPATH=src python3 bench/multigpu.py " + " ".join(shlex.quote(a) for a in argv)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'part':<12} {'what':<34} {'gpus':>4} {'value':>12} {'unit':<26} notes")
    for r in rows:
        sh = r["shape"]
        what = sh.get("variant") or sh.get("metric", "")
        value = value_of(r) if sh.get("part") == "scaling" else r.get("tilewise")
        shown = f"{value:,.4g}" if isinstance(value, (int, float)) else "-"
        notes = []
        for key in ("scaling", "ratio_best_peer", "peak_mem_gb", "one_gpu", "loss_rel_diff", "agrees", "meets_goal"):
            if r.get(key) is not None:
                notes.append(f"{key} {r[key]}")
        if r.get("error"):
            notes.append(f"ERROR {r['error'][:120]}")
        print(f"{sh.get('part', '?'):<12} {what:<34} {sh.get('gpus', ''):>4} {shown:>12} {r['unit']:<26} "
              f"{', '.join(notes)}")


# ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write multigpu.json into this directory")
    p.add_argument("--quick", action="store_true", help="fsdp and the peer only; checkpoints every 20 steps; a "
                                                        "50-step fsdp correctness run")
    p.add_argument("--gpus", default="1,2,4,8",
                   help="GPU counts to measure, those the machine has (default 1,2,4,8; leave 1 out when merging with "
                        "an earlier call's 1-GPU rows). Checkpoint and correctness use the largest")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the same flow with gloo, the tiny preset and 2 processes (a smoke test)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--variants", help=f"scaling variants, comma list of {', '.join(SCALING_VARIANTS)}")
    p.add_argument("--correctness-variants", help=f"comma list of {', '.join(CORRECTNESS_VARIANTS)}")
    p.add_argument("--preset", help="scaling and checkpoint: the tilewise preset (default gpt-1.3b on cuda)")
    p.add_argument("--rows-per-gpu", type=int, help="scaling and checkpoint: rows per GPU and step (default 8)")
    p.add_argument("--correctness-preset", help="correctness: the preset (default gpt-1.3b on cuda)")
    p.add_argument("--correctness-rows-per-gpu", type=int, help="correctness: rows per GPU (default 1 on cuda)")
    p.add_argument("--steps", type=int, help="scaling: timed steps per launch (default 20 on cuda)")
    p.add_argument("--correctness-steps", type=int, help="correctness: steps per run (default 200 on cuda)")
    p.add_argument("--ckpt-every", type=int, help="checkpoint: steps between saves (default 50 on cuda: a 1.3B save "
                                                  "should be durable before the next one starts)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="time for the whole script (default 540, for a 10-minute device call; 0: none)")
    p.add_argument("--launch-timeout-s", type=float, help="the most one launch may take (default 480 on cuda)")
    p.add_argument("--merge", metavar="FILE", help="keep this earlier multigpu.json's rows not measured again")
    p.add_argument("--profile", action="store_true",
                   help="scaling: after the timed steps, profile a few more (train.profile_steps) and keep each "
                        "rank's GPU time by kind, exposed communication among it, in the row's details")
    p.add_argument("--work", help="folder for data and runs (default: a new temporary folder, removed at the end)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    def comma(text, allowed, name):
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            p.error(f"--{name} {text!r}: expected a comma list of {', '.join(allowed)}")
        return items
    args.parts = comma(args.parts, PARTS, "parts")
    if args.variants:
        args.variants = comma(args.variants, tuple(SCALING_VARIANTS), "variants")
    if args.correctness_variants:
        args.correctness_variants = comma(args.correctness_variants, CORRECTNESS_VARIANTS, "correctness-variants")
    try:
        args.gpus = sorted({int(x) for x in args.gpus.split(",") if x.strip()})
    except ValueError:
        p.error(f"--gpus {args.gpus!r}: expected a comma list of GPU counts, e.g. 1,2,4,8")
    if not args.gpus or min(args.gpus) < 1:
        p.error(f"--gpus {args.gpus}: expected counts of at least 1")
    from tilewise.config import PRESETS
    for name in ("preset", "correctness_preset"):
        if getattr(args, name) is not None and getattr(args, name) not in PRESETS:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: expected one of {', '.join(PRESETS)}")
    for name in ("steps", "correctness_steps", "ckpt_every", "rows_per_gpu", "correctness_rows_per_gpu"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}={value}: expected at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(MULTICAST_OFF)
    s = settings_for(args.device, args.quick)
    if args.steps:
        s.steps = -(-args.steps // s.log_every) * s.log_every   # whole logged intervals
    for name in ("preset", "rows_per_gpu", "correctness_preset", "correctness_rows_per_gpu", "correctness_steps",
                 "ckpt_every", "launch_timeout_s"):
        if getattr(args, name):
            setattr(s, name, getattr(args, name))
    if args.device == "cuda":
        import torch
        available = torch.cuda.device_count()   # no CUDA context in this process: the launches own the GPUs
        if available < 1:
            print("bench/multigpu.py: no CUDA GPU here (use --device cpu for the smoke test)", file=sys.stderr)
            return 2
    else:
        available = 2
    counts = [g for g in args.gpus if g <= available]
    missing = [g for g in args.gpus if g > available]
    if not counts:
        print(f"bench/multigpu.py: --gpus {','.join(map(str, args.gpus))}, but this machine has {available}",
              file=sys.stderr)
        return 2
    work = args.work or tempfile.mkdtemp(prefix="tilewise-multigpu-")
    os.makedirs(work, exist_ok=True)
    bench = Bench(s, args, work, counts)
    if missing:
        bench.not_measured.append(f"{', '.join(map(str, missing))} GPUs: this machine has {available}")
    print(f"bench/multigpu.py: {args.device}, counts {counts}, parts {', '.join(args.parts)}, "
          f"budget {args.budget_s:.0f} s, work {work}", flush=True)

    def on_term(signum, frame):   # a stopped script stops its launch too (torchrun ends its workers)
        if _current is not None:
            _stop(_current)
        sys.exit(128 + signum)
    previous_handler = signal.signal(signal.SIGTERM, on_term)
    try:
        for part in args.parts:
            if part == "scaling":
                bench.scaling(args.variants or list(s.variants))
            elif part == "checkpoint":
                bench.checkpoint()
            else:
                bench.correctness(args.correctness_variants or list(s.correctness_variants))
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    result = write_results(bench.rows, args, bench.header(), bench.not_measured)
    print_table(result["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
