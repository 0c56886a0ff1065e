"""Token datasets: fixed-length training rows cut from the shards `prepare` writes, read through numpy memmaps.

The split's shards, concatenated, are one token stream of N tokens (documents packed back to back, each ending
with eot). Row i is the window of seq_len + 1 tokens starting at i * seq_len, so rows overlap by one token and
R = (N - 1) // seq_len rows make an epoch. Epoch e visits rows in the order numpy.random.default_rng((seed, e))
.permutation(R); the global batch `index` of size B is made of global positions index*B ... index*B + B - 1 of
that endless sequence, and rank r of world_size W takes positions r, r + W, ... of each batch. The order thus
depends only on (seed, seq_len, B), never on W: a run resumed with another world size sees the same rows.

A batch reads B * (seq_len + 1) tokens from the page cache (2 or 4 bytes each) and writes them once as int64.
With cu_seqlens, each row is cut into its documents (a new one starts after every eot), so attention can keep
to one document: offsets over the flattened (B, seq_len) inputs, int32, with every row start among them; no
piece is longer than seq_len, so max_seqlen = seq_len is always a valid bound.
"""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import torch

from .corpus import DataError

SPLITS = ("train", "val")


def load_meta(data_dir: str) -> dict:
    """out_dir/meta.json of a finished `prepare`, or DataError saying how to make one."""
    path = os.path.join(os.fspath(data_dir), "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"no meta.json in {data_dir}: run `tilewise prepare` for that folder first") from None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    for key in ("vocab_size", "eot_id", "dtype", "train", "val"):
        if key not in meta:
            raise DataError(f"{path} has no {key!r} entry; prepare the data again")
    return meta


class _Shards:
    """The files of one split as one memory-mapped stream; checks sizes against meta.json on open."""

    def __init__(self, data_dir: str, meta: dict, split: str):
        self.dtype = np.dtype(meta["dtype"])
        entry = meta[split]
        counts = entry.get("file_tokens") or [None] * len(entry["files"])
        self.paths, self.maps, starts = [], [], [0]
        for name, expected in zip(entry["files"], counts):
            path = os.path.join(data_dir, name)
            try:
                size = os.path.getsize(path)
            except OSError:
                raise DataError(f"shard {path} is missing (meta.json lists it); prepare the data again") from None
            whole = size // self.dtype.itemsize
            if size % self.dtype.itemsize:
                raise DataError(f"shard {path} is truncated: {size} bytes is not a whole number of {self.dtype.name} "
                                f"tokens; the data breaks off after token offset {whole}")
            if expected is not None and whole != expected:
                what = "truncated" if whole < expected else "longer than meta.json says"
                raise DataError(f"shard {path} is {what}: it holds {whole} tokens, meta.json says {expected}; "
                                f"the data {'ends' if whole < expected else 'should end'} at token offset {min(whole, expected)}")
            if whole:
                self.paths.append(path)
                self.maps.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(whole,)))
                starts.append(starts[-1] + whole)
        self.starts = np.asarray(starts, dtype=np.int64)  # file k holds stream tokens [starts[k], starts[k+1])
        self.num_tokens = int(starts[-1])

    def read(self, start: int, out: np.ndarray):
        """Copy stream tokens [start, start + len(out)) into out."""
        pos, end, filled = start, start + out.shape[0], 0
        k = int(np.searchsorted(self.starts, pos, side="right")) - 1
        while pos < end:
            lo = pos - int(self.starts[k])
            n = min(end, int(self.starts[k + 1])) - pos
            out[filled:filled + n] = self.maps[k][lo:lo + n]
            pos, filled, k = pos + n, filled + n, k + 1

    def locate(self, stream_offset: int) -> tuple[str, int]:
        """(file, token offset in that file) of a stream offset."""
        k = int(np.searchsorted(self.starts, stream_offset, side="right")) - 1
        return self.paths[k], stream_offset - int(self.starts[k])


def _check_int(name: str, value, low: int):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"TokenDataset: {name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"TokenDataset: {name}={value}; expected an int >= {low}")


def cu_seqlens_of(inputs, eot_id: int) -> torch.Tensor:
    """int32 offsets of the documents in the flattened (rows, seq_len) inputs: row starts and after each eot."""
    x = inputs.numpy() if isinstance(inputs, torch.Tensor) else np.asarray(inputs)
    rows, seq_len = x.shape
    hits = np.flatnonzero(x[:, :-1] == eot_id)  # an eot in the last column ends its row anyway
    r, t = np.divmod(hits, seq_len - 1) if seq_len > 1 else (hits, hits)
    cuts = np.concatenate([np.arange(rows + 1, dtype=np.int64) * seq_len, r * seq_len + t + 1])
    return torch.from_numpy(np.sort(cuts).astype(np.int32))


