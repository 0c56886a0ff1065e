"""Process groups and data-parallel strategies on torch.distributed: ddp, fsdp (ZeRO-3/ZeRO-2) and hsdp.

Launch with torchrun (`torchrun --nproc_per_node=N -m tilewise train ...`, plus --nnodes and the rendezvous
options on several nodes). init_distributed() reads RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from
torchrun's environment and opens the process group: NCCL on CUDA, gloo on CPU, with distributed.timeout_s
on every collective, so a rank that dies or hangs ends the job instead of leaving the others waiting.
A strategy other than "none" without torchrun opens a one-rank group (no network, an in-memory store).

parallelize() applies the strategy to a model built identically on every rank (the same seed):
- ddp: DistributedDataParallel; gradients are all-reduced in buckets while backward runs. The trainer
  skips that all-reduce (no_sync) on every micro-batch but the last of a step.
- fsdp: FSDP2 fully_shard on each block, then on the root: parameters, gradients and optimizer state are
  sharded (ZeRO-3). Each block's parameters are all-gathered just before its forward and backward and
  its gradients reduce-scattered after its backward; reshard_after_forward=False keeps the gathered
  parameters from forward to backward (ZeRO-2: one all-gather per step instead of two, more memory).
  On CUDA the gathered parameters are bf16 and gradients are reduced in fp32.
- hsdp: fully_shard on a 2-D mesh (nodes, ranks of a node): sharded within a node, replicated across.
- fsdp/hsdp with FP8 recipe "delayed" (fp8.fsdp_fp8_all_gather, on by default): Fp8Linear weights are cast
  to FP8 shard by shard and gathered as 1-byte elements (tilewise.fp8.fsdp); other parameters as above.
Bytes per step and rank (P parameters, fp32 master, bf16 compute): ddp all-reduces 4P (ring: ~2x that on
the wire); fsdp all-gathers 2P twice (once with reshard_after_forward=False) and reduce-scatters 4P.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import Config, ConfigError

STRATEGIES = ("none", "ddp", "fsdp", "hsdp")


@dataclass
class Dist:
    """Where this process stands: its rank among world_size, its device, and the collectives it needs.

    Every helper is a no-op without a process group (strategy "none", one process)."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    strategy: str = "none"
    mesh: object = None          # the DeviceMesh fsdp/hsdp shard over (1-D, or 2-D for hsdp)
    owns_group: bool = False     # init_distributed opened the process group (and close() ends it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce tensor in place over all ranks ("sum", "mean" or "max") and return it."""
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"Dist.all_reduce: op={op!r}; expected one of {tuple(ops)}")
        if self.active and self.world_size > 1:
            dist.all_reduce(tensor, op=ops[op])
            if op == "mean":
                tensor.div_(self.world_size)
        return tensor

    def close(self) -> None:
        """End the process group if init_distributed opened it (the end of a successful run)."""
        if self.owns_group and self.active:
            dist.destroy_process_group()
        self.owns_group = False


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r}; expected an integer (torchrun sets it)") from None


