"""Prefetcher: the same batches as the dataset, in order; exact resume; errors from the thread; close; CUDA streams."""
import os
import threading
import time

import numpy as np
import pytest
import torch

from tilewise.data import DataError, Prefetcher, TokenDataset, write_token_shards

VOCAB, EOT = 1000, 0


@pytest.fixture
def path(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=5000)
    tokens[rng.random(5000) < 0.05] = EOT
    write_token_shards(str(tmp_path), {"train": tokens, "val": tokens[:500]}, vocab_size=VOCAB, eot_id=EOT,
                       shard_tokens=700)
    return str(tmp_path)


def test_returns_the_dataset_batches_in_order(path, device):
    ds = TokenDataset(path, "train", 32, seed=3, rank=1, world_size=2)
    with Prefetcher(ds, 8, device, start_batch=11, depth=3) as loader:
        for k in range(40):  # 40 * 8 rows > 156 rows an epoch: crosses epoch boundaries
            x, y = loader.next()
            want_x, want_y = ds.batch(11 + k, 8)
            assert x.device.type == device and x.shape == (4, 32) and x.dtype == torch.int64
            assert torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y)
            assert x.is_contiguous() and y.is_contiguous()
            assert loader.state_dict() == {"next_batch": 11 + k + 1}


def test_cu_seqlens_come_along(path, device):
    ds = TokenDataset(path, "train", 32, seed=0)
    with Prefetcher(ds, 4, device, with_cu_seqlens=True) as loader:
        for k in range(5):
            x, y, cu = loader.next()
            want = ds.batch(k, 4, with_cu_seqlens=True)
            assert cu.device.type == device and cu.dtype == torch.int32
            assert torch.equal(x.cpu(), want[0]) and torch.equal(cu.cpu(), want[2])


def test_batches_are_never_overwritten(path, device):
    ds = TokenDataset(path, "train", 16, seed=1)
    with Prefetcher(ds, 8, device, depth=2) as loader:
        kept = [loader.next() for _ in range(12)]  # far more than depth + 1 buffers
        time.sleep(0.05)
    for k, (x, y) in enumerate(kept):
        want_x, want_y = ds.batch(k, 8)
        assert torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y)


def test_resume_from_state_dict(path):
    ds = TokenDataset(path, "train", 32, seed=7)
    with Prefetcher(ds, 6, "cpu", depth=4) as first:
        for _ in range(9):
            first.next()
        time.sleep(0.05)  # let the thread run ahead: prefetched batches must not count
        state = first.state_dict()
        assert state == {"next_batch": 9}
        tail = [first.next() for _ in range(5)]
    with Prefetcher(ds, 6, "cpu", start_batch=state["next_batch"]) as resumed:
        for x, y in tail:
            rx, ry = resumed.next()
            assert torch.equal(rx, x) and torch.equal(ry, y)


def test_resume_with_another_world_size(path):
    whole = TokenDataset(path, "train", 32, seed=2)
    with Prefetcher(whole, 8, "cpu") as loader:
        for _ in range(4):
            loader.next()
        state = loader.state_dict()
        expected = [loader.next() for _ in range(3)]
    loaders = [Prefetcher(TokenDataset(path, "train", 32, seed=2, rank=r, world_size=4), 8, "cpu",
                          start_batch=state["next_batch"]) for r in range(4)]
    try:
        for x, _ in expected:
            parts = [ldr.next()[0] for ldr in loaders]
            for r, part in enumerate(parts):
                assert torch.equal(part, x[r::4])
    finally:
        for ldr in loaders:
            ldr.close()


