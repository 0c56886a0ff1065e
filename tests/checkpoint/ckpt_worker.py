"""The ranks of a multi-process checkpoint test: `python ckpt_worker.py SCENARIO WORLD JSON` imports torch once,
then forks WORLD ranks that meet over gloo on CPU (forking saves each rank the seconds of importing torch).
Prints "EXIT <rank> <code>" per rank and exits non-zero if a rank failed. Not a test module itself.

train: a tiny GPT under FSDP2 with AdamW; optionally load a checkpoint into it (resharding) and compare
       every tensor bitwise with the reference the saver wrote; train some steps; save; write a reference.
crash: save step 1, then start an async save of step 2 whose writer stalls on rank `stall_rank`, so the
       test can kill -9 that rank in the middle of writing.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tilewise.checkpoint import Checkpointer, CheckpointError
from tilewise.config import ModelConfig
from tilewise.model import GPT

CONFIG = dict(vocab_size=100, seq_len=16, n_layer=2, n_head=2, d_model=40 - 8, d_ff=52)


def build(seed: int):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = GPT(ModelConfig(**CONFIG))
    with torch.no_grad():   # every parameter random, so a misplaced bias or norm weight shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer


def named_state(model, optimizer) -> dict:
    """Model and AdamW tensors by name, as the trainer names them (DTensors stay DTensors)."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            tensors[f"optim.{names[p]}.{key}"] = value
    return tensors


