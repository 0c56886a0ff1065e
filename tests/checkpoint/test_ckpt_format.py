"""Checkpoints in one process: bitwise round trips, the commit protocol, pruning, and every error path."""
import errno
import json
import os

import pytest
import torch
from safetensors import safe_open

import tilewise.checkpoint.save as save_mod
from tilewise.checkpoint import Checkpointer, CheckpointError, inspect, load_into, load_tensors, read_manifest
from tilewise.checkpoint.manifest import chunk_range, manifest_bytes


def sample_tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {
        "f64": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "f32": torch.randn(37, 11, generator=g),
        "f16": torch.randn(9, generator=g).half(),
        "bf16": torch.randn(4, 6, generator=g).bfloat16(),
        "i64": torch.randint(-2**62, 2**62, (7,), generator=g),
        "i32": torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int32),
        "i16": torch.randint(-2**15, 2**15 - 1, (5,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (6,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 8, generator=g).t(),          # not contiguous
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
        "rng.cpu": torch.get_rng_state(),
    }
    if hasattr(torch, "float8_e4m3fn"):
        out["f8"] = torch.randn(8, generator=g).to(torch.float8_e4m3fn)
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return bytes(a.view(torch.uint8).numpy()) == bytes(b.view(torch.uint8).numpy()) if a.numel() else True


def rewrite_manifest(ckpt_dir, edit) -> None:
    """Change manifest.json and re-sign it, as a malicious or buggy writer would."""
    path = os.path.join(ckpt_dir, "manifest.json")
    m = json.load(open(path))
    m.pop("crc32")
    edit(m)
    open(path, "wb").write(manifest_bytes(m))


def test_round_trip_is_bitwise_for_every_dtype(tmp_path):
    tensors = sample_tensors()
    ckpt = Checkpointer(tmp_path, chunk_bytes=64)   # many chunks per file
    path = ckpt.save(7, tensors, {"data": {"next_batch": 7}, "config": {"lr": 0.1}})
    assert path == str(tmp_path / "step_00000007") and ckpt.latest() == path
    loaded, state = ckpt.load()
    assert state == {"data": {"next_batch": 7}, "config": {"lr": 0.1}, "step": 7}
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert bitwise_equal(loaded[name], t), name
    # The shard file is plain safetensors: its own reader agrees.
    with safe_open(os.path.join(path, "rank00000.safetensors"), "pt") as f:
        for name in f.keys():
            assert bitwise_equal(f.get_tensor(name), tensors[name]), name
    m = read_manifest(path)
    assert m["world_size"] == 1 and m["tensors"]["rng.cpu"]["kind"] == "per_rank"
    assert m["tensors"]["f32"]["kind"] == "replicated" and m["tensors"]["empty"]["shards"] == []
    assert len(m["files"]["rank00000.safetensors"]["crc32"]) > 10


def test_load_into_fills_targets_in_place(tmp_path):
    tensors = sample_tensors()
    Checkpointer(tmp_path).save(3, tensors, {"x": [1, 2]})
    targets = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
               for k, v in tensors.items()}
    ids = {k: v.data_ptr() for k, v in targets.items()}
    state = Checkpointer(tmp_path).load_into(targets)
    assert state == {"x": [1, 2], "step": 3}
    for name, t in tensors.items():
        assert bitwise_equal(targets[name], t), name
        assert targets[name].data_ptr() == ids[name]
    # A parameter that requires grad is filled too (no autograd error).
    p = torch.nn.Parameter(torch.zeros(37, 11))
    Checkpointer(tmp_path).load_into({"f32": p}, strict=False)
    assert torch.equal(p.detach(), tensors["f32"])


def test_async_save_snapshots_the_values_at_the_call(tmp_path):
    w = torch.randn(300, 40)
    expected = w.clone()
    ckpt = Checkpointer(tmp_path, async_save=True, chunk_bytes=1024)
    final = ckpt.save(1, {"w": w}, {})
    w.add_(1.0)                  # the training step goes on at once
    ckpt.wait()
    assert ckpt.latest() == final
    assert torch.equal(ckpt.load()[0]["w"], expected)
    assert ckpt.last_stats["bytes"] > w.numel() * 4 and ckpt.last_stats["durable_s"] >= ckpt.last_stats["blocked_s"]
    ckpt.save(2, {"w": w}, {})   # the host buffer is reused; the second save waits for nothing
    ckpt.close()
    assert torch.equal(ckpt.load()[0]["w"], expected + 1.0)


