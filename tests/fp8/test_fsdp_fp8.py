"""FP8 all-gather of Fp8Linear weights under FSDP2 (tilewise.fp8.fsdp).

In one process: the sharded-weight subclass behaves as its master tensor (forward, AdamW, state_dict), its
pre-all-gather hook casts the shard with the slot's scale and records its amax, the post hook's weight gives
Fp8Linear the same FP8 operands it would cast itself. With 2 gloo ranks running the trainer (fsdp, delayed
scaling): the all-gather moves 1-byte elements for those weights, the losses follow the bf16/fp32-gather run
within FP8 rounding, checkpoints hold plain float32 weights and a resume continues the same trajectory.
"""
import gc
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

from tilewise.config import load_config
from tilewise.data import write_token_shards
from tilewise.fp8 import Fp8Linear, convert_to_fp8
from tilewise.fp8.fsdp import Fp8GatheredWeight, Fp8ShardedWeight, enable_fp8_all_gather
from tilewise.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

E4M3 = torch.float8_e4m3fn


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


# ------------------------------------------------------------------------------------------------
# One process
# ------------------------------------------------------------------------------------------------

def test_sharded_weight_trains_like_the_plain_layer():
    """Forward, backward and AdamW through the subclass equal the unwrapped model's; no subclass leaks into
    gradients, optimizer state or the state dict, and in-place updates are counted."""
    plain, wrapped = _mlp(), _mlp()
    states = [convert_to_fp8(m, "delayed") for m in (plain, wrapped)]
    assert enable_fp8_all_gather(wrapped, shard_size=2) == ["0", "2"]
    assert isinstance(wrapped[0].weight, Fp8ShardedWeight) and isinstance(wrapped[0].weight, nn.Parameter)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (plain, wrapped)]
    x = torch.randn(48, 32)
    for _ in range(3):
        for m, opt, st in zip((plain, wrapped), opts, states):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            st.step()
    w = wrapped[0].weight
    assert w._mutations >= 3
    torch.testing.assert_close(w._tensor, plain[0].weight.detach(), rtol=0, atol=0)
    assert type(w.grad) is torch.Tensor
    assert all(type(v) is torch.Tensor for v in opts[1].state[w].values())
    sd = wrapped.state_dict()
    assert type(sd["0.weight"]) is torch.Tensor and sd["0.weight"].dtype == torch.float32
    sd["0.weight"].zero_()   # the state dict's tensor is the master weight itself: loading writes through
    assert w._tensor.abs().max() == 0


def test_enable_skips_what_it_cannot_gather_and_checks_its_argument():
    m = _mlp()
    convert_to_fp8(m, "delayed")
    assert enable_fp8_all_gather(m, shard_size=3) == []        # 64 and 32 rows do not split in 3 equal shards
    assert enable_fp8_all_gather(m, shard_size=32) == ["0", "2"]
    assert enable_fp8_all_gather(m, shard_size=32) == []       # already wrapped
    current = _mlp()
    convert_to_fp8(current, "current")
    assert enable_fp8_all_gather(current, shard_size=1) == []  # per-tensor current scaling gathers bf16
    with pytest.raises(ValueError, match="shard_size"):
        enable_fp8_all_gather(m, shard_size=0)


def _dequantized(q, inv):
    return q.float() * inv


