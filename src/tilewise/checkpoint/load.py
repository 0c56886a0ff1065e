"""Reading checkpoints: each rank maps the shard files and reads only the byte ranges its targets need.

A target is a whole tensor or a DTensor's local shard, that is a box of the global tensor. Every saved shard
whose box meets the target's contributes the intersection: a strided view of the memory-mapped file, copied
into the target's slice. So a checkpoint written by N ranks loads into M: the boxes need not line up.
Everything is checked before any target is touched: names, dtypes, shapes, file sizes, the safetensors
headers against the manifest, and the CRC-32 of every file chunk under the bytes to be read (each chunk once).
Bytes moved: each needed byte read once from disk or page cache for its checksum and once into the target.
"""
from __future__ import annotations

import mmap
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from .manifest import (CheckpointError, _CODES, dtensor_box, dtype_from_name, numel, parse_header, read_manifest,
                       safe_path)

__all__ = ["load_tensors", "load_into"]


class _Files:
    """The checkpoint's shard files, memory-mapped on first use, with their headers and verified chunks."""

    def __init__(self, ckpt_dir: str, manifest: dict, verify: bool):
        self.dir, self.manifest, self.verify = ckpt_dir, manifest, verify
        self.maps: dict[str, tuple] = {}
        self.checked: set = set()
        self.lock = threading.Lock()

    def open(self, name: str):
        """(mmap, header entries, data start) of file `name`, its size and header checked."""
        with self.lock:
            if name in self.maps:
                return self.maps[name]
            path = safe_path(self.dir, name, "file")
            expected = self.manifest["files"][name]["bytes"]
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing; the manifest lists it") from None
            try:
                size = os.fstat(fd).st_size
                if size != expected:
                    how = "truncated" if size < expected else "longer than written"
                    raise CheckpointError(f"{path}: {size} bytes, the manifest says {expected}: the file is {how}")
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)   # private: writable for torch, never written
            finally:
                os.close(fd)
            header, start = parse_header(mm, path)
            self.maps[name] = (mm, header, start)
        self.check(name, 0, start)
        return self.maps[name]

    def check(self, name: str, lo: int, hi: int) -> None:
        """Verify the CRC-32 of every chunk of file `name` under the byte range [lo, hi)."""
        if not self.verify or hi <= lo:
            return
        entry = self.manifest["files"][name]
        size = entry["chunk_bytes"]
        mm = self.maps[name][0]
        for i in range(lo // size, (hi - 1) // size + 1):
            if (name, i) in self.checked:
                continue
            with memoryview(mm) as whole, whole[i * size:(i + 1) * size] as part:
                crc = zlib.crc32(part)
            if crc != entry["crc32"][i]:
                raise CheckpointError(f"{os.path.join(self.dir, name)}: checksum mismatch in bytes "
                                      f"[{i * size}, {min((i + 1) * size, entry['bytes'])}) (chunk {i}): the file "
                                      f"is corrupt")
            with self.lock:
                self.checked.add((name, i))


def _region(t) -> tuple[torch.Tensor, list[int], list[int]]:
    """(the tensor to write into, its offsets and shape in the global tensor)."""
    from .save import _is_dtensor
    if _is_dtensor(t):
        offsets, shape, _ = dtensor_box(t)
        return t.to_local(), offsets, shape
    return t, [0] * t.dim(), list(t.shape)


def _plan_reads(files: _Files, name: str, entry: dict, target, rank: int) -> list:
    """The copies that fill target from the saved shards: (file, byte range, source view maker, target slice)."""
    dtype = dtype_from_name(entry["dtype"], name)
    local, t_off, t_shape = _region(target)
    if entry["kind"] == "per_rank":
        shards = [s for s in entry["shards"] if s.get("rank") == rank]
    else:
        shards = entry["shards"]
    reads, covered = [], 0
    for s in shards:
        lo = [max(a, b) for a, b in zip(t_off, s["offsets"])]
        hi = [min(a + n, b + m) for a, n, b, m in zip(t_off, t_shape, s["offsets"], s["shape"])]
        if any(h <= low for low, h in zip(lo, hi)) or numel(s["shape"]) == 0:
            continue
        mm, header, start = files.open(s["file"])
        where = f"{os.path.join(files.dir, s['file'])}: tensor {name!r}"
        h = header.get(name)
        if not isinstance(h, dict):
            raise CheckpointError(f"{where}: not in the file's header; the file does not match the manifest")
        begin, end = h.get("data_offsets", [0, -1])
        if (h.get("dtype") != _CODES[dtype] or h.get("shape") != s["shape"]
                or end - begin != numel(s["shape"]) * dtype.itemsize or start + end > len(mm) or begin < 0):
            raise CheckpointError(f"{where}: header entry {h} does not match the manifest's "
                                  f"{entry['dtype']} {s['shape']}")
        strides = [numel(s["shape"][d + 1:]) for d in range(len(s["shape"]))]
        first = sum((a - o) * st for a, o, st in zip(lo, s["offsets"], strides))
        last = sum((b - 1 - o) * st for b, o, st in zip(hi, s["offsets"], strides))
        byte_lo = start + begin + first * dtype.itemsize
        byte_hi = start + begin + (last + 1) * dtype.itemsize
        src_slice = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, s["offsets"]))
        dst_slice = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, t_off))
        reads.append((s["file"], byte_lo, byte_hi, (mm, start + begin, dtype, s["shape"], src_slice),
                      local, dst_slice))
        covered += numel([b - a for a, b in zip(lo, hi)])
    if covered != numel(t_shape):
        raise CheckpointError(f"{files.dir}: tensor {name!r}: the saved shards cover {covered} of the "
                              f"{numel(t_shape)} elements this rank needs; the manifest is inconsistent")
    return reads


