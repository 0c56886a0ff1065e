"""Multi-process checkpoints on CPU (gloo, FSDP2): save with N ranks, load into M, every tensor bitwise equal;
kill -9 of a rank in the middle of an asynchronous save leaves the previous checkpoint as latest, intact."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from tilewise.checkpoint import Checkpointer, load_tensors
from tilewise.config import ModelConfig
from tilewise.model import GPT

pytest.importorskip("torch.distributed.fsdp")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ckpt_worker.py")
sys.path.insert(0, HERE)
import ckpt_worker  # noqa: E402


def start(scenario: str, world: int, args: dict) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, WORKER, scenario, str(world), json.dumps(args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(scenario: str, world: int, args: dict, timeout: float = 120) -> str:
    proc = start(scenario, world, args)
    try:
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"{world} ranks of {scenario} failed:\n{out[-6000:]}"
    return out


@pytest.fixture(scope="module")
def single_process_checkpoint(tmp_path_factory):
    """A checkpoint written by one process without torch.distributed, after two AdamW steps."""
    base = tmp_path_factory.mktemp("reshard")
    torch.manual_seed(0)
    model = GPT(ModelConfig(**ckpt_worker.CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(2):
        idx = torch.randint(0, 100, (2, 17), generator=gen)
        model(idx[:, :-1], idx[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.manual_seed(100)
    tensors = {**ckpt_worker.named_state(model, optimizer), "rng.cpu": torch.get_rng_state()}
    Checkpointer(base / "ckpt1", chunk_bytes=256).save(2, tensors, {"data": {"next_batch": 2}})
    ref = {k: v.clone() for k, v in tensors.items() if k != "rng.cpu"}
    ref["rng.cpu.rank0"] = tensors["rng.cpu"]
    save_file(ref, base / "ref1.safetensors")
    return base


def check_single_process_load(ckpt_root, ref_path, saved_world):
    from safetensors.torch import load_file
    tensors, state = Checkpointer(ckpt_root).load()
    ref = load_file(ref_path)
    assert sorted(k for k in tensors if k != "rng.cpu") == sorted(k for k in ref if not k.startswith("rng."))
    for name, value in tensors.items():
        expected = ref["rng.cpu.rank0" if name == "rng.cpu" else name]
        assert value.dtype == expected.dtype and torch.equal(value, expected), name
    manifest = json.load(open(os.path.join(Checkpointer(ckpt_root).latest(), "manifest.json")))
    assert manifest["world_size"] == saved_world
    assert len(manifest["files"]) == saved_world
    return state


def test_reshard_1_to_2_to_3_to_1(single_process_checkpoint):
    base = single_process_checkpoint
    outs = run("train", 2, {"load_from": str(base / "ckpt1"), "ref_in": str(base / "ref1.safetensors"),
                            "expect_step": 2, "init_seed": 5, "steps": 1, "save_to": str(base / "ckpt2"),
                            "ref_out": str(base / "ref2.safetensors")})
    assert outs.count("bitwise equal") == 2
    outs = run("train", 3, {"load_from": str(base / "ckpt2"), "ref_in": str(base / "ref2.safetensors"),
                            "expect_step": 3, "init_seed": 6, "steps": 1, "save_to": str(base / "ckpt3"),
                            "ref_out": str(base / "ref3.safetensors"), "async": True})
    assert outs.count("bitwise equal") == 3
    # 2 -> 1 and 3 -> 1: a single process without torch.distributed reads whole tensors
    assert check_single_process_load(base / "ckpt2", base / "ref2.safetensors", 2)["step"] == 3
    assert check_single_process_load(base / "ckpt3", base / "ref3.safetensors", 3)["step"] == 4
    # The 3-rank checkpoint's model loads into a plain (unsharded) GPT for inference.
    model = GPT(ModelConfig(**ckpt_worker.CONFIG))
    targets = {f"model.{k}": v for k, v in model.state_dict().items()}
    Checkpointer(base / "ckpt3").load_into(targets, strict=False)
    full, _ = load_tensors(Checkpointer(base / "ckpt3").latest(), [f"model.{k}" for k in model.state_dict()])
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[f"model.{k}"]), k


def test_reshard_4_to_2(single_process_checkpoint, tmp_path):
    base = single_process_checkpoint
    run("train", 4, {"load_from": str(base / "ckpt1"), "ref_in": str(base / "ref1.safetensors"),
                     "expect_step": 2, "init_seed": 7, "steps": 1, "save_to": str(tmp_path / "ckpt4"),
                     "ref_out": str(tmp_path / "ref4.safetensors"), "mesh_root": str(tmp_path / "mesh"),
                     "mesh_save": True})
    outs = run("train", 2, {"load_from": str(tmp_path / "ckpt4"), "ref_in": str(tmp_path / "ref4.safetensors"),
                            "expect_step": 3, "init_seed": 8, "mesh_root": str(tmp_path / "mesh")})
    assert outs.count("loaded") == 2 and outs.count("mesh tensors bitwise equal") == 2
    # On the 2x2 mesh, replicas write nothing twice: x (Replicate, Shard(0)) has two shards, not four.
    mesh = json.load(open(tmp_path / "mesh" / "step_00000001" / "manifest.json"))["tensors"]
    assert len(mesh["x"]["shards"]) == 2 and len(mesh["y"]["shards"]) == 4 and len(mesh["z"]["shards"]) == 4
    assert sorted(s["offsets"][1] for s in mesh["z"]["shards"]) == [0, 3, 6, 9]
    manifest = json.load(open(os.path.join(tmp_path, "ckpt4", "step_00000003", "manifest.json")))
    assert manifest["world_size"] == 4
    # Every rank wrote a share: FSDP2 shards, plus rows of the replicated tensors.
    assert all(f["bytes"] > 4096 for f in manifest["files"].values())
    assert "read" in outs and "of" in outs


@pytest.mark.parametrize("world", [1, 2])
def test_kill_9_during_async_save_keeps_previous_checkpoint(tmp_path, world):
    root = tmp_path / "ckpt"
    proc = start("crash", world, {"root": str(root), "stall_rank": world - 1})
    try:
        deadline, line = time.time() + 90, ""
        while not line.startswith("STALLED") and time.time() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert line.startswith("STALLED"), f"the writer never stalled: {line!r}, {proc.poll()}"
        assert os.path.isdir(root / "step_00000002.tmp")
        os.kill(int(line.split()[1]), signal.SIGKILL)
        out = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"EXIT {world - 1} -9" in out, out
    if world > 1:   # the survivor learns of it: its save fails with an error that names a rank
        assert "EXIT 0 0" in out and "ERROR" in out and "rank" in out and "NO ERROR" not in out, out
    ckpt = Checkpointer(root)
    assert ckpt.latest() == str(root / "step_00000001")
    assert open(root / "latest").read().strip() == "step_00000001"
    assert not (root / "step_00000002").exists()
    tensors, state = ckpt.load()
    expected = ckpt_worker.crash_tensors(0, world)
    assert state == {"data": {"next_batch": 1}, "step": 1}
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    # The next save clears the half-written directory.
    ckpt.save(3, expected, {})
    assert not (root / "step_00000002.tmp").exists() and ckpt.latest() == str(root / "step_00000003")
