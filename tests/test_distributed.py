"""Multi-process training on CPU (gloo): the loss trajectory, resharding resume and failures of every strategy.

Without dropout, every strategy and world size follows the one-process loss trajectory over 20 steps within
fp32 rounding (same global batch, gradient clipping active); a checkpoint saved by 2 ranks resumes on 1 and
on 3; hsdp runs as two "nodes" of one process; a rank that raises, or hangs, ends the whole job within a
bounded time, with a message naming the rank. Launches: torchrun running `-m tilewise train` as users do
(ddp and the failures), and, to keep the file fast, ranks forked from this process once it has imported
torch (the rest). Run as a script (under torchrun), this file is a worker that injects faults.
"""
import gc
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tilewise.config import ConfigError, load_config
from tilewise.data import write_token_shards
from tilewise.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

THIS = os.path.abspath(__file__)
STEPS = 20
RTOL = 1e-5   # fp32 rounding of a different reduction order, after 20 AdamW steps


def tiny_overrides(data_dir, out_dir, **extra) -> list[str]:
    """A 30k-parameter GPT on a 12-row global batch (divisible by 1, 2, 3 and 4 ranks)."""
    items = {
        "data.dir": json.dumps(str(data_dir)), "train.out_dir": json.dumps(str(out_dir)),
        "model.n_layer": 2, "model.d_model": 32, "model.n_head": 2, "model.seq_len": 16, "model.pad_vocab_to": 16,
        "train.batch_size": 12, "train.max_steps": STEPS, "train.warmup_steps": 3, "train.lr": 1e-2,
        "train.grad_clip": 0.5,   # below the gradient norm on most steps: clipping must be right on every rank
        "train.log_every": 1, "train.eval_every": 10, "train.eval_batches": 2, "train.progress": "false",
        "train.device": '"cpu"', "distributed.timeout_s": 60,
    }
    items.update(extra)
    return [f"{k}={v}" for k, v in items.items()]


def cli_args(overrides) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Like the ranks (OMP_NUM_THREADS=1): on two cores, more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A token folder with structure to learn (a noisy linear recurrence, documents ending in eot 0)."""
    rng = np.random.default_rng(0)

    def stream(n):
        x = np.empty(n, np.int64)
        x[0] = 1
        noise = rng.integers(0, 7, n)
        for i in range(1, n):
            x[i] = (x[i - 1] * 5 + noise[i]) % 120 + 1
        x[rng.random(n) < 0.02] = 0
        return x

    out = tmp_path_factory.mktemp("dist") / "data"
    write_token_shards(str(out), {"train": stream(20000), "val": stream(3000)}, vocab_size=128, eot_id=0)
    return out


def run_inprocess(data_dir, out_dir, resume=False, **extra):
    from tilewise.train import train
    return train(load_config("tiny", overrides=tiny_overrides(data_dir, out_dir, **extra)), resume=resume)


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """One process, no torch.distributed: the trajectory every other run must follow."""
    out = tmp_path_factory.mktemp("ref") / "run"
    run_inprocess(data_dir, out)
    return read_metrics(str(out))


def torchrun(nproc, args, *, timeout=120, script=False, env=None):
    """`torchrun --standalone --nproc_per_node=nproc -m tilewise train args` (script: this file as the
    worker); returns (exit code, output, seconds)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [THIS] if script else ["-m", "tilewise"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.time()
    proc = subprocess.Popen(command + ["train"] + args, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"torchrun did not end within {timeout} s:\n{out[-4000:]}") from None
    return proc.returncode, out, time.time() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forked_rank(rank, world, local_world, port, argv, env, log):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    torch.set_num_threads(1)
    code = 1
    try:
        code = _worker(argv)
    except BaseException:
        import traceback
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # not the parent's atexit handlers


def launch(nproc, args, *, timeout=120, env=None, local_world=None):
    """The ranks of `tilewise train args`, forked from this process (no second import of torch): returns
    (exit codes, every rank's output). Where CUDA is initialized a fork cannot be trusted: torchrun instead."""
    import multiprocessing
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        code, out, _ = torchrun(nproc, args, timeout=timeout, script=True, env=env)
        return [code], out
    ctx = multiprocessing.get_context("fork")
    # Garbage left by earlier tests (a destroyed process group, a loader) would otherwise be collected in the
    # child, whose copy of it refers to threads that exist only here: its C++ destructor joins a thread that
    # is not there and aborts the rank ("std::system_error: Invalid argument"). Collect it here, where they are.
    gc.collect()
    import tempfile
    logs = [os.path.join(tempfile.gettempdir(), f"tilewise-rank{r}-{os.getpid()}-{time.monotonic_ns()}.log")
            for r in range(nproc)]
    port = free_port()
    procs = [ctx.Process(target=_forked_rank, args=(r, nproc, local_world or nproc, port, ["train"] + args,
                                                    env or {}, logs[r])) for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    out = ""
    for r, log in enumerate(logs):
        with open(log) as f:
            out += f"--- rank {r}\n" + f.read()
        os.remove(log)
    assert not hung, f"ranks still running after {timeout} s:\n{out[-4000:]}"
    return [p.exitcode for p in procs], out


def assert_same_trajectory(records, reference, first_step=1, keys=("loss", "grad_norm", "val_loss")):
    ref = {r["step"]: r for r in reference}
    assert [r["step"] for r in records] == list(range(first_step, STEPS + 1))
    for r in records:
        want = ref[r["step"]]
        assert ("val_loss" in r) == ("val_loss" in want), r["step"]
        for key in keys:
            if key in want:
                assert r[key] == pytest.approx(want[key], rel=RTOL), (r["step"], key, r[key], want[key])
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3   # it learns: the comparison is not of noise
    assert sum(r["grad_norm"] > 0.5 for r in reference) > STEPS // 2   # and it clips


# ------------------------------------------------------------------------------------------------
# In one process
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "hsdp"])
def test_strategy_with_world_size_1_follows_the_reference(data_dir, reference, tmp_path, strategy):
    summary = run_inprocess(data_dir, tmp_path / "run", **{"distributed.strategy": strategy})
    assert summary["world_size"] == 1 and summary["strategy"] == strategy
    assert_same_trajectory(read_metrics(str(tmp_path / "run")), reference)
    assert not torch.distributed.is_initialized()   # the one-rank group it opened is closed again


