"""The checkpoint format: one safetensors file per rank plus manifest.json, and the checks that read them.

    <root>/step_00000100/rank00000.safetensors   rank 0's pieces, each under the tensor's own name
    <root>/step_00000100/rank00001.safetensors
    <root>/step_00000100/manifest.json           the index below, plus the non-tensor state
    <root>/latest                                the name of the newest committed checkpoint

manifest.json:
    {"format": "tilewise-checkpoint", "version": 2, "step": 100, "world_size": 2,
     "files":   {"rank00000.safetensors": {"rank": 0, "bytes": N, "chunk_bytes": C, "crc32": [..]}, ...},
     "tensors": {"model.wte.weight": {"dtype": "float32", "shape": [V, D], "kind": "sharded",
                                      "shards": [{"file": "rank00000.safetensors", "offsets": [0, 0],
                                                  "shape": [V / 2, D]}, ...]}, ...},
     "state":   {...the trainer's JSON state...},
     "crc32":   crc32 of the canonical JSON of everything above}

A tensor is one of three kinds. "sharded": a DTensor; each shard is the box of the global tensor that its
placements (Shard(dim) chunks, Replicate) give one rank, written by one replica. "replicated": a plain tensor that every rank holds
the same; the writing is split across ranks (large ones by rows, small ones whole). "per_rank": a plain
tensor whose value differs by rank (RNG states); every rank writes its own, and rank r reads rank r's back.
Its shards carry "rank". A file's crc32 list holds the CRC-32 of each chunk_bytes-long piece of the file, so a
reader that needs a few byte ranges checks only the chunks under them.
"""
from __future__ import annotations

import json
import math
import os
import re
import zlib

import torch