def test_hooks_cast_the_shard_with_the_slot_scale_and_feed_the_gemms():
    """Cold (before the first step): the scale is current scaling of the shard (the whole weight here, one
    rank); warm: the slot's delayed scale. The amax of the shard lands in the slot; the cast is cached until
    the weight changes or the state steps; the gathered weight's operands dequantize to the cast weight."""
    m = _mlp()
    st = convert_to_fp8(m, "delayed")
    enable_fp8_all_gather(m, shard_size=1)
    w = m[0].weight
    (q,), (inv,) = w.fsdp_pre_all_gather(None)
    assert q.dtype == E4M3 and q.shape == w.shape and inv.numel() == 1
    master = w._tensor
    amax = master.abs().max()
    assert float(st.amax_history[0, 1]) == float(amax)                    # slot 1: layer 0's weight
    torch.testing.assert_close(float(inv), float(amax) / 448.0, rtol=1e-6, atol=0)
    err = (_dequantized(q, inv) - master).abs().max()
    assert 0 < err <= amax * 2.0 ** -4                                    # E4M3: 3 mantissa bits
    again = w.fsdp_pre_all_gather(None)
    assert again[0][0] is q                                                # cached within the step
    st.step()
    st.scale[1] = 64.0
    st.scale_inv[1] = 1 / 64.0
    (q2,), (inv2,) = w.fsdp_pre_all_gather(None)
    assert q2 is not q and float(inv2) == 1 / 64.0
    torch.testing.assert_close(q2.float(), (master * 64).clamp(-448, 448).to(E4M3).float(), rtol=0, atol=0)
    with torch.no_grad():
        w.mul_(0.5)                                                        # an update through the wrapper
    assert w.fsdp_pre_all_gather(None)[0][0] is not q2

    gathered, inner = w.fsdp_post_all_gather((q2,), (inv2,), torch.bfloat16)
    assert isinstance(gathered, Fp8GatheredWeight) and gathered.dtype == torch.bfloat16 and inner == ()
    w8, s, w8t, st_ = gathered.fp8_operands(need_t=True)
    assert w8.shape == (32, 64) and w8t.shape == (64, 32) and w8t.stride() == (1, 64)
    torch.testing.assert_close(w8t.float(), q2.float(), rtol=0, atol=0)
    assert gathered.fp8_operands(need_t=False)[2] is None
    # anything else sees the dequantized weight; in-place changes are refused
    torch.testing.assert_close(gathered.float(), _dequantized(q2, inv2).to(torch.bfloat16).float())
    with pytest.raises(RuntimeError, match="read-only"):
        gathered.add_(1)
    assert w.fsdp_post_all_gather((q2,), (inv,), torch.bfloat16, out=gathered) is None
    assert gathered._scale_inv is inv


def test_shards_are_rounded_to_the_param_dtype_before_the_cast():
    """Under FSDP2 with param_dtype bf16 over fp32 masters the plain gather hands the layer a bf16 weight to
    cast; the FP8 shard is that same cast (bytes and amax), not the cast of the fp32 master, which differs."""
    m = _mlp()
    st = convert_to_fp8(m, "delayed")
    enable_fp8_all_gather(m, shard_size=1, param_dtype=torch.bfloat16)
    w = m[0].weight
    (q,), (inv,) = w.fsdp_pre_all_gather(None)
    w16 = w._tensor.bfloat16().float()
    amax = w16.abs().max()
    want = (w16 * (448.0 / amax)).clamp(-448, 448).to(E4M3)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert float(st.amax_history[0, 1]) == float(amax)
    direct = (w._tensor * (448.0 / w._tensor.abs().max())).clamp(-448, 448).to(E4M3)
    assert not torch.equal(direct.view(torch.uint8), want.view(torch.uint8))   # the rounding matters here
    assert m[0].weight.detach()._cast_from == torch.bfloat16                  # kept through FSDP2's views


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_linear_uses_the_gathered_weight_without_casting(device):
    """An Fp8Linear whose weight is an Fp8GatheredWeight computes with its FP8 data: forward and input
    gradient equal those of a layer whose master weight is the dequantized FP8 weight (which the cast
    reproduces exactly, at the same scale)."""
    torch.manual_seed(1)
    ref = Fp8Linear(64, 32, bias=True, recipe="delayed", device=device)
    ref.fp8_state.step()                       # warm: delayed scales, the weight's from its (zero) history
    ref.fp8_state.scale[1] = 128.0
    ref.fp8_state.scale_inv[1] = 1 / 128.0
    q = (ref.weight.detach() * 128).to(E4M3)
    with torch.no_grad():
        ref.weight.copy_(q.float() / 128)      # on the FP8 grid: the layer's own cast gives q back
    test = Fp8Linear(64, 32, bias=True, recipe="delayed", device=device)
    test.fp8_state.load_state_dict(ref.fp8_state.state_dict())
    with torch.no_grad():
        test.bias.copy_(ref.bias)
    gathered = Fp8GatheredWeight(q, torch.full((1,), 1 / 128.0, device=device), torch.float32)
    test.weight = nn.Parameter(gathered)
    x = torch.randn(16, 64, device=device)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [layer(xi) for layer, xi in zip((ref, test), xs)]
    torch.testing.assert_close(ys[1], ys[0], rtol=0, atol=0)
    g = torch.randn_like(ys[0])
    for y in ys:
        y.backward(g)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=0)
    torch.testing.assert_close(test.weight.grad, ref.weight.grad, rtol=0, atol=0)
    assert type(test.weight.grad) is torch.Tensor