def test_activation_checkpointing_repeats_dropout_and_losses(data_dir, tmp_path):
    """Recomputed blocks see the forward's RNG state: with dropout, the same losses as without checkpointing."""
    extra = {"model.dropout": 0.1, "train.max_steps": 8}
    run_inprocess(data_dir, tmp_path / "plain", **extra)
    run_inprocess(data_dir, tmp_path / "ac", **extra, **{"distributed.activation_checkpointing": "true",
                                                          "distributed.strategy": "fsdp",
                                                          "distributed.reshard_after_forward": "false"})
    plain, ac = read_metrics(str(tmp_path / "plain")), read_metrics(str(tmp_path / "ac"))
    assert [r["loss"] for r in ac] == pytest.approx([r["loss"] for r in plain], rel=RTOL)


def test_activation_checkpointing_recomputes_each_block_in_backward():
    from tilewise.config import ModelConfig
    from tilewise.distributed import apply_activation_checkpointing
    from tilewise.model import GPT
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, d_model=16))
    calls = []
    for block in model.blocks:
        block.attn.register_forward_hook(lambda *_: calls.append(1))
    idx = torch.randint(0, 64, (2, 9))
    model(idx[:, :-1], idx[:, 1:]).backward()
    assert len(calls) == 3
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_activation_checkpointing(model)
    apply_activation_checkpointing(model)   # idempotent
    calls.clear()
    model(idx[:, :-1], idx[:, 1:]).backward()
    assert len(calls) == 6                  # each block's forward once more, in backward
    assert "blocks.0.attn.qkv.weight" in dict(model.named_parameters())   # names unchanged
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)


def test_config_errors_name_the_problem(data_dir, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"batch_size=12 .* world size 1 x train.grad_accum 5"):
        run_inprocess(data_dir, tmp_path / "a", **{"distributed.strategy": "fsdp", "train.grad_accum": 5})
    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="distributed.strategy='zero'"):
        run_inprocess(data_dir, tmp_path / "b", **{"distributed.strategy": '"zero"'})
    with pytest.raises(ConfigError, match="cpu_offload needs strategy fsdp or hsdp"):
        run_inprocess(data_dir, tmp_path / "c", **{"distributed.strategy": "ddp", "distributed.cpu_offload": "true"})
    with pytest.raises(ConfigError, match="on CPU it has nothing to do"):
        run_inprocess(data_dir, tmp_path / "d", **{"distributed.strategy": "fsdp", "distributed.cpu_offload": "true"})
    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="fp8.*scaling='blocky'"):
        run_inprocess(data_dir, tmp_path / "e", **{"fp8.recipe": '"blocky"'})
    monkeypatch.setenv("WORLD_SIZE", "2")   # as under torchrun, but strategy none
    with pytest.raises(ConfigError, match=r"rank 0: launched as 2 processes but distributed.strategy=none"):
        run_inprocess(data_dir, tmp_path / "f")


