"""ops.cublaslt: the three epilogue GEMMs against float64, on the GPU; their torch-op reference everywhere.

The GPU tests make the reference fail so that only cuBLASLt can pass them, and tell its GELU apart from
erf's where the two differ most (4e-4 near |x| = 2.7).
"""
import pytest
import torch
import torch.nn.functional as F

from tilewise.ops import cublaslt


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def operands(tokens, n_in, n_out, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n_in, generator=g).to(device, dtype)
    w = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(device, dtype)
    b = (0.5 * torch.randn(n_out, generator=g)).to(device, dtype)
    dy = torch.randn(tokens, n_out, generator=g).to(device, dtype)
    return x, w, b, dy


def gelu64(h, approximate="tanh"):
    return F.gelu(h.double(), approximate=approximate)


def dgelu64(g, h):
    return torch.ops.aten.gelu_backward(g.double(), h.double(), approximate="tanh")


def test_not_available_on_the_cpu():
    assert not cublaslt.available("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_reference_functions_against_float64(dtype):
    """What the CPU (and a shape cuBLASLt has no algorithm for) computes: the same three functions."""
    x, w, b, dy = operands(24, 40, 16, dtype, "cpu")
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    act, pre = cublaslt.gelu_bias(x, w, b)
    pre64 = x.double() @ w.double().t() + b.double()
    assert act.dtype == pre.dtype == dtype and rel_err(pre, pre64) < tol and rel_err(act, gelu64(pre64)) < tol
    act_only, none = cublaslt.gelu_bias(x, w, None, keep_pre=False)
    assert none is None and rel_err(act_only, gelu64(x.double() @ w.double().t())) < tol
    pre_in = torch.randn(24, 40).to(dtype)
    dh = cublaslt.dgelu(dy, w, pre_in)
    assert dh.dtype == dtype and rel_err(dh, dgelu64(dy.double() @ w.double(), pre_in)) < tol
    dw, db = cublaslt.wgrad(dy, x, bias_grad=True)
    assert dw.dtype == db.dtype == torch.float32 and dw.shape == (16, 40)
    assert rel_err(dw, dy.double().t() @ x.double()) < 1e-5 and rel_err(db, dy.double().sum(0)) < 1e-5
    assert cublaslt.wgrad(dy, x)[1] is None


# ------------------------------------------------------------------------------------------ on the GPU

@pytest.fixture
def no_reference(monkeypatch):
    """The torch-op reference made to fail: a test passes only if cuBLASLt ran."""
    for name in ("gelu_bias_reference", "dgelu_reference", "wgrad_reference"):
        monkeypatch.setattr(cublaslt, name, lambda *a, _n=name: pytest.fail(f"{_n} ran"))


@pytest.mark.gpu
def test_gpu_gelu_is_the_tanh_approximation(no_reference):
    """fp32 GEMMs by the identity (exact), so the epilogue sees chosen inputs: |x| in [2.2, 3.2], where the tanh
    approximation sits 4e-4 above erf's GELU. Closer to tanh's in RMS whatever the epilogue's own error."""
    g = torch.Generator().manual_seed(1)
    band = 2.2 + torch.rand(8192, 8, generator=g)
    x = (band * torch.where(torch.rand(8192, 8, generator=g) < 0.5, -1.0, 1.0)).cuda()
    eye = torch.eye(8, device="cuda")
    act, pre = cublaslt.gelu_bias(x, eye, torch.zeros(8, device="cuda"))
    assert torch.equal(pre, x)
    rms = {kind: (act.double() - gelu64(x, kind)).pow(2).mean().sqrt().item() for kind in ("tanh", "none")}
    assert rms["tanh"] < rms["none"] and rms["tanh"] < 2 ** -9 * gelu64(x).abs().mean().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens, n_in, n_out", [(4096, 768, 3072), (2048, 2048, 8192), (136, 64, 200)])
def test_gpu_epilogues_against_float64(dtype, tokens, n_in, n_out, no_reference):
    """Each epilogue within two roundings of its output dtype of float64 of the same operands."""
    x, w, b, dy_out = operands(tokens, n_in, n_out, dtype, "cuda", seed=2)
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    act, pre = cublaslt.gelu_bias(x, w, b)
    pre64 = x.double() @ w.double().t() + b.double()
    assert rel_err(pre, pre64) < ulp and rel_err(act, gelu64(pre64)) < ulp
    act_nb, pre_nb = cublaslt.gelu_bias(x, w, None)
    assert rel_err(pre_nb, x.double() @ w.double().t()) < ulp
    act_only, _ = cublaslt.gelu_bias(x, w, b, keep_pre=False)
    assert torch.equal(act_only, act)
    # dgelu: the gradient at the GELU's input of y = gelu(pre) @ w2.T, w2: (n_in, n_out)
    w2 = w.t().contiguous()
    dy = dy_out[:, :n_in].contiguous()
    dh = cublaslt.dgelu(dy, w2, act)   # any tensor of the right shape serves as the GELU's input
    assert rel_err(dh, dgelu64(dy.double() @ w2.double(), act)) < ulp
    dw, db = cublaslt.wgrad(dy_out, x, bias_grad=True)
    assert dw.dtype == db.dtype == torch.float32
    assert rel_err(dw, dy_out.double().t() @ x.double()) < 1e-5
    assert rel_err(db, dy_out.double().sum(0)) < 1e-5
    dw_only, none = cublaslt.wgrad(dy_out, x)
    assert none is None and torch.equal(dw_only, dw)


@pytest.mark.gpu
def test_gpu_unsupported_widths_take_the_reference(monkeypatch):
    """A width that is not a multiple of 8 never reaches cuBLASLt: the reference computes it."""
    x, w, b, _ = operands(64, 36, 40, torch.bfloat16, "cuda")
    called = []
    real = cublaslt._matmul
    monkeypatch.setattr(cublaslt, "_matmul", lambda *a, **k: called.append(1) or real(*a, **k))
    act, pre = cublaslt.gelu_bias(x, w, b)
    assert not called and rel_err(pre, x.double() @ w.double().t() + b.double()) < 2 ** -8


def test_matmul_fallback_computes_every_form():
    """Where cuBLASLt does not run (here: the CPU), matmul's torch ops give each form: bias, accumulate, a
    half-precision product into fp32, transposed operands."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(24, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(40, 16, generator=g).to(torch.bfloat16).t()
    bias = torch.randn(40, generator=g).to(torch.bfloat16)
    ref = a.double() @ b.double()
    assert rel_err(cublaslt.matmul(a, b, torch.empty(24, 40, dtype=torch.bfloat16)), ref) < 2 ** -8
    assert rel_err(cublaslt.matmul(a, b, torch.empty(24, 40, dtype=torch.bfloat16), bias=bias),
                   ref + bias.double()) < 2 ** -8
    acc = torch.ones(24, 40)
    assert rel_err(cublaslt.matmul(a, b, acc, accumulate=True), ref + 1) < 1e-6
    assert rel_err(cublaslt.matmul(a.t().contiguous().t(), b, torch.empty(24, 40)), ref) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("tune", [False, True])
@pytest.mark.parametrize("a_t, b_t", [(False, True), (False, False), (True, False), (True, True)])
def test_gpu_matmul_forms_against_float64(a_t, b_t, tune, monkeypatch):
    """cuBLASLt itself (a plan made, none fallen back) for each operand layout, bf16 and fp32 outputs, with a
    bias and accumulating, heuristic and tuned."""
    monkeypatch.setattr(cublaslt, "TUNE", tune)
    g = torch.Generator(device="cuda").manual_seed(4)
    M, K, N = 1024, 768, 2304
    a = torch.randn(*((K, M) if a_t else (M, K)), device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(*((N, K) if b_t else (K, N)), device="cuda", generator=g).to(torch.bfloat16)
    a, b = (a.t() if a_t else a), (b.t() if b_t else b)
    bias = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
    ref = a.double() @ b.double()
    monkeypatch.setattr(cublaslt, "_PLANS", {})   # this test's plans alone
    assert rel_err(cublaslt.matmul(a, b, torch.empty(M, N, device="cuda", dtype=torch.bfloat16)), ref) < 2 ** -8
    out = cublaslt.matmul(a, b, torch.empty(M, N, device="cuda", dtype=torch.bfloat16), bias=bias)
    assert rel_err(out, ref + bias.double()) < 2 ** -8
    acc = torch.randn(M, N, device="cuda", generator=g)
    cublaslt.matmul(a, b, acc)
    assert rel_err(acc, ref) < 1e-5
    acc += 1.0
    assert rel_err(cublaslt.matmul(a, b, acc, accumulate=True), 2 * ref + 1.0) < 1e-5
    plans = list(cublaslt._PLANS.values())
    assert len(plans) == 3 and all(plan is not None for plan in plans)   # bf16 out, its bias, fp32 out
    assert [plan[5] for plan in plans] == [tune] * 3   # accumulating (beta 1) reuses the fp32 plan untimed
