"""ops.gelu_mlp and GeluMLP: down(gelu_tanh(up(x) + b)) with the GELU inside cuBLASLt's epilogues.

On the CPU the Function runs on cublaslt's torch-op reference (the library is CUDA's), which checks its autograd
wiring: the saved tensors, the gradients' shapes, dtypes and values against float64. The GPU tests run the
fused epilogues themselves against the same float64 and against the unfused chain, eager and in a CUDA graph.
"""
import sys

import pytest
import torch

from tilewise import ops
from tilewise.ops import cublaslt
from tilewise.ops.mlp import GeluMLP

mlp = sys.modules["tilewise.ops.mlp"]


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def make(tokens, d, ff, bias=True, device="cpu", x_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, d, generator=g).to(device, x_dtype)
    w_up = (torch.randn(ff, d, generator=g) / d ** 0.5).to(device)
    b_up = (0.5 * torch.randn(ff, generator=g)).to(device) if bias else None
    w_down = (torch.randn(d, ff, generator=g) / ff ** 0.5).to(device)
    dy = torch.randn(*tokens, d, generator=g).to(device, torch.bfloat16)
    return x, w_up, b_up, w_down, dy


def run(fn, x, w_up, b_up, w_down, dy, mode="triton"):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w_up, b_up, w_down)]
    with ops.use(mode), torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = fn(*leaves)
    y.backward(dy)
    return y, [t.grad if t is not None else None for t in leaves]


def fused(x, w_up, b_up, w_down):
    return GeluMLP.apply(x, w_up, b_up, w_down, torch.bfloat16)


def reference(x, w_up, b_up, w_down, dy):
    """float64 of the operands autocast multiplies (x, the weights and the bias rounded to bf16)."""
    with torch.enable_grad():
        leaves = [t.to(torch.bfloat16).double().requires_grad_() if t is not None else None
                  for t in (x, w_up, b_up, w_down)]
        x64, wu, bu, wd = leaves
        h = x64 @ wu.t() + (bu if bu is not None else 0)
        y = torch.nn.functional.gelu(h, approximate="tanh") @ wd.t()
        y.backward(dy.double())
    return y.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gelu_mlp_function_matches_float64(bias, x_dtype):
    x, w_up, b_up, w_down, dy = make((3, 21), 32, 128, bias, x_dtype=x_dtype)
    y, (dx, dw_up, db_up, dw_down) = run(fused, x, w_up, b_up, w_down, dy)
    y_chain, (dx_chain, *_) = run(ops.gelu_mlp, x, w_up, b_up, w_down, dy)
    y64, (dx64, dw_up64, db_up64, dw_down64) = reference(x, w_up, b_up, w_down, dy)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 21, 32) and dx.dtype == x_dtype and dx.shape == x.shape
    assert "GeluMLP" in type(y.grad_fn).__name__
    tol = 2 * max(rel_err(y_chain, y64), 2 ** -8)   # both round the GELU's input and output to bf16
    assert rel_err(y, y64) <= tol and rel_err(dx, dx64) <= 2 * max(rel_err(dx_chain, dx64), 2 ** -8)
    for grad, param, ref in ((dw_up, w_up, dw_up64), (dw_down, w_down, dw_down64)):
        assert grad.dtype == torch.float32 and grad.shape == param.shape and grad.stride() == param.stride()
        assert rel_err(grad, ref) < 2 ** -7     # dh is bf16; the products themselves are in fp32
    if bias:
        assert db_up.dtype == torch.float32 and db_up.shape == b_up.shape and rel_err(db_up, db_up64) < 2 ** -7


def test_frozen_parameters_get_no_gradient():
    x, w_up, b_up, w_down, dy = make((2, 8), 16, 64)
    w_up_leaf, b_frozen, w_down_frozen = w_up.clone().requires_grad_(), b_up.clone(), w_down.clone()
    x_leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = GeluMLP.apply(x_leaf, w_up_leaf, b_frozen, w_down_frozen, torch.bfloat16)
    y.backward(dy)
    assert b_frozen.grad is None and w_down_frozen.grad is None
    assert w_up_leaf.grad.dtype == torch.float32 and x_leaf.grad.shape == x.shape