def test_bad_shard_error_reaches_next(path):
    shard = os.path.join(path, "train_002.bin")  # stream tokens 1400..2099
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[10] = VOCAB + 1
    tokens.tofile(shard)
    ds = TokenDataset(path, "train", 32, seed=0)
    bad = next(i for i in range(100) if _raises(ds, i, 4))
    with pytest.raises(DataError) as direct:
        ds.batch(bad, 4)
    loader = Prefetcher(ds, 4, "cpu", depth=2)
    try:
        for k in range(bad):
            assert torch.equal(loader.next()[0], ds.batch(k, 4)[0])  # the good batches come first
        for _ in range(2):  # and the error stays raised
            with pytest.raises(DataError) as info:
                loader.next()
            assert str(info.value) == str(direct.value)
            assert "train_002.bin at token offset 10" in str(info.value)
            assert isinstance(info.value.__cause__, DataError)
        assert loader.state_dict() == {"next_batch": bad}
    finally:
        loader.close()
    assert not loader._thread.is_alive()


def _raises(ds, index, batch_size):
    try:
        ds.batch(index, batch_size)
    except DataError:
        return True
    return False


class Exploding(TokenDataset):
    def rows(self, index, batch_size, out=None):
        if index == 3:
            raise KeyError("boom at three")
        return super().rows(index, batch_size, out)


def test_any_thread_error_reaches_next(path, capsys):
    ds = Exploding(path, "train", 32)
    with Prefetcher(ds, 4, "cpu") as loader:
        for _ in range(3):
            loader.next()
        with pytest.raises(RuntimeError, match=r"data loader failed on batch 3: KeyError: 'boom at three'") as info:
            loader.next()
        assert isinstance(info.value.__cause__, KeyError)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out


class Slow(TokenDataset):
    def rows(self, index, batch_size, out=None):
        time.sleep(0.1)
        return super().rows(index, batch_size, out)


def test_data_wait_ms(path):
    with Prefetcher(Slow(path, "train", 32), 4, "cpu", depth=2) as loader:
        loader.next()
        assert loader.data_wait_ms >= 50  # the first batch takes 100 ms to read
        time.sleep(0.5)  # the thread has two batches ready by now
        loader.next()
        assert loader.data_wait_ms < 50


def test_close_stops_the_thread(path):
    ds = TokenDataset(path, "train", 32)
    before = threading.active_count()
    loader = Prefetcher(ds, 4, "cpu", depth=2)
    loader.next()
    time.sleep(0.05)  # the thread is now blocked on a full queue
    assert loader._thread.is_alive() and loader._thread.daemon
    loader.close()
    assert not loader._thread.is_alive()
    assert threading.active_count() == before
    loader.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        loader.next()
    with Prefetcher(ds, 4, "cpu") as ctx:
        ctx.next()
    assert not ctx._thread.is_alive()


def test_bad_arguments(path):
    ds = TokenDataset(path, "train", 32, world_size=2)
    with pytest.raises(ValueError, match="depth=0"):
        Prefetcher(ds, 4, "cpu", depth=0)
    with pytest.raises(ValueError, match="batch_size=3 is the global batch"):
        Prefetcher(ds, 3, "cpu")
    with pytest.raises(ValueError, match="start_batch=-1"):
        Prefetcher(ds, 4, "cpu", start_batch=-1)
    with pytest.raises(TypeError, match="must be a TokenDataset"):
        Prefetcher([1, 2, 3], 4, "cpu")


@pytest.mark.gpu
def test_cuda_copies_overlap_compute_and_stay_correct(path):
    """While the compute stream is busy, batches arrive on the side stream; each one is intact and on the GPU."""
    ds = TokenDataset(path, "train", 32, seed=4)
    a = torch.randn(4096, 4096, device="cuda")
    with Prefetcher(ds, 8, "cuda", depth=2) as loader:
        assert all(buf.is_pinned() for buf in loader._host)
        batches = []
        for _ in range(20):
            x, y = loader.next()
            a = (a @ a).tanh_()  # keep the compute stream busy so the copies run under it
            batches.append((x, y, (x * 2).sum()))  # a use on the compute stream, after the wait on the event
        torch.cuda.synchronize()
    for k, (x, y, s) in enumerate(batches):
        want_x, want_y = ds.batch(k, 8)
        assert x.is_cuda and torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y)
        assert int(s) == int(want_x.sum()) * 2
