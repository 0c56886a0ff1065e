"""CUDA graphs for the training step: one whole optimizer step captured once, then replayed with new batches.

Why: at GPT-2 scale the host is as slow as the GPU. An eager step is ~120 Triton launches, ~50 GEMMs, the
autograd engine and the optimizer, tens of milliseconds of Python and driver time; a replay is one launch.
Captured: forward and backward of every micro-batch, gradient clipping, AdamW (fused, capturable=True, with
the learning rate in a device tensor that the loop fills before each replay) and the FP8 scale update.
The batches go into static input buffers (copy_ on the compute stream); the step's loss and gradient norm
are static output tensors, read by the host only at log steps. Nothing in a replayed step waits on the host.

A replay reruns the kernels recorded at capture on the same addresses, and none of the host code between
them. What that needs, and how each is met:
- Lazy work happens before capture: train.py runs WARMUP_STEPS eager steps first (Triton autotuning and
  compilation, cuBLAS workspaces, AdamW's moments, FP8's switch from current to delayed scales).
- Host state read once per step would freeze. The learning rate lives in a device tensor. Fp8Linear caches
  its FP8 weight under the weight's _version, a host counter that replays never bump: every Fp8Linear is
  invalidated before capture (so the weight cast is recorded and reruns each replay) and before any eager
  forward between replays (evaluation), so none reuses a stale copy.
- Dropout in the fused norm draws a host seed per call; a graph would replay one mask forever. Graphs are
  refused with dropout (model.dropout > 0), as with activation checkpointing, whose blocks stash the CUDA
  RNG state on the host, which cannot be captured.
- ddp, fsdp and hsdp run their collectives from host-side hooks (ddp's buckets, fsdp's per-block
  all-gathers and frees), which would need capture support of their own: graphs are off there.
Evaluation and checkpoints run eagerly between replays, on the same stream.

train.cuda_graphs: "auto" (the default) turns graphs on where all of the above holds (one CUDA process,
no dropout, no activation checkpointing) and off elsewhere, with a one-line notice saying why on CUDA;
a failed capture under auto continues eagerly. It is the default because there a replay computes what the
eager step computes, and the eager step is host-bound at GPT-2 scale (on the H200's host, 48 ms of Python
and launches per GPT-2 124M step, against 72 ms of GPU work at 32 x 1024). The cost: the graph keeps the
step's activation memory reserved between steps, and the first steps of a run are eager. "true" asks for them: a CPU device, dropout or activation
checkpointing is a ConfigError, a failed capture an error. "false" never captures.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch

from .config import Config, ConfigError
from .fp8 import Fp8Linear

WARMUP_STEPS = 3   # eager steps before capture: step 0 autotunes and makes the optimizer state, step 1 runs
                   # FP8's delayed-scaling kernels for the first time, step 2 checks nothing is left to do

_MODES = {"auto": "auto", "true": "on", "false": "off"}


def graph_mode(value) -> str:
    """train.cuda_graphs as "auto", "on" or "off" (it accepts auto, true, false in any case, or a bool)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    mode = _MODES.get(str(value).strip().lower())
    if mode is None:
        raise ConfigError(f"train.cuda_graphs={value!r}; expected auto, true or false")
    return mode


def resolve(cfg: Config, device: torch.device, strategy: str) -> tuple[bool, str | None]:
    """Whether this run captures its step: (enabled, a one-line notice for the console or None).

    Raises ConfigError where train.cuda_graphs=true asks for what cannot work (see the module docstring).
    """
    mode = graph_mode(cfg.train.cuda_graphs)
    if mode == "off":
        return False, None
    if device.type != "cuda":
        if mode == "on":
            raise ConfigError(f"train.cuda_graphs=true needs a CUDA device; this run is on {device.type} "
                              f"(set train.cuda_graphs=auto or false)")
        return False, None
    if strategy != "none":
        return False, (f"tilewise: CUDA graphs off: distributed.strategy={strategy} runs its collectives from "
                       f"host-side hooks, which a captured step would skip")
    refusals = []
    if cfg.model.dropout > 0:
        refusals.append(f"model.dropout={cfg.model.dropout} draws a host seed per call (a graph would replay "
                        f"one mask)")
    if cfg.distributed.activation_checkpointing:
        refusals.append("distributed.activation_checkpointing=true stashes the CUDA RNG state on the host in "
                        "every block")
    if refusals:
        if mode == "on":
            raise ConfigError(f"train.cuda_graphs=true cannot capture this step: {'; '.join(refusals)}; "
                              f"set train.cuda_graphs=false")
        return False, f"tilewise: CUDA graphs off: {'; '.join(refusals)}"
    return True, None


