"""Checkpoints: tilewise's asynchronous sharded writer against torch.distributed.checkpoint (DCP).

The state is the gpt-1.3b preset's model (tilewise.model.GPT, vocab 50304, fp32 parameters) on the GPU plus
its AdamW state (fp32 moments, step counts) and the RNG states, named as the trainer names them: ~16.2 GB.
One process, a world of one (gloo + nccl, which DCP's async_save needs). Every method saves the same tensors
into its own directory under --dir, on the same disk, and loads them back into the same GPU tensors:
- tilewise: Checkpointer(async_save=True). blocked = save() plus the current stream catching up with the
  device-to-host copy (what the next training step waits for); durable = save() until wait() returns
  (every file fsynced, manifest written, directory renamed, `latest` replaced).
- dcp_save: dcp.save. blocked = durable = the call (its FileSystemWriter fsyncs each file).
- dcp_async_save: dcp.async_save. blocked = the call (plus staging, if it returns an AsyncSaveResponse);
  durable = the future's result.
tilewise and dcp_async_save save twice: the first save allocates host buffers (reported as blocked_first_s),
the second is the steady state. Right after a save returns, a stand-in training step changes every floating
tensor in place; a load must give back the values of the save call, bitwise, or the run fails. Load times
read from the page cache (each method's files were just written), the same for every method.
ratio_best_peer is best peer / tilewise for times (above 1: tilewise is faster) and tilewise / best peer for
GB/s. --device cpu runs a tiny model on the CPU, a smoke test of this script.

    PYTHONPATH=src python3 bench/checkpoint.py --out DIR [--quick] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from common import RESULTS, git_commit, write_result

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="also write checkpoint.json into this folder")
    p.add_argument("--quick", action="store_true", help="the gpt2-350m preset's state (~4.3 GB) instead of 1.3B")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a new folder under /tmp)")
    p.add_argument("--extra-peers", action="store_true",
                   help="also DCP async_save with a pinned-memory, asynchronous stager (DefaultStager)")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="past this many seconds, the remaining methods are skipped (recorded as such)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the benchmark) or cpu (a smoke run of the script with a tiny model)")
    return p.parse_args(argv)


def init_world(device: str) -> None:
    """A process group of one: DCP's async_save needs a CPU backend, the GPU work nccl."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def build_state(device: str, quick: bool):
    """(name -> tensor as the trainer saves them, the model's config name)."""
    from tilewise.config import ModelConfig, load_config
    from tilewise.model import GPT
    from tilewise.train import training_tensors
    if device == "cpu":
        preset, mc = "tiny (cpu smoke)", ModelConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, d_model=64)
    else:
        preset = "gpt2-350m" if quick else "gpt-1.3b"
        mc = load_config(preset).model
        mc.vocab_size = 50304
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(mc)
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    for p in model.parameters():   # one step with random gradients: moments that are not zeros
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return training_tensors(model, optimizer), preset, model.num_params()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_step(state: dict) -> None:
    """Stand-in for the optimizer: every floating tensor changes in place, on the current stream."""
    for t in state.values():
        if t.is_floating_point():
            t.add_(1.0)