def check_config(cfg: Config, world_size: int, local_world_size: int) -> None:
    """ConfigError for a distributed section that cannot work with this launch."""
    d = cfg.distributed
    if d.strategy not in STRATEGIES:
        raise ConfigError(f"distributed.strategy={d.strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if d.strategy == "none" and world_size > 1:
        raise ConfigError(f"launched as {world_size} processes but distributed.strategy=none: set "
                          f"distributed.strategy to ddp, fsdp or hsdp (e.g. --set distributed.strategy=ddp)")
    if d.timeout_s <= 0:
        raise ConfigError(f"distributed.timeout_s={d.timeout_s}; expected a positive number of seconds")
    if d.cpu_offload and d.strategy not in ("fsdp", "hsdp"):
        raise ConfigError(f"distributed.cpu_offload needs strategy fsdp or hsdp (FSDP2's offload policy), "
                          f"not {d.strategy!r}")
    if d.strategy == "hsdp" and world_size % local_world_size:
        raise ConfigError(f"distributed.strategy=hsdp: world size {world_size} is not a multiple of the "
                          f"{local_world_size} processes per node (LOCAL_WORLD_SIZE)")


def init_distributed(cfg: Config, device: torch.device) -> Dist:
    """Open the process group for cfg.distributed.strategy (see the module docstring); returns the Dist.

    device: the resolved device type (cuda or cpu); on CUDA each rank takes GPU LOCAL_RANK.
    An already initialized process group is used as it is (and left open by close()).
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank if world > 1 else 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    check_config(cfg, world, local_world)
    strategy = cfg.distributed.strategy
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                              f"start at most that many processes per node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    out = Dist(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, device=device,
               strategy=strategy)
    if strategy == "none":
        return out
    if not dist.is_available():
        raise ConfigError(f"distributed.strategy={strategy} but this PyTorch build has no torch.distributed")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=cfg.distributed.timeout_s)
        extra = {"device_id": device} if device.type == "cuda" else {}
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **extra)
        else:   # not launched by torchrun: a group of one, nothing to rendezvous with
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    **extra)
        out.owns_group = True
    if strategy in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        if strategy == "hsdp":
            out.mesh = init_device_mesh(device.type, (world // local_world, local_world),
                                        mesh_dim_names=("replicate", "shard"))
        else:
            out.mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return out


# ------------------------------------------------------------------------------------------------
# Strategies
# ------------------------------------------------------------------------------------------------

def _checkpointed_forward(forward, *args, **kwargs):
    # Non-reentrant checkpointing: recompute in backward, with the CPU and CUDA RNG states of the forward
    # (so dropout, whose kernels draw their seed from the CPU generator, repeats its mask).
    from torch.utils.checkpoint import checkpoint
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them: only each block's inputs
    stay alive between forward and backward. The module tree and the parameter names do not change."""
    for block in model.blocks:
        if not getattr(block, "_tilewise_checkpointed", False):
            block.forward = functools.partial(_checkpointed_forward, block.forward)
            block._tilewise_checkpointed = True


def parallelize(model: nn.Module, cfg: Config, d: Dist, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Apply activation checkpointing (if configured) and d.strategy to model, which is on d.device with the
    same values on every rank. Returns the module to train: a DistributedDataParallel for ddp; for
    fsdp/hsdp (and none) the model itself, changed in place. compute_dtype: the training dtype; bf16 makes
    fsdp gather bf16 parameters (gradients are still reduced in fp32)."""
    if cfg.distributed.activation_checkpointing:
        apply_activation_checkpointing(model)
    strategy = d.strategy
    if strategy == "none":
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        ids = [d.device.index] if d.device.type == "cuda" else None
        # The only buffers (RoPE tables) are computed the same on every rank: no broadcast before each forward.
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True, **no_sync)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    if compute_dtype == torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if cfg.distributed.cpu_offload:
        if d.device.type != "cuda":
            raise ConfigError("distributed.cpu_offload moves GPU state to host memory; on CPU it has nothing to do")
        offload = CPUOffloadPolicy(pin_memory=True)
    else:
        offload = OffloadPolicy()
    # Blocks return views (reshapes); the model never changes them in place, which is what FSDP2 warns about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    if cfg.fp8.fsdp_fp8_all_gather and cfg.fp8.recipe == "delayed":
        from .fp8.fsdp import enable_fp8_all_gather
        enable_fp8_all_gather(model, shard_size=d.mesh.size(d.mesh.ndim - 1), param_dtype=mp.param_dtype)
    reshard = bool(cfg.distributed.reshard_after_forward)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        if cfg.train.compile:
            block.compile()
        # The last block's backward starts right after forward: resharding it would only gather it again.
        fully_shard(block, mesh=d.mesh, reshard_after_forward=reshard and i < len(blocks) - 1, mp_policy=mp,
                    offload_policy=offload)
    fully_shard(model, mesh=d.mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DistributedDataParallel or torch.compile wrapper (the names its state uses)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def sync_context(model: nn.Module, last_micro_batch: bool):
    """Gradient synchronization for one micro-batch: ddp skips its all-reduce until the last micro-batch of
    a step (gradients accumulate locally). fsdp reduce-scatters every micro-batch, so gradients accumulate
    sharded, in fp32, instead of unsharded in the compute dtype."""
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel) and not last_micro_batch:
        return model.no_sync()
    return contextlib.nullcontext()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank must call it); other tensors as they are."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
