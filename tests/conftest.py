"""Test setup: the Triton interpreter on CPU, the gpu marker, fresh seeds.

TRITON_INTERPRET must be set before triton is first imported (it is read when a kernel is decorated),
so it is set here, at collection, unless a CUDA GPU is present.
"""
import os

import pytest

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """The device the test's tensors live on: CUDA when present, else CPU (the interpreter runs kernels)."""
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture
def calls_taken(monkeypatch):
    """taken = calls_taken(run, fwd=(module, "forward"), bwd=(module, "backward")): taken(*a, **kw) runs
    run(*a, **kw) and says, per keyword in order, whether that function was called (wrapped by monkeypatch)."""
    def make(run, **targets):
        counts = dict.fromkeys(targets, 0)
        for kind, (module, name) in targets.items():
            real = getattr(module, name)

            def counted(*a, _real=real, _kind=kind, **kw):
                counts[_kind] += 1
                return _real(*a, **kw)
            monkeypatch.setattr(module, name, counted)

        def taken(*a, **kw):
            before = dict(counts)
            run(*a, **kw)
            return tuple(counts[kind] > before[kind] for kind in targets)
        return taken
    return make


@pytest.fixture
def tiny_gpt_step(monkeypatch):
    """step(module, switch, on, autocast=False) -> (loss, {name: grad}) of one forward + backward of a small
    GPT (two layers, seeded) on fixed tokens, in the Triton mode, with module.switch set to on: the same model
    and tokens each call, so a test compares a switch's two settings."""
    from tilewise import ops
    from tilewise.config import ModelConfig
    from tilewise.model import GPT
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, seq_len=16, n_layer=2, n_head=2, d_model=32)
    model, idx = GPT(cfg), torch.randint(0, 96, (2, 16))

    def step(module, switch, on, autocast=False):
        monkeypatch.setattr(module, switch, on)
        model.zero_grad(set_to_none=True)
        with ops.use("triton"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(idx, idx)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    return step