@pytest.mark.parametrize("raise_at", ["wait", "save", "close"])
def test_background_failure_is_raised_naming_rank_and_file(tmp_path, monkeypatch, raise_at):
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, {"w": torch.randn(8)}, {})
    ckpt.wait()
    real = save_mod._write_file

    def disk_full(path, *args):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(save_mod, "_write_file", disk_full)
    ckpt.save(2, {"w": torch.randn(8)}, {})   # returns: the failure happens in the background
    with pytest.raises(CheckpointError) as err:
        {"wait": ckpt.wait, "close": ckpt.close,
         "save": lambda: ckpt.save(3, {"w": torch.randn(8)}, {})}[raise_at]()
    message = str(err.value)
    assert "rank 0" in message and "step 2" in message and "No space left" in message
    assert os.path.join("step_00000002.tmp", "rank00000.safetensors") in message
    assert ckpt.latest() == str(tmp_path / "step_00000001")
    monkeypatch.setattr(save_mod, "_write_file", real)
    ckpt.wait()                                # raised once, not again
    ckpt.save(4, {"w": torch.ones(8)}, {})
    ckpt.wait()
    assert ckpt.latest() == str(tmp_path / "step_00000004")
    assert not os.path.exists(tmp_path / "step_00000002.tmp")   # the failed save's leftovers are gone


