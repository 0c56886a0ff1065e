"""The peer of bench/multigpu.py: plain PyTorch FSDP2 + torch.compile, training the plain GPT of bench/common.py.

What a strong PyTorch user writes to train a GPT on several GPUs: fully_shard on each block, then on the root
(ZeRO-3), bf16 parameters with gradients reduced in fp32 (MixedPrecisionPolicy, no autocast), each block
compiled before it is sharded (as torchtitan does), fused AdamW and gradient clipping. The model is sized like a
tilewise preset (d_model, layers, heads, seq_len, padded vocabulary) and initialized as GPT-2 (and tilewise) are;
with --data it reads the trainer's token folder in the trainer's order (each rank its rows of each global batch,
loaded onto the device before timing) with the trainer's learning-rate schedule, so its loss is comparable with a
tilewise run of the same steps; without, random tokens. Launched by torchrun, like the trainer:

    torchrun --standalone --nproc_per_node=N bench/multigpu_baseline.py --preset gpt-1.3b --data DIR --out result.json

Rank 0 writes one JSON object to --out: tokens/s per GPU over the timed steps (the slowest rank's time),
step_ms, peak_mem_gb (the largest over ranks), mfu, the loss after the last step. On CPU (--device cpu, gloo)
the same code runs in fp32, uncompiled unless --compile is given: a smoke test of the launch, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

BATCHES = 4   # random batches rotated through the steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-1.3b", help="the tilewise preset whose shape the plain GPT takes")
    p.add_argument("--rows-per-gpu", type=int, default=8, help="rows of seq_len tokens per rank and step")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation happens in the first)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="torch.compile each block (default: on cuda only)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--data", help="a tilewise token folder to train on (default: random tokens)")
    p.add_argument("--timeout-s", type=int, default=300, help="the process group's collective timeout")
    p.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    args = p.parse_args(argv)
    for name in ("rows_per_gpu", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected at least 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup}: expected 0 or more")
    if args.compile is None:
        args.compile = args.device == "cuda"
    return args


def plain_shape(preset: str) -> dict:
    """The plain GPT's constructor arguments for a tilewise preset (GPT-2 family: LayerNorm, GELU, tied head)."""
    from tilewise.config import load_config
    cfg = load_config(preset)
    c = cfg.model
    if c.norm != "layernorm" or c.mlp != "gelu" or c.pos != "learned":
        raise ValueError(f"--preset {preset}: the plain GPT is GPT-2 shaped (layernorm, gelu, learned positions); "
                         f"this preset has {c.norm}, {c.mlp}, {c.pos}")
    vocab = -(-cfg.data.vocab_size // c.pad_vocab_to) * c.pad_vocab_to
    return {"vocab": vocab, "real_vocab": cfg.data.vocab_size, "seq_len": c.seq_len, "d": c.d_model,
            "layers": c.n_layer, "heads": c.n_head, "lr": cfg.train.lr, "betas": (cfg.train.beta1, cfg.train.beta2),
            "weight_decay": cfg.train.weight_decay, "grad_clip": cfg.train.grad_clip}


def init_like_gpt2(model, layers: int, std: float = 0.02) -> None:
    """N(0, std) weights, the projections into the residual scaled by 1/sqrt(2 * layers), zero biases, unit norms
    (PyTorch's default N(0, 1) embeddings give a tied head logits of std ~sqrt(d_model))."""
    import math

    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln"):
                p.fill_(1.0)
            elif name.endswith(("proj.weight", "out.weight")):
                p.normal_(0.0, std / math.sqrt(2 * layers))
            else:
                p.normal_(0.0, std)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from common import PlainGPT
    from tilewise.config import load_config
    from tilewise.metrics import peak_flops
    from tilewise.train import lr_at

    shape = plain_shape(args.preset)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            print("multigpu_baseline.py: --device cuda but no CUDA GPU is available", file=sys.stderr)
            return 2
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout_s)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, **({"device_id": device} if cuda else {}))
    else:   # run by hand, without torchrun: a group of one
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, **({"device_id": device} if cuda else {}))
    ok = False
    try:
        mesh = init_device_mesh(device.type, (world,))
        torch.manual_seed(0)   # the same initial weights on every rank, as fully_shard expects
        with device:
            model = PlainGPT(shape["vocab"], shape["seq_len"], shape["d"], shape["layers"], shape["heads"])
        init_like_gpt2(model, shape["layers"])
        params = sum(p.numel() for p in model.parameters())
        flops_per_token = 6 * params + 6 * shape["layers"] * shape["seq_len"] * shape["d"]
        if args.compile:
            # One compiled block serves all; headroom for guards (the name before torch 2.6: cache_size_limit).
            limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
            setattr(torch._dynamo.config, limit, 64)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cuda else torch.float32, reduce_dtype=torch.float32)
        for block in model.blocks:
            if args.compile:
                block.compile()
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=shape["lr"], betas=shape["betas"],
                                      weight_decay=shape["weight_decay"], **({"fused": True} if cuda else
                                                                             {"foreach": True}))
        rows, seq = args.rows_per_gpu, shape["seq_len"]
        total = args.warmup + args.steps
        if args.data:   # the trainer's rows, in its order: global batch i, this rank's share
            from tilewise.data import TokenDataset
            data = TokenDataset(args.data, "train", seq, seed=0, rank=rank, world_size=world)
            batches = [tuple(t.to(device) for t in data.batch(i, rows * world)) for i in range(total)]
        else:
            gen = torch.Generator(device=device).manual_seed(1000 + rank)
            batches = [(torch.randint(0, shape["real_vocab"], (rows, seq), device=device, generator=gen),
                        torch.randint(0, shape["real_vocab"], (rows, seq), device=device, generator=gen))
                       for _ in range(BATCHES)]
        schedule = load_config(args.preset, overrides=[f"train.max_steps={total}"])

        def step(i):
            x, y = batches[i % len(batches)]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(i, schedule)
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), shape["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        started = time.perf_counter()
        for i in range(args.warmup):
            step(i)
        if cuda:   # the peak memory stays the whole run's, as the trainer's summary reports it
            torch.cuda.synchronize(device)
        warmup_s = time.perf_counter() - started
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for i in range(args.steps):
            loss = step(args.warmup + i)
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            seconds = start.elapsed_time(end) / 1e3
            peak_gb = torch.cuda.max_memory_allocated(device) / 1e9
        else:
            seconds = time.perf_counter() - t0
            import resource
            peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        # The slowest rank sets the pace; memory: the largest rank's peak; the loss: the mean over ranks.
        stats = torch.tensor([seconds, peak_gb], dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        mean_loss = loss.float().clone()
        dist.all_reduce(mean_loss)
        seconds, peak_gb = float(stats[0]), float(stats[1])
        loss_value = mean_loss.item() / world
        tokens_per_s_per_gpu = rows * seq * args.steps / seconds
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        peak = peak_flops(name) if cuda else None
        result = {"tokens_per_s_per_gpu": tokens_per_s_per_gpu, "step_ms": 1e3 * seconds / args.steps,
                  "timed_steps": args.steps, "warmup_steps": args.warmup, "warmup_s": warmup_s,
                  "peak_mem_gb": peak_gb, "mfu": flops_per_token * tokens_per_s_per_gpu / peak if peak else None,
                  "final_loss": loss_value, "params": params, "world_size": world, "device": name,
                  "compile": bool(args.compile), "rows_per_gpu": rows, "seq_len": seq,
                  "data": "token folder" if args.data else "random tokens"}
        if rank == 0:
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, args.out)
            print(f"plain FSDP2{' + compile' if args.compile else ''}: {world} x {name}, "
                  f"{tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {result['step_ms']:.1f} ms/step, "
                  f"{peak_gb:.1f} GB, loss {loss_value:.4f}", flush=True)
        ok = True
    finally:
        if ok:   # after a failure, ending the group could wait on a peer that is gone: the exit ends it
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
