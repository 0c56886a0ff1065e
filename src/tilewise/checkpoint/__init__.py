"""Checkpoints: tensors in safetensors files, everything else as JSON; no pickle anywhere.

A checkpoint is written under a temporary name and renamed into place, and `latest` is replaced
atomically after it, so a crash mid-save leaves the previous checkpoint as latest.
"""
from .save import Checkpointer

__all__ = ["Checkpointer"]