def snapshot(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def check_equal(state: dict, ref: dict, who: str) -> None:
    bad = [k for k in ref if not torch.equal(state[k], ref[k])]
    if bad:
        raise SystemExit(f"bench/checkpoint.py: {who}: the loaded tensors differ from the saved ones: {bad[:5]}")


def fresh(root: str, name: str) -> str:
    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    return path


def bench_tilewise(state, root, device, nbytes):
    from tilewise.checkpoint import Checkpointer
    out = {}
    path = fresh(root, "tilewise")
    ckpt = Checkpointer(path, keep=1, async_save=True)
    for i in (1, 2):
        ref = snapshot(state) if i == 2 else None
        sync(device)
        t0 = time.perf_counter()
        ckpt.save(i, state, {"data": {"next_batch": i}})
        sync(device)
        blocked = time.perf_counter() - t0
        train_step(state)
        ckpt.wait()
        durable = time.perf_counter() - t0
        out["blocked_first_s" if i == 1 else "blocked_s"] = blocked
        out["durable_first_s" if i == 1 else "durable_s"] = durable
        if i == 1:   # one checkpoint on disk at a time (the disk holds ~4 copies at most)
            shutil.rmtree(os.path.join(path, "step_00000001"))
    # The device-to-host floor: the same copies into the same pinned buffer, nothing else.
    buf = ckpt._buffer.tensor
    if device == "cuda" and buf is not None:
        sync(device)
        t0 = time.perf_counter()
        at = 0
        for t in state.values():
            if t.is_cuda:
                n = t.numel() * t.element_size()
                buf[at:at + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
                at += -(-n // 8) * 8
        sync(device)
        out["d2h_floor_s"] = time.perf_counter() - t0
    sync(device)
    t0 = time.perf_counter()
    ckpt.load_into(state)
    sync(device)
    out["load_s"] = time.perf_counter() - t0
    check_equal(state, ref, "tilewise")
    ckpt.close()
    out["write_GBps"] = nbytes / out["durable_s"] / 1e9
    shutil.rmtree(path, ignore_errors=True)
    return out


def bench_dcp_save(state, root, device, nbytes):
    import torch.distributed.checkpoint as dcp
    path = fresh(root, "dcp_save")
    ref = snapshot(state)
    sync(device)
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=path)
    sync(device)
    blocked = time.perf_counter() - t0
    train_step(state)
    out = {"blocked_s": blocked, "durable_s": blocked}
    sync(device)
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    sync(device)
    out["load_s"] = time.perf_counter() - t0
    check_equal(state, ref, "dcp_save")
    out["write_GBps"] = nbytes / out["durable_s"] / 1e9
    shutil.rmtree(path, ignore_errors=True)
    return out


def bench_dcp_async(state, root, device, nbytes, stager=None):
    import torch.distributed.checkpoint as dcp
    out = {}
    for i in (1, 2):
        path = fresh(root, f"dcp_async{i}")
        ref = snapshot(state) if i == 2 else None
        sync(device)
        t0 = time.perf_counter()
        kwargs = {"async_stager": stager} if stager is not None else {}
        response = dcp.async_save(state, checkpoint_id=path, **kwargs)
        staging = getattr(response, "staging_completion", None)
        upload = getattr(response, "upload_completion", response)
        if staging is not None:   # the tensors may change only once staged
            staging.result()
        sync(device)
        blocked = time.perf_counter() - t0
        train_step(state)
        upload.result()
        durable = time.perf_counter() - t0
        out["blocked_first_s" if i == 1 else "blocked_s"] = blocked
        out["durable_first_s" if i == 1 else "durable_s"] = durable
        if i == 1:
            shutil.rmtree(path, ignore_errors=True)
    sync(device)
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    sync(device)
    out["load_s"] = time.perf_counter() - t0
    check_equal(state, ref, "dcp_async_save")
    out["write_GBps"] = nbytes / out["durable_s"] / 1e9
    shutil.rmtree(path, ignore_errors=True)
    return out


def pinned_stager():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=True))


