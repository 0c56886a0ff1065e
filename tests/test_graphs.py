"""CUDA graphs for the training step: the flag is validated and refused where a captured step cannot be right;
on the GPU, replayed steps give the eager steps' losses, never sync with the host, and resume like eager ones."""
import json
import os
import shutil

import pytest
import torch

from tilewise.config import ConfigError, load_config
from tilewise.graphs import StepGraph, graph_mode, invalidate_fp8_weights, resolve
from tilewise.metrics import read_metrics
from tilewise.train import make_optimizer, make_step, train

from test_train import small_run, stdlib_subset

CUDA = torch.device("cuda")   # a device object needs no GPU: resolve() only reads its type


# ------------------------------------------------------------------------------------------------
# The flag (CPU)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, mode", [("auto", "auto"), ("true", "on"), ("True", "on"), ("FALSE", "off"),
                                         (True, "on"), (False, "off")])
def test_flag_values(value, mode):
    assert graph_mode(value) == mode


@pytest.mark.parametrize("value", ["yes", "1", "", "on"])
def test_bad_flag_values_name_the_key(value):
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs=.*expected auto, true or false"):
        graph_mode(value)


def test_flag_from_set_and_toml(tmp_path):
    assert graph_mode(load_config("tiny").train.cuda_graphs) == "auto"
    assert graph_mode(load_config("tiny", overrides=["train.cuda_graphs=true"]).train.cuda_graphs) == "on"
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\ncuda_graphs = false\n")
    assert graph_mode(load_config("tiny", str(toml)).train.cuda_graphs) == "off"


def _cfg(graphs="auto", **overrides):
    return load_config("tiny", overrides=[f"train.cuda_graphs={graphs}"] + [f"{k}={v}" for k, v in overrides.items()])


def test_auto_turns_graphs_on_only_where_they_work():
    assert resolve(_cfg(), CUDA, "none") == (True, None)
    assert resolve(_cfg(), torch.device("cpu"), "none") == (False, None)          # quietly off on CPU
    assert resolve(_cfg("false"), CUDA, "none") == (False, None)
    enabled, notice = resolve(_cfg(**{"model.dropout": 0.1}), CUDA, "none")
    assert not enabled and "model.dropout=0.1" in notice and "host seed" in notice
    enabled, notice = resolve(_cfg(**{"distributed.activation_checkpointing": "true"}), CUDA, "none")
    assert not enabled and "activation_checkpointing" in notice


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp"])
@pytest.mark.parametrize("graphs", ["auto", "true"])
def test_distributed_strategies_turn_graphs_off_with_a_notice(strategy, graphs):
    enabled, notice = resolve(_cfg(graphs), CUDA, strategy)
    assert not enabled
    assert notice.count("\n") == 0 and f"distributed.strategy={strategy}" in notice


@pytest.mark.parametrize("overrides, message", [
    ({"model.dropout": 0.1}, "model.dropout=0.1"),
    ({"distributed.activation_checkpointing": "true"}, "activation_checkpointing"),
])
def test_asking_for_graphs_where_they_cannot_work_is_an_error(overrides, message):
    with pytest.raises(ConfigError, match=rf"train\.cuda_graphs=true cannot capture.*{message}"):
        resolve(_cfg("true", **overrides), CUDA, "none")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve(_cfg("true"), torch.device("cpu"), "none")


def test_train_refuses_graphs_on_cpu_before_touching_data(tmp_path):
    cfg = small_run(tmp_path, ["nothing-to-read"], steps=2, **{"train.cuda_graphs": "true", "train.device": "cpu"})
    with pytest.raises(ConfigError, match="train.cuda_graphs=true needs a CUDA device"):
        train(cfg)
    assert not os.path.exists(tmp_path / "data") and not os.path.exists(tmp_path / "run")


def test_step_graph_and_tensor_lr_check_their_arguments():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        StepGraph(lambda batch: None, 1, 2, 8, "cpu")
    with pytest.raises(ValueError, match="micro_batches=0"):
        StepGraph(lambda batch: None, 0, 2, 8, "cuda")
    cfg = load_config("tiny")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="tensor lr"):
        make_optimizer(model, cfg, torch.device("cpu"), lr=torch.tensor(1e-3))


def test_invalidate_reaches_every_fp8_linear():
    from tilewise.fp8 import Fp8Linear, convert_to_fp8
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Sequential(torch.nn.Linear(32, 16)))
    convert_to_fp8(model, "delayed")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 2
    for layer in layers:
        layer.__dict__["_w_cache"] = ("key", None, None, None)
    invalidate_fp8_weights(model)
    assert all(layer._w_cache is None for layer in layers)


# ------------------------------------------------------------------------------------------------
# On the GPU
# ------------------------------------------------------------------------------------------------

