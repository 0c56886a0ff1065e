"""FP8 training: formats and scaling recipes, their device-side state, Fp8Linear and convert_to_fp8.

Wiring into a trainer (per optimizer step, after backward of every micro-batch):
    state = convert_to_fp8(model, "delayed", skip=lambda name: name.endswith("lm_head"))
    ...
    optimizer.step()
    state.step()          # MAX-reduce amaxes across ranks, update scales, invalidate FP8 weight copies
Checkpoint `state.state_dict()` (tensors) beside the model and restore it with `state.load_state_dict`.
Under FSDP2 (fsdp/hsdp), enable_fp8_all_gather(model, shard_size) before fully_shard gathers the weights in FP8
(tilewise.distributed.parallelize does it when fp8.fsdp_fp8_all_gather is on).
"""
from .fsdp import Fp8GatheredWeight, Fp8ShardedWeight, enable_fp8_all_gather
from .linear import Fp8Linear, convert_to_fp8, fp8_compatible
from .recipe import (AMAX_COMPUTE, E4M3, E5M2, FORMATS, SCALINGS, Fp8Recipe, as_recipe, fp8_max,
                     recipe_from_config)
from .state import Fp8State, reduce_amaxes

__all__ = [
    "Fp8Linear", "convert_to_fp8", "fp8_compatible",
    "Fp8Recipe", "as_recipe", "recipe_from_config", "fp8_max", "E4M3", "E5M2", "SCALINGS", "FORMATS", "AMAX_COMPUTE",
    "Fp8State", "reduce_amaxes", "enable_fp8_all_gather", "Fp8ShardedWeight", "Fp8GatheredWeight",
]