# ------------------------------------------------------------------------------------------------
# Several processes
# ------------------------------------------------------------------------------------------------

def test_ddp_two_ranks_with_accumulation_follows_the_reference(data_dir, reference, tmp_path):
    # 2 ranks x 2 micro-batches of 3 rows = the reference's 12 rows; val batches are micro-batches (6 rows)
    code, out, _ = torchrun(2, cli_args(tiny_overrides(data_dir, tmp_path / "run", **{
        "distributed.strategy": "ddp", "train.grad_accum": 2})))
    assert code == 0, out[-4000:]
    assert_same_trajectory(read_metrics(str(tmp_path / "run")), reference, keys=("loss", "grad_norm"))
    assert out.count("tilewise: 0.03M parameters") == 1   # rank 0 alone prints
    assert not (tmp_path / "run" / "metrics.jsonl.tmp").exists()


@pytest.fixture(scope="module")
def fsdp_two_ranks(data_dir, tmp_path_factory):
    """2 ranks under fsdp, checkpoints at steps 10 and 20."""
    run = tmp_path_factory.mktemp("fsdp2") / "run"
    codes, out = launch(2, cli_args(tiny_overrides(data_dir, run, **{
        "distributed.strategy": "fsdp", "checkpoint.every": 10})))
    assert codes == [0] * len(codes), out[-4000:]
    return run


def test_fsdp_two_ranks_follows_the_reference(fsdp_two_ranks, reference):
    assert_same_trajectory(read_metrics(str(fsdp_two_ranks)), reference)
    manifest = json.load(open(fsdp_two_ranks / "checkpoints" / "step_00000010" / "manifest.json"))
    assert manifest["world_size"] == 2 and len(manifest["files"]) == 2
    assert manifest["tensors"]["model.wte.weight"]["kind"] == "sharded"   # each rank wrote its half
    assert manifest["state"]["data"] == {"next_batch": 10, "batch_rows": 12}


def copy_checkpoint(run, step, dest):
    import shutil
    name = f"step_{step:08d}"
    os.makedirs(dest / "checkpoints")
    shutil.copytree(run / "checkpoints" / name, dest / "checkpoints" / name)
    (dest / "checkpoints" / "latest").write_text(name + "\n")


def test_resume_two_rank_checkpoint_on_one_rank(data_dir, fsdp_two_ranks, reference, tmp_path):
    copy_checkpoint(fsdp_two_ranks, 10, tmp_path / "run")
    run_inprocess(data_dir, tmp_path / "run", resume=True)
    assert_same_trajectory(read_metrics(str(tmp_path / "run")), reference, first_step=11)


def test_resume_two_rank_checkpoint_on_three_ranks(data_dir, fsdp_two_ranks, reference, tmp_path):
    copy_checkpoint(fsdp_two_ranks, 10, tmp_path / "run")
    codes, out = launch(3, cli_args(tiny_overrides(data_dir, tmp_path / "run", **{
        "distributed.strategy": "fsdp"})) + ["--resume"])
    assert codes == [0] * len(codes), out[-4000:]
    assert_same_trajectory(read_metrics(str(tmp_path / "run")), reference, first_step=11)
    manifest = json.load(open(tmp_path / "run" / "checkpoints" / "step_00000020" / "manifest.json"))
    assert manifest["world_size"] == 3


def test_hsdp_on_two_nodes_follows_the_reference(data_dir, reference, tmp_path):
    """Two ranks as two nodes of one process each (LOCAL_WORLD_SIZE=1, as `torchrun --nnodes=2
    --nproc_per_node=1` sets it): a (2, 1) mesh, replicated across the nodes, sharded within."""
    codes, out = launch(2, cli_args(tiny_overrides(data_dir, tmp_path / "run", **{"distributed.strategy": "hsdp"})),
                        local_world=1)
    assert codes == [0] * len(codes), out[-4000:]
    assert_same_trajectory(read_metrics(str(tmp_path / "run")), reference)
    manifest = json.load(open(tmp_path / "run" / "checkpoints" / "step_00000020" / "manifest.json"))
    # sharded within a node of one process: whole tensors, written once although both nodes hold them
    assert manifest["world_size"] == 2
    shards = manifest["tensors"]["model.wte.weight"]["shards"]
    assert len(shards) == 1 and manifest["files"][shards[0]["file"]]["rank"] == 0