def _tiny_gpt(fp8: str):
    from tilewise.model import GPT
    cfg = load_config("tiny", overrides=["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=64",
                                         "train.lr=1e-2", "train.warmup_steps=10", f"fp8.recipe={fp8}"])
    cfg.model.vocab_size = 512
    torch.manual_seed(0)
    model = GPT(cfg.model).cuda()
    fp8_state = None
    if fp8 != "off":
        from tilewise.fp8 import convert_to_fp8
        fp8_state = convert_to_fp8(model, fp8, skip=lambda name: name.endswith("lm_head"))
    return cfg, model, fp8_state


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", ["off", "delayed"])
def test_replayed_steps_match_eager_steps_and_never_sync(fp8):
    from tilewise.graphs import WARMUP_STEPS, uncaptured_optimizer_steps
    from tilewise.train import lr_at
    cfg, eager_model, eager_fp8 = _tiny_gpt(fp8)
    _, graph_model, graph_fp8 = _tiny_gpt(fp8)
    graph_model.load_state_dict(eager_model.state_dict())
    initial = [p.detach().clone() for p in eager_model.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randint(0, 512, (8, 64), device="cuda", generator=gen) for _ in range(10)]
    batches = [(x, (7 * x + 3) % 512) for x in inputs]   # a mapping to learn, so the steps move the weights
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731

    eager_opt = make_optimizer(eager_model, cfg, CUDA)
    eager_step = make_step(eager_model, eager_model, eager_opt, eager_fp8, autocast, 1, 1.0)
    eager_losses = []
    for i, batch in enumerate(batches):
        for group in eager_opt.param_groups:
            group["lr"] = lr_at(i, cfg)
        eager_losses.append(eager_step(lambda k: batch)[0])

    lr = torch.full((), cfg.train.lr, device="cuda")
    graph_opt = make_optimizer(graph_model, cfg, CUDA, lr=lr)
    step = make_step(graph_model, graph_model, graph_opt, graph_fp8, autocast, 1, 1.0)
    graph = StepGraph(step, 1, 8, 64, CUDA, model=graph_model)
    graph_losses = []
    for i, batch in enumerate(batches):
        lr.fill_(lr_at(i, cfg))
        if i < WARMUP_STEPS:
            with uncaptured_optimizer_steps():
                graph_losses.append(step(lambda k: batch)[0])
            continue
        graph.load(0, *batch)
        if not graph.captured:
            graph.capture()
            torch.cuda.set_sync_debug_mode("error")   # from here on, any host sync raises
        try:
            graph_losses.append(graph.replay()[0].clone())
        except Exception:
            torch.cuda.set_sync_debug_mode("default")
            raise
    torch.cuda.set_sync_debug_mode("default")

    eager_losses, graph_losses = torch.stack(eager_losses).tolist(), torch.stack(graph_losses).tolist()
    for i, (e, g) in enumerate(zip(eager_losses, graph_losses)):
        assert abs(e - g) <= 1e-3 * abs(e), (i, eager_losses, graph_losses)
    for (name, p), q, p0 in zip(eager_model.named_parameters(), graph_model.parameters(), initial):
        moved, err = (p - p0).norm().item(), (p - q).norm().item()
        assert moved > 0 and err <= 1e-2 * moved, (name, moved, err)   # 10 steps moved it; graph and eager agree


def _gpu_run(tmp_path, name, steps, **extra):
    cfg = small_run(tmp_path, stdlib_subset(None), steps=steps, **{
        "train.device": "cuda", "train.lr": 1e-2, "train.warmup_steps": 10, "train.eval_every": 5, **extra})
    cfg.data.dir = str(tmp_path / "data")           # one prepared corpus for every run of a test
    cfg.train.out_dir = str(tmp_path / name)
    return cfg


def _losses(cfg):
    return [r["loss"] for r in read_metrics(cfg.train.out_dir)]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, accum", [("off", 1), ("off", 2), ("delayed", 1)])
def test_trainer_with_graphs_gives_the_eager_losses(tmp_path, fp8, accum):
    runs = {}
    for graphs in ("false", "true"):
        cfg = _gpu_run(tmp_path, f"graphs-{graphs}", 10, **{"train.cuda_graphs": graphs, "fp8.recipe": fp8,
                                                            "train.grad_accum": accum})
        runs[graphs] = (train(cfg), _losses(cfg))
    (eager_summary, eager), (graph_summary, graphed) = runs["false"], runs["true"]
    assert graph_summary["cuda_graphs"] and not eager_summary["cuda_graphs"]
    assert len(eager) == len(graphed) == 10
    assert sum(eager[-3:]) < sum(eager[:3]), eager     # the steps do train
    for i, (e, g) in enumerate(zip(eager, graphed)):
        assert abs(e - g) <= 1e-3 * e, (i, eager, graphed)
    # evaluations at steps 5 and 10 ran between replays: a stale FP8 weight would show here
    e, g = eager_summary["final_val_loss"], graph_summary["final_val_loss"]
    assert abs(e - g) <= 1e-3 * e, (e, g)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", ["off", "delayed"])
def test_resumed_graph_run_matches_the_uninterrupted_one(tmp_path, fp8):
    full = _gpu_run(tmp_path, "full", 12, **{"checkpoint.every": 5, "train.cuda_graphs": "true", "fp8.recipe": fp8})
    assert train(full)["cuda_graphs"]
    losses = _losses(full)

    resumed = _gpu_run(tmp_path, "resumed", 12, **{"checkpoint.every": 5, "train.cuda_graphs": "true",
                                                   "fp8.recipe": fp8})
    ckpt = os.path.join(resumed.train.out_dir, "checkpoints")
    os.makedirs(ckpt)
    shutil.copytree(os.path.join(full.train.out_dir, "checkpoints", "step_00000005"),
                    os.path.join(ckpt, "step_00000005"))
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("step_00000005\n")
    summary = train(resumed, resume=True)
    assert summary["cuda_graphs"]    # steps 6-8 eager, captured at 9
    resumed_losses = _losses(resumed)
    assert len(resumed_losses) == 7
    for i, (e, g) in enumerate(zip(losses[5:], resumed_losses)):
        assert abs(e - g) <= 1e-3 * e, (i, losses[5:], resumed_losses)
    with open(os.path.join(full.train.out_dir, "summary.json")) as f:
        uninterrupted_val = json.load(f)["final_val_loss"]
    assert abs(summary["final_val_loss"] - uninterrupted_val) <= 1e-3 * uninterrupted_val
