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

StreamingDataset (at the end) serves the same rows()/batch() contract from text and JSONL tokenized on the fly
by worker processes, for corpora that were never prepared; its order is sequential within a seeded file order.
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


def _check_int(name: str, value, low: int, owner: str = "TokenDataset"):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{owner}: {name}={value}; expected an int >= {low}")


def cu_seqlens_of(inputs, eot_id: int) -> torch.Tensor:
    """int32 offsets of the documents in the flattened (rows, seq_len) inputs: row starts and after each eot."""
    x = inputs.numpy() if isinstance(inputs, torch.Tensor) else np.asarray(inputs)
    rows, seq_len = x.shape
    hits = np.flatnonzero(x[:, :-1] == eot_id)  # an eot in the last column ends its row anyway
    r, t = np.divmod(hits, seq_len - 1) if seq_len > 1 else (hits, hits)
    cuts = np.concatenate([np.arange(rows + 1, dtype=np.int64) * seq_len, r * seq_len + t + 1])
    return torch.from_numpy(np.sort(cuts).astype(np.int32))


class _RowSource:
    """What TokenDataset and StreamingDataset share: batch() on top of rows(), and the batch argument checks."""

    seq_len: int
    eot_id: int
    world_size: int
    rank: int

    def _local_rows(self, index: int, batch_size: int) -> int:
        _check_int("index", index, 0, type(self).__name__)
        _check_int("batch_size", batch_size, 1, type(self).__name__)
        if batch_size % self.world_size:
            raise ValueError(f"{type(self).__name__}: batch_size={batch_size} is the global batch and must be a "
                             f"multiple of world_size={self.world_size}")
        return batch_size // self.world_size

    def _out(self, out, local: int) -> np.ndarray:
        width = self.seq_len + 1
        if out is None:
            return np.empty((local, width), dtype=np.int64)
        if out.shape != (local, width) or out.dtype != np.int64:
            raise ValueError(f"{type(self).__name__}.rows: out is {out.dtype} {out.shape}; expected int64 {(local, width)}")
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


class TokenDataset(_RowSource):
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
        out = self._out(out, self._local_rows(index, batch_size))
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


# ----------------------------------------------------------------------------------------------------------
# Streaming: text and JSONL tokenized on the fly by worker processes


