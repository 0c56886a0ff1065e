"""Checkpointer: each rank writes its own shard file, in the background; rank 0 commits.

save(step, tensors, state) runs in four stages:
  1. Every rank describes its pieces (DTensor shards, its rows of replicated tensors, its per-rank tensors);
     one all-gather of that JSON over a gloo group checks that the ranks agree and plans who writes what.
     Rank 0 has made step_X.tmp/ before it, so the all-gather is also the "directory exists" barrier.
  2. The pieces are copied into one host buffer laid out byte for byte as the rank's safetensors file.
     CUDA tensors go on a side stream into pinned memory; the current stream then waits on the copy's
     event, so no later kernel (the optimizer step) changes a tensor before it is copied. save() returns here.
  3. A background thread (inline when async_save=False) writes the buffer with pwrite from a few threads,
     CRC-32 per chunk on the way, and fsyncs. An all-gather of the outcomes is the barrier.
  4. Rank 0 writes manifest.json and fsyncs it, renames step_X.tmp -> step_X, replaces `latest` (temp file,
     os.replace, fsync of the directory) and prunes to the newest `keep`; an all-gather shares the outcome.
Bytes moved per save: each byte of state once device -> host, once into the page cache, once to disk.
A crash before stage 4's rename leaves only a .tmp directory, which is never read and is removed later.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist

from .manifest import (FORMAT, LATEST, MANIFEST, VERSION, CheckpointError, boxes_tile, chunk_range, dtensor_box,
                       dtype_name, file_layout, is_complete, numel, rank_file, step_name, step_of)

__all__ = ["Checkpointer", "CheckpointError", "latest_in"]

PER_RANK_PREFIXES = ("rng.", "per_rank.")


def _is_dtensor(t) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def latest_in(root: str) -> str | None:
    """The checkpoint that root/latest names if it is complete, else the newest complete one, else None."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        name = ""
    if step_of(name) is not None and is_complete(os.path.join(root, name)):
        return os.path.join(root, name)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    for _, n in sorted(((step_of(n), n) for n in names if step_of(n) is not None), reverse=True):
        if is_complete(os.path.join(root, n)):
            return os.path.join(root, n)
    return None


def _write_file(path: str, buf: torch.Tensor, nbytes: int, chunk: int, threads: int) -> list[int]:
    """Write buf[:nbytes] to path with pwrite, chunk by chunk from a few threads; fsync; the chunks' CRC-32s."""
    view = memoryview(buf.numpy())[:nbytes]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        def one(i: int) -> int:
            piece = view[i * chunk:(i + 1) * chunk]
            crc, at = zlib.crc32(piece), i * chunk
            while len(piece):
                n = os.pwrite(fd, piece, at)
                piece, at = piece[n:], at + n
            return crc
        count = -(-nbytes // chunk)
        if threads > 1 and count > 1:
            with ThreadPoolExecutor(min(threads, count)) as pool:
                crcs = list(pool.map(one, range(count)))
        else:
            crcs = [one(i) for i in range(count)]
        os.fsync(fd)
    finally:
        os.close(fd)
    return crcs


class _HostBuffer:
    """One reusable host buffer; page-locked (cudaHostRegister of exactly its size) when it receives CUDA copies."""

    def __init__(self):
        self.tensor, self.registered = None, False

    def get(self, nbytes: int, pinned: bool) -> torch.Tensor:
        t = self.tensor
        if t is not None and t.numel() >= nbytes and (self.registered or t.is_pinned()) == pinned:
            return t
        self.release()
        t = torch.empty(max(nbytes, 8), dtype=torch.uint8)
        if pinned:
            try:
                self.registered = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 1)) == 0
            except (AttributeError, RuntimeError):
                self.registered = False
            if not self.registered:   # the caching host allocator: rounds up, but always there
                t = torch.empty(max(nbytes, 8), dtype=torch.uint8, pin_memory=True)
        self.tensor = t
        return t

    def release(self) -> None:
        if self.tensor is not None and self.registered:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.tensor, self.registered = None, False


