"""The training loop: data -> model -> loss -> AdamW -> metrics and checkpoints, on one process or many.

One optimizer step consumes train.batch_size rows of model.seq_len tokens (the global batch, over all ranks),
in train.grad_accum micro-batches; each rank reads batch_size // (world_size * grad_accum) rows of each.
The loop syncs with the host only every log_every steps (to read the loss), never per step. On one CUDA
process, after a few eager steps, the whole optimizer step is captured as a CUDA graph and replayed
(train.cuda_graphs; tilewise/graphs.py says what that takes and when it is refused).

Under torchrun (distributed.strategy ddp, fsdp or hsdp; see tilewise/distributed.py) rank 0 prepares the
data, prints, and writes metrics, config.json and summary.json; every rank writes its shard of each
checkpoint. The data position is a global batch index, so a run resumes exactly with any world size.
RNG: each rank has its own CPU/CUDA generator state (dropout), seeded from (seed, rank, step) and saved per
rank. Resumed with the same world size, a run repeats the uninterrupted one bitwise; with another world size
the generators are seeded anew from (seed, rank, step), so with dropout only the distribution repeats.
Without dropout, runs of any world size follow one trajectory up to fp32 rounding (reduction order).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch

from .checkpoint import Checkpointer, CheckpointError, read_manifest
from .config import Config, ConfigError
from .data import DataError, Prefetcher, TokenDataset, load_meta, prepare, unigram_val_loss
from .distributed import Dist, full_value, init_distributed, parallelize, sync_context, unwrap
from .graphs import WARMUP_STEPS, StepGraph, invalidate_fp8_weights, resolve as resolve_graphs
from .graphs import graph_mode, uncaptured_optimizer_steps
from .metrics import Metrics, peak_flops, plot_losses, write_json
from .model import GPT
from .ops.adamw import AdamW
from .profile import StepProfiler, parse_steps


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


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The optimizer's parameter groups: weight decay on matrices (and embeddings), none on vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device, *,
                   lr: float | torch.Tensor | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only. Where the parameters are on a GPU, tilewise's AdamW
    (ops/adamw.py: one pass over each large tensor, torch's fused kernel for the small ones); else torch's.

    lr: a 0-d device tensor makes the optimizer capturable in a CUDA graph: its step reads the learning rate
    from the tensor, which the loop fills before each replay (fused AdamW takes a tensor lr)."""
    groups = decay_groups(model, cfg.train.weight_decay)
    on_gpu = device.type == "cuda" and all(p.device.type == "cuda" for g in groups for p in g["params"])
    extra = {"fused": True} if on_gpu else {"foreach": True}
    if isinstance(lr, torch.Tensor):
        if not on_gpu or lr.device.type != "cuda" or lr.numel() != 1:
            raise ValueError(f"make_optimizer: a tensor lr (shape {tuple(lr.shape)} on {lr.device}) needs one "
                             f"element on the GPU that holds every parameter")
        extra["capturable"] = True
    return (AdamW if on_gpu else torch.optim.AdamW)(groups, lr=cfg.train.lr if lr is None else lr,
                                                   betas=(cfg.train.beta1, cfg.train.beta2), **extra)


def _clip_folds_into_adamw(optimizer) -> bool:
    """Fused AdamW over plain tensors divides each gradient by its grad_scale tensor as it reads it, so
    clipping costs only the norm, not a pass that reads and writes every gradient. (FSDP's DTensor
    gradients take torch's clip_grad_norm_.)"""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return bool(optimizer.defaults.get("fused")) and all(type(p) is torch.nn.Parameter for p in params)