@pytest.mark.parametrize("fault, culprit, reporter, timeout_s", [("crash", 1, 1, 60), ("hang", 1, 0, 8)])
def test_a_failing_rank_ends_the_job(data_dir, tmp_path, fault, culprit, reporter, timeout_s):
    """crash: rank 1 raises at step 3; rank 0's collective fails at once (its peer is gone) and torchrun
    ends the job. hang: rank 1 stops at step 3; rank 0's next collective times out after
    distributed.timeout_s, rank 0 fails, and torchrun ends rank 1."""
    args = cli_args(tiny_overrides(data_dir, tmp_path / "run", **{"distributed.strategy": "ddp",
                                                                   "distributed.timeout_s": timeout_s}))
    code, out, seconds = torchrun(2, args, script=True, timeout=100,
                                  env={"TILEWISE_TEST_FAULT": f"{fault}:{culprit}:3"})
    assert code != 0, out[-4000:]
    assert f"tilewise: rank {reporter} of 2 failed" in out, out[-4000:]
    if fault == "crash":
        assert "RuntimeError: induced failure on rank 1 at step 3" in out
    assert seconds < 90
    assert not os.path.exists(tmp_path / "run" / "summary.json")


def test_fp8_two_ranks_share_scales_and_follow_one_rank(data_dir, tmp_path):
    """FP8 (delayed scaling) under fsdp: amaxes are max-reduced over the ranks every step, so both ranks hold
    the same scales bitwise; the losses follow a one-process FP8 run within FP8 rounding."""
    extra = {"fp8.recipe": '"delayed"', "train.max_steps": 10}
    run_inprocess(data_dir, tmp_path / "one", **extra)
    codes, out = launch(2, cli_args(tiny_overrides(data_dir, tmp_path / "two", **extra,
                                                   **{"distributed.strategy": "fsdp"})),
                        env={"TILEWISE_TEST_FP8_LOG": str(tmp_path / "scales")})
    assert codes == [0] * len(codes), out[-4000:]
    logs = [json.load(open(tmp_path / f"scales.{r}.json")) for r in range(2)]
    assert len(logs[0]) == 10 and logs[0] == logs[1]
    assert len({len(s) for s in logs[0]}) == 1 and logs[0][0] != logs[0][-1]   # scales moved, in step
    one, two = read_metrics(str(tmp_path / "one")), read_metrics(str(tmp_path / "two"))
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=2e-3)


# ------------------------------------------------------------------------------------------------
# One GPU (the H200): every strategy in bf16 with the Triton kernels, then the torchrun launch
# ------------------------------------------------------------------------------------------------

GPU_VARIANTS = {   # name -> config overrides; numerics: "none" (fp32 master, autocast) or "bf16" (FSDP bf16 params)
    "none": {},
    "ddp": {"distributed.strategy": "ddp"},
    "fsdp": {"distributed.strategy": "fsdp", "checkpoint.every": 10},
    "fsdp_zero2_ac": {"distributed.strategy": "fsdp", "distributed.reshard_after_forward": "false",
                      "distributed.activation_checkpointing": "true"},
    "hsdp": {"distributed.strategy": "hsdp"},
    "fsdp_offload": {"distributed.strategy": "fsdp", "distributed.cpu_offload": "true"},
    "fsdp_fp8": {"distributed.strategy": "fsdp", "fp8.recipe": '"delayed"'},
    "ddp_fp8": {"distributed.strategy": "ddp", "fp8.recipe": '"delayed"'},
}


def gpu_overrides(data_dir, out_dir, **extra):
    """A 20M-parameter GPT-2 on 16 x 512 tokens, bf16 on the GPU."""
    return tiny_overrides(data_dir, out_dir, **{
        "model.n_layer": 4, "model.d_model": 512, "model.n_head": 8, "model.seq_len": 512, "model.pad_vocab_to": 64,
        "train.batch_size": 16, "train.lr": 3e-3, "train.device": '"cuda"', "train.eval_every": 100,
        "distributed.timeout_s": 300, **extra})


