"""The trainer end to end on CPU: loss falls on real text, resume is exact, the run directory is complete."""
import json
import os
import shutil
import sysconfig

import pytest

from tilewise.config import load_config
from tilewise.metrics import read_metrics
from tilewise.train import train


def stdlib_subset(tmp_path_factory):
    """A slice of the real corpus: a few packages of Python's standard library (~1 MB of source)."""
    root = sysconfig.get_paths()["stdlib"]
    return [os.path.join(root, name) for name in ("json", "email", "http", "logging")]


def small_run(tmp_path, inputs, steps, **extra):
    overrides = [
        f"data.dir={json.dumps(str(tmp_path / 'data'))}", f"data.inputs={json.dumps(inputs)}",
        "data.vocab_size=512", f"train.out_dir={json.dumps(str(tmp_path / 'run'))}",
        "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=64",
        "train.batch_size=8", f"train.max_steps={steps}", "train.warmup_steps=5", "train.lr=3e-3",
        "train.log_every=1", f"train.eval_every={steps}", "train.eval_batches=2", "train.progress=false",
    ]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_config("tiny", overrides=overrides)


def test_loss_falls_on_real_text_and_run_dir_is_complete(tmp_path, tmp_path_factory):
    cfg = small_run(tmp_path, stdlib_subset(tmp_path_factory), steps=60)
    summary = train(cfg)
    records = read_metrics(cfg.train.out_dir)
    assert [r["step"] for r in records] == list(range(1, 61))
    first = sum(r["loss"] for r in records[:5]) / 5
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert last < first - 0.6, (first, last)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_ms", "data_wait_ms", "mem_gb"):
        assert key in records[-1]
    assert "val_loss" in records[-1]
    for key in ("final_val_loss", "unigram_val_loss", "tokens_seen", "wall_s", "params"):
        assert key in summary
    assert summary["tokens_seen"] == 60 * 8 * 64
    assert summary["cuda_graphs"] is False     # train.cuda_graphs=auto stays eager on CPU
    assert summary["final_val_loss"] < summary["unigram_val_loss"]
    run = cfg.train.out_dir
    with open(os.path.join(run, "summary.json")) as f:
        assert json.load(f)["final_val_loss"] == summary["final_val_loss"]
    assert os.path.getsize(os.path.join(run, "loss.png")) > 1000
    assert os.path.isdir(os.path.join(run, "checkpoints", "step_00000060"))
    with open(os.path.join(run, "checkpoints.jsonl")) as f:
        saves = [json.loads(line) for line in f]
    assert [s["step"] for s in saves] == [60]
    assert 0 <= saves[0]["blocked_s"] <= saves[0]["durable_s"] and saves[0]["bytes"] > 0


def test_checkpoint_at_end_off_saves_nothing_at_the_end(tmp_path, tmp_path_factory):
    """checkpoint.at_end=false: the periodic saves happen, the end-of-run save does not."""
    cfg = small_run(tmp_path, stdlib_subset(tmp_path_factory), steps=6, **{"checkpoint.every": 4,
                                                                           "checkpoint.at_end": "false"})
    train(cfg)
    ckpts = os.path.join(cfg.train.out_dir, "checkpoints")
    assert sorted(n for n in os.listdir(ckpts) if n.startswith("step_")) == ["step_00000004"]


