"""`tilewise ckpt inspect` and `tilewise export`: output on success, one line and status 2 on a user mistake."""
import json
import os
import sys

import torch

from tilewise.checkpoint import Checkpointer
from tilewise.cli import main

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_ckpt_export import make_run  # noqa: E402


def test_ckpt_inspect_prints_the_manifest(tmp_path, capsys):
    Checkpointer(tmp_path / "run" / "checkpoints").save(
        9, {"model.w": torch.ones(6, 2), "rng.cpu": torch.zeros(3, dtype=torch.uint8)}, {})
    assert main(["ckpt", "inspect", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("step_00000009: step 9, 1 ranks, 2 tensors, 1 files, " + lines[0].split("files, ")[1])
    assert lines[1].split() == ["tensor", "dtype", "shape", "kind", "shards", "bytes", "files"]
    assert lines[2].split() == ["model.w", "float32", "6x2", "replicated", "1", "48", "0"]
    assert lines[3].split() == ["rng.cpu", "uint8", "3", "per_rank", "1", "3", "0"]


def test_ckpt_inspect_mistakes_are_one_line(tmp_path, capsys):
    assert main(["ckpt", "inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory" in err
    assert main(["ckpt", "inspect", str(tmp_path)]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_export_command(tmp_path, capsys):
    run, _ = make_run(tmp_path, "gpt2")
    out = tmp_path / "hf"
    assert main(["export", "--run", run, "--format", "hf", str(out)]) == 0
    assert "GPT2LMHeadModel, step 5, vocab 128" in capsys.readouterr().out
    assert json.load(open(out / "config.json"))["architectures"] == ["GPT2LMHeadModel"]
    assert os.path.isfile(out / "model.safetensors")
    assert main(["export", "--run", str(tmp_path / "nope"), str(out)]) == 2
    assert "not a run directory" in capsys.readouterr().err