class StreamingDataset(_RowSource):
    """Rows of a token stream tokenized while training runs, for corpora not pre-tokenized (same rows()/batch()
    contract as TokenDataset, so a Prefetcher can drive it).

    The stream: epoch e takes the input files in the order numpy.random.default_rng((seed, e)).permutation, each
    file's documents (one per file, or one per JSONL line) each followed by eot, and the epochs follow each other.
    Row k is the window of seq_len + 1 tokens at k * seq_len; global batch `index` is rows index*B ... index*B+B-1
    (no shuffle beyond the file order: that is the price of streaming), rank r taking rows r, r + W, ...
    Worker processes (spawned) tokenize pieces (a file, or ~piece_bytes of a JSONL file's lines) ahead, in order.
    Every rank tokenizes the whole stream, so the order never depends on the world size or the worker count.
    Access is sequential: asking for an earlier batch restarts the stream, a later one tokenizes the gap, so a
    resume at batch N re-tokenizes N batches' worth (a prepared TokenDataset resumes at once). close() stops
    the workers.
    """

    def __init__(self, inputs, tokenizer: str, seq_len: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 num_workers: int = 2, vocab_size: int | None = None, piece_bytes: int = 4 << 20):
        from . import corpus

        owner = "StreamingDataset"
        for name, value, low in (("seq_len", seq_len, 1), ("seed", seed, 0), ("world_size", world_size, 1),
                                 ("rank", rank, 0), ("num_workers", num_workers, 0), ("piece_bytes", piece_bytes, 1)):
            _check_int(name, value, low, owner)
        if rank >= world_size:
            raise ValueError(f"{owner}: rank={rank} is not below world_size={world_size}")
        self._files = corpus.resolve_inputs(inputs)
        tok = corpus._load_tokenizer(os.fspath(tokenizer))
        if vocab_size is not None and vocab_size < tok.get_vocab_size():
            raise DataError(f"vocab_size {vocab_size} is smaller than the {tok.get_vocab_size()} tokens of {tokenizer}")
        self._tok, self._tok_json = tok, tok.to_str()
        self.vocab_size: int = int(vocab_size or tok.get_vocab_size())
        self.eot_id: int = int(tok.token_to_id(corpus.EOT))
        self.seq_len, self.seed, self.rank, self.world_size = int(seq_len), int(seed), int(rank), int(world_size)
        self.num_workers, self.piece_bytes = int(num_workers), int(piece_bytes)
        self._pool = None
        self._restart()

    def _restart(self):
        for _, _, future in getattr(self, "_pending", []):
            if hasattr(future, "cancel"):
                future.cancel()
        self._pieces = self._piece_stream()
        self._pending: list = []  # (epoch, last piece of its epoch?, future), in stream order
        self._buf = np.zeros(0, dtype=np.int64)  # stream tokens [buf_start, buf_start + len(buf))
        self._buf_start = 0
        self._next_index = 0
        self._epoch_tokens = 0
        self.skipped = {"binary_or_non_utf8": 0, "empty": 0, "jsonl_no_text": 0}

    def _piece_stream(self):
        from .corpus import JSONL_SUFFIXES
        epoch = 0
        while True:
            pieces = []
            for i in np.random.default_rng((self.seed, epoch)).permutation(len(self._files)).tolist():
                path = self._files[i][1]
                size = os.path.getsize(path)
                if path.lower().endswith(JSONL_SUFFIXES) and size > self.piece_bytes:
                    pieces += [(path, True, a, min(a + self.piece_bytes, size)) for a in range(0, size, self.piece_bytes)]
                else:
                    pieces.append((path, path.lower().endswith(JSONL_SUFFIXES), 0, size))
            for k, piece in enumerate(pieces):
                yield epoch, k == len(pieces) - 1, piece
            epoch += 1

    def _submit(self):
        epoch, last, piece = next(self._pieces)
        if self.num_workers == 0:
            result = _tokenize_piece(piece, self._tok, self.eot_id)
            self._pending.append((epoch, last, _Done(result)))
            return
        if self._pool is None:
            import concurrent.futures
            import multiprocessing
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_stream_worker_init, initargs=(self._tok_json,))
        self._pending.append((epoch, last, self._pool.submit(_stream_worker_tokenize, piece, self.eot_id)))

    def _fill(self, end: int):
        """Tokenize until the buffer reaches stream offset `end`, keeping num_workers * 2 pieces in flight."""
        ahead = max(1, 2 * self.num_workers)
        while self._buf_start + self._buf.size < end:
            while len(self._pending) < ahead:
                self._submit()
            epoch, last, future = self._pending.pop(0)
            tokens, skipped = future.result()  # a worker's exception (DataError included) is raised here
            for key, n in skipped.items():
                self.skipped[key] += n
            self._epoch_tokens += tokens.size
            if last:
                if self._epoch_tokens == 0:  # only epoch 0 can be empty: every epoch reads the same files
                    from .corpus import _raise_no_text
                    _raise_no_text(self._files, self.skipped)
                self._epoch_tokens = 0
            if tokens.size:
                self._buf = np.concatenate([self._buf, tokens.astype(np.int64)])

    def _drop_before(self, offset: int):
        """Forget the stream before `offset`, tokenizing up to it first when it lies ahead (piece by piece)."""
        while self._buf_start + self._buf.size < offset:
            self._fill(self._buf_start + self._buf.size + 1)
            end = self._buf_start + self._buf.size
            self._buf, self._buf_start = self._buf[min(offset, end) - self._buf_start:].copy(), min(offset, end)
        cut = offset - self._buf_start
        if cut > 0:
            self._buf = self._buf[cut:].copy()
            self._buf_start = offset

    def rows(self, index: int, batch_size: int, out: np.ndarray | None = None) -> np.ndarray:
        """This rank's rows of global batch `index` (sequential access is cheap; see the class docstring)."""
        out = self._out(out, self._local_rows(index, batch_size))
        if index < self._next_index:
            self._restart()
        L = self.seq_len
        first = index * batch_size  # the global row where this batch starts
        self._drop_before(first * L)
        self._fill((first + batch_size) * L + 1)
        for i, row in enumerate(range(first + self.rank, first + batch_size, self.world_size)):
            lo = row * L - self._buf_start
            out[i] = self._buf[lo:lo + L + 1]
        self._drop_before((first + batch_size) * L)
        self._next_index = index + 1
        return out

    def close(self):
        """Stop the worker processes."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Done:
    """A finished result with a future's result() (the in-process path, num_workers=0)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


_worker_tokenizer = None  # each worker process's tokenizer, built once by the pool initializer


def _stream_worker_init(tokenizer_json: str):
    global _worker_tokenizer
    from tokenizers import Tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _stream_worker_tokenize(piece, eot_id: int):
    return _tokenize_piece(piece, _worker_tokenizer, eot_id)


def _tokenize_piece(piece, tok, eot_id: int):
    """Tokens (uint32, each document followed by eot) and skip counts of one piece: (path, is_jsonl, start, end).
    A JSONL piece owns the lines that start in [start, end)."""
    from .corpus import _documents, _encode

    path, jsonl, start, end = piece
    skipped = {"binary_or_non_utf8": 0, "empty": 0, "jsonl_no_text": 0}
    if not jsonl or (start == 0 and end == os.path.getsize(path)):
        texts = [text for _, text in _documents(path, path, skipped)]
    else:
        texts = []
        with open(path, "rb") as f:
            f.seek(max(start - 1, 0))
            if start > 0 and f.read(1) != b"\n":
                f.readline()  # the line under way at `start` belongs to the piece before
            while f.tell() < end:
                offset, raw = f.tell(), f.readline()
                if not raw:
                    break
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    skipped["binary_or_non_utf8"] += 1
                    continue
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise DataError(f"{path}: byte offset {offset}: not a JSON object (a JSONL file needs one "
                                    f"object with a \"text\" string per line)") from None
                doc = obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(doc, str):
                    skipped["jsonl_no_text"] += 1
                elif not doc.strip():
                    skipped["empty"] += 1
                else:
                    texts.append(doc)
    if not texts:
        return np.zeros(0, dtype=np.uint32), skipped
    ids = _encode(tok, texts)
    tokens = np.empty(sum(len(x) + 1 for x in ids), dtype=np.uint32)
    pos = 0
    for x in ids:
        tokens[pos:pos + len(x)] = x
        tokens[pos + len(x)] = eot_id
        pos += len(x) + 1
    return tokens, skipped