METRICS = [("blocked_s", "s", "lower"), ("blocked_first_s", "s", "lower"), ("durable_s", "s", "lower"),
           ("write_GBps", "GB/s", "higher"), ("load_s", "s", "lower"), ("d2h_floor_s", "s", "lower")]


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/checkpoint.py: no CUDA GPU; use --device cpu for a smoke run")
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
    root = args.dir or tempfile.mkdtemp(prefix="tilewise-ckpt-bench-")
    root = os.path.join(root, "tilewise-ckpt-bench") if args.dir else root
    os.makedirs(root, exist_ok=True)
    init_world(device)
    t_start = time.perf_counter()
    state, preset, params = build_state(device, args.quick)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    free = shutil.disk_usage(root).free
    if free < 1.3 * nbytes:
        raise SystemExit(f"bench/checkpoint.py: {root} has {free / 1e9:.1f} GB free; the state is "
                         f"{nbytes / 1e9:.1f} GB and each method keeps one copy on disk at a time: pass --dir")
    print(f"state: {preset}, {params / 1e9:.2f}B parameters + AdamW, {len(state)} tensors, {nbytes / 1e9:.2f} GB; "
          f"checkpoints under {root}", flush=True)

    results, missing = {}, {}
    methods = [("tilewise", bench_tilewise), ("dcp_save", bench_dcp_save), ("dcp_async_save", bench_dcp_async)]
    if args.extra_peers:
        methods.append(("dcp_async_save_pinned", lambda *a: bench_dcp_async(*a, stager=pinned_stager())))
    for name, fn in methods:
        t0 = time.perf_counter()
        if name != "tilewise" and t0 - t_start > args.budget_s:
            missing[name] = f"skipped: past the {args.budget_s:.0f} s budget"
            print(f"{name}: {missing[name]}", flush=True)
            continue
        try:
            results[name] = fn(state, root, device, nbytes)
        except ImportError as e:
            missing[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: missing ({missing[name]})", flush=True)
            continue
        except Exception as e:   # an optional peer that fails here is recorded, not fatal
            if name == "tilewise" or not name.endswith("_pinned"):
                raise
            missing[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: missing ({missing[name]})", flush=True)
            continue
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name].items())
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    shutil.rmtree(root, ignore_errors=True)

    peers = [m for m in results if m != "tilewise"]
    rows = []
    for metric, unit, better in METRICS:
        row = {"shape": {"state": preset, "GB": round(nbytes / 1e9, 2), "metric": metric}, "unit": unit}
        for m in results:
            row[m] = results[m].get(metric)
        ours = row.get("tilewise")
        theirs = [row[m] for m in peers if row.get(m) is not None]
        if ours and theirs:
            best = min(theirs) if better == "lower" else max(theirs)
            row["ratio_best_peer"] = best / ours if better == "lower" else ours / best
        else:
            row["ratio_best_peer"] = None
        rows.append(row)
    tw, da, ds = results.get("tilewise", {}), results.get("dcp_async_save", {}), results.get("dcp_save", {})
    targets = {}
    if tw and da:
        targets["blocked_at_most_a_tenth_of_dcp_async_save"] = tw["blocked_s"] <= da["blocked_s"] / 10
        targets["durable_no_worse_than_dcp_async_save"] = tw["durable_s"] <= da["durable_s"]
        targets["load_no_slower_than_dcp"] = tw["load_s"] <= min(r["load_s"] for r in (da, ds) if r)
    if tw:
        targets["blocked_under_0.5_s"] = tw["blocked_s"] < 0.5
    result = {
        "area": "checkpoint", "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke run)",
        "torch": torch.__version__, "triton": _triton_version(), "commit": git_commit(),
        "date": datetime.date.today().isoformat(), "device": device, "quick": args.quick,
        "state": {"preset": preset, "params": params, "tensors": len(state), "bytes": nbytes},
        "page_cache": "warm: each load reads files just written", "missing": missing, "targets": targets,
        "wall_s": time.perf_counter() - t_start, "rows": rows,
    }
    write_result(result, "checkpoint.json", [RESULTS if device == "cuda" else None, args.out])

    names = list(results)
    print()
    print(f"{'metric':<18}" + "".join(f"{n:>24}" for n in names) + f"{'ratio_best_peer':>18}")
    for row in rows:
        cells = "".join(f"{row[n]:>24.3f}" if row.get(n) is not None else f"{'-':>24}" for n in names)
        ratio = f"{row['ratio_best_peer']:>18.2f}" if row["ratio_best_peer"] is not None else f"{'-':>18}"
        print(f"{row['shape']['metric'] + ' (' + row['unit'] + ')':<18}{cells}{ratio}")
    print("targets: " + ", ".join(f"{k}={v}" for k, v in targets.items()))
    dist.destroy_process_group()


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
