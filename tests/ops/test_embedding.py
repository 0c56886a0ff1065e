"""ops.embedding: token + position rows forward, the deterministic segment-sum backward, against float64."""
import pytest
import torch

import sys

from tilewise import ops
from tilewise.ops.embedding import Embedding


@pytest.fixture(autouse=True)
def triton_embedding(monkeypatch):
    """TRITON_EMBEDDING on for every test here (off by default until the H200 measures it)."""
    monkeypatch.setattr(sys.modules["tilewise.ops.embedding"], "TRITON_EMBEDDING", True)


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def make(batch, seqlen, vocab, width, positions, device="cpu", dtype=torch.float32, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:   # real text: a few ids take most positions
        frequent = torch.randint(0, 3, (batch, seqlen), generator=g)
        idx = torch.where(torch.rand(batch, seqlen, generator=g) < 0.6, frequent,
                          torch.randint(0, vocab, (batch, seqlen), generator=g))
    else:
        idx = torch.randint(0, vocab, (batch, seqlen), generator=g)
    w = torch.randn(vocab, width, generator=g).to(device, dtype)
    p = torch.randn(positions, width, generator=g).to(device, dtype) if positions else None
    dx = torch.randn(batch, seqlen, width, generator=g).to(device, dtype)
    return idx.to(device), w, p, dx


def run(idx, w, p, dx, start=0, mode="triton"):
    w, p = w.clone().requires_grad_(), None if p is None else p.clone().requires_grad_()
    with ops.use(mode):
        x = ops.embedding(idx, w, p, start)
    x.backward(dx)
    return x, w.grad, None if p is None else p.grad


def float64(idx, w, p, dx, start=0):
    """x, dW, dP by their definitions: one-hot sums, in float64."""
    onehot = torch.nn.functional.one_hot(idx.reshape(-1).cpu(), w.shape[0]).double()
    x = (onehot @ w.cpu().double()).view(*idx.shape, -1)
    dw = onehot.t() @ dx.cpu().double().reshape(-1, w.shape[1])
    dp = None
    if p is not None:
        x = x + p.cpu().double()[start:start + idx.shape[-1]]
        dp = torch.zeros_like(p.cpu().double())
        dp[start:start + idx.shape[-1]] = dx.cpu().double().sum(0)
    return x, dw, dp


@pytest.mark.parametrize("positions", [0, 24], ids=["tokens", "tokens+positions"])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("width", [48, 96])
def test_embedding_against_float64(positions, skew, width):
    idx, w, p, dx = make(3, 17, 37, width, positions, skew=skew)
    x, dw, dp = run(idx, w, p, dx, start=5 if positions else 0)
    x64, dw64, dp64 = float64(idx, w, p, dx, start=5 if positions else 0)
    assert "Embedding" in type(x.grad_fn).__name__ and x.shape == (3, 17, width) and x.dtype == w.dtype
    assert rel_err(x, x64) < 1e-6 and rel_err(dw, dw64) < 1e-6 and dw.shape == w.shape
    assert not (dw[torch.bincount(idx.reshape(-1), minlength=37) == 0] != 0).any()   # rows with no token: zero
    if positions:
        assert rel_err(dp, dp64) < 1e-6 and dp.shape == p.shape


def test_bf16_table_and_int32_ids():
    idx, w, p, dx = make(2, 9, 21, 32, 9, dtype=torch.bfloat16)
    x, dw, dp = run(idx.to(torch.int32), w, p, dx)
    x64, dw64, dp64 = float64(idx, w, p, dx)
    assert x.dtype == dw.dtype == dp.dtype == torch.bfloat16
    assert rel_err(x, x64) < 2 ** -8 and rel_err(dw, dw64) < 2 ** -8 and rel_err(dp, dp64) < 2 ** -8


def test_backward_is_deterministic_and_matches_torch():
    """The same bits twice; torch's dense embedding backward agrees to fp32 rounding."""
    idx, w, p, dx = make(4, 16, 11, 40, 16, skew=True)
    _, dw1, dp1 = run(idx, w, p, dx)
    _, dw2, dp2 = run(idx, w, p, dx)
    _, dw_ref, dp_ref = run(idx, w, p, dx, mode="reference")
    assert torch.equal(dw1, dw2) and torch.equal(dp1, dp2)
    assert torch.allclose(dw1, dw_ref, rtol=1e-6, atol=1e-6) and torch.allclose(dp1, dp_ref, rtol=1e-6, atol=1e-6)


def test_frozen_tables_get_no_gradient():
    idx, w, p, dx = make(2, 8, 10, 16, 8)
    w_leaf = w.clone().requires_grad_()
    with ops.use("triton"):
        x = Embedding.apply(idx, w_leaf, p, 0)
    x.backward(dx)
    assert w_leaf.grad is not None and p.grad is None


@pytest.mark.parametrize("args, error, match", [
    (lambda idx, w, p: (idx.float(), w, p, 0), TypeError, "idx dtype"),
    (lambda idx, w, p: (idx, w[0], p, 0), ValueError, "weight shape"),
    (lambda idx, w, p: (idx, w, p[:, :8], 0), ValueError, "pos_weight"),
    (lambda idx, w, p: (idx, w, p, 3), ValueError, "positions 3 .. 11"),
    (lambda idx, w, p: (idx + 10, w, p, 0), ValueError, "token ids"),
])
def test_bad_input_is_named(args, error, match):
    idx, w, p, _ = make(2, 8, 10, 16, 8)
    with ops.use("triton"), pytest.raises(error, match=match):
        ops.embedding(*args(idx, w, p))


@pytest.mark.gpu
@pytest.mark.parametrize("vocab, width", [(50304, 768), (50304, 2048)], ids=["124m", "1.3b"])
def test_gpu_embedding_at_the_e2e_sizes(vocab, width):
    idx, w, p, dx = make(4, 1024, vocab, width, 1024, device="cuda", seed=1, skew=True)
    x, dw, dp = run(idx, w, p, dx)
    _, dw_ref, dp_ref = run(idx, w, p, dx, mode="reference")
    x64 = w.double()[idx] + p.double()
    assert rel_err(x, x64) < 1e-7
    assert torch.allclose(dw, dw_ref, rtol=1e-5, atol=1e-5) and torch.allclose(dp, dp_ref, rtol=1e-5, atol=1e-5)
    _, dw2, _ = run(idx, w, p, dx)
    assert torch.equal(dw, dw2)


@pytest.mark.gpu
def test_gpu_out_of_range_ids_give_nan_rows():
    idx, w, p, dx = make(1, 8, 10, 16, 8, device="cuda")
    idx[0, 3] = 10
    x, dw, _ = run(idx, w, p, dx)
    assert x[0, 3].isnan().all() and not x[0, [0, 1, 2, 4, 5, 6, 7]].isnan().any() and dw.isfinite().all()


def test_switch_off_runs_the_reference(monkeypatch):
    monkeypatch.setattr(sys.modules["tilewise.ops.embedding"], "TRITON_EMBEDDING", False)
    idx, w, p, dx = make(2, 8, 10, 16, 8)
    with ops.use("triton"):
        x = ops.embedding(idx, w.requires_grad_(), p)
    assert "Embedding" not in type(x.grad_fn).__name__


def test_model_step_is_the_same_with_the_kernels(tiny_gpt_step):
    """The GPT's loss and gradients with the Triton embedding against torch's."""
    def step(on):
        return tiny_gpt_step(sys.modules["tilewise.ops.embedding"], "TRITON_EMBEDDING", on)

    (loss_ref, grads_ref), (loss, grads) = step(False), step(True)
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    for name, grad in grads_ref.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), name