def empty_optimizer_state(model, optimizer) -> None:
    """AdamW state of the right shapes and placements (zeros), for load_into to fill."""
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(args, rank, world):
    model, optimizer = build(seed=args.get("init_seed", 0))
    if args.get("load_from"):
        empty_optimizer_state(model, optimizer)
        targets = named_state(model, optimizer)
        targets["rng.cpu"] = torch.zeros_like(torch.get_rng_state())
        ckpt = Checkpointer(args["load_from"])
        import tilewise.checkpoint.load as load_mod
        manifest = json.load(open(os.path.join(ckpt.latest(), "manifest.json")))
        size = next(iter(manifest["files"].values()))["chunk_bytes"]
        read = set()   # (file, chunk) pairs whose checksum this rank verified, i.e. the bytes it read
        check = load_mod._Files.check
        load_mod._Files.check = lambda self, name, lo, hi: (
            read.update((name, i) for i in range(lo // size, (hi - 1) // size + 1) if hi > lo),
            check(self, name, lo, hi))[1]
        saved_world = json.load(open(os.path.join(ckpt.latest(), "manifest.json")))["world_size"]
        if rank >= saved_world:   # this rank has no saved RNG state: strict refuses, non-strict skips it
            try:
                ckpt.load_into(targets)
                raise AssertionError("strict load_into accepted a per-rank tensor this rank never saved")
            except CheckpointError as e:
                assert "rng.cpu" in str(e) and "per-rank" in str(e), e
            before = targets["rng.cpu"].clone()
            state = ckpt.load_into(targets, strict=False)
            assert torch.equal(targets["rng.cpu"], before)
        else:
            state = ckpt.load_into(targets)
        assert state["step"] == args["expect_step"] and state["data"] == {"next_batch": args["expect_step"]}, state
        ref = load_file(args["ref_in"])
        names = sorted(k for k in targets if not k.startswith("rng."))
        assert names == sorted(k for k in ref if not k.startswith("rng.")), (names, sorted(ref))
        for name in names:
            got = full(targets[name])
            assert got.dtype == ref[name].dtype and torch.equal(got, ref[name]), f"rank {rank}: {name} differs"
        if rank < saved_world:
            assert torch.equal(targets["rng.cpu"], ref[f"rng.cpu.rank{rank}"]), f"rank {rank}: rng differs"
        load_mod._Files.check = check
        chunks = sum(-(-f["bytes"] // f["chunk_bytes"]) for f in manifest["files"].values())
        if world > 1:   # each rank reads its shards' bytes: about 1/world of the checkpoint, not all of it
            assert len(read) < 1.5 * chunks / world, (len(read), chunks)
        print(f"rank {rank}: read {len(read)} of {chunks} checksum chunks", flush=True)
        print(f"rank {rank}: loaded {len(names)} tensors bitwise equal", flush=True)
    if args.get("mesh_root"):
        (mesh_save if args.get("mesh_save") else mesh_load)(args, rank, world)
    step = args.get("expect_step", 0)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(args.get("steps", 0)):
        idx = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["seq_len"] + 1), generator=gen)
        model(idx[:, :-1], idx[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
    if args.get("save_to"):
        torch.manual_seed(100 + rank)
        tensors = {**named_state(model, optimizer), "rng.cpu": torch.get_rng_state()}
        ckpt = Checkpointer(args["save_to"], async_save=args.get("async", False), chunk_bytes=256,
                            split_bytes=2048)
        ckpt.save(step, tensors, {"data": {"next_batch": step}})
        ckpt.close()
        ref = {k: full(v).contiguous() for k, v in tensors.items() if k != "rng.cpu"}
        rngs = [torch.empty_like(tensors["rng.cpu"]) for _ in range(world)]
        dist.all_gather(rngs, tensors["rng.cpu"])
        ref.update({f"rng.cpu.rank{r}": t for r, t in enumerate(rngs)})
        if rank == 0:
            save_file(ref, args["ref_out"])
        print(f"rank {rank}: saved step {step}", flush=True)


def mesh_expected() -> dict:
    g = torch.Generator().manual_seed(11)
    return {"x": torch.randn(7, 10, generator=g), "y": torch.randn(9, 5, generator=g),
            "z": torch.arange(6 * 11, dtype=torch.int32).view(6, 11)}


def mesh_save(args, rank, world):
    """DTensors on a 2-D mesh: replicas (written once), both dims sharded, one dim sharded twice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, world // 2))
    full = mesh_expected()
    placements = {"x": [Replicate(), Shard(0)], "y": [Shard(0), Shard(1)], "z": [Shard(1), Shard(1)]}
    tensors = {k: distribute_tensor(v, mesh, placements[k]) for k, v in full.items()}
    Checkpointer(args["mesh_root"], chunk_bytes=64).save(1, tensors, {})
    print(f"rank {rank}: saved the 2-D mesh tensors", flush=True)


def mesh_load(args, rank, world):
    """The 2-D mesh checkpoint into a 1-D mesh with other placements, and into whole tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = mesh_expected()
    targets = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in full.items()}
    Checkpointer(args["mesh_root"]).load_into(targets)
    whole = {k: torch.zeros_like(v) for k, v in full.items()}
    Checkpointer(args["mesh_root"]).load_into(whole)
    for k, v in full.items():
        assert torch.equal(targets[k].full_tensor(), v) and torch.equal(whole[k], v), k
    print(f"rank {rank}: mesh tensors bitwise equal", flush=True)


def crash_tensors(rank: int, world: int) -> dict:
    """Plain tensors, the same on every rank (so replicated), plus each rank's own RNG-like tensor."""
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 48, generator=gen), "b": torch.randn(48, generator=gen),
            "rng.cpu": torch.full((16,), rank, dtype=torch.uint8)}


def crash(args, rank, world):
    import tilewise.checkpoint.save as save_mod
    ckpt = Checkpointer(args["root"], async_save=True, chunk_bytes=1024, split_bytes=1024, timeout_s=30)
    ckpt.save(1, crash_tensors(rank, world), {"data": {"next_batch": 1}})
    ckpt.wait()
    real = save_mod._write_file

    def stalling(path, buf, nbytes, chunk, threads):
        if rank == args["stall_rank"]:
            with open(path, "wb") as f:      # half the file on disk, then stop until killed
                f.write(buf.numpy()[:nbytes // 2].tobytes())
                f.flush()
                os.fsync(f.fileno())
            print(f"STALLED {os.getpid()}", flush=True)
            time.sleep(600)
        return real(path, buf, nbytes, chunk, threads)

    save_mod._write_file = stalling
    tensors = {k: v + 1 if v.is_floating_point() else v for k, v in crash_tensors(rank, world).items()}
    ckpt.save(2, tensors, {"data": {"next_batch": 2}})
    try:
        ckpt.wait()
        print("NO ERROR", flush=True)
    except CheckpointError as e:
        print(f"ERROR {e}", flush=True)
    os._exit(0)   # the process group has a dead member: skip its teardown


def run_rank(scenario: str, args: dict, rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1 or scenario == "train":
        dist.init_process_group("gloo")
    {"train": train, "crash": crash}[scenario](args, rank, world)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> int:
    import socket
    import traceback

    import torch.distributed.fsdp  # noqa: F401  (imported once, before the fork)
    scenario, world, args = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                run_rank(scenario, args, rank, world, port)
                code = 0
            except BaseException:
                print(f"rank {rank} failed:", flush=True)
                traceback.print_exc(file=sys.stdout)
            finally:
                sys.stdout.flush()
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    for rank, code in enumerate(codes):
        print(f"EXIT {rank} {code}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