FORMAT = "tilewise-checkpoint"
VERSION = 2
MANIFEST = "manifest.json"
LATEST = "latest"
KINDS = ("sharded", "replicated", "per_rank")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or does not match what it is loaded into."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a committed checkpoint directory's name, or None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# ------------------------------------------------------------------------------------------------
# dtypes: torch <-> safetensors header codes <-> manifest names
# ------------------------------------------------------------------------------------------------

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code
_BY_NAME = {str(d).removeprefix("torch."): d for d in _CODES}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _CODES:
        raise TypeError(f"checkpoint: tensors of dtype {dtype} cannot be saved; supported: {sorted(_BY_NAME)}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise CheckpointError(f"{where}: unknown dtype {name!r}; expected one of {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def numel(shape) -> int:
    return math.prod(shape)


# ------------------------------------------------------------------------------------------------
# Placements -> the box of the global tensor that one rank holds
# ------------------------------------------------------------------------------------------------

def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk `index` when `size` is cut into `parts` torch.chunk-style pieces."""
    step = -(-size // parts) if size else 0
    start = min(index * step, size)
    return start, min(step, size - start)


def dtensor_box(t, name: str = "") -> tuple[list[int], list[int], bool]:
    """(offsets, shape, writes) of a DTensor's local shard in its global tensor.

    Shard(dim) follows torch.chunk (FSDP2 and DTensor both cut that way), applied mesh dimension by mesh
    dimension; other placements (Partial, strided sharding) are refused. Along a Replicate mesh dimension
    one replica writes (writes=True), chosen by the tensor's name, so replicas share the writing.
    """
    from torch.distributed.tensor import Replicate, Shard
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    if coord is None:
        raise CheckpointError("a DTensor whose mesh does not include this rank cannot be saved or loaded")
    offsets, shape, writes = [0] * t.dim(), list(t.shape), True
    for mesh_dim, p in enumerate(t.placements):
        if type(p).__name__ == "_StridedShard" or not isinstance(p, (Shard, Replicate)):
            raise CheckpointError(f"DTensor placement {p!r} is not supported; expected Shard(dim) or Replicate()")
        if isinstance(p, Replicate):
            writes = writes and coord[mesh_dim] == zlib.crc32(name.encode()) % mesh.size(mesh_dim)
            continue
        start, length = chunk_range(shape[p.dim], mesh.size(mesh_dim), coord[mesh_dim])
        offsets[p.dim] += start
        shape[p.dim] = length
    local = list(t.to_local().shape)
    if local != shape:
        raise CheckpointError(f"DTensor of global shape {list(t.shape)} and placements {t.placements}: local shard "
                              f"{local}, expected {shape} from torch.chunk sharding")
    return offsets, shape, writes


def boxes_tile(shape, shards) -> str | None:
    """None if the shards' boxes lie inside `shape` and cover it exactly once; else what is wrong."""
    for s in shards:
        if len(s["offsets"]) != len(shape) or len(s["shape"]) != len(shape):
            return f"shard {s} does not have {len(shape)} dimensions"
        if any(o < 0 or n < 0 or o + n > g for o, n, g in zip(s["offsets"], s["shape"], shape)):
            return f"shard at offsets {s['offsets']} of shape {s['shape']} lies outside {list(shape)}"
    if sum(numel(s["shape"]) for s in shards) != numel(shape):
        return f"shards hold {sum(numel(s['shape']) for s in shards)} elements, the tensor {numel(shape)}"
    if len(shards) <= 128:   # disjoint + right volume = exact cover; beyond 128 shards the volume check alone
        for i, a in enumerate(shards):
            for b in shards[i + 1:]:
                if numel(a["shape"]) and numel(b["shape"]) and all(
                        ao < bo + bn and bo < ao + an
                        for ao, an, bo, bn in zip(a["offsets"], a["shape"], b["offsets"], b["shape"])):
                    return f"shards at offsets {a['offsets']} and {b['offsets']} overlap"
    return None


# ------------------------------------------------------------------------------------------------
# safetensors headers (written by us, so the writer can stream from one host buffer)
# ------------------------------------------------------------------------------------------------

def file_layout(pieces: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]):
    """The header bytes of a safetensors file holding `pieces` (name, dtype, shape), and each piece's
    byte offset in the file. Pieces go largest itemsize first, so each starts aligned to its itemsize."""
    order = sorted(pieces, key=lambda p: (-p[1].itemsize, p[0]))
    header, at = {"__metadata__": metadata}, 0
    for name, dtype, shape in order:
        nbytes = numel(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    start = 8 + len(text)
    offsets = {name: start + header[name]["data_offsets"][0] for name, _, _ in order}
    return len(text).to_bytes(8, "little") + text, offsets, start + at


def parse_header(data, path: str) -> tuple[dict, int]:
    """(header entries, data start) of a safetensors file's bytes; CheckpointError naming path if malformed."""
    if len(data) < 8:
        raise CheckpointError(f"{path}: {len(data)} bytes, too short for a safetensors header (truncated?)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise CheckpointError(f"{path}: header of {n} bytes does not fit in the file's {len(data)} (truncated?)")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
    header.pop("__metadata__", None)
    return header, 8 + n


# ------------------------------------------------------------------------------------------------
# Manifest: writing, reading, checking
# ------------------------------------------------------------------------------------------------

def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(body: dict) -> bytes:
    """manifest.json's text: body plus the CRC-32 of its canonical form."""
    return json.dumps({**body, "crc32": zlib.crc32(_canonical(body))}, indent=1).encode()


def safe_path(ckpt_dir: str, name, what: str) -> str:
    """ckpt_dir/name, refusing any name that would leave the checkpoint directory."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointError(f"{ckpt_dir}/{MANIFEST}: {what} names {name!r}, a path outside the checkpoint "
                              f"directory; expected a plain file name inside it")
    path = os.path.join(ckpt_dir, name)
    if os.path.dirname(os.path.realpath(path)) != os.path.realpath(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}/{MANIFEST}: {what} names {name!r}, which resolves outside the "
                              f"checkpoint directory")
    return path


def read_manifest(ckpt_dir: str) -> dict:
    """The checked manifest of the checkpoint directory ckpt_dir (CheckpointError if absent or invalid)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if os.path.isfile(os.path.join(ckpt_dir, "state.json")):
            raise CheckpointError(f"{ckpt_dir} is a format-1 checkpoint (state.json); this tilewise reads "
                                  f"format {VERSION} (manifest.json)") from None
        raise CheckpointError(f"{ckpt_dir} is not a complete checkpoint (no {MANIFEST})") from None
    try:
        m = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the manifest is corrupt or incomplete") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a tilewise checkpoint manifest (format {FORMAT!r})")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {m.get('version')!r}; this tilewise reads {VERSION}")
    crc = m.pop("crc32", None)
    if crc != zlib.crc32(_canonical(m)):
        raise CheckpointError(f"{path}: checksum mismatch (stored {crc}, computed {zlib.crc32(_canonical(m))}); "
                              f"the manifest was changed or corrupted")
    for key, kind in (("step", int), ("world_size", int), ("files", dict), ("tensors", dict), ("state", dict)):
        if not isinstance(m.get(key), kind):
            raise CheckpointError(f"{path}: field {key!r} is missing or not a {kind.__name__}")
    for name, f in m["files"].items():
        safe_path(ckpt_dir, name, "files")
        if not (isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("chunk_bytes"), int)
                and f["chunk_bytes"] > 0 and isinstance(f.get("crc32"), list)
                and len(f["crc32"]) == -(-f["bytes"] // f["chunk_bytes"])):
            raise CheckpointError(f"{path}: the entry of file {name!r} is malformed")
    for name, t in m["tensors"].items():
        if not (isinstance(t, dict) and t.get("kind") in KINDS and isinstance(t.get("shape"), list)
                and isinstance(t.get("shards"), list)):
            raise CheckpointError(f"{path}: the entry of tensor {name!r} is malformed")
        dtype_from_name(t.get("dtype"), f"{path}: tensor {name!r}")
        for s in t["shards"]:
            safe_path(ckpt_dir, s.get("file"), f"tensor {name!r}")
            if s["file"] not in m["files"]:
                raise CheckpointError(f"{path}: tensor {name!r} names file {s['file']!r}, which is not in 'files'")
        if t["kind"] != "per_rank":
            problem = boxes_tile(t["shape"], t["shards"])
            if problem:
                raise CheckpointError(f"{path}: tensor {name!r}: {problem}")
    return m


def is_complete(ckpt_dir: str) -> bool:
    try:
        read_manifest(ckpt_dir)
        return True
    except (CheckpointError, OSError):
        return False


def resolve(path: str) -> str:
    """A checkpoint directory from path: itself, a checkpoint root's latest, or a run directory's latest."""
    from .save import latest_in
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a directory; expected a checkpoint, a checkpoint root or a run "
                              f"directory")
    if os.path.exists(os.path.join(path, MANIFEST)) or os.path.exists(os.path.join(path, "state.json")):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        if os.path.isdir(root):
            found = latest_in(root)
            if found:
                return found
    raise CheckpointError(f"{path!r} holds no complete checkpoint (looked for {MANIFEST}, {LATEST} and "
                          f"checkpoints/{LATEST})")


def inspect(path: str) -> list[dict]:
    """The manifest of the checkpoint at path (see resolve) as table rows, one per tensor."""
    ckpt_dir = resolve(path)
    m = read_manifest(ckpt_dir)
    rows = []
    for name in sorted(m["tensors"]):
        t = m["tensors"][name]
        dtype = dtype_from_name(t["dtype"], name)
        files = sorted({s["file"] for s in t["shards"]})
        rows.append({"tensor": name, "dtype": t["dtype"], "shape": "x".join(map(str, t["shape"])) or "()",
                     "kind": t["kind"], "shards": len(t["shards"]),
                     "bytes": sum(numel(s["shape"]) for s in t["shards"]) * dtype.itemsize,
                     "files": ",".join(f.removeprefix("rank").removesuffix(".safetensors").lstrip("0") or "0"
                                       for f in files)})
    return rows


def summary(path: str) -> dict:
    """The manifest's header fields: directory, step, world size, files and their bytes."""
    ckpt_dir = resolve(path)
    m = read_manifest(ckpt_dir)
    return {"path": ckpt_dir, "step": m["step"], "world_size": m["world_size"], "files": len(m["files"]),
            "bytes": sum(f["bytes"] for f in m["files"].values()), "tensors": len(m["tensors"])}


def table(path: str) -> str:
    """inspect() and summary() as text: a header line, then one aligned row per tensor."""
    head = summary(path)
    rows = inspect(path)
    cols = ["tensor", "dtype", "shape", "kind", "shards", "bytes", "files"]
    cells = [cols] + [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = [f"{head['path']}: step {head['step']}, {head['world_size']} ranks, {head['tensors']} tensors, "
             f"{head['files']} files, {head['bytes']:,} bytes"]
    for row in cells:
        lines.append("  ".join(c.rjust(w) if i in (4, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     .rstrip())
    return "\n".join(lines)