def invalidate_fp8_weights(model: torch.nn.Module) -> None:
    """Drop every Fp8Linear's cached FP8 weight, so the next forward casts the weight again."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.invalidate()


@contextlib.contextmanager
def uncaptured_optimizer_steps():
    """Silence torch's warning that a capturable optimizer steps outside a capture (the eager warm-up does)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")
        yield


Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class StepGraph:
    """One optimizer step captured in a torch.cuda.CUDAGraph and replayed with new batches.

    step(batch) runs a whole optimizer step, taking micro-batch k as batch(k) -> (inputs, targets), and
    returns its outputs (device tensors). The graph calls it once, at capture, on static buffers of shape
    (micro_batches, rows, seq_len); load() fills them before each replay. model: its Fp8Linears are
    invalidated around the capture (module docstring).
    """

    def __init__(self, step: Callable[[Batch], tuple], micro_batches: int, rows: int, seq_len: int,
                 device: torch.device | str, model: torch.nn.Module | None = None):
        for name, value in (("micro_batches", micro_batches), ("rows", rows), ("seq_len", seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StepGraph: {name}={value!r}; expected an int >= 1")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"StepGraph: device {device}; CUDA graphs need a CUDA device")
        self._step, self._model = step, model
        self.inputs = torch.zeros((micro_batches, rows, seq_len), dtype=torch.int64, device=device)
        self.targets = torch.zeros_like(self.inputs)
        self._graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def _static_batch(self, k: int):
        return self.inputs[k], self.targets[k]

    def load(self, k: int, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy micro-batch k into the static buffers, on the current stream (no host sync)."""
        if not 0 <= k < self.inputs.shape[0]:
            raise ValueError(f"StepGraph.load: micro-batch {k}; expected 0 <= k < {self.inputs.shape[0]}")
        for name, given in (("inputs", inputs), ("targets", targets)):
            if tuple(given.shape) != tuple(self.inputs.shape[1:]):
                raise ValueError(f"StepGraph.load: {name} of shape {tuple(given.shape)}; the captured step takes "
                                 f"{tuple(self.inputs.shape[1:])}")
        self.inputs[k].copy_(inputs, non_blocking=True)
        self.targets[k].copy_(targets, non_blocking=True)

    def capture(self) -> None:
        """Record the step on the loaded buffers. Nothing runs: replay() then performs this step.

        A failed capture leaves no gradients behind and raises; run_eager() can then do the step instead.
        """
        if self._graph is not None:
            raise RuntimeError("StepGraph.capture: already captured")
        if self._model is not None:
            invalidate_fp8_weights(self._model)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the Prefetcher's thread keeps copying batches on its own stream meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = self._step(self._static_batch)
        except BaseException:
            if self._model is not None:
                self._model.zero_grad(set_to_none=True)
            raise
        finally:
            if self._model is not None:   # the caches hold tensors of the capture, valid only inside it
                invalidate_fp8_weights(self._model)
        self._graph, self.outputs = graph, outputs

    def replay(self):
        """Run the captured step on what load() put in the buffers; returns the (static) outputs."""
        if self._graph is None:
            raise RuntimeError("StepGraph.replay: capture() first")
        self._graph.replay()
        return self.outputs

    def run_eager(self):
        """Run the step eagerly on the loaded buffers (after a failed capture)."""
        return self._step(self._static_batch)