@pytest.mark.parametrize("dropout, accum", [(0.0, 1), (0.1, 2)])
def test_resume_reproduces_uninterrupted_losses_exactly(tmp_path, tmp_path_factory, dropout, accum):
    inputs = stdlib_subset(tmp_path_factory)[:1]
    full = small_run(tmp_path / "full", inputs, steps=16, **{"checkpoint.every": 8, "model.dropout": dropout,
                                                              "train.grad_accum": accum})
    train(full)
    losses = [r["loss"] for r in read_metrics(full.train.out_dir)]
    assert len(losses) == 16

    # A second run directory that holds only the step-8 checkpoint, resumed to step 16.
    resumed = small_run(tmp_path / "full", inputs, steps=16, **{"checkpoint.every": 8, "model.dropout": dropout,
                                                                 "train.grad_accum": accum})
    resumed.train.out_dir = str(tmp_path / "resumed")
    ckpt = os.path.join(resumed.train.out_dir, "checkpoints")
    os.makedirs(ckpt)
    shutil.copytree(os.path.join(full.train.out_dir, "checkpoints", "step_00000008"),
                    os.path.join(ckpt, "step_00000008"))
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("step_00000008\n")
    train(resumed, resume=True)
    resumed_losses = [r["loss"] for r in read_metrics(resumed.train.out_dir)]
    assert resumed_losses == losses[8:]


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_clipping_folded_into_fused_adamw_matches_clip_grad_norm(grad_clip):
    """With fused AdamW the clipping is the optimizer's gradient divisor (no pass over the gradients): the
    weights after a few steps match clip_grad_norm_ + foreach AdamW, and grad_clip 0 clips nothing."""
    from contextlib import nullcontext

    import torch
    from tilewise.model import GPT
    from tilewise.train import _clip_folds_into_adamw, make_step
    cfg = load_config("tiny", overrides=["model.n_layer=1", "model.d_model=32", "model.n_head=2",
                                         "model.seq_len=16"])
    cfg.model.vocab_size = 64
    torch.manual_seed(0)
    models = [GPT(cfg.model) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    initial = [p.detach().clone() for p in models[0].parameters()]
    # eps 1: the update follows the gradient's scale, so clipping changes where the weights go
    folded = torch.optim.AdamW(models[0].parameters(), lr=1e-2, eps=1.0, fused=True)
    plain = torch.optim.AdamW(models[1].parameters(), lr=1e-2, eps=1.0, foreach=True)
    unclipped = torch.optim.AdamW(models[2].parameters(), lr=1e-2, eps=1.0, foreach=True)
    assert _clip_folds_into_adamw(folded) and not _clip_folds_into_adamw(plain)
    steps = [make_step(models[0], models[0], folded, None, nullcontext, 1, grad_clip),
             make_step(models[1], models[1], plain, None, nullcontext, 1, grad_clip if grad_clip > 0 else 1e9),
             make_step(models[2], models[2], unclipped, None, nullcontext, 1, 1e9)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 64, (4, 16), generator=gen)
        norms = [float(step(lambda k: (x, (3 * x + 1) % 64))[1]) for step in steps]
        assert abs(norms[0] - norms[1]) <= 1e-4 * norms[1]
    for p, q, p0 in zip(models[0].parameters(), models[1].parameters(), initial):
        moved = (q - p0).norm().item()
        assert moved > 0 and (p - q).norm().item() <= 1e-3 * moved
    away = sum((q - r).norm().item() for q, r in zip(models[1].parameters(), models[2].parameters()))
    moved = sum((r - p0).norm().item() for r, p0 in zip(models[2].parameters(), initial))
    assert (away > 0.5 * moved) if grad_clip > 0 else away == 0   # clipping (norms ~1 against 0.05) mattered


def test_step_runs_the_backward_on_the_calling_thread():
    """make_step's backward runs with autograd's device worker threads off (each handoff to them costs
    host time), and the setting is restored after the step."""
    from contextlib import nullcontext

    import torch
    from tilewise.model import GPT
    from tilewise.train import make_step
    cfg = load_config("tiny", overrides=["model.n_layer=1", "model.d_model=32", "model.n_head=2",
                                         "model.seq_len=16"])
    cfg.model.vocab_size = 64
    model = GPT(cfg.model)
    seen = []
    model.register_full_backward_pre_hook(lambda mod, grad: seen.append(torch._C._is_multithreading_enabled()))
    step = make_step(model, model, torch.optim.AdamW(model.parameters(), lr=1e-3), None, nullcontext, 2, 1.0)
    x = torch.randint(0, 64, (4, 16))
    step(lambda k: (x, x))
    assert seen == [False, False] and torch._C._is_multithreading_enabled()
