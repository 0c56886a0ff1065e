"""The training loop: data -> model -> loss -> AdamW -> metrics and checkpoints.

One optimizer step consumes train.batch_size rows of model.seq_len tokens, in train.grad_accum
micro-batches. The loop syncs with the host only every log_every steps (to read the loss), never per step.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time

import torch

from .checkpoint import Checkpointer
from .config import Config, ConfigError
from .data import Prefetcher, TokenDataset, prepare, unigram_val_loss
from .metrics import Metrics, peak_flops, plot_losses, write_json
from .model import GPT


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but no CUDA GPU is available")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"train.device={name!r}; expected auto, cpu or cuda")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype: bf16 on GPU, fp32 on CPU (bf16 matmuls on CPU are slower, not faster)."""
    table = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ConfigError(f"train.dtype={name!r}; expected auto, bf16 or fp32")
    return table[name]


def data_dir_for(cfg: Config) -> str:
    if cfg.data.dir:
        return cfg.data.dir
    if cfg.data.inputs:
        raise ConfigError("data.inputs is set: also set data.dir, where its token shards go")
    return os.path.join("data", f"stdlib-{cfg.data.vocab_size}")


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr, then a cosine down to lr * min_lr_ratio at max_steps."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; the fused CUDA kernel on GPU."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), **extra)


# ------------------------------------------------------------------------------------------------
# Training state <-> flat tensors (for the checkpoint)
# ------------------------------------------------------------------------------------------------