def make_step(step_model, model, optimizer, fp8_state, autocast, grad_accum: int, grad_clip: float):
    """The optimizer step as a function step(batch) -> (mean loss, gradient norm), both device tensors.

    batch(k) gives micro-batch k as (inputs, targets). The eager loop and the CUDA graph capture run this same
    function, so a replayed step is the eager step's kernels. step_model: model, or its torch.compile wrapper.
    grad_clip: the largest gradient norm (the gradients are scaled down to it); 0 or less: no clipping.

    The backward runs on the calling thread, not on autograd's per-device worker thread: each handoff to that
    thread, and each GIL transfer for a Python autograd node (every tilewise op), costs host time that an
    eager step on a slow host pays in full (bench/host_overhead.py on the H200: a GPT-2 124M step at 2 x 256
    took 21.3 instead of 29.3 ms of host time; flash attention's forward+backward 396 instead of 860 us).
    """
    fold_clip = _clip_folds_into_adamw(optimizer)

    def step(batch):
        loss_sum = None
        for k in range(grad_accum):
            x, y = batch(k)
            with sync_context(model, k == grad_accum - 1):
                with autocast():
                    loss = step_model(x, y)
                with torch.autograd.set_multithreading_enabled(False):
                    (loss / grad_accum).backward()
            part = loss.detach() / grad_accum
            loss_sum = part if loss_sum is None else loss_sum + part
        if grad_clip <= 0 or fold_clip:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            if grad_clip > 0:   # clip_grad_norm_'s factor min(1, grad_clip / (norm + 1e-6)), as a divisor
                optimizer.grad_scale = torch.clamp((grad_norm + 1e-6) / grad_clip, min=1.0)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8_state is not None:
            fp8_state.step()   # max-reduce this step's amaxes over the ranks, new scales, FP8 weights recast
        return loss_sum, grad_norm
    return step


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The seed of rank's generators (dropout) from step on: distinct per rank, independent of the init seed."""
    return int(np.random.SeedSequence([seed, rank, step, 0x7417]).generate_state(1, np.uint64)[0] >> 1)


# ------------------------------------------------------------------------------------------------
# Training state <-> flat tensors (for the checkpoint)
# ------------------------------------------------------------------------------------------------

