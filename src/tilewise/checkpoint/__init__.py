"""Sharded, asynchronous, crash-safe checkpoints: safetensors shard files plus a JSON manifest; no pickle.

manifest.py  the format (layout, manifest fields, checks), inspect()
save.py      Checkpointer: per-rank shard files written in the background, committed by rank 0
load.py      reading N writer ranks' shards into M reader ranks (memory-mapped byte ranges)
export.py    a HuggingFace transformers model directory from a run
"""
from .export import export_hf
from .load import load_into, load_tensors
from .manifest import CheckpointError, inspect, read_manifest, resolve, summary
from .save import Checkpointer

__all__ = ["Checkpointer", "CheckpointError", "export_hf", "inspect", "load_into", "load_tensors", "read_manifest",
           "resolve", "summary"]