def training_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """Model weights, AdamW moments and RNG states as one flat dict of named tensors."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            tensors[f"optim.{names[p]}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


def restore_training_tensors(tensors, model, optimizer) -> None:
    model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(model_state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    sd = optimizer.state_dict()
    index = {}
    for group, saved in zip(optimizer.param_groups, sd["param_groups"]):
        index.update(zip(group["params"], saved["params"]))
    sd["state"] = {}
    for name, p in model.named_parameters():
        keys = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"optim.{name}.")
                and k.count(".") == name.count(".") + 2}
        if keys:
            sd["state"][index[p]] = keys
    optimizer.load_state_dict(sd)
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, dataset: TokenDataset, cfg: Config, device, autocast) -> float:
    """Mean loss over the first eval_batches batches of the val split (the same batches every time)."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(cfg.train.eval_batches):
        x, y = dataset.batch(i, cfg.train.batch_size // cfg.train.grad_accum)
        with autocast():
            total += model(x.to(device), y.to(device)).float()
    model.train()
    return total.item() / cfg.train.eval_batches


def memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def train(cfg: Config, *, resume: bool = False) -> dict:
    """Run the training described by cfg; returns the summary (also written to summary.json)."""
    t0 = time.time()
    t = cfg.train
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not a multiple of train.grad_accum={t.grad_accum}")
    device = resolve_device(t.device)
    dtype = resolve_dtype(t.dtype, device)
    torch.manual_seed(t.seed)
    run_dir = t.out_dir
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.checkpoint.keep)
    if resume and ckpt.latest() is None:
        raise ConfigError(f"--resume: no checkpoint under {run_dir}/checkpoints")

    data_dir = cfg.data.dir = data_dir_for(cfg)
    meta = prepare(data_dir, cfg.data.inputs or None, vocab_size=cfg.data.vocab_size,
                   tokenizer=cfg.data.tokenizer or None, val_fraction=cfg.data.val_fraction, seed=t.seed,
                   progress=t.progress)
    prepare_s = time.time() - t0
    real_vocab = meta["vocab_size"]
    pad = cfg.model.pad_vocab_to
    cfg.model.vocab_size = -(-real_vocab // pad) * pad
    seq = cfg.model.seq_len
    train_set = TokenDataset(data_dir, "train", seq, seed=t.seed)
    val_set = TokenDataset(data_dir, "val", seq, seed=t.seed)
    unigram = unigram_val_loss(data_dir)

    model = GPT(cfg.model).to(device)
    optimizer = make_optimizer(model, cfg, device)
    start_step, start_batch = 0, 0
    if resume:
        tensors, state = ckpt.load()
        restore_training_tensors({k: v.to(device) if k.startswith(("model.", "optim.")) else v
                                  for k, v in tensors.items()}, model, optimizer)
        start_step, start_batch = state["step"], state["data"]["next_batch"]
    step_model = torch.compile(model) if t.compile else model
    autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext

    os.makedirs(run_dir, exist_ok=True)
    write_json(os.path.join(run_dir, "config.json"), cfg.to_dict())
    if resume:  # keep the records up to the checkpoint; the steps after it are run again
        _truncate_metrics(run_dir, start_step)
    metrics = Metrics(run_dir, total_steps=t.max_steps, start_step=start_step, progress=t.progress, append=resume)
    params = model.num_params()
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    metrics.print(f"tilewise: {params / 1e6:.2f}M parameters, vocab {real_vocab} (padded {cfg.model.vocab_size}), "
                  f"{train_set.num_tokens:,} train tokens, device {device}, {str(dtype).replace('torch.', '')}")

    micro = t.batch_size // t.grad_accum
    tokens_per_step = t.batch_size * seq
    loader = Prefetcher(train_set, micro, device, start_batch=start_batch)
    loss_sum = torch.zeros((), device=device)
    val_loss = None
    last_time, last_step, wait_ms = time.time(), start_step, 0.0
    train_time = 0.0
    try:
        for step in range(start_step, t.max_steps):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(t.grad_accum):
                x, y = loader.next()
                wait_ms += loader.data_wait_ms
                with autocast():
                    loss = step_model(x, y)
                (loss / t.grad_accum).backward()
                loss_sum += loss.detach() / t.grad_accum
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            is_eval = done % t.eval_every == 0 or done == t.max_steps
            if done % t.log_every == 0 or is_eval:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.time()
                steps = done - last_step
                elapsed = now - last_time
                train_time += elapsed
                tokens_per_s = steps * tokens_per_step / elapsed
                record = {"step": done, "loss": loss_sum.item() / steps, "lr": lr, "grad_norm": grad_norm.item(),
                          "tokens_per_s": tokens_per_s,
                          "mfu": model.flops_per_token() * tokens_per_s / peak if peak else None,
                          "step_ms": 1000 * elapsed / steps, "data_wait_ms": wait_ms / steps,
                          "mem_gb": memory_gb(device)}
                if is_eval:
                    val_loss = evaluate(step_model, val_set, cfg, device, autocast)
                    record["val_loss"] = val_loss
                metrics.log(record)
                loss_sum.zero_()
                wait_ms = 0.0
                last_step, last_time = done, time.time()  # evaluation time is not training time
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < t.max_steps:
                _save(ckpt, done, model, optimizer, loader, cfg)
        if start_step < t.max_steps:
            _save(ckpt, t.max_steps, model, optimizer, loader, cfg)
    finally:
        loader.close()
        metrics.close()
    if val_loss is None:
        val_loss = evaluate(step_model, val_set, cfg, device, autocast)

    steps_run = t.max_steps - start_step
    summary = {
        "final_val_loss": val_loss, "unigram_val_loss": unigram, "val_over_unigram": val_loss / unigram,
        "tokens_seen": t.max_steps * tokens_per_step, "steps": t.max_steps, "params": params,
        "wall_s": time.time() - t0, "prepare_s": prepare_s, "train_s": train_time,
        "tokens_per_s": steps_run * tokens_per_step / train_time if train_time else None,
        "mfu": (model.flops_per_token() * steps_run * tokens_per_step / train_time / peak) if peak and train_time else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_mem_gb": memory_gb(device),
    }
    write_json(os.path.join(run_dir, "summary.json"), summary)
    plot_losses(run_dir)
    return summary


def _save(ckpt: Checkpointer, step: int, model, optimizer, loader, cfg: Config) -> None:
    state = {"data": loader.state_dict(), "config": cfg.to_dict()}
    ckpt.save(step, training_tensors(model, optimizer), state)


def _truncate_metrics(run_dir: str, step: int) -> None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