def _copy(read) -> None:
    _, _, _, (mm, at, dtype, shape, src_slice), local, dst_slice = read
    src = torch.frombuffer(mm, dtype=torch.uint8, count=numel(shape) * dtype.itemsize, offset=at)
    src = src.view(dtype).view(shape)[src_slice]
    with torch.no_grad():
        local[dst_slice].copy_(src)


def check_targets(targets) -> None:
    if not isinstance(targets, dict):
        raise TypeError(f"load_into: targets must be a dict of name -> tensor, got {type(targets).__name__}")
    for name, t in targets.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"load_into: targets[{name!r}] is a {type(t).__name__}; expected a tensor or DTensor")


def load_into(ckpt_dir: str, targets: dict, *, rank: int = 0, strict: bool = True, verify: bool = True,
              threads: int = 8) -> dict:
    """Fill targets {name: tensor or DTensor} in place from the checkpoint directory; returns its state.

    A plain tensor receives the whole saved tensor; a DTensor its local shard, read from whichever saved
    shards overlap it. Per-rank tensors (RNG states) receive rank `rank`'s value. strict: the targets and the
    checkpoint hold the same names, and a per-rank target this rank has no saved value for is an error; not
    strict: such targets are left as they are and checkpoint tensors absent from targets are skipped.
    Raises CheckpointError (before touching any target) on a missing or unexpected name, a dtype or shape
    mismatch, a missing, truncated or corrupt file.
    """
    check_targets(targets)
    m = read_manifest(ckpt_dir)
    saved = m["tensors"]
    missing = sorted(set(targets) - set(saved))
    unexpected = sorted(set(saved) - set(targets))
    if strict and missing:
        raise CheckpointError(f"{ckpt_dir}: missing keys: the checkpoint has no tensor {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")
    if strict and unexpected:
        raise CheckpointError(f"{ckpt_dir}: unexpected keys: the checkpoint's tensors {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all) are not among "
                              f"the targets")
    from .save import _is_dtensor
    files = _Files(ckpt_dir, m, verify)
    reads = []
    for name in sorted(set(targets) & set(saved)):
        entry, t = saved[name], targets[name]
        dtype = dtype_from_name(entry["dtype"], name)
        if t.dtype != dtype:
            raise CheckpointError(f"{ckpt_dir}: tensor {name!r}: dtype mismatch: the checkpoint has {entry['dtype']}, "
                                  f"the target is {str(t.dtype).removeprefix('torch.')}")
        if list(t.shape) != entry["shape"]:
            raise CheckpointError(f"{ckpt_dir}: tensor {name!r}: shape mismatch: the checkpoint has {entry['shape']}, "
                                  f"the target is {list(t.shape)}")
        if entry["kind"] == "per_rank":
            if _is_dtensor(t):
                raise CheckpointError(f"tensor {name!r} is a per-rank tensor; its target must be a plain tensor")
            if not any(s.get("rank") == rank for s in entry["shards"]):
                if strict:
                    raise CheckpointError(f"{ckpt_dir}: tensor {name!r} is per-rank and was saved by "
                                          f"{m['world_size']} ranks; this is rank {rank}, which has none (load "
                                          f"with strict=False to leave it as it is)")
                continue
        reads += _plan_reads(files, name, entry, t, rank)
    _run(threads, lambda r: files.check(r[0], r[1], r[2]), reads)
    _run(threads, _copy, reads)
    return {**m["state"], "step": m["step"]}


def load_tensors(ckpt_dir: str, names=None, *, rank: int = 0, verify: bool = True,
                 threads: int = 8) -> tuple[dict[str, torch.Tensor], dict]:
    """(whole tensors on CPU, state) of the checkpoint directory; names: a subset (default: all).
    Per-rank tensors hold rank `rank`'s value, and are absent if that rank saved none."""
    m = read_manifest(ckpt_dir)
    wanted = sorted(m["tensors"]) if names is None else list(names)
    out = {}
    for name in wanted:
        entry = m["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"{ckpt_dir}: the checkpoint has no tensor {name!r}")
        if entry["kind"] == "per_rank" and not any(s.get("rank") == rank for s in entry["shards"]):
            continue
        out[name] = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"], name))
    state = load_into(ckpt_dir, out, rank=rank, strict=False, verify=verify, threads=threads)
    return out, state


def _run(threads: int, fn, items) -> None:
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(min(threads, len(items))) as pool:
            for _ in pool.map(fn, items):
                pass
    else:
        for item in items:
            fn(item)