_SM90_BUILD = r"""
import importlib, json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
emb = importlib.import_module("tilewise.ops.embedding")
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
types = {"IDX": "*i64", "ORDER": "*i64", "OFFSETS": "*i64", "W": "*fp32", "P": "*fp32", "OUT": "*fp32",
         "DX": "*fp32", "DW": "*fp32"}
out = []
for width in (768, 2048):
    for fn, meta in ((emb._embed_fwd_kernel, dict(emb.forward_meta(width), HAS_POS=True)),
                     (emb._embed_bwd_kernel, emb.backward_meta(width))):
        warps = meta.pop("num_warps")
        sig = {n: "constexpr" if n in meta else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=meta, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        out.append([fn.__name__, width, len(sass), sass.count("LDL") + sass.count("STL")])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90_builds_do_not_spill():
    """The launches at GPT-2 124M's and the 1.3B preset's widths, compiled for sm_90a ahead of time with
    Triton's own ptxas (no GPU needed): no local loads or stores (register spills)."""
    import json
    import os
    import subprocess
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no NVIDIA toolchain")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SM90_BUILD], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, width, sass, spills in json.loads(done.stdout.strip().splitlines()[-1]):
        assert sass > 500 and spills == 0, f"{name} at width {width}: {spills} local loads/stores"
