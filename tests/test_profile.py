"""tilewise.profile: the trace summary's arithmetic on made-up events, the step window, and the trainer's
profile_rank{R}.json on the GPU."""
import json
import os

import pytest
import torch

from tilewise.config import ConfigError, load_config
from tilewise.profile import StepProfiler, kind_of, parse_steps, summarize_trace


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_kinds_by_name():
    assert kind_of("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert kind_of("_attn_bwd_dkdv") == "attention"
    assert kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "gemm"
    assert kind_of("multi_tensor_apply_kernel") == "optimizer"
    assert kind_of("_layer_norm_fwd") == "memory_bound"


def test_summary_busy_idle_and_exposed_communication():
    """Two steps over 0..100 ms: a GEMM 0-40, an all-gather 30-70 (10 ms of it overlapped), a norm 80-90, a
    copy 95-100 (trace times are microseconds)."""
    events = [kernel("cutlass_gemm", 0, 40e3), kernel("ncclDevKernel_AllGather", 30e3, 40e3),
              kernel("_norm_fwd", 80e3, 10e3),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500e3},   # host events: ignored
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 95e3, "dur": 5e3}]
    got = summarize_trace(events, steps=2)
    ms = got["breakdown_ms"]
    assert ms["gemm"] == 20 and ms["communication"] == 20 and ms["memory_bound"] == 7.5
    assert ms["wall"] == 50 and ms["busy"] == 42.5 and ms["idle"] == 7.5   # busy: 0-70, 80-90, 95-100
    assert ms["communication_exposed"] == 15   # 30 of its 40 ms ran beside no compute kernel
    assert {k["name"] for k in got["top_kernels"][:2]} == {"cutlass_gemm", "ncclDevKernel_AllGather"}
    assert all(k["calls"] == 0.5 for k in got["top_kernels"])   # one launch each over two steps
    assert [(k["name"], k["ms"]) for k in got["memory_bound_kernels"]] == [("_norm_fwd", 5), ("Memcpy DtoD", 2.5)]
    assert summarize_trace([events[3]], 1) == {"error": "the profiler recorded no GPU activity"}


def test_gemm_launches_are_told_apart_by_grid():
    """One GEMM kernel at two layers' shapes (grids) is two launch rows; the same grid twice is one row with
    its calls summed; a GEMM event without args has an empty grid; non-GEMMs are not listed."""
    def gemm(ts, dur, grid=None):
        e = kernel("nvjet_sm90_tst_128x256", ts, dur)
        if grid is not None:
            e["args"] = {"grid": grid, "block": [384, 1, 1]}
        return e
    events = [gemm(0, 4e3, [132, 1, 1]), gemm(5e3, 4e3, [132, 1, 1]), gemm(10e3, 10e3, [66, 2, 1]),
              gemm(30e3, 1e3), kernel("_norm_fwd", 40e3, 1e3)]
    got = summarize_trace(events, steps=2)["gemm_launches"]
    assert got == [{"name": "nvjet_sm90_tst_128x256", "grid": [66, 2, 1], "ms": 5, "calls": 0.5},
                   {"name": "nvjet_sm90_tst_128x256", "grid": [132, 1, 1], "ms": 4, "calls": 1},
                   {"name": "nvjet_sm90_tst_128x256", "grid": [], "ms": 0.5, "calls": 0.5}]


@pytest.mark.parametrize("spec", ["5", "3:3", "4:2", "-1:2", "a:b", "1:2:3"])
def test_bad_windows_are_refused_by_name(spec):
    with pytest.raises(ValueError, match="train.profile_steps"):
        parse_steps(spec)
    with pytest.raises(ConfigError, match="train.profile_steps"):
        load_config("tiny", overrides=[f'train.profile_steps="{spec}"'])


def test_window_outside_cuda_writes_nothing(tmp_path):
    assert parse_steps("") is None and parse_steps("2:5") == (2, 5)
    prof = StepProfiler((0, 2), str(tmp_path / "p.json"), torch.device("cpu"))
    for step in range(3):
        prof.before(step)
        prof.after(step)
    prof.close()
    assert not os.path.exists(tmp_path / "p.json")


def test_cpu_trainer_says_it_profiles_nothing(tmp_path, capsys):
    from test_train import small_run, stdlib_subset
    from tilewise.train import train
    cfg = small_run(tmp_path, stdlib_subset(None)[:1], steps=3, **{"train.profile_steps": '"1:2"',
                                                                   "train.device": '"cpu"'})
    train(cfg)
    assert "nothing is profiled on cpu" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(cfg.train.out_dir, "profile_rank0.json"))


@pytest.mark.gpu
def test_gpu_trainer_writes_the_profile_of_its_window(tmp_path):
    from test_train import small_run, stdlib_subset
    from tilewise.train import train
    cfg = small_run(tmp_path, stdlib_subset(None), steps=8, **{"train.profile_steps": '"3:6"',
                                                               "train.device": '"cuda"'})
    train(cfg)
    with open(os.path.join(cfg.train.out_dir, "profile_rank0.json")) as f:
        got = json.load(f)
    assert got["steps"] == [3, 6]
    ms = got["breakdown_ms"]
    assert ms["gemm"] > 0 and ms["busy"] > 0 and ms["busy"] <= ms["wall"] + 1e-6
    assert ms["communication"] == 0