def test_keep_last_k_and_never_latest(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in range(1, 6):
        ckpt.save(step, {"w": torch.full((3,), float(step))}, {})
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step_")) == ["step_00000004", "step_00000005"]
    # Saving an older step (a resumed run) keeps it as latest, though two newer steps exist.
    Checkpointer(tmp_path, keep=1).save(3, {"w": torch.zeros(3)}, {})
    assert ckpt.latest() == str(tmp_path / "step_00000003")
    assert os.path.isdir(tmp_path / "step_00000003") and os.path.isdir(tmp_path / "step_00000005")
    assert not os.path.isdir(tmp_path / "step_00000004")


def test_saving_a_step_again_replaces_it(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(4, {"w": torch.zeros(3)}, {"v": 1})
    ckpt.save(4, {"w": torch.ones(3)}, {"v": 2})
    tensors, state = ckpt.load()
    assert torch.equal(tensors["w"], torch.ones(3)) and state["v"] == 2
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000004"]


def test_incomplete_checkpoints_are_never_picked(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"w": torch.ones(3)}, {})
    # A crash mid-save leaves a .tmp directory; a torn manifest leaves invalid JSON.
    os.makedirs(tmp_path / "step_00000002.tmp")
    os.makedirs(tmp_path / "step_00000003")
    good = open(tmp_path / "step_00000001" / "manifest.json").read()
    open(tmp_path / "step_00000003" / "manifest.json", "w").write(good[:len(good) // 2])
    assert ckpt.latest() == str(tmp_path / "step_00000001")
    (tmp_path / "latest").write_text("step_00000003\n")         # even when latest names it
    assert ckpt.latest() == str(tmp_path / "step_00000001")
    (tmp_path / "latest").unlink()
    assert ckpt.latest() == str(tmp_path / "step_00000001")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ckpt.load(str(tmp_path / "step_00000003"))
    assert Checkpointer(tmp_path / "nothing").latest() is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        Checkpointer(tmp_path / "nothing").load()


def saved(tmp_path, chunk_bytes=256):
    tensors = {"a": torch.randn(64, 16), "b": torch.randn(64, 16), "c": torch.arange(5)}
    path = Checkpointer(tmp_path, chunk_bytes=chunk_bytes).save(1, tensors, {})
    return path, tensors, os.path.join(path, "rank00000.safetensors")


def test_corrupt_byte_is_a_checksum_error_naming_the_file(tmp_path):
    path, tensors, shard = saved(tmp_path)
    header_len = 8 + int.from_bytes(open(shard, "rb").read(8), "little")
    offset = header_len + json.loads(open(shard, "rb").read(header_len)[8:])["b"]["data_offsets"][0] + 2000
    data = bytearray(open(shard, "rb").read())
    data[offset] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors: checksum mismatch"):
        load_tensors(path)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_into(path, {"b": torch.empty(64, 16)}, strict=False)
    # Only the chunks under the bytes read are checked: "a" lies in other chunks and still loads.
    a, _ = load_tensors(path, ["a"])
    assert torch.equal(a["a"], tensors["a"])
    assert torch.equal(load_tensors(path, ["b"], verify=False)[0]["b"].view(-1)[:400], tensors["b"].view(-1)[:400])


def test_corrupt_header_is_an_error_naming_the_file(tmp_path):
    path, _, shard = saved(tmp_path)
    data = bytearray(open(shard, "rb").read())
    data[10] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors"):
        load_tensors(path, verify=False)   # even unverified, a broken header is caught
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors"):
        load_tensors(path)


def test_truncated_and_missing_files_are_errors_naming_them(tmp_path):
    path, _, shard = saved(tmp_path)
    size = os.path.getsize(shard)
    os.truncate(shard, size - 1)
    with pytest.raises(CheckpointError, match=rf"rank00000\.safetensors: {size - 1} bytes, the manifest says {size}: "
                                              r"the file is truncated"):
        Checkpointer(tmp_path).load()
    os.remove(shard)
    with pytest.raises(CheckpointError, match=r"rank00000\.safetensors: missing"):
        Checkpointer(tmp_path).load()


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "..", "sub/rank00000.safetensors"])
def test_manifest_naming_a_path_outside_is_refused(tmp_path, name):
    path, _, shard = saved(tmp_path / "ckpt")
    (tmp_path / "outside.safetensors").write_bytes(open(shard, "rb").read())

    def edit(m):
        m["files"][name] = m["files"].pop("rank00000.safetensors")
        for t in m["tensors"].values():
            for s in t["shards"]:
                s["file"] = name
    rewrite_manifest(path, edit)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        load_tensors(path)
    assert Checkpointer(tmp_path / "ckpt").latest() is None     # and such a checkpoint is not complete


def test_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    path, _, shard = saved(tmp_path / "ckpt")
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(shard, outside)
    os.symlink(outside, shard)
    with pytest.raises(CheckpointError, match="resolves outside the checkpoint directory"):
        load_tensors(path)


def test_edited_manifest_fails_its_checksum(tmp_path):
    path, _, _ = saved(tmp_path)
    text = open(os.path.join(path, "manifest.json")).read()
    open(os.path.join(path, "manifest.json"), "w").write(text.replace('"step": 1,', '"step": 2,', 1))
    assert text != open(os.path.join(path, "manifest.json")).read()
    with pytest.raises(CheckpointError, match="manifest.json: checksum mismatch"):
        load_tensors(path)


def test_manifest_shards_that_do_not_tile_are_refused(tmp_path):
    path, _, _ = saved(tmp_path)
    rewrite_manifest(path, lambda m: m["tensors"]["a"]["shards"][0].update(shape=[32, 16]))
    with pytest.raises(CheckpointError, match="tensor 'a'"):
        load_tensors(path)


def test_key_shape_and_dtype_mismatches_name_the_tensor(tmp_path):
    path, tensors, _ = saved(tmp_path)
    ckpt = Checkpointer(tmp_path)
    good = {k: torch.empty_like(v) for k, v in tensors.items()}
    with pytest.raises(CheckpointError, match=r"missing keys: .*'d'"):
        ckpt.load_into({**good, "d": torch.empty(3)})
    with pytest.raises(CheckpointError, match=r"unexpected keys: .*\['c'\]"):
        ckpt.load_into({k: v for k, v in good.items() if k != "c"})
    with pytest.raises(CheckpointError, match=r"tensor 'a': shape mismatch: the checkpoint has \[64, 16\], the "
                                              r"target is \[16, 64\]"):
        ckpt.load_into({**good, "a": torch.empty(16, 64)})
    with pytest.raises(CheckpointError, match=r"tensor 'b': dtype mismatch: the checkpoint has float32, the target "
                                              r"is bfloat16"):
        ckpt.load_into({**good, "b": torch.empty(64, 16, dtype=torch.bfloat16)})
    # Errors come before any target is written.
    sentinel = torch.full((64, 16), 7.0)
    with pytest.raises(CheckpointError):
        ckpt.load_into({"a": sentinel, "b": torch.empty(1)}, strict=False)
    assert torch.equal(sentinel, torch.full((64, 16), 7.0))
    # Not strict: names on one side only are skipped.
    part = {"a": torch.empty(64, 16), "zzz": torch.zeros(2)}
    ckpt.load_into(part, strict=False)
    assert torch.equal(part["a"], tensors["a"]) and torch.equal(part["zzz"], torch.zeros(2))


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.save(-1, {}, {}), ValueError, "step=-1; expected a non-negative integer"),
    (lambda c: c.save(1.0, {}, {}), ValueError, "step=1.0"),
    (lambda c: c.save(1, [torch.ones(1)], {}), TypeError, "tensors must be a dict"),
    (lambda c: c.save(1, {"w": [1.0]}, {}), TypeError, r"tensors\['w'\] is a list; expected a tensor"),
    (lambda c: c.save(1, {"": torch.ones(1)}, {}), ValueError, "tensor name ''"),
    (lambda c: c.save(1, {"w": torch.ones(1, dtype=torch.complex64)}, {}), TypeError, "complex64 cannot be saved"),
    (lambda c: c.save(1, {}, {"x": object()}), TypeError, "state must be JSON-serializable"),
    (lambda c: c.save(1, {}, [1]), TypeError, "state must be a dict"),
    (lambda c: c.load_into([torch.ones(1)]), TypeError, "targets must be a dict"),
    (lambda c: c.load_into({"w": 1.0}), TypeError, r"targets\['w'\] is a float"),
])
def test_bad_arguments(tmp_path, call, error, message):
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(error, match=message):
        call(ckpt)
    assert not os.path.exists(tmp_path / "latest")


