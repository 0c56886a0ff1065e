"""FP8 in the trainer: a few steps of a tiny GPT with each recipe, through tilewise.train.train.

The H200 once gave a finite loss at step 1 and NaN from step 2 on (tiny preset at GPU size, bf16 autocast,
recipe "delayed", strategy ddp on one GPU): the gpu tests below run that configuration, with each recipe and
both strategies; the CPU test runs the same loop on the reference ops.
"""
import json

import numpy as np
import pytest
import torch

from tilewise.config import load_config
from tilewise.data import write_token_shards
from tilewise.metrics import read_metrics
from tilewise.train import train

RECIPES = ["delayed", "current", "blockwise"]


def learnable_tokens(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """Zipf-distributed tokens, each followed by a fixed successor: a stream a few steps already learn from."""
    rng = np.random.default_rng(seed)
    x = np.empty(n, np.int64)
    x[0::2] = rng.zipf(1.3, (n + 1) // 2) % (vocab - 1) + 1
    x[1::2] = (x[0::2][:n // 2] * 7) % (vocab - 1) + 1
    return x


def run(tmp_path, name, steps, vocab, **settings):
    """Train on a synthetic corpus in tmp_path/data; returns (losses per step, summary)."""
    data = tmp_path / "data"
    if not (data / "meta.json").exists():
        x = learnable_tokens(vocab, 1 << 19)
        write_token_shards(str(data), {"train": x, "val": x[-(1 << 14):]}, vocab_size=vocab, eot_id=0)
    out = tmp_path / name
    settings = {"data.dir": json.dumps(str(data)), "train.out_dir": json.dumps(str(out)),
                "train.max_steps": steps, "train.warmup_steps": 2, "train.lr": 3e-3, "train.log_every": 1,
                "train.eval_every": steps, "train.eval_batches": 1, "train.progress": "false",
                "checkpoint.every": 0, **settings}
    cfg = load_config("tiny", overrides=[f"{k}={v}" for k, v in settings.items()])
    summary = train(cfg)
    return [r["loss"] for r in read_metrics(str(out))], summary


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_train_on_cpu(tmp_path, recipe):
    losses, summary = run(tmp_path, recipe, 8, 512, **{"fp8.recipe": recipe, "train.device": "cpu",
                                                       "model.n_layer": 2, "model.seq_len": 64,
                                                       "train.batch_size": 8})
    assert len(losses) == 8 and all(np.isfinite(losses)), losses
    assert np.isfinite(summary["final_val_loss"])
    assert sum(losses[-3:]) < sum(losses[:3]), losses


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["none", "ddp"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_tiny_trainer_losses_stay_finite(tmp_path, recipe, strategy):
    """The failing run's configuration: the tiny preset at GPU size (d_model 512, 8 heads, 17M parameters
    with a vocabulary of 8192), bf16 autocast, fp32 master weights, fused AdamW, clipping, one GPU."""
    losses, summary = run(tmp_path, f"{recipe}-{strategy}", 10, 8192, **{
        "fp8.recipe": recipe, "distributed.strategy": strategy, "train.device": "cuda",
        "model.d_model": 512, "model.n_head": 8})
    assert all(np.isfinite(losses)), f"{recipe}/{strategy} losses {losses}"
    assert np.isfinite(summary["final_val_loss"]), summary
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_recipes_replay_in_cuda_graphs(tmp_path, recipe):
    """The step captured whole (train.cuda_graphs=true, see tilewise/graphs.py) with each recipe's casts and
    GEMMs inside: the replayed steps' losses stay finite and fall, and match the eager run's to bf16
    rounding (1e-3 relative)."""
    runs = {}
    for graphs in ("false", "true"):
        runs[graphs], _ = run(tmp_path, f"{recipe}-graphs-{graphs}", 10, 8192, **{
            "fp8.recipe": recipe, "train.device": "cuda", "train.cuda_graphs": graphs,
            "model.d_model": 512, "model.n_head": 8})
    eager, graphed = runs["false"], runs["true"]
    assert all(np.isfinite(graphed)) and sum(graphed[-3:]) < sum(graphed[:3]), graphed
    for i, (e, g) in enumerate(zip(eager, graphed)):
        assert abs(e - g) <= 1e-3 * abs(e), (i, eager, graphed)
