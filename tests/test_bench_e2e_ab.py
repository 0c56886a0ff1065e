"""bench/e2e_ab.py: its settings reach the ops they name, and bad arguments are refused by name."""
import importlib
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import e2e_ab  # noqa: E402

attention = importlib.import_module("tilewise.ops.attention")
sm90_bwd = importlib.import_module("tilewise.ops.attention_sm90_bwd")


def test_atomic_configs_are_configs_of_the_kernel():
    for head_dim, config in e2e_ab.ATOMIC_CONFIGS.items():
        assert config in sm90_bwd.CONFIGS["dkdv_dq"][head_dim]


def test_atomic_backward_routes_every_covered_backward(monkeypatch):
    calls = []
    monkeypatch.setattr(sm90_bwd, "backward", lambda *args, **kw: calls.append((args, kw)) or "ran")
    monkeypatch.setattr(attention, "_gluon_wins", lambda kind, *args: False)   # restored after the test
    e2e_ab.atomic_backward()
    assert attention._gluon_wins("bwd", None, None, 0, None, None) is True
    assert attention._gluon_wins("fwd", None, None, 0, None, None) is False   # the forward still races
    q = torch.zeros(1, 4, 2, 64)
    assert sm90_bwd.backward(None, q, None, None, None, None, True, 0.125, grads=None) == "ran"
    (args, kw), = calls
    assert args[1] is q and args[6:] == (True, 0.125)
    assert kw == {"dq_mode": "atomic", "dkdv_dq_config": e2e_ab.ATOMIC_CONFIGS[64], "grads": None}


def _run(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e_ab.py"), *argv],
                          capture_output=True, text=True, timeout=120)


def test_bad_arguments_are_named():
    done = _run()
    assert done.returncode == 2 and "exactly one of --attn-bwd, --head-chunk-mb" in done.stderr
    done = _run("--attn-bwd", "atomic", "--head-chunk-mb", "64")
    assert done.returncode == 2 and "exactly one" in done.stderr
    done = _run("--head-chunk-mb", "0")
    assert done.returncode == 2 and "--head-chunk-mb=0" in done.stderr