# ------------------------------------------------------------------------------------------------
# Two gloo ranks running the trainer (forked from this process, as in tests/test_distributed.py)
# ------------------------------------------------------------------------------------------------

STEPS = 20


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    n = 12000
    x = np.empty(n, np.int64)
    x[0] = 1
    noise = rng.integers(0, 7, n)
    for i in range(1, n):
        x[i] = (x[i - 1] * 5 + noise[i]) % 120 + 1
    out = tmp_path_factory.mktemp("fsdp_fp8") / "data"
    write_token_shards(str(out), {"train": x[:10000], "val": x[10000:]}, vocab_size=128, eot_id=0)
    return out


def _overrides(data_dir, out_dir, fp8_gather: bool) -> list[str]:
    items = {
        "data.dir": json.dumps(str(data_dir)), "train.out_dir": json.dumps(str(out_dir)),
        "model.n_layer": 2, "model.d_model": 32, "model.n_head": 2, "model.seq_len": 16, "model.pad_vocab_to": 16,
        "train.batch_size": 8, "train.max_steps": STEPS, "train.warmup_steps": 2, "train.lr": 1e-2,
        "train.log_every": 1, "train.eval_every": STEPS, "train.eval_batches": 1, "train.progress": "false",
        "train.device": '"cpu"',
        "distributed.strategy": '"fsdp"', "distributed.timeout_s": 60, "checkpoint.every": 10,
        "checkpoint.async_save": "false", "fp8.recipe": '"delayed"',
        "fp8.fsdp_fp8_all_gather": "true" if fp8_gather else "false",
    }
    return [f"{k}={v}" for k, v in items.items()]


