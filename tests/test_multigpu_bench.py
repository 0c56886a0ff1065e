"""bench/multigpu.py: its arithmetic on made-up records, its bookkeeping with a fake torchrun (a failing launch
keeps the other rows, a spent budget skips launches), the multicast-off environment reaching torchrun's workers,
and real CPU launches: the checkpoint part (save with 2 ranks, resume with 1) in CI, the whole flow on request
(TILEWISE_MULTIGPU_SMOKE=1, about 2-3 minutes on 2 cores) and a small run on one GPU (gpu marker).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    """bench/<name>.py as module bench_<name> (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mg = _load("multigpu")


# ------------------------------------------------------------------------------------------------
# Arithmetic
# ------------------------------------------------------------------------------------------------

def test_grad_accum_fits_the_rows_per_gpu():
    assert mg.grad_accum_for(64, 8, 8) == 1
    assert mg.grad_accum_for(64, 4, 8) == 2
    assert mg.grad_accum_for(64, 1, 8) == 8
    assert mg.grad_accum_for(12, 3, 3) == 2    # 12 rows, 3 ranks: 2 micro-batches of 2 rows
    with pytest.raises(ValueError, match="world=0"):
        mg.grad_accum_for(8, 0, 8)


def test_throughput_leaves_out_the_warmup_interval():
    # 5 steps per record: the first interval is slow (autotuning) and must not count
    records = [{"step": 5, "step_ms": 1000.0, "loss": 9.0, "mfu": 0.1},
               {"step": 10, "step_ms": 100.0, "loss": 8.0, "mfu": 0.4},
               {"step": 15, "step_ms": 300.0, "loss": 7.0, "mfu": 0.2}]
    t = mg.throughput(records, log_every=5, global_rows=16, seq=128, gpus=2)
    assert t["timed_steps"] == 10
    assert t["step_ms"] == pytest.approx(200.0)
    assert t["tokens_per_s_per_gpu"] == pytest.approx(16 * 128 * 10 / 2.0 / 2)
    assert t["mfu"] == pytest.approx((0.4 * 100 + 0.2 * 300) / 400)   # weighted by time, not a plain mean
    assert t["final_loss"] == 7.0
    with pytest.raises(ValueError, match="warm-up"):
        mg.throughput(records[:1], log_every=5, global_rows=16, seq=128, gpus=2)


class FakeWatcher:
    def __init__(self, first_seen):
        self.first_seen = first_seen

    durable_s = mg.CheckpointWatcher.durable_s


def test_save_timings_from_the_step_after_each_save_and_the_folder():
    every, max_steps = 3, 9
    ms = {s: 100.0 for s in range(1, max_steps + 1)}
    ms[1] = 5000.0           # warm-up: not part of the typical step
    ms[4] += 900.0           # the step after the first save (buffer allocation)
    ms[7] += 50.0            # the step after the second
    records = [{"step": s, "step_ms": v} for s, v in ms.items()]
    name = mg.step_dir
    watcher = FakeWatcher({name(3) + ".tmp": 10.0, name(3): 10.4, name(6) + ".tmp": 20.0, name(6): 20.1,
                           name(9): 30.0})   # the last save's .tmp went unseen
    saves = mg.save_timings(records, watcher, every, max_steps, warmup=1)
    assert [x["step"] for x in saves] == [3, 6, 9]
    assert saves[0]["blocked_s"] == pytest.approx(0.9)
    assert saves[1]["blocked_s"] == pytest.approx(0.05)
    assert saves[2]["blocked_s"] is None          # no step after the final save
    assert saves[0]["durable_s"] == pytest.approx(0.4)
    assert saves[1]["durable_s"] == pytest.approx(0.1)
    assert saves[2]["durable_s"] is None
    assert saves[0]["next_save_waits"] is True    # durable after 0.4 s, the next save 3 steps (0.3 s) later
    assert saves[1]["next_save_waits"] is False


def test_save_timings_flag_a_save_still_writing_when_the_next_starts():
    records = [{"step": s, "step_ms": 100.0} for s in range(1, 7)]
    watcher = FakeWatcher({mg.step_dir(2) + ".tmp": 0.0, mg.step_dir(2): 1.0})
    saves = mg.save_timings(records, watcher, every=2, max_steps=6, warmup=0)
    assert saves[0]["next_save_waits"] is True    # durable after 1 s, the next save 2 steps (0.2 s) later


def test_compare_runs_agrees_within_tolerance_only():
    ref = [{"step": 10, "loss": 5.0}, {"step": 20, "loss": 4.0, "val_loss": 4.1}]
    close = [{"step": 10, "loss": 5.001}, {"step": 20, "loss": 4.002, "val_loss": 4.1001}]
    far = [{"step": 10, "loss": 5.0}, {"step": 20, "loss": 4.4, "val_loss": 4.1}]
    ok = mg.compare_runs(close, ref, tolerance=1e-3)
    assert ok["agrees"] and ok["loss_rel_diff"] == pytest.approx(5e-4, rel=1e-2)
    assert ok["max_rel_diff"] == pytest.approx(5e-4, rel=1e-2) and ok["learned"] == pytest.approx(1.0)
    bad = mg.compare_runs(far, ref, tolerance=1e-3)
    assert not bad["agrees"] and bad["loss_rel_diff"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="different steps"):
        mg.compare_runs(close[:1], ref, tolerance=1e-3)


def scaling_row(variant, gpus, value):
    strategy, precision = mg.SCALING_VARIANTS[variant]
    shape = {"part": "scaling", "model": "gpt-1.3b", "rows_per_gpu": 8, "seqlen": 2048, "variant": variant,
             "strategy": strategy, "precision": precision, "gpus": gpus}
    if variant == mg.PEER:
        return {"shape": shape, "unit": "tokens/s per GPU", "tilewise": None, mg.PEER: value}
    return {"shape": shape, "unit": "tokens/s per GPU", "tilewise": value}


def test_ratios_to_one_gpu_and_to_the_peer():
    rows = [scaling_row("fsdp", 1, 100.0), scaling_row("fsdp", 8, 92.0), scaling_row(mg.PEER, 1, 80.0),
            scaling_row(mg.PEER, 8, 40.0), scaling_row("ddp", 8, 50.0),
            dict(scaling_row("fsdp", 2, None), error="exit 1: boom")]
    mg.fill_ratios(rows)
    fsdp8, peer8, ddp8, failed = rows[1], rows[3], rows[4], rows[5]
    assert fsdp8["scaling"] == pytest.approx(0.92) and fsdp8["meets_goal"] is True
    assert fsdp8[mg.PEER] == 40.0 and fsdp8["ratio_best_peer"] == pytest.approx(2.3)
    assert peer8["scaling"] == pytest.approx(0.5)
    assert ddp8["scaling"] is None                  # no ddp run on 1 GPU to compare with
    assert "meets_goal" not in ddp8                 # the goal is fsdp's
    assert "scaling" not in failed


def test_merge_keeps_rows_not_measured_again():
    old = [scaling_row("fsdp", 1, 100.0), scaling_row("fsdp", 8, 70.0), scaling_row(mg.PEER, 8, 40.0)]
    new = [scaling_row("fsdp", 8, 90.0), scaling_row("ddp", 1, 95.0)]
    merged = mg.merge_rows(old, new)
    got = {(r["shape"]["variant"], r["shape"]["gpus"]): mg.value_of(r) for r in merged}
    assert got == {("fsdp", 1): 100.0, ("fsdp", 8): 90.0, (mg.PEER, 8): 40.0, ("ddp", 1): 95.0}
    assert [(r["shape"]["variant"], r["shape"]["gpus"]) for r in merged] == [
        ("fsdp", 1), ("fsdp", 8), (mg.PEER, 8), ("ddp", 1)]


def test_readme_tables_one_per_part_with_every_merged_command():
    tables = _load("tables")
    result = {"area": "multigpu", "commit": "abc", "commands": ["abc: first", "def: second"], "rows": [
        {"shape": {"part": "scaling", "gpus": 1}, "unit": "tokens/s per GPU", "tilewise": 10.0, "scaling": 1.0},
        {"shape": {"part": "checkpoint", "gpus": 2}, "unit": "s", "tilewise": 0.5, "GB": 3.0}]}
    text = "\n\n".join(tables.tables_of(result))
    assert "### multigpu: scaling" in text and "### multigpu: checkpoint" in text
    assert "`abc: first` + `def: second`" in text
    assert "| GB |" not in text.split("### multigpu: checkpoint")[0]   # each part's own columns


def test_failure_names_the_root_cause_not_torchruns_summary():
    output = ("tilewise train: error: rank 1: train.batch_size=3 is not a multiple of world size 2\n"
              "Traceback (most recent call last):\n  File \"run.py\", line 1\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert mg.failure_of(mg.Launch(1, 1.0, output, {}), 60) == (
        "exit 1: tilewise train: error: rank 1: train.batch_size=3 is not a multiple of world size 2")
    traceback = "Traceback (most recent call last):\nValueError: --preset llama-1b: not GPT-2\nChildFailedError: x\n"
    assert mg.failure_of(mg.Launch(1, 1.0, traceback, {}), 60) == "exit 1: ValueError: --preset llama-1b: not GPT-2"
    assert mg.failure_of(mg.Launch(None, 60.0, "", {}, timed_out=True), 60) == "timed out after 60 s (stopped)"


def test_bad_arguments_are_refused(capsys):
    for argv in (["--parts", "scaling,nope"], ["--variants", "zero3"], ["--gpus", "two"], ["--gpus", "0"],
                 ["--steps", "0"], ["--preset", "gpt-7b"]):
        with pytest.raises(SystemExit) as e:
            mg.parse_args(argv)
        assert e.value.code == 2
    assert "gpt-7b" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Bookkeeping with a fake torchrun
# ------------------------------------------------------------------------------------------------

def fake_torchrun(fail_when):
    """A torchrun that writes what a finished run writes (or fails when fail_when(nproc, target))."""
    calls = []

    def run(nproc, target, *, timeout, device, marks=()):
        calls.append((nproc, target))
        if fail_when(nproc, target):
            return mg.Launch(code=1, seconds=0.1, output="tilewise: rank 1 of 2 failed: RuntimeError: boom\n",
                             marks={})
        if target[0].endswith("multigpu_baseline.py"):
            out = target[target.index("--out") + 1]
            with open(out, "w") as f:
                json.dump({"tokens_per_s_per_gpu": 1000.0 / nproc, "step_ms": 10.0, "mfu": None, "peak_mem_gb": 1.0,
                           "final_loss": 7.0, "timed_steps": 4, "compile": False, "params": 1, "device": "cpu"}, f)
        else:
            sets = dict(a.split("=", 1) for a in target if "=" in a)
            out = json.loads(sets["train.out_dir"])
            os.makedirs(out, exist_ok=True)
            steps = int(sets["train.max_steps"])
            with open(os.path.join(out, "metrics.jsonl"), "w") as f:
                for step in range(2, steps + 1, 2):   # a profiled interval (after step 6) runs slower
                    f.write(json.dumps({"step": step, "step_ms": 100.0 * nproc * (1 if step <= 6 else 50),
                                        "loss": 9.0 - step, "mfu": None}) + "\n")
            if "train.profile_steps" in sets:
                for rank in range(nproc):
                    with open(os.path.join(out, f"profile_rank{rank}.json"), "w") as f:
                        json.dump({"steps": json.loads(sets["train.profile_steps"]), "rank": rank}, f)
            with open(os.path.join(out, "summary.json"), "w") as f:
                json.dump({"peak_mem_gb": 0.5, "device": "cpu"}, f)
        return mg.Launch(code=0, seconds=0.1, output="", marks={})
    return run, calls


def test_a_failing_launch_keeps_the_other_rows(monkeypatch, tmp_path):
    run, calls = fake_torchrun(lambda nproc, target: nproc == 2 and "fsdp" in " ".join(target)
                               and "baseline" not in target[0])
    monkeypatch.setattr(mg, "torchrun", run)
    out = tmp_path / "out"
    assert mg.main(["--device", "cpu", "--parts", "scaling", "--out", str(out), "--work", str(tmp_path / "w")]) == 0
    result = json.loads((out / "multigpu.json").read_text())
    rows = {(r["shape"]["variant"], r["shape"]["gpus"]): r for r in result["rows"]}
    assert set(rows) == {("fsdp", 1), ("fsdp", 2), (mg.PEER, 1), (mg.PEER, 2)}
    assert "boom" in rows["fsdp", 2]["error"] and rows["fsdp", 2]["tilewise"] is None
    assert rows["fsdp", 1]["tilewise"] > 0 and rows[mg.PEER, 2]["scaling"] == pytest.approx(0.5)
    assert result["area"] == "multigpu" and result["gpu"] == "cpu" and result["commit"]
    assert result["multicast_off"]["NCCL_NVLS_ENABLE"] == "0"
    assert "4, 8 GPUs" in result["not_measured"][0]
    assert len(calls) == 4
    assert not (tmp_path / "w" / "scaling-fsdp-1").exists()   # run folders are removed


def test_profile_runs_an_untimed_interval_and_keeps_every_ranks_summary(monkeypatch, tmp_path):
    run, calls = fake_torchrun(lambda nproc, target: False)
    monkeypatch.setattr(mg, "torchrun", run)
    out = tmp_path / "out"
    mg.main(["--device", "cpu", "--parts", "scaling", "--variants", "fsdp", "--out", str(out), "--profile"])
    sets = dict(a.split("=", 1) for a in calls[0][1] if "=" in a)
    assert sets["train.max_steps"] == "8" and json.loads(sets["train.profile_steps"]) == "7:8"
    rows = {r["shape"]["gpus"]: r for r in json.loads((out / "multigpu.json").read_text())["rows"]}
    assert rows[1]["step_ms"] == 100 and rows[2]["step_ms"] == 200   # the profiled interval is not timed
    assert [p["rank"] for p in rows[2]["details"]["profile"]] == [0, 1]


def test_a_later_call_merges_with_an_earlier_ones_rows(monkeypatch, tmp_path):
    """The workflow of several device calls: 1 GPU first, then 2 GPUs merged with it; ratios over both."""
    run, calls = fake_torchrun(lambda nproc, target: False)
    monkeypatch.setattr(mg, "torchrun", run)
    first, second = tmp_path / "first", tmp_path / "second"
    mg.main(["--device", "cpu", "--parts", "scaling", "--gpus", "1", "--out", str(first)])
    assert [c[0] for c in calls] == [1, 1]
    mg.main(["--device", "cpu", "--parts", "scaling", "--gpus", "2", "--out", str(second),
             "--merge", str(first / "multigpu.json")])
    assert [c[0] for c in calls] == [1, 1, 2, 2]          # the second call does not measure 1 GPU again
    merged = json.loads((second / "multigpu.json").read_text())
    rows = {(r["shape"]["variant"], r["shape"]["gpus"]): r for r in merged["rows"]}
    assert set(rows) == {("fsdp", 1), ("fsdp", 2), (mg.PEER, 1), (mg.PEER, 2)}
    assert [c.split("--gpus ")[1][0] for c in merged["commands"]] == ["1", "2"]   # both calls, in order
    assert rows["fsdp", 2]["scaling"] == pytest.approx(0.5) and rows[mg.PEER, 2]["scaling"] == pytest.approx(0.5)
    assert rows["fsdp", 2]["ratio_best_peer"] is not None
    assert mg.main(["--device", "cpu", "--gpus", "4", "--out", str(tmp_path / "none")]) == 2   # CPU: 2 processes


def test_a_spent_budget_skips_launches_and_says_so(monkeypatch, tmp_path):
    run, calls = fake_torchrun(lambda nproc, target: False)
    monkeypatch.setattr(mg, "torchrun", run)
    out = tmp_path / "out"
    mg.main(["--device", "cpu", "--budget-s", "1", "--out", str(out), "--work", str(tmp_path / "w")])
    rows = json.loads((out / "multigpu.json").read_text())["rows"]
    assert calls == []
    assert {r["shape"]["part"] for r in rows} == {"scaling", "checkpoint", "correctness"}
    assert all("skipped:" in r["error"] for r in rows)
    resumes = [r for r in rows if r["shape"].get("metric") == "resume_loss_rel_diff"]
    assert [r["shape"]["gpus"] for r in resumes] == [1]   # N = 2 processes on CPU: N/2 = 1
    assert resumes[0]["error"].startswith("not resumed")


# ------------------------------------------------------------------------------------------------
# Real launches
# ------------------------------------------------------------------------------------------------

def test_multicast_off_reaches_torchruns_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")   # even a caller's opposite setting is overridden
    script = tmp_path / "show_env.py"
    names = sorted(mg.MULTICAST_OFF)
    script.write_text(f"import json, os\nprint('ENV ' + json.dumps({{k: os.environ.get(k) for k in {names!r}}}))\n")
    launch = mg.torchrun(1, [str(script)], timeout=60, device="cpu", marks=("ENV ",))
    assert launch.code == 0, launch.output
    line = next(line for line in launch.output.splitlines() if line.startswith("ENV "))
    assert json.loads(line[4:]) == mg.MULTICAST_OFF
    assert "ENV " in launch.marks


@pytest.mark.slow
def test_cpu_checkpoint_saved_by_two_ranks_resumes_on_one(tmp_path):
    """Two real launches (about 30-40 s on 2 cores): fsdp on 2 ranks saving every 2 steps, then its step-4
    checkpoint resumed on 1 rank; fp32 on CPU, so the resumed losses match the 2-rank run's closely."""
    out = tmp_path / "out"
    assert mg.main(["--device", "cpu", "--parts", "checkpoint", "--out", str(out), "--budget-s", "300"]) == 0
    rows = json.loads((out / "multigpu.json").read_text())["rows"]
    by_metric = {r["shape"]["metric"]: r for r in rows}
    assert set(by_metric) == {"blocked_first_s", "blocked_s", "durable_s", "write_GBps", "resume_loss_rel_diff"}
    assert not [r for r in rows if r.get("error") and r["shape"]["metric"] in ("blocked_s", "resume_loss_rel_diff")]
    saves = by_metric["blocked_s"]["details"]["saves"]
    assert [x["step"] for x in saves] == [2, 4, 6, 8]
    assert by_metric["blocked_s"]["GB"] > 0
    resume = by_metric["resume_loss_rel_diff"]
    assert resume["shape"]["saved_gpus"] == 2 and resume["shape"]["gpus"] == 1 and resume["grad_accum"] == 2
    assert resume["agrees"] and resume["tilewise"] < 1e-4
    assert len(resume["details"]["losses"]) == 2


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TILEWISE_MULTIGPU_SMOKE") != "1",
                    reason="the whole CPU flow takes minutes: set TILEWISE_MULTIGPU_SMOKE=1")