def training_tensors(model, optimizer, fp8_state=None) -> dict[str, torch.Tensor]:
    """Model weights, AdamW moments, FP8 scaling state and RNG states as one flat dict of named tensors.

    Under fsdp/hsdp the weights and moments are DTensors (each rank's shard); rng.* are per-rank values."""
    model = unwrap(model)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            tensors[f"optim.{names[p]}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    if fp8_state is not None:
        tensors.update({f"fp8.{k}": v for k, v in fp8_state.state_dict().items()})
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (moments and step counters in their real dtypes, devices and placements)
    by one step of zero gradients at learning rate 0, which leaves the parameters as they are."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def restore(ckpt: Checkpointer, path: str, model, optimizer, fp8_state, d: Dist, seed: int) -> dict:
    """Load checkpoint `path` into this rank's model, optimizer and FP8 state (resharding to this world
    size); restore this rank's RNG states when the world size is the one saved, else seed them anew.
    Returns the checkpoint's state (with "step")."""
    init_optimizer_state(optimizer)
    targets = training_tensors(model, optimizer, fp8_state)
    fp8_targets = {k: v for k, v in targets.items() if k.startswith("fp8.")}
    rng = {k: torch.empty_like(v) for k, v in targets.items() if k.startswith("rng.")}
    targets = {k: v for k, v in targets.items() if not k.startswith("rng.")}
    manifest = read_manifest(path)
    saved = {k for k in manifest["tensors"] if not k.startswith("rng.")}
    missing, unexpected = sorted(set(targets) - saved), sorted(saved - set(targets))
    if missing or unexpected:
        hint = " (was fp8.recipe the same?)" if any(k.startswith("fp8.") for k in missing + unexpected) else ""
        raise CheckpointError(f"{path} does not match this run{hint}: it lacks {missing[:5]} and has "
                              f"{unexpected[:5]} that this run does not")
    same_world = manifest["world_size"] == d.world_size
    if same_world:
        targets.update({k: v for k, v in rng.items() if k in manifest["tensors"]})
    state = ckpt.load_into(targets, path, strict=False)
    if fp8_state is not None:
        fp8_state.load_state_dict({k[len("fp8."):]: v for k, v in fp8_targets.items()})
    if same_world and "rng.cpu" in targets:
        torch.set_rng_state(targets["rng.cpu"])
        if "rng.cuda" in targets and torch.cuda.is_available():
            torch.cuda.set_rng_state(targets["rng.cuda"])
    else:
        torch.manual_seed(rank_seed(seed, d.rank, state["step"]))
    return state


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, dataset: TokenDataset, cfg: Config, d: Dist, autocast) -> float:
    """Mean loss over the first eval_batches batches of the val split (the same batches every time, whatever
    the world size: each rank takes its rows of each batch, and the means are averaged over ranks)."""
    model.eval()
    total = torch.zeros((), device=d.device)
    for i in range(cfg.train.eval_batches):
        x, y = dataset.batch(i, cfg.train.batch_size // cfg.train.grad_accum)
        with autocast():
            total += model(x.to(d.device), y.to(d.device)).float()
    model.train()
    return d.all_reduce(total, "mean").item() / cfg.train.eval_batches


def memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def _prepare_data(cfg: Config, d: Dist) -> dict:
    """Rank 0 prepares the token shards (cached); the others wait, then read meta.json. A folder of token
    shards without a tokenizer (write_token_shards: tokens made elsewhere) is used as it is."""
    data_dir = cfg.data.dir = data_dir_for(cfg)
    premade = None
    if not cfg.data.inputs and os.path.isfile(os.path.join(data_dir, "meta.json")):
        meta = load_meta(data_dir)
        premade = meta if meta.get("tokenizer") is None else None
    if premade is not None:
        return premade
    if d.is_main:
        meta = prepare(data_dir, cfg.data.inputs or None, vocab_size=cfg.data.vocab_size,
                       tokenizer=cfg.data.tokenizer or None, val_fraction=cfg.data.val_fraction, seed=cfg.train.seed,
                       progress=cfg.train.progress)
    d.barrier()
    if not d.is_main:
        try:
            meta = load_meta(data_dir)
        except DataError as e:
            raise DataError(f"{e} (rank 0 prepared {data_dir}: on several nodes data.dir must be on a shared "
                            f"filesystem, or prepared on every node first with `tilewise prepare`)") from None
    return meta


def train(cfg: Config, *, resume: bool = False) -> dict:
    """Run the training described by cfg; returns the summary (also written to summary.json by rank 0).

    Under torchrun, an error on any rank is raised with the rank in its message (ConfigError, DataError,
    CheckpointError) or announced on stderr as "rank N of W failed" before its traceback."""
    d, ok = None, False
    try:
        d = init_distributed(cfg, resolve_device(cfg.train.device))
        summary = _train(cfg, d, resume)
        ok = True
        return summary
    except Exception as e:
        rank = d.rank if d else int(os.environ.get("RANK", "0") or 0)
        world = d.world_size if d else int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            raise
        if isinstance(e, (ConfigError, DataError, CheckpointError)) and not str(e).startswith("rank "):
            raise type(e)(f"rank {rank}: {e}") from e
        print(f"tilewise: rank {rank} of {world} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    finally:
        # After a failure with peers, the group is left to the process's exit: ending it could wait on them.
        if d is not None and (ok or d.world_size == 1):
            d.close()


def _train(cfg: Config, d: Dist, resume: bool) -> dict:
    t0 = time.time()
    t = cfg.train
    device = d.device
    if t.batch_size % (d.world_size * t.grad_accum):
        raise ConfigError(f"train.batch_size={t.batch_size} (the global batch) is not a multiple of world size "
                          f"{d.world_size} x train.grad_accum {t.grad_accum} = {d.world_size * t.grad_accum}: "
                          f"each rank reads batch_size // (world_size * grad_accum) rows per micro-batch")
    dtype = resolve_dtype(t.dtype, device)
    use_graphs, graphs_notice = resolve_graphs(cfg, device, d.strategy)
    run_dir = t.out_dir
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save, timeout_s=float(cfg.distributed.timeout_s))
    resume_path = ckpt.latest() if resume else None
    if resume and resume_path is None:
        raise ConfigError(f"--resume: no checkpoint under {run_dir}/checkpoints")

    meta = _prepare_data(cfg, d)
    data_dir = cfg.data.dir
    prepare_s = time.time() - t0
    real_vocab = meta["vocab_size"]
    pad = cfg.model.pad_vocab_to
    cfg.model.vocab_size = -(-real_vocab // pad) * pad
    seq = cfg.model.seq_len
    train_set = TokenDataset(data_dir, "train", seq, seed=t.seed, rank=d.rank, world_size=d.world_size)
    val_set = TokenDataset(data_dir, "val", seq, seed=t.seed, rank=d.rank, world_size=d.world_size)
    unigram = unigram_val_loss(data_dir)

    torch.manual_seed(t.seed)    # the same initial weights on every rank
    model = GPT(cfg.model).to(device)
    params, flops_per_token = model.num_params(), model.flops_per_token()
    fp8_state = None
    if cfg.fp8.recipe != "off":
        from .fp8 import convert_to_fp8, recipe_from_config
        try:
            recipe = recipe_from_config(cfg.fp8)
        except ValueError as e:
            raise ConfigError(f"fp8: {e}") from None
        # The head matmul runs inside the fused cross-entropy, never through lm_head's forward.
        fp8_state = convert_to_fp8(model, recipe, skip=lambda name: name.endswith("lm_head"))
    model = parallelize(model, cfg, d, dtype)
    # Under CUDA graphs the learning rate is a device tensor, filled before every step (eager ones too).
    lr_tensor = torch.full((), t.lr, dtype=torch.float32, device=device) if use_graphs else None
    optimizer = make_optimizer(model, cfg, device, lr=lr_tensor)
    micro = t.batch_size // t.grad_accum          # rows of one micro-batch, over all ranks
    start_step, start_batch, load_s = 0, 0, None
    if resume:
        load_start = time.time()
        with uncaptured_optimizer_steps():   # restore makes the optimizer state with one step
            state = restore(ckpt, resume_path, model, optimizer, fp8_state, d, t.seed)
        load_s = time.time() - load_start
        start_step = state["step"]
        data = state["data"]
        rows = data["next_batch"] * data.get("batch_rows", micro)
        if rows % micro:
            raise ConfigError(f"--resume: the checkpoint stops after {rows} rows, not a whole number of micro-batches "
                              f"of {micro} rows (train.batch_size // train.grad_accum); use the saved grad_accum")
        start_batch = rows // micro
    else:
        torch.manual_seed(rank_seed(t.seed, d.rank, 0))
    sharded = d.strategy in ("fsdp", "hsdp")     # their blocks are compiled one by one in parallelize
    step_model = torch.compile(model) if t.compile and not sharded else model
    autocast = (lambda: torch.autocast("cuda", dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext

    if d.is_main:
        os.makedirs(run_dir, exist_ok=True)
        write_json(os.path.join(run_dir, "config.json"), cfg.to_dict())
        if resume:  # keep the records up to the checkpoint; the steps after it are run again
            _truncate_metrics(run_dir, start_step)
    metrics = Metrics(run_dir, enabled=d.is_main, total_steps=t.max_steps, start_step=start_step,
                      progress=t.progress, append=resume)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    where = f"{d.world_size} ranks ({d.strategy}), {device.type}" if d.world_size > 1 else f"device {device}"
    metrics.print(f"tilewise: {params / 1e6:.2f}M parameters, vocab {real_vocab} (padded {cfg.model.vocab_size}), "
                  f"{train_set.num_tokens:,} train tokens, {where}, {str(dtype).replace('torch.', '')}"
                  f"{', fp8 ' + cfg.fp8.recipe if fp8_state is not None else ''}")
    if graphs_notice:
        metrics.print(graphs_notice)

    tokens_per_step = t.batch_size * seq
    loader = Prefetcher(train_set, micro, device, start_batch=start_batch)
    step_fn = make_step(step_model, model, optimizer, fp8_state, autocast, t.grad_accum, t.grad_clip)
    graph = None
    if use_graphs:
        graph = StepGraph(step_fn, t.grad_accum, micro // d.world_size, seq, device, model=model)
    capture_step = start_step + WARMUP_STEPS   # a resumed run warms up again before it captures
    wait_ms = 0.0

    def next_batch(k):
        nonlocal wait_ms
        batch = loader.next()
        wait_ms += loader.data_wait_ms
        return batch

    profiler = StepProfiler(parse_steps(t.profile_steps), os.path.join(run_dir, f"profile_rank{d.rank}.json"),
                            device)
    if t.profile_steps and device.type != "cuda":
        metrics.print(f"train.profile_steps={t.profile_steps!r}: GPU time only, nothing is profiled on {device.type}")
    loss_sum = torch.zeros((), device=device)
    val_loss = None
    last_time, last_step = time.time(), start_step
    train_time = 0.0
    failed = True
    try:
        for step in range(start_step, t.max_steps):
            profiler.before(step)
            lr = lr_at(step, cfg)
            if lr_tensor is not None:
                lr_tensor.fill_(lr)      # a kernel on the compute stream, ahead of the step: no host sync
            else:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            if graph is None:
                step_loss, grad_norm = step_fn(next_batch)
            elif step < capture_step:
                with uncaptured_optimizer_steps():
                    step_loss, grad_norm = step_fn(next_batch)
            else:
                for k in range(t.grad_accum):
                    graph.load(k, *next_batch(k))
                if not graph.captured:
                    graph = _capture(graph, cfg, metrics, step)
                step_loss, grad_norm = graph.replay() if graph.captured else graph.run_eager()
                if not graph.captured:   # the capture failed under auto: eager from here on
                    graph = None
            loss_sum += step_loss
            profiler.after(step)
            done = step + 1
            is_eval = (t.eval_every > 0 and done % t.eval_every == 0) or done == t.max_steps
            if done % t.log_every == 0 or is_eval:
                grad_norm = full_value(grad_norm)
                d.all_reduce(loss_sum, "mean")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.time()
                steps = done - last_step
                elapsed = now - last_time
                train_time += elapsed
                tokens_per_s = steps * tokens_per_step / elapsed
                record = {"step": done, "loss": loss_sum.item() / steps, "lr": lr, "grad_norm": grad_norm.item(),
                          "tokens_per_s": tokens_per_s,
                          "mfu": flops_per_token * tokens_per_s / (peak * d.world_size) if peak else None,
                          "step_ms": 1000 * elapsed / steps, "data_wait_ms": wait_ms / steps,
                          "mem_gb": memory_gb(device)}
                if is_eval:
                    if graph is not None:
                        invalidate_fp8_weights(model)   # replays never bump the weights' _version
                    val_loss = evaluate(step_model, val_set, cfg, d, autocast)
                    record["val_loss"] = val_loss
                metrics.log(record)
                loss_sum.zero_()
                wait_ms = 0.0
                last_step, last_time = done, time.time()  # evaluation time is not training time
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < t.max_steps:
                _save(ckpt, done, model, optimizer, fp8_state, loader, micro, cfg)
        if start_step < t.max_steps and cfg.checkpoint.at_end:
            _save(ckpt, t.max_steps, model, optimizer, fp8_state, loader, micro, cfg)
        ckpt.close()   # the last save is committed before the run counts as done
        failed = False
        if d.is_main and ckpt.history:   # blocked and durable seconds of every save of this run
            with open(os.path.join(run_dir, "checkpoints.jsonl"), "a") as f:
                f.writelines(json.dumps(stats) + "\n" for stats in ckpt.history)
    finally:
        profiler.close()
        loader.close()
        metrics.close()
        if failed:   # the error in flight is the one to report, not a save that cannot finish without a peer
            with contextlib.suppress(Exception):
                ckpt.close()
    if val_loss is None:
        invalidate_fp8_weights(model)
        val_loss = evaluate(step_model, val_set, cfg, d, autocast)

    steps_run = t.max_steps - start_step
    summary = {
        "final_val_loss": val_loss, "unigram_val_loss": unigram, "val_over_unigram": val_loss / unigram,
        "tokens_seen": t.max_steps * tokens_per_step, "steps": t.max_steps, "params": params,
        "wall_s": time.time() - t0, "prepare_s": prepare_s, "load_s": load_s, "train_s": train_time,
        "tokens_per_s": steps_run * tokens_per_step / train_time if train_time else None,
        "mfu": (flops_per_token * steps_run * tokens_per_step / train_time / (peak * d.world_size))
        if peak and train_time else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": d.world_size, "strategy": d.strategy,
        "cuda_graphs": graph is not None and graph.captured,
        "peak_mem_gb": memory_gb(device),
    }
    if d.is_main:
        write_json(os.path.join(run_dir, "summary.json"), summary)
        plot_losses(run_dir)
    return {**summary, "rank": d.rank}


def _capture(graph: StepGraph, cfg: Config, metrics: Metrics, step: int) -> StepGraph:
    """Capture the step whose batches are loaded. Under train.cuda_graphs=auto a failure is a notice, and the
    graph stays uncaptured (the caller runs that step eagerly and every step after it)."""
    start = time.time()
    try:
        graph.capture()
    except Exception as e:
        if graph_mode(cfg.train.cuda_graphs) == "on":
            raise RuntimeError(f"CUDA graph capture of step {step + 1} failed: {type(e).__name__}: {e} "
                               f"(set train.cuda_graphs=false to train eagerly)") from e
        metrics.print(f"tilewise: CUDA graph capture failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                      f"training eagerly")
        return graph
    metrics.print(f"tilewise: CUDA graphs: step {step + 1} captured in {time.time() - start:.1f} s, replayed "
                  f"from here on")
    return graph


def _save(ckpt: Checkpointer, step: int, model, optimizer, fp8_state, loader, micro: int, cfg: Config) -> None:
    """Every rank calls this: each writes its shard. The data position counts micro-batches of `micro` rows."""
    state = {"data": {**loader.state_dict(), "batch_rows": micro}, "config": cfg.to_dict()}
    ckpt.save(step, training_tensors(model, optimizer, fp8_state), state)


def _truncate_metrics(run_dir: str, step: int) -> None:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