def _rank_main(rank, world, port, overrides, resume, report):
    """One rank: record what each all-gather moves, train, write the record."""
    fd = os.open(report + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    code = 1
    try:
        import torch.distributed as dist
        seen = {"pre_hook": [], "collective": []}
        pre = Fp8ShardedWeight.fsdp_pre_all_gather

        def spy_pre(self, mesh):
            out = pre(self, mesh)
            seen["pre_hook"].append([str(t.dtype) for t in out[0]])
            return out
        Fp8ShardedWeight.fsdp_pre_all_gather = spy_pre
        for name in ("all_gather_single", "all_gather_into_tensor"):   # torch 2.13 / 2.11 FSDP2
            real = getattr(dist, name, None)
            if real is not None:
                def spy(out, inp, *a, _real=real, **k):
                    seen["collective"].append([str(inp.dtype), inp.numel()])
                    return _real(out, inp, *a, **k)
                setattr(dist, name, spy)
        from tilewise.train import train
        train(load_config("tiny", overrides=overrides), resume=resume)
        with open(f"{report}.{rank}.json", "w") as f:
            json.dump(seen, f)
        code = 0
    except BaseException:
        import traceback
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch(overrides, tmp, resume=False, world=2, timeout=120):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = os.path.join(tmp, f"rank-{time.monotonic_ns()}")
    ctx = multiprocessing.get_context("fork")
    gc.collect()   # see tests/test_distributed.py's launch: no garbage with threads into the children
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, overrides, resume, f"{report}-{r}"))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    logs = "".join(open(f"{report}-{r}.log").read() for r in range(world))
    assert [p.exitcode for p in procs] == [0] * world, logs[-4000:]
    return [json.load(open(f"{report}-{r}.{r}.json")) for r in range(world)]


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """fsdp + delayed FP8 on 2 ranks, with and without the FP8 all-gather (checkpoints at steps 10 and 20)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("forked ranks need a process without CUDA initialized")
    root = tmp_path_factory.mktemp("fsdp_fp8_runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for gather in (True, False):
            run = root / ("fp8_gather" if gather else "plain_gather")
            out[gather] = (run, _launch(_overrides(data_dir, run, gather), tempfile.gettempdir()))
        return out
    finally:
        torch.set_num_threads(threads)


def test_all_gather_moves_one_byte_elements_for_fp8_weights(runs):
    _, seen = runs[True]
    _, seen_plain = runs[False]
    for rank_seen in seen:
        assert rank_seen["pre_hook"] and all(d == ["torch.float8_e4m3fn"] for d in rank_seen["pre_hook"])
    assert not seen_plain[0]["pre_hook"]
    # A block's weights (qkv 96x32, proj 32x32, fc 128x32, fc2 32x128: 12288 elements, 6144 a rank) plus its
    # biases and norms (fp32): 1 byte a weight element instead of 4. Block 0 has 16 fp32 elements a rank
    # fewer: its first norm adds the embeddings, with no input_bias.
    fp8 = [tuple(c) for c in seen[0]["collective"] if c[0] == "torch.uint8"]
    plain = [tuple(c) for c in seen_plain[0]["collective"] if c[0] == "torch.float32"]
    block_plain = max(n for _, n in plain)
    block_sizes = {block_plain, block_plain - 16}
    assert fp8 and {n for _, n in fp8} == {(n - 6144) * 4 + 6144 for n in block_sizes}
    assert len(fp8) == len([c for c in plain if c[1] in block_sizes])   # one per block gather, fwd and bwd


def test_fp8_gather_losses_follow_the_plain_gather(runs):
    one = read_metrics(str(runs[True][0]))
    two = read_metrics(str(runs[False][0]))
    assert [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], rel=2e-3)
    assert one[-1]["loss"] < one[0]["loss"] - 0.15   # it learns: the comparison is not of noise


def test_checkpoint_holds_plain_weights_and_resumes(runs, data_dir, tmp_path):
    import shutil
    run, _ = runs[True]
    manifest = json.load(open(run / "checkpoints" / "step_00000010" / "manifest.json"))
    entry = manifest["tensors"]["model.blocks.0.attn.qkv.weight"]
    assert entry["dtype"] == "float32" and entry["kind"] == "sharded" and entry["shape"] == [96, 32]
    assert manifest["tensors"]["optim.blocks.0.attn.qkv.weight.exp_avg"]["dtype"] == "float32"
    # the step-10 checkpoint resumed on 2 ranks: steps 11-20 as in the uninterrupted run
    resumed = tmp_path / "resumed"
    os.makedirs(resumed / "checkpoints")
    shutil.copytree(run / "checkpoints" / "step_00000010", resumed / "checkpoints" / "step_00000010")
    (resumed / "checkpoints" / "latest").write_text("step_00000010\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _launch(_overrides(data_dir, resumed, True), str(tmp_path), resume=True)
    finally:
        torch.set_num_threads(threads)
    want = {r["step"]: r["loss"] for r in read_metrics(str(run))}
    got = read_metrics(str(resumed))
    assert [r["step"] for r in got] == list(range(11, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([want[r["step"]] for r in got], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# One rank (fsdp with world size 1): on CPU here, on the GPU with bf16 parameters, the Triton casts and
# torch._scaled_mm
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_one_rank_fsdp_fp8_gather_follows_the_plain_gather(data_dir, tmp_path, device, monkeypatch):
    from tilewise.train import train
    calls = []
    pre = Fp8ShardedWeight.fsdp_pre_all_gather

    def spy(self, mesh):
        out = pre(self, mesh)
        calls.append(out[0][0].dtype)
        return out
    monkeypatch.setattr(Fp8ShardedWeight, "fsdp_pre_all_gather", spy)
    losses = {}
    for gather in (True, False):
        extra = [f"train.device={json.dumps(device)}", "checkpoint.every=0"]
        if device == "cuda":
            extra += ["model.d_model=128", "model.n_head=2"]   # bf16 parameters (train.dtype auto)
        train(load_config("tiny", overrides=_overrides(data_dir, tmp_path / str(gather), gather) + extra))
        losses[gather] = [r["loss"] for r in read_metrics(str(tmp_path / str(gather)))]
    assert calls and set(calls) == {E4M3}
    assert len(losses[True]) == STEPS
    assert losses[True] == pytest.approx(losses[False], rel=2e-3)