@pytest.fixture(scope="module")
def gpu_data_dir(tmp_path_factory):
    """2M tokens over 8192 ids: Zipf-distributed tokens, each followed by its successor (a skewed unigram and a
    bigram to learn)."""
    rng = np.random.default_rng(1)
    out = tmp_path_factory.mktemp("gpu") / "data"
    n = 1 << 21
    tokens = np.empty(n, np.int64)
    tokens[0::2] = rng.zipf(1.3, n // 2) % 8191 + 1
    tokens[1::2] = tokens[0::2] % 8191 + 1
    tokens[rng.random(n) < 0.002] = 0
    write_token_shards(str(out), {"train": tokens, "val": tokens[-(1 << 16):]}, vocab_size=8192, eot_id=0)
    return out


@pytest.fixture(scope="module")
def gpu_runs(gpu_data_dir, tmp_path_factory):
    """Every variant in this process (one-rank NCCL groups), 20 steps each: name -> (run dir, records), or
    name -> the error it raised (so one failing variant does not hide the others)."""
    import shutil
    import traceback
    from tilewise.train import train
    root = tmp_path_factory.mktemp("gpu_runs")
    runs = {}
    for name, extra in GPU_VARIANTS.items():
        try:
            summary = train(load_config("tiny", overrides=gpu_overrides(gpu_data_dir, root / name, **extra)))
            assert summary["strategy"] == extra.get("distributed.strategy", "none")
            runs[name] = (root / name, read_metrics(str(root / name)))
        except Exception:
            runs[name] = traceback.format_exc(limit=-6)
        if name != "fsdp":   # keep only the checkpoints the resume test reads
            shutil.rmtree(root / name / "checkpoints", ignore_errors=True)
    return runs


@pytest.mark.gpu
def test_gpu_every_strategy_trains_and_agrees(gpu_runs):
    failed = {name: run for name, run in gpu_runs.items() if isinstance(run, str)}
    assert not failed, "\n".join(f"--- {name}:\n{tb}" for name, tb in failed.items())
    losses = {name: [r["loss"] for r in records] for name, (_, records) in gpu_runs.items()}
    for name, ls in losses.items():
        assert len(ls) == STEPS and all(np.isfinite(ls)), (name, ls)
        assert ls[-1] < ls[0] - 0.5, (name, ls[0], ls[-1])
    # The same numerics give the same trajectory (rounding and kernel order aside)
    for a, b in (("ddp", "none"), ("fsdp_zero2_ac", "fsdp"), ("hsdp", "fsdp"), ("fsdp_offload", "fsdp")):
        assert losses[a] == pytest.approx(losses[b], rel=2e-3), (a, b)
    # bf16 parameters under FSDP, FP8 matmuls: close to the fp32-master reference
    for name, rel in (("fsdp", 0.02), ("fsdp_fp8", 0.05), ("ddp_fp8", 0.05)):
        assert losses[name][-1] == pytest.approx(losses["none"][-1], rel=rel), name


@pytest.mark.gpu
def test_gpu_fsdp_resume(gpu_runs, gpu_data_dir, tmp_path):
    from tilewise.train import train
    assert not isinstance(gpu_runs["fsdp"], str), gpu_runs["fsdp"]
    run, records = gpu_runs["fsdp"]
    copy_checkpoint(run, 10, tmp_path / "run")
    train(load_config("tiny", overrides=gpu_overrides(gpu_data_dir, tmp_path / "run", **GPU_VARIANTS["fsdp"])),
          resume=True)
    resumed = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in resumed] == list(range(11, STEPS + 1))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records[10:]], rel=1e-3)


@pytest.mark.gpu
def test_gpu_torchrun_fsdp_one_process(gpu_data_dir, tmp_path):
    """The launch users type: torchrun, NCCL through the env:// rendezvous, fsdp on one GPU."""
    code, out, _ = torchrun(1, cli_args(gpu_overrides(gpu_data_dir, tmp_path / "run", **{
        "distributed.strategy": "fsdp", "train.max_steps": 10})), timeout=300)
    assert code == 0, out[-4000:]
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["world_size"] == 1 and summary["strategy"] == "fsdp" and summary["device"] != "cpu"
    assert np.isfinite(summary["final_val_loss"])


# ------------------------------------------------------------------------------------------------
# Worker: this file under torchrun, with a fault or a probe patched into the trainer
# ------------------------------------------------------------------------------------------------

def _worker(argv) -> int:
    import tilewise.train as train_mod
    from tilewise.cli import main
    rank = int(os.environ["RANK"])
    fault = os.environ.get("TILEWISE_TEST_FAULT")
    if fault:
        kind, culprit, at = fault.split(":")
        real_lr_at = train_mod.lr_at

        def lr_at(step, cfg):
            if rank == int(culprit) and step == int(at):
                if kind == "crash":
                    raise RuntimeError(f"induced failure on rank {rank} at step {step}")
                time.sleep(300)
            return real_lr_at(step, cfg)
        train_mod.lr_at = lr_at
    log = os.environ.get("TILEWISE_TEST_FP8_LOG")
    if log:
        from tilewise.fp8 import Fp8State
        real_step, scales = Fp8State.step, []

        def step(self, *args, **kwargs):
            real_step(self, *args, **kwargs)
            scales.append(self.scale.tolist())
            with open(f"{log}.{rank}.json", "w") as f:
                json.dump(scales, f)
        Fp8State.step = step
    return main(argv)


if __name__ == "__main__":
    raise SystemExit(_worker(sys.argv[1:]))
