"""The checkpoint writer and reader of a single process.

Layout under the checkpoint root:
    step_00000100/tensors.safetensors   every tensor, by name
    step_00000100/state.json            non-tensor state (step, data position, config, ...)
    latest                              the name of the newest complete checkpoint
A checkpoint is written into step_XXXXXXXX.tmp/, fsynced, renamed, and only then named in `latest`.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not match what is loaded into."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


class Checkpointer:
    def __init__(self, root: str, *, keep: int = 3):
        if keep < 1:
            raise ValueError(f"Checkpointer: keep={keep}; expected at least 1")
        self.root, self.keep = root, keep

    @staticmethod
    def step_name(step: int) -> str:
        return f"step_{step:08d}"

    def save(self, step: int, tensors: dict[str, torch.Tensor], state: dict) -> str:
        """Write tensors and JSON state as checkpoint `step`; returns its directory."""
        os.makedirs(self.root, exist_ok=True)
        final = os.path.join(self.root, self.step_name(step))
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        save_file(cpu, os.path.join(tmp, "tensors.safetensors"))
        with open(os.path.join(tmp, "tensors.safetensors"), "rb+") as f:
            os.fsync(f.fileno())
        _write_json(os.path.join(tmp, "state.json"), {"format": FORMAT_VERSION, "step": step, **state})
        _fsync_dir(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._point_latest(self.step_name(step))
        self._prune()
        return final

    def _point_latest(self, name: str) -> None:
        tmp = os.path.join(self.root, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, "latest"))
        _fsync_dir(self.root)

    def _prune(self) -> None:
        latest = self.latest()
        done = sorted(d for d in os.listdir(self.root) if d.startswith("step_") and not d.endswith(".tmp"))
        for name in done[:-self.keep]:
            if latest is None or os.path.basename(latest) != name:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def latest(self) -> str | None:
        """The newest complete checkpoint's directory, or None."""
        try:
            with open(os.path.join(self.root, "latest")) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        path = os.path.join(self.root, name)
        return path if os.path.isfile(os.path.join(path, "state.json")) else None

    def load(self, path: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors on CPU, state) of the checkpoint at path (default: latest)."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no complete checkpoint under {self.root!r}")
        state_path = os.path.join(path, "state.json")
        if not os.path.isfile(state_path):
            raise CheckpointError(f"{path!r} is not a complete checkpoint (no state.json)")
        with open(state_path) as f:
            state = json.load(f)
        if state.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{state_path}: format {state.get('format')!r}; this tilewise reads {FORMAT_VERSION}")
        try:
            tensors = load_file(os.path.join(path, "tensors.safetensors"))
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"{path}/tensors.safetensors cannot be read: {e}") from None
        return tensors, state