def test_no_grad_forward_keeps_no_gelu_input(monkeypatch):
    """Without gradients the forward asks for the GELU alone (no kept input) and gives the same output."""
    x, w_up, b_up, w_down, _ = make((4, 8), 16, 64)
    kept = []
    real = cublaslt.gelu_bias

    def spy(*a, keep_pre=True):
        kept.append(keep_pre)
        return real(*a, keep_pre=keep_pre)
    monkeypatch.setattr(cublaslt, "gelu_bias", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            y0 = GeluMLP.apply(x, w_up, b_up, w_down, torch.bfloat16)
        y1 = GeluMLP.apply(x, w_up.requires_grad_(), b_up, w_down, torch.bfloat16)
    assert kept == [False, True] and torch.equal(y0, y1)


def test_dispatch_takes_the_function_only_where_it_runs(monkeypatch):
    """CUBLASLT_MLP off, the reference mode, a bf16 weight, a width not a multiple of 8, no autocast, or no
    library: the unfused chain (ops.linear's MasterWeightLinear first). On and available: GeluMLP."""
    x, w_up, b_up, w_down, _ = make((2, 8), 16, 64)
    w_up = w_up.requires_grad_()

    def grad_fn(*args, mode="triton", autocast=True):
        with ops.use(mode), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return type(ops.gelu_mlp(*args).grad_fn).__name__

    monkeypatch.setattr(cublaslt, "available", lambda device: True)
    assert "GeluMLP" not in grad_fn(x, w_up, b_up, w_down)
    monkeypatch.setattr(mlp, "CUBLASLT_MLP", True)
    assert "GeluMLP" in grad_fn(x, w_up, b_up, w_down)
    assert "GeluMLP" not in grad_fn(x, w_up, b_up, w_down, mode="reference")
    assert "GeluMLP" not in grad_fn(x.float(), w_up, b_up, w_down, autocast=False)
    assert "GeluMLP" not in grad_fn(x, w_up.detach().to(torch.bfloat16).requires_grad_(), b_up, w_down)
    x12, w_up12, b_up12, w_down12, _ = make((2, 8), 12, 64)
    assert "GeluMLP" not in grad_fn(x12, w_up12.requires_grad_(), b_up12, w_down12)
    monkeypatch.setattr(cublaslt, "available", lambda device: False)
    assert "GeluMLP" not in grad_fn(x, w_up, b_up, w_down)


@pytest.mark.parametrize("shapes, message", [
    (((16,), (64, 12), (64,), (16, 64)), "up_weight"),
    (((16,), (64, 16), (64,), (16, 32)), "down_weight"),
    (((16,), (64, 16), (32,), (16, 64)), "up_bias"),
])
def test_bad_shapes_name_the_argument(shapes, message):
    x, w_up, b_up, w_down = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        ops.gelu_mlp(x, w_up, b_up, w_down)


def test_model_step_is_the_same_with_the_fused_mlp(monkeypatch, tiny_gpt_step):
    """The GPT's loss and gradients with GeluMLP (on cublaslt's reference here) against the unfused chain."""
    def step(on):
        return tiny_gpt_step(mlp, "CUBLASLT_MLP", on, autocast=True)

    loss_chain, grads_chain = step(False)
    monkeypatch.setattr(cublaslt, "available", lambda device: True)
    calls = []
    monkeypatch.setattr(GeluMLP, "forward", staticmethod(lambda *a, _f=GeluMLP.forward: calls.append(1) or _f(*a)))
    loss_fused, grads_fused = step(True)
    assert len(calls) == 2   # one a layer
    assert abs(loss_fused.item() - loss_chain.item()) < 1e-2 * abs(loss_chain.item())
    for name, grad in grads_chain.items():
        assert grads_fused[name].dtype == grad.dtype, name
        assert rel_err(grads_fused[name], grad.double()) < 3e-2, name


# ------------------------------------------------------------------------------------------ on the GPU

GPU_SHAPES = [((4, 1024), 768, 3072), ((2, 2048), 2048, 8192)]   # GPT-2 124M's and the 1.3B preset's MLPs


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, d, ff", GPU_SHAPES, ids=["124m", "1.3b"])
def test_gpu_fused_mlp_matches_float64_and_the_chain(tokens, d, ff, monkeypatch):
    """The epilogues themselves (the reference made to fail, so it cannot stand in) against float64, as
    close as the unfused chain is."""
    x, w_up, b_up, w_down, dy = make(tokens, d, ff, device="cuda", seed=1)
    y_chain, (dx_c, dwu_c, dbu_c, dwd_c) = run(ops.gelu_mlp, x, w_up, b_up, w_down, dy)
    for name in ("gelu_bias_reference", "dgelu_reference", "wgrad_reference"):
        monkeypatch.setattr(cublaslt, name, lambda *a, _n=name: pytest.fail(f"{_n} ran"))
    y, (dx, dwu, dbu, dwd) = run(fused, x, w_up, b_up, w_down, dy)
    y64, (dx64, dwu64, dbu64, dwd64) = reference(x, w_up, b_up, w_down, dy)
    for got, chain, ref in ((y, y_chain, y64), (dx, dx_c, dx64), (dwu, dwu_c, dwu64), (dbu, dbu_c, dbu64),
                            (dwd, dwd_c, dwd64)):
        assert rel_err(got, ref) <= 1.25 * rel_err(chain, ref) + 1e-4
    assert dwu.dtype == dbu.dtype == dwd.dtype == torch.float32


@pytest.mark.gpu
def test_gpu_fused_mlp_in_a_cuda_graph(monkeypatch):
    """Captured forward + backward replayed on new inputs: the eager results, bitwise."""
    x, w_up, b_up, w_down, dy = make((4, 256), 768, 3072, device="cuda", seed=2)
    params = [t.clone().requires_grad_() for t in (w_up, b_up, w_down)]
    static_x, static_dy = x.clone().requires_grad_(), dy.clone()

    def step():
        for p in params:
            p.grad = None
        static_x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = GeluMLP.apply(static_x, *params[:2], params[2], torch.bfloat16)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    x2, *_, dy2 = make((4, 256), 768, 3072, device="cuda", seed=3)
    with torch.no_grad():
        static_x.copy_(x2)
    static_dy.copy_(dy2)
    graph.replay()
    got = [y_static.clone(), static_x.grad.clone()] + [p.grad.clone() for p in params]
    eager = step()
    want = [eager, static_x.grad] + [p.grad for p in params]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