class TokenDataset:
    """Fixed-length training rows from the token shards of `prepare`, in a global order that depends only on (seed, epoch)."""

    def __init__(self, data_dir: str, split: str, seq_len: int, *, seed: int = 0, rank: int = 0, world_size: int = 1):
        if split not in SPLITS:
            raise ValueError(f"TokenDataset: split={split!r}; expected one of {SPLITS}")
        _check_int("seq_len", seq_len, 1)
        _check_int("seed", seed, 0)
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"TokenDataset: rank={rank} is not below world_size={world_size}")
        self.data_dir, self.split, self.seq_len = os.fspath(data_dir), split, int(seq_len)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        meta = load_meta(self.data_dir)
        self.meta = meta
        self.vocab_size: int = int(meta["vocab_size"])
        self.eot_id: int = int(meta["eot_id"])
        self._shards = _Shards(self.data_dir, meta, split)
        self.num_tokens: int = self._shards.num_tokens
        if self.num_tokens < self.seq_len + 1:
            raise DataError(f"the {split} split of {self.data_dir} has {self.num_tokens} tokens; one row of "
                            f"seq_len {self.seq_len} needs {self.seq_len + 1}: use a larger corpus or a shorter seq_len")
        self.rows_per_epoch: int = (self.num_tokens - 1) // self.seq_len
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # a Prefetcher thread and the caller may both read

    def permutation(self, epoch: int) -> np.ndarray:
        """The row order of one epoch (the last two are cached)."""
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng((self.seed, epoch)).permutation(self.rows_per_epoch)
                if len(self._perms) >= 2:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = perm
            return perm

    def epoch(self, index: int, batch_size: int) -> float:
        """How many epochs the batches before `index` have covered."""
        return index * batch_size / self.rows_per_epoch

    def rows(self, index: int, batch_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """This rank's rows of global batch `index`: int64 (batch_size // world_size, seq_len + 1)."""
        _check_int("index", index, 0)
        _check_int("batch_size", batch_size, 1)
        if batch_size % self.world_size:
            raise ValueError(f"TokenDataset: batch_size={batch_size} is the global batch and must be a multiple "
                             f"of world_size={self.world_size}")
        local = batch_size // self.world_size
        width = self.seq_len + 1
        if out is None:
            out = np.empty((local, width), dtype=np.int64)
        elif out.shape != (local, width) or out.dtype != np.int64:
            raise ValueError(f"TokenDataset.rows: out is {out.dtype} {out.shape}; expected int64 {(local, width)}")
        positions = index * batch_size + np.arange(self.rank, batch_size, self.world_size, dtype=np.int64)
        epochs, slots = np.divmod(positions, self.rows_per_epoch)
        for i, (e, s) in enumerate(zip(epochs.tolist(), slots.tolist())):
            self._shards.read(int(self.permutation(e)[s]) * self.seq_len, out[i])
        if out.size and int(out.max()) >= self.vocab_size:
            i, j = np.argwhere(out >= self.vocab_size)[0]
            row = int(self.permutation(int(epochs[i]))[int(slots[i])])
            path, offset = self._shards.locate(row * self.seq_len + int(j))
            raise DataError(f"token id {int(out[i, j])} >= vocab_size {self.vocab_size} in {path} at token offset "
                            f"{offset} (byte {offset * self._shards.dtype.itemsize}); the shard does not match meta.json")
        return out

    def batch(self, index: int, batch_size: int, *, with_cu_seqlens: bool = False):
        """(inputs, targets) int64 (batch_size // world_size, seq_len) of global batch `index`, targets shifted by one;
        with_cu_seqlens=True adds the int32 document offsets over the flattened inputs (module docstring)."""
        rows = self.rows(index, batch_size)
        inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
        if with_cu_seqlens:
            return inputs, targets, cu_seqlens_of(inputs, self.eot_id)
        return inputs, targets


def _bincount(shards: _Shards, vocab_size: int, chunk: int = 1 << 24) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path, m in zip(shards.paths, shards.maps):
        for lo in range(0, m.shape[0], chunk):
            c = np.bincount(m[lo:lo + chunk], minlength=vocab_size)
            if c.shape[0] > vocab_size:
                bad = int(np.argmax(m[lo:lo + chunk] >= vocab_size))
                raise DataError(f"token id {int(m[lo + bad])} >= vocab_size {vocab_size} in {path} at token offset {lo + bad}")
            counts += c
    return counts


def unigram_val_loss(data_dir: str) -> float:
    """Cross-entropy (nats/token) of the val split under a unigram model of the train split, add-one smoothed."""
    meta = load_meta(data_dir)
    vocab = int(meta["vocab_size"])
    train, val = (_bincount(_Shards(os.fspath(data_dir), meta, s), vocab) for s in SPLITS)
    if val.sum() == 0:
        raise DataError(f"the val split of {data_dir} is empty: a unigram loss needs at least one val token")
    log_p = np.log(train + 1.0) - np.log(train.sum() + float(vocab))
    return float(-(val * log_p).sum() / val.sum())