@pytest.mark.parametrize("kwargs, message", [({"keep": 0}, "keep=0"), ({"chunk_bytes": 0}, "chunk_bytes=0"),
                                             ({"io_threads": "4"}, "io_threads='4'")])
def test_bad_constructor_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path, **kwargs)


def test_inspect_rows_and_resolution(tmp_path):
    run = tmp_path / "run"
    tensors = {"model.w": torch.ones(4, 3), "rng.cpu": torch.zeros(5, dtype=torch.uint8)}
    Checkpointer(run / "checkpoints").save(12, tensors, {})
    for where in (run, run / "checkpoints", run / "checkpoints" / "step_00000012"):
        rows = inspect(str(where))
        assert rows == [
            {"tensor": "model.w", "dtype": "float32", "shape": "4x3", "kind": "replicated", "shards": 1,
             "bytes": 48, "files": "0"},
            {"tensor": "rng.cpu", "dtype": "uint8", "shape": "5", "kind": "per_rank", "shards": 1, "bytes": 5,
             "files": "0"}]
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        inspect(str(tmp_path))


def test_format_1_checkpoint_is_named(tmp_path):
    os.makedirs(tmp_path / "step_00000001")
    (tmp_path / "step_00000001" / "state.json").write_text('{"format": 1}')
    with pytest.raises(CheckpointError, match="format-1 checkpoint"):
        load_tensors(str(tmp_path / "step_00000001"))


def test_chunk_range_matches_torch_chunk():
    for size in range(0, 12):
        for parts in range(1, 6):
            pieces = torch.arange(size).chunk(parts) if size else ()
            got = [chunk_range(size, parts, i) for i in range(parts)]
            expected = [(int(p[0]), len(p)) for p in pieces] + [(size, 0)] * (parts - len(pieces))
            assert [g for g in got if g[1]] == [e for e in expected if e[1]], (size, parts)
            assert sum(n for _, n in got) == size


@pytest.mark.gpu
def test_cuda_async_save_orders_the_copy_before_later_kernels(tmp_path):
    """On the GPU: the parameters change right after save() returns, on the current stream; the checkpoint
    holds the values of the call (the current stream waits on the copy's event). Loads into CUDA targets."""
    g = torch.Generator(device="cuda").manual_seed(0)
    params = {f"p{i}": torch.randn(1024, 1024, device="cuda", generator=g) for i in range(64)}   # 256 MiB
    params["bf16"] = torch.randn(333, 77, device="cuda", generator=g).bfloat16()
    expected = {k: v.cpu() for k, v in params.items()}
    ckpt = Checkpointer(tmp_path, async_save=True)
    for step in (1, 2):
        ckpt.save(step, params, {})
        for v in params.values():
            v.mul_(2.0)          # queued behind the copy on the same stream
        ckpt.wait()
        loaded, _ = ckpt.load()
        for k, v in expected.items():
            assert torch.equal(loaded[k], v), (step, k)
        expected = {k: v.cpu() for k, v in params.items()}
    assert ckpt._buffer.registered or ckpt._buffer.tensor.is_pinned()
    targets = {k: torch.full_like(v, float("nan")) for k, v in params.items()}
    ckpt.load_into(targets)
    for k, v in targets.items():
        assert torch.equal(v.cpu(), (expected[k].float() / 2).to(v.dtype)), k
    ckpt.close()


def test_background_failure_nobody_waited_for_is_printed_at_exit(tmp_path):
    import subprocess
    import sys
    script = f"""
import errno, torch
import tilewise.checkpoint.save as save_mod
from tilewise.checkpoint import Checkpointer
def disk_full(path, *args):
    raise OSError(errno.ENOSPC, "No space left on device", path)
save_mod._write_file = disk_full
Checkpointer({str(tmp_path)!r}, async_save=True).save(1, {{"w": torch.ones(3)}}, {{}})
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "CheckpointError" in proc.stderr and "No space left on device" in proc.stderr, proc.stderr
    assert "rank00000.safetensors" in proc.stderr and "step 1" in proc.stderr
    assert not os.path.exists(tmp_path / "latest")
