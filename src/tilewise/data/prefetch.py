"""The Prefetcher: batches on their way to the device while the model computes, and a loader position to resume from.

A daemon thread reads batch start, start+1, ... from a TokenDataset ahead of the consumer, at most `depth` ready
batches ahead. On CUDA it writes each batch into one of depth + 1 pinned host buffers (allocated once, reused
round-robin), starts its host-to-device copy with non_blocking=True on a dedicated copy stream and records an
event; next() makes the caller's current stream wait on that event (the host never waits for a copy) and calls
record_stream, so the caching allocator keeps the memory until the compute stream is done with it. A host buffer
is refilled only after the event of its previous copy has completed (the thread waits on it, not the consumer).
On CPU the thread builds the batch tensors directly: no streams, no pinning.

Buffer rule: every next() returns new tensors, on CUDA and CPU alike; nothing returned is overwritten by later
batches, so the consumer may keep a batch as long as it likes. Per batch this moves 2 * rows * seq_len int64
values host to device (plus cu_seqlens when asked for).

Errors: an exception in the thread (DataError from a bad shard, anything else) ends the thread and is raised by
the next() call that would have returned that batch, chained to the original; the batches before it come first.
"""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from .corpus import DataError
from .dataset import TokenDataset, cu_seqlens_of


class Prefetcher:
    """Keeps the next batches on their way while the GPU computes (module docstring for streams and buffers)."""

    def __init__(self, dataset: TokenDataset, batch_size: int, device: torch.device | str, *,
                 start_batch: int = 0, depth: int = 2, with_cu_seqlens: bool = False):
        if not isinstance(dataset, TokenDataset) and not hasattr(dataset, "rows"):
            raise TypeError(f"Prefetcher: dataset must be a TokenDataset, got {type(dataset).__name__}")
        for name, value, low in (("batch_size", batch_size, 1), ("start_batch", start_batch, 0), ("depth", depth, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Prefetcher: {name}={value!r}; expected an int >= {low}")
        if batch_size % dataset.world_size:
            raise ValueError(f"Prefetcher: batch_size={batch_size} is the global batch and must be a multiple of "
                             f"world_size={dataset.world_size}")
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"Prefetcher: device {device} asked for, but CUDA is not available")
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        elif device.type != "cpu":
            raise ValueError(f"Prefetcher: device {device}; expected cpu or cuda")
        self.dataset, self.batch_size, self.device, self.depth = dataset, batch_size, device, depth
        self.with_cu_seqlens = with_cu_seqlens
        self._cuda = device.type == "cuda"
        local = batch_size // dataset.world_size
        self._shape = (2, local, dataset.seq_len)  # inputs and targets side by side: one copy per batch
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(device)
            self._host = [torch.empty(self._shape, dtype=torch.int64, pin_memory=True) for _ in range(depth + 1)]
            self._host_done: list = [None] * (depth + 1)  # the event of each buffer's last copy
        self._rows = np.empty((local, dataset.seq_len + 1), dtype=np.int64)  # the thread's read buffer
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._next_batch = start_batch
        self._wait_ms = 0.0
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(start_batch,), name="tilewise-prefetch", daemon=True)
        self._thread.start()

    # ---- the background thread

    def _run(self, index: int):
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)
            slot = 0
            while not self._stop.is_set():
                rows = self.dataset.rows(index, self.batch_size, out=self._rows)
                cu = cu_seqlens_of(rows[:, :-1], self.dataset.eot_id) if self.with_cu_seqlens else None
                if self._cuda:
                    item = self._to_device(rows, cu, slot)
                    slot = (slot + 1) % len(self._host)
                else:
                    batch = torch.empty(self._shape, dtype=torch.int64)
                    self._fill(batch, rows)
                    item = (batch, None, cu)
                if not self._put(("batch", index, item)):
                    return
                index += 1
        except BaseException as e:  # everything goes to the consumer; nothing is printed from here
            self._put(("error", index, e))

    @staticmethod
    def _fill(batch: torch.Tensor, rows: np.ndarray):
        view = batch.numpy()
        np.copyto(view[0], rows[:, :-1])
        np.copyto(view[1], rows[:, 1:])

    def _to_device(self, rows, cu, slot):
        host = self._host[slot]
        if self._host_done[slot] is not None:
            self._host_done[slot].synchronize()  # the previous copy out of this buffer has finished
        self._fill(host, rows)
        if cu is not None:
            cu = cu.pin_memory()  # the host allocator keeps it alive until the copy below has run
        with torch.cuda.stream(self._copy_stream):
            batch = host.to(self.device, non_blocking=True)
            cu = cu.to(self.device, non_blocking=True) if cu is not None else None
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._host_done[slot] = done
        return batch, done, cu

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    # ---- the consumer

    def next(self):
        """The batch `start_batch + k` on the k-th call, on the device: (inputs, targets[, cu_seqlens])."""
        if self._closed:
            raise RuntimeError("Prefetcher.next() after close()")
        if self._error is not None:
            self._raise(*self._error)
        start = time.perf_counter()
        while True:
            try:
                kind, index, item = self._ready.get(timeout=0.5)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError("Prefetcher: the loader thread stopped without a batch or an error") from None
        self._wait_ms = (time.perf_counter() - start) * 1e3
        if kind == "error":
            self._error = (index, item)
            self._raise(index, item)
        batch, done, cu = item
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            batch.record_stream(stream)
            if cu is not None:
                cu.record_stream(stream)
        self._next_batch = index + 1
        return (batch[0], batch[1], cu) if self.with_cu_seqlens else (batch[0], batch[1])

    __next__ = next

    def __iter__(self):
        return self

    @staticmethod
    def _raise(index: int, error: BaseException):
        if isinstance(error, DataError):
            raise DataError(str(error)) from error
        raise RuntimeError(f"data loader failed on batch {index}: {type(error).__name__}: {error}") from error

    @property
    def data_wait_ms(self) -> float:
        """Host milliseconds the last next() blocked waiting for the thread (the copy itself is waited on by the stream)."""
        return self._wait_ms

    def state_dict(self) -> dict:
        """{"next_batch": the global batch the next next() returns}; batches prefetched but not returned do not count."""
        return {"next_batch": self._next_batch}

    def close(self):
        """Stop the thread and wait for it; idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