def test_cpu_whole_flow(tmp_path):
    out = tmp_path / "out"
    assert mg.main(["--device", "cpu", "--out", str(out), "--budget-s", "600"]) == 0
    rows = json.loads((out / "multigpu.json").read_text())["rows"]
    errors = [(r["shape"], r["error"]) for r in rows if r.get("error")]
    assert not errors, errors
    scaling = [r for r in rows if r["shape"]["part"] == "scaling"]
    assert {(r["shape"]["variant"], r["shape"]["gpus"]) for r in scaling} == {
        ("fsdp", 1), ("fsdp", 2), (mg.PEER, 1), (mg.PEER, 2)}
    assert all(r["scaling"] > 0 and r["peak_mem_gb"] > 0 for r in scaling)
    correctness = [r for r in rows if r["shape"]["part"] == "correctness"]
    assert correctness and all(r["agrees"] and r["learned"] > 0.5 for r in correctness)


@pytest.mark.gpu
def test_gpu_one_gpu_scaling_and_checkpoint(tmp_path):
    """The flow on one GPU with GPT-2 124M (a few minutes): the trainer and the compiled FSDP2 peer give
    throughput, a save's blocked and durable times are observed, and the checkpoint resumes."""
    out = tmp_path / "out"
    mg.main(["--gpus", "1", "--preset", "gpt2-124m", "--rows-per-gpu", "8", "--parts", "scaling,checkpoint",
             "--variants", f"fsdp,{mg.PEER}", "--ckpt-every", "10", "--out", str(out), "--budget-s", "500"])
    rows = json.loads((out / "multigpu.json").read_text())["rows"]
    errors = [(r["shape"], r["error"]) for r in rows if r.get("error")]
    assert not errors, errors
    fsdp = next(r for r in rows if r["shape"].get("variant") == "fsdp")
    assert fsdp["tilewise"] > 0 and fsdp[mg.PEER] > 0 and fsdp["mfu"] > 0
    by_metric = {r["shape"].get("metric"): r for r in rows if r["shape"]["part"] == "checkpoint"}
    assert by_metric["durable_s"]["tilewise"] > 0
    assert by_metric["resume_loss_rel_diff"]["agrees"]