class Checkpointer:
    """Sharded, asynchronous, crash-safe checkpoints under `root` (format in tilewise/checkpoint/manifest.py).

    keep: the newest K committed checkpoints are kept (by step); `latest` is never deleted.
    async_save: save() returns once the tensors are copied to host memory (CUDA: once the copy is queued);
        the files are written and committed by a background thread. At most one save is in flight; the next
        save(), wait() or close() (or interpreter exit) raises a background failure, naming rank and file.
    process_group: the ranks that save together (default: all, when torch.distributed is initialized).
        Ranks coordinate over a gloo group of the same ranks, made at the first save: that save is collective.
    per_rank_prefixes: tensor names with these prefixes are per-rank values (RNG states): each rank writes
        its own and reads its own back. Other plain tensors are taken as replicated (the same on every rank).
    io_threads, chunk_bytes: writer threads per rank, and the unit of writing and of the CRC-32 checksums.
    split_bytes: replicated tensors at least this large are written in row blocks by every rank.
    """

    def __init__(self, root, *, keep: int = 3, async_save: bool = False, process_group=None,
                 per_rank_prefixes: tuple[str, ...] = PER_RANK_PREFIXES, io_threads: int = 4,
                 chunk_bytes: int = 32 << 20, split_bytes: int = 16 << 20, timeout_s: float = 1800.0):
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"Checkpointer: root must be a path, got {type(root).__name__}")
        for name, value, low in (("keep", keep, 1), ("io_threads", io_threads, 1), ("chunk_bytes", chunk_bytes, 1),
                                 ("split_bytes", split_bytes, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Checkpointer: {name}={value!r}; expected an integer of at least {low}")
        if not isinstance(per_rank_prefixes, (tuple, list)) or not all(isinstance(p, str) and p for p in
                                                                         per_rank_prefixes):
            raise TypeError(f"Checkpointer: per_rank_prefixes={per_rank_prefixes!r}; expected a tuple of strings")
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("Checkpointer: a process_group was given but torch.distributed is not initialized")
        self.root, self.keep, self.async_save = os.fspath(root), keep, bool(async_save)
        self.process_group, self.per_rank_prefixes = process_group, tuple(per_rank_prefixes)
        self.io_threads, self.chunk_bytes, self.split_bytes = io_threads, chunk_bytes, split_bytes
        self.timeout_s = timeout_s
        self.last_stats: dict = {}
        self.history: list[dict] = []   # every save's last_stats (a save's entry fills in when it is durable)
        self._gloo = None
        self._buffer = _HostBuffer()
        self._streams: dict = {}
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._at_exit = self._close_at_exit

    @staticmethod
    def step_name(step: int) -> str:
        return step_name(step)

    # -------------------------------------------------------------------------------- ranks
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def rank_world(self) -> tuple[int, int]:
        """(this process's rank, the number of ranks) in the checkpoint's process group; (0, 1) alone."""
        if not self._distributed():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _group(self):
        if self._gloo is None:
            base = self.process_group or dist.group.WORLD
            ranks = dist.get_process_group_ranks(base)
            self._gloo = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=self.timeout_s),
                                        use_local_synchronization=self.process_group is not None)
        return self._gloo

    def _all_gather(self, obj) -> list:
        """Every rank's obj (JSON), gathered over the gloo group; [obj] alone."""
        if not self._distributed() or self.rank_world()[1] == 1:
            return [obj]
        group = self._group()
        world = dist.get_world_size(group)
        data = json.dumps(obj).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(out, mine, group=group)
        return [json.loads(bytes(o[:int(s)].numpy())) for o, s in zip(out, sizes)]

    # -------------------------------------------------------------------------------- saving
    def save(self, step: int, tensors: dict, state: dict) -> str:
        """Save tensors (plain or DTensor) and JSON state as checkpoint `step`; returns its final directory.

        Collective: every rank of the group calls it with the same names. With async_save the directory
        exists only once the background write commits (wait() for it).
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"Checkpointer.save: step={step!r}; expected a non-negative integer")
        if not isinstance(tensors, dict):
            raise TypeError(f"Checkpointer.save: tensors must be a dict of name -> tensor, "
                            f"got {type(tensors).__name__}")
        for name, t in tensors.items():
            if not isinstance(name, str) or not name or name == "__metadata__":
                raise ValueError(f"Checkpointer.save: tensor name {name!r}; expected a non-empty string")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Checkpointer.save: tensors[{name!r}] is a {type(t).__name__}; expected a tensor")
            dtype_name(t.dtype)
        if not isinstance(state, dict):
            raise TypeError(f"Checkpointer.save: state must be a dict, got {type(state).__name__}")
        try:
            state = json.loads(json.dumps(state))   # a copy: the caller may change its dict while we write
        except (TypeError, ValueError) as e:
            raise TypeError(f"Checkpointer.save: state must be JSON-serializable: {e}") from None

        self.wait()
        t0 = time.perf_counter()
        rank, world = self.rank_world()
        final = os.path.join(self.root, step_name(step))
        tmp = final + ".tmp"
        error, local = None, {}
        try:
            if rank == 0:
                os.makedirs(self.root, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            local = self._describe(tensors)
        except (OSError, CheckpointError) as e:
            error = f"rank {rank}: {e}"
        metas = self._all_gather({"error": error, "tensors": local})
        errors = [m["error"] for m in metas if m["error"]]
        if errors:
            raise CheckpointError(f"checkpoint of step {step} not saved: " + "; ".join(errors))
        manifest_tensors, mine = _plan(metas, self.split_bytes)

        pieces = []   # (name, source tensor, shape)
        for name, start, length in mine[rank]:
            t = tensors[name]
            src = t.to_local() if _is_dtensor(t) else t
            if length is not None:
                src = src.narrow(0, start, length)
            pieces.append((name, src, list(src.shape)))
        header, offsets, nbytes = file_layout([(n, s.dtype, shape) for n, s, shape in pieces],
                                              {"format": "pt", "step": str(step), "rank": str(rank)})
        buf = self._buffer.get(nbytes, pinned=any(s.is_cuda for _, s, _ in pieces))
        buf[:len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        events = self._snapshot(buf, pieces, offsets)
        self.last_stats = {"step": step, "rank": rank, "bytes": nbytes, "blocked_s": time.perf_counter() - t0}
        self.history.append(self.last_stats)

        args = (step, tmp, final, buf, nbytes, events, manifest_tensors, state, t0, rank, world)
        if not self.async_save:
            self._write_and_commit(*args)
            return final
        self._thread = threading.Thread(target=self._background, args=args, name=f"tilewise-ckpt-{step}")
        self._thread.start()
        atexit.register(self._at_exit)   # a failure nobody waited for is still raised (printed) at exit
        return final

    def _describe(self, tensors: dict) -> dict:
        """This rank's view of each tensor: kind, dtype, global shape and, for shards, its box."""
        out = {}
        for name in sorted(tensors):
            t = tensors[name]
            entry = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
            if _is_dtensor(t):
                if name.startswith(self.per_rank_prefixes):
                    raise CheckpointError(f"tensor {name!r} is a DTensor but its name marks a per-rank tensor")
                offsets, shape, writes = dtensor_box(t, name)
                if shape == list(t.shape):        # fully replicated DTensor: a replicated tensor
                    entry["kind"] = "replicated"
                else:
                    entry.update(kind="sharded", offsets=offsets, local=shape, writes=writes)
            else:
                entry["kind"] = "per_rank" if name.startswith(self.per_rank_prefixes) else "replicated"
            out[name] = entry
        return out

    def _snapshot(self, buf: torch.Tensor, pieces, offsets) -> list:
        """Copy the pieces into buf; CUDA ones on a side stream. Returns the events the writer waits on."""
        events, by_device = [], {}
        for name, src, shape in pieces:
            n = numel(shape)
            if n == 0:
                continue
            at = offsets[name]
            dst = buf[at:at + n * src.dtype.itemsize].view(src.dtype).view(shape)
            if src.is_cuda:
                by_device.setdefault(src.device, []).append((dst, src))
            else:
                with torch.no_grad():
                    dst.copy_(src)
        for device, copies in by_device.items():
            with torch.cuda.device(device):
                current = torch.cuda.current_stream(device)
                if device not in self._streams:
                    self._streams[device] = torch.cuda.Stream(device)
                side = self._streams[device]
                side.wait_stream(current)            # copy the values as of this call
                with torch.cuda.stream(side), torch.no_grad():
                    for dst, src in copies:
                        dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
                current.wait_event(event)            # nothing queued after save() runs before the copy is done
                events.append(event)
        return events

    def _background(self, *args) -> None:
        try:
            self._write_and_commit(*args)
        except BaseException as e:   # kept for the next save(), wait() or close()
            self._failure = e

    def _write_and_commit(self, step, tmp, final, buf, nbytes, events, manifest_tensors, state, t0, rank, world):
        path = os.path.join(tmp, rank_file(rank))
        try:
            for event in events:
                event.synchronize()
            crcs = _write_file(path, buf, nbytes, self.chunk_bytes, self.io_threads)
            result = {"error": None, "bytes": nbytes, "chunk_bytes": self.chunk_bytes, "crc32": crcs}
        except Exception as e:
            result = {"error": f"rank {rank}: writing {path}: {e}"}
        written = time.perf_counter()
        results = self._gather_or_fail(result, step, rank, "the ranks' write results")
        errors = [r["error"] for r in results if r["error"]]
        if errors:
            raise CheckpointError(f"checkpoint of step {step} not saved: " + "; ".join(errors))
        outcome = None
        if rank == 0:
            try:
                files = {rank_file(r): {"rank": r, "bytes": res["bytes"], "chunk_bytes": res["chunk_bytes"],
                                        "crc32": res["crc32"]} for r, res in enumerate(results)}
                body = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world,
                        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "files": files, "tensors": manifest_tensors, "state": state}
                self._commit(tmp, final, body)
            except Exception as e:
                outcome = f"rank 0: committing {final}: {e}"
        outcome = self._gather_or_fail(outcome, step, rank, "rank 0's commit")[0]
        if outcome:
            raise CheckpointError(f"checkpoint of step {step} not saved: {outcome}")
        self.last_stats.update(write_s=written - t0, durable_s=time.perf_counter() - t0)

    def _gather_or_fail(self, obj, step: int, rank: int, what: str) -> list:
        try:
            return self._all_gather(obj)
        except Exception as e:   # a rank died or hung: this checkpoint cannot commit
            raise CheckpointError(f"rank {rank}: checkpoint of step {step} not saved: exchanging {what} failed "
                                  f"(did a rank die?): {e}") from e

    def _commit(self, tmp: str, final: str, body: dict) -> None:
        from .manifest import manifest_bytes
        _write_durably(os.path.join(tmp, MANIFEST), manifest_bytes(body))
        _fsync_dir(tmp)
        old = None
        if os.path.exists(final):   # the same step saved again: swap, so `latest` never names a missing one
            old = f"{final}.old{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        name = os.path.basename(final)
        _write_durably(os.path.join(self.root, LATEST + ".tmp"), (name + "\n").encode())
        os.replace(os.path.join(self.root, LATEST + ".tmp"), os.path.join(self.root, LATEST))
        _fsync_dir(self.root)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        self._prune(name)

    def _prune(self, latest: str) -> None:
        """Keep the newest `keep` checkpoints (and always `latest`); remove leftovers of crashed saves."""
        names = os.listdir(self.root)
        done = sorted((step_of(n), n) for n in names if step_of(n) is not None)
        for _, n in done[:-self.keep]:
            if n != latest:
                shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)
        for n in names:   # no save is in flight while rank 0 commits: any .tmp or .old is a leftover
            if n.startswith("step_") and (n.endswith(".tmp") or ".old" in n):
                shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its failure, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            atexit.unregister(self._at_exit)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            if isinstance(failure, CheckpointError):
                raise CheckpointError(str(failure)) from failure
            rank = self.rank_world()[0] if self._distributed() else 0
            raise CheckpointError(f"rank {rank}: background checkpoint save failed: {failure!r}") from failure

    def close(self) -> None:
        """wait(), then free the host buffer. The Checkpointer can still save afterwards."""
        try:
            self.wait()
        finally:
            self._buffer.release()

    def _close_at_exit(self) -> None:
        self.close()   # a background failure still raises here, so it is printed, never silent

    # -------------------------------------------------------------------------------- reading
    def latest(self) -> str | None:
        """The newest complete checkpoint's directory (what `latest` names), or None."""
        return latest_in(self.root)

    def _path(self, path):
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no complete checkpoint under {self.root!r}")
        return os.fspath(path)

    def load(self, path=None, *, verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
        """(every tensor, whole, on CPU; state with "step") of the checkpoint at path (default: latest).
        Per-rank tensors: this rank's value (absent if the checkpoint had fewer ranks)."""
        from .load import load_tensors
        return load_tensors(self._path(path), rank=self.rank_world()[0], verify=verify,
                            threads=self.io_threads)

    def load_into(self, targets: dict, path=None, *, strict: bool = True, verify: bool = True) -> dict:
        """Fill targets (plain tensors: whole; DTensors: this rank's shard) in place; returns the state.
        Each rank reads only the byte ranges it needs. See tilewise.checkpoint.load.load_into."""
        from .load import check_targets, load_into
        check_targets(targets)
        return load_into(self._path(path), targets, rank=self.rank_world()[0], strict=strict, verify=verify,
                         threads=max(self.io_threads, 8))


def _plan(metas: list[dict], split_bytes: int) -> tuple[dict, list[list]]:
    """From every rank's description: the manifest's tensor entries and, per rank, what it writes
    ((name, start, length): rows [start, start + length) of a replicated tensor, or length None for all)."""
    world = len(metas)
    names = sorted(metas[0]["tensors"])
    for r, m in enumerate(metas):
        if sorted(m["tensors"]) != names:
            extra = sorted(set(m["tensors"]) - set(names))
            lacking = sorted(set(names) - set(m["tensors"]))
            raise CheckpointError(f"rank {r} saves different tensors than rank 0: extra {extra[:5]}, "
                                  f"missing {lacking[:5]}")
    entries, mine, loads, replicated = {}, [[] for _ in range(world)], [0] * world, []
    for name in names:
        first = metas[0]["tensors"][name]
        for r, m in enumerate(metas):
            e = m["tensors"][name]
            if (e["kind"], e["dtype"], e["shape"]) != (first["kind"], first["dtype"], first["shape"]):
                raise CheckpointError(f"tensor {name!r}: rank {r} has {e['kind']} {e['dtype']} {e['shape']}, rank 0 "
                                      f"{first['kind']} {first['dtype']} {first['shape']}")
        entry = {"dtype": first["dtype"], "shape": first["shape"], "kind": first["kind"], "shards": []}
        itemsize = torch.empty((), dtype=getattr(torch, first["dtype"])).element_size()
        if first["kind"] == "sharded":
            for r, m in enumerate(metas):
                e = m["tensors"][name]
                if e["writes"] and numel(e["local"]):
                    entry["shards"].append({"file": rank_file(r), "offsets": e["offsets"], "shape": e["local"]})
                    mine[r].append((name, 0, None))
                    loads[r] += numel(e["local"]) * itemsize
            problem = boxes_tile(first["shape"], entry["shards"])
            if problem:
                raise CheckpointError(f"tensor {name!r}: the ranks' DTensor shards do not tile it: {problem}")
        elif first["kind"] == "per_rank":
            for r in range(world):
                entry["shards"].append({"file": rank_file(r), "rank": r, "offsets": [0] * len(first["shape"]),
                                        "shape": first["shape"]})
                mine[r].append((name, 0, None))
                loads[r] += numel(first["shape"]) * itemsize
        else:
            replicated.append((numel(first["shape"]) * itemsize, name))
        entries[name] = entry
    for nbytes, name in sorted(replicated, key=lambda x: (-x[0], x[1])):
        shape = entries[name]["shape"]
        if nbytes == 0:
            continue
        if world > 1 and nbytes >= split_bytes and len(shape) >= 1 and shape[0] >= world:
            for r in range(world):
                start, length = chunk_range(shape[0], world, r)
                if length:
                    entries[name]["shards"].append({"file": rank_file(r), "offsets": [start] + [0] * (len(shape) - 1),
                                                    "shape": [length] + shape[1:]})
                    mine[r].append((name, start, length))
                    loads[r] += nbytes * length // shape[0]
        else:
            r = min(range(world), key=lambda i: (loads[i], i))
            entries[name]["shards"].append({"file": rank_file(r), "offsets": [0] * len(shape), "shape": shape})
            mine[r].append((name, 0, None))
            loads[r] += nbytes
    return entries, mine
