"""ops.linear: under autocast with an fp32 weight, MasterWeightLinear against F.linear under autocast and a
float64 reference of the same (autocast-rounded) operands.

y and dx round to the autocast dtype as F.linear's do; dW and db are fp32 in the parameters' layout, and
since they are never rounded to bf16 they sit far closer to the float64 reference than F.linear's.
"""
import pytest
import torch
import torch.nn.functional as F

from tilewise import ops
from tilewise.ops.linear import MasterWeightLinear


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


def make(shape_x, out_features, bias=True, device="cpu", x_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape_x, generator=g).to(device, x_dtype)
    w = (torch.randn(out_features, shape_x[-1], generator=g) / shape_x[-1] ** 0.5).to(device)
    b = torch.randn(out_features, generator=g).to(device) if bias else None
    dy = torch.randn(*shape_x[:-1], out_features, generator=g).to(device, torch.bfloat16)
    return x, w, b, dy


def run(fn, x, w, b, dy, mode="triton"):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    with ops.use(mode), torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = fn(*leaves)
    y.backward(dy)
    return y, [t.grad if t is not None else None for t in leaves]


def reference(x, w, b, dy):
    """float64 of the operands autocast multiplies (x, w, b rounded to bf16): y, dx, dW, db."""
    x64, w64 = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
    dy64 = dy.double().reshape(-1, dy.shape[-1])
    y = x64 @ w64.t() + (b.to(torch.bfloat16).double() if b is not None else 0)
    dx = (dy64 @ w64).view(x.shape)
    dw = dy64.t() @ x64.reshape(-1, x.shape[-1])
    return y, dx, dw, (dy64.sum(0) if b is not None else None)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_master_weight_linear_matches_autocast_and_float64(bias, x_dtype):
    x, w, b, dy = make((3, 37, 96), 80, bias, x_dtype=x_dtype)
    y, (dx, dw, db) = run(ops.linear, x, w, b, dy)
    assert y.grad_fn is not None and "MasterWeightLinear" in type(y.grad_fn).__name__
    y_ref, (dx_ref, dw_ref, db_ref) = run(F.linear, x, w, b, dy, mode="reference")
    y64, dx64, dw64, db64 = reference(x, w, b, dy)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and dx.dtype == x_dtype and dx.shape == x.shape
    assert rel_err(y, y64) <= 2 * max(rel_err(y_ref, y64), 2 ** -9)
    assert rel_err(dx, dx64) <= 2 * max(rel_err(dx_ref, dx64), 2 ** -9)
    # the weight's gradient: fp32, the weight's layout, and not rounded to bf16 on the way (autocast's is)
    assert dw.dtype == torch.float32 and dw.shape == w.shape and dw.stride() == w.stride()
    assert rel_err(dw, dw64) < 1e-5 < rel_err(dw_ref, dw64)
    if bias:
        assert db.dtype == torch.float32 and rel_err(db, db64) < 1e-5


def test_only_fp32_weights_under_autocast_take_the_function():
    """Without autocast, in reference mode, with a bf16 weight or without grad: plain F.linear."""
    x, w, b, _ = make((5, 16), 8)
    w_leaf = w.clone().requires_grad_()
    with ops.use("triton"):
        assert ops.linear(x.float(), w_leaf, b).grad_fn.name() != "MasterWeightLinearBackward"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert "MasterWeightLinear" in type(ops.linear(x, w_leaf, b).grad_fn).__name__
            bf16_w = w.to(torch.bfloat16).requires_grad_()
            assert "MasterWeightLinear" not in type(ops.linear(x, bf16_w).grad_fn).__name__
            with torch.no_grad():
                assert ops.linear(x, w_leaf, b).grad_fn is None
    with ops.use("reference"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert "MasterWeightLinear" not in type(ops.linear(x, w_leaf, b).grad_fn).__name__


@pytest.mark.parametrize("shape_x", [(0, 16), (16,), (2, 0, 16)], ids=["no rows", "1-D", "empty batch"])
def test_empty_and_1d_inputs(shape_x):
    """F.linear's shapes: no rows (gradients of zeros), a 1-D input."""
    x, w, b, dy = make(shape_x, 8)
    y, (dx, dw, db) = run(ops.linear, x, w, b, dy)
    y_ref, (dx_ref, dw_ref, db_ref) = run(F.linear, x, w, b, dy, mode="reference")
    assert y.shape == y_ref.shape and dx.shape == x.shape and dw.dtype == db.dtype == torch.float32
    assert torch.allclose(dw, dw_ref, atol=1e-2) and torch.allclose(db, db_ref.float(), atol=1e-2)


def test_frozen_weight_and_input_without_grad():
    """needs_input_grad: a frozen weight gets no gradient, an input that needs none gets none."""
    x, w, b, dy = make((4, 9, 32), 24)
    w_frozen, b_leaf = w.clone(), b.clone().requires_grad_()
    x_leaf = x.clone().requires_grad_()
    with ops.use("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = MasterWeightLinear.apply(x_leaf, w_frozen, b_leaf, torch.bfloat16)
    y.backward(dy)
    assert w_frozen.grad is None and x_leaf.grad is not None and b_leaf.grad.dtype == torch.float32


@pytest.mark.gpu
def test_gpu_master_weight_linear_at_a_real_size():
    """The cuBLAS fp32-output GEMM (torch.mm with out_dtype) on the 1.3B model's qkv shape, against autocast's
    F.linear and float64."""
    x, w, b, dy = make((2, 2048, 2048), 6144, device="cuda", seed=3)
    y, (dx, dw, db) = run(ops.linear, x, w, b, dy)
    y_ref, (dx_ref, dw_ref, _) = run(F.linear, x, w, b, dy, mode="reference")
    y64, dx64, dw64, db64 = reference(x, w, b, dy)
    assert rel_err(y, y64) <= 2 * max(rel_err(y_ref, y64), 2 ** -9)
    assert rel_err(dx, dx64) <= 2 * max(rel_err(dx_ref, dx64), 2 ** -9)
    assert dw.dtype == torch.float32 and dw.stride() == w.stride()
    assert rel_err(dw, dw64) < 1e-4 < rel_err(dw_ref, dw64)
    assert rel_err(db, db64) < 1e-4


def test_torch_compile_fullgraph_matches_eager():
    """torch.compile traces MasterWeightLinear whole (the bias gradient by torch's sum while compiling;
    aot_eager keeps the CPU free of codegen): the same gradients as the eager Function."""
    x, w, b, dy = make((2, 7, 32), 16)
    with ops.use("triton"):
        compiled = torch.compile(lambda *a: ops.linear(*a), backend="aot_eager", fullgraph=True)
        y, (dx, dw, db) = run(compiled, x, w, b, dy)
        y_ref, (dx_ref, dw_ref, db_ref) = run(ops.linear, x, w, b, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)
    assert dw.dtype == db.dtype == torch.float32 and torch.allclose(db, db_ref, rtol=1e-5, atol=1e-6)


def test_kept_low_weight_is_rewritten_by_adamw_and_dropped_when_stale(monkeypatch):
    """With KEEP_LOW_WEIGHTS: from the second step on the forward uses the bf16 copy AdamW wrote beside its
    update (bitwise the cast of the updated weight, as a fresh cast would be); an in-place change of the
    weight outside the optimizer makes the forward cast afresh; with the switch off nothing is kept."""
    import sys

    from tilewise.ops.adamw import AdamW
    lin = sys.modules["tilewise.ops.linear"]   # tilewise.ops.linear is also the function's name

    def train(keep, steps):
        monkeypatch.setattr(lin, "KEEP_LOW_WEIGHTS", keep)
        g = torch.Generator().manual_seed(5)
        w = torch.nn.Parameter(torch.randn(24, 40, generator=g) / 40 ** 0.5)
        opt = AdamW([w], lr=1e-2)
        opt.min_numel = 0
        ys = []
        for _ in range(steps):
            x = torch.randn(8, 40, generator=g, dtype=torch.bfloat16)
            with ops.use("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
                y = ops.linear(x, w)
            ys.append((x, y.detach()))
            y.float().square().sum().backward()
            opt.step()
            opt.zero_grad()
        return w, ys

    w, ys = train(True, 4)
    kept = w._tilewise_low[0]
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, w.detach().to(torch.bfloat16))
    assert lin.low_weight(w, torch.bfloat16) is kept   # what the next forward multiplies by
    w_off, ys_off = train(False, 4)
    assert getattr(w_off, "_tilewise_low", None) is None
    for (_, y), (_, y_off) in zip(ys, ys_off):   # same numbers with and without the kept copy
        assert torch.equal(y, y_off)
    monkeypatch.setattr(lin, "KEEP_LOW_WEIGHTS", True)
    with torch.no_grad():
        w.mul_(2)                                  # not through the optimizer: the copy is stale
    x = ys[-1][0]
    with ops.use("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.linear(x, w)
    assert torch.equal(y, F.linear(x, w.detach().to(torch.bfloat16)))
    assert w._tilewise_low[0] is not kept           # and the fresh cast is kept in its place


def test_gemms_routed_through_cublaslt(monkeypatch):
    """cublaslt.GEMMS on (its torch-op fallback on the CPU): the same y, dx, dW and db, the bias gradient from
    cublaslt.wgrad (never column_sums), and a frozen weight's bias gradient by a sum."""
    import sys
    lin = sys.modules["tilewise.ops.linear"]
    from tilewise.ops import cublaslt
    x, w, b, dy = make((3, 37, 96), 80)
    y_ref, (dx_ref, dw_ref, db_ref) = run(ops.linear, x, w, b, dy)
    monkeypatch.setattr(cublaslt, "GEMMS", True)
    monkeypatch.setattr(cublaslt, "available", lambda device: True)
    taken = []
    monkeypatch.setattr(cublaslt, "matmul", lambda *a, _m=cublaslt.matmul, **k: taken.append("mm") or _m(*a, **k))
    monkeypatch.setattr(cublaslt, "wgrad", lambda *a, _w=cublaslt.wgrad, **k: taken.append(k) or _w(*a, **k))
    monkeypatch.setattr(lin, "column_sums", lambda *a: pytest.fail("column_sums ran"))
    y, (dx, dw, db) = run(ops.linear, x, w, b, dy)
    assert taken == ["mm", "mm", {"bias_grad": True}]
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref) and dw.dtype == db.dtype == torch.float32
    assert torch.allclose(dw, dw_ref, rtol=1e-5, atol=1e-5) and torch.allclose(db, db_ref, rtol=1e-5, atol=1e-5)
    assert dw.stride() == w.stride()
    b_leaf, x_leaf = b.clone().requires_grad_(), x.clone().requires_grad_()
    with ops.use("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        MasterWeightLinear.apply(x_leaf, w, b_leaf, torch.bfloat16).backward(dy)
    assert torch.allclose(b_leaf.grad, db_ref, rtol=1e-5, atol=1e-5) and w.grad is None


@pytest.mark.gpu
def test_gpu_gemms_routed_through_cublaslt(monkeypatch):
    """The same on the GPU at the 1.3B qkv shape with cuBLASLt itself (the fallbacks made to fail), tuned and
    not: y and dx as F.linear's within bf16 rounding, dW and db against float64."""
    from tilewise.ops import cublaslt
    monkeypatch.setattr(cublaslt, "GEMMS", True)
    monkeypatch.setattr(cublaslt, "wgrad_reference", lambda *a: pytest.fail("the reference ran"))
    x, w, b, dy = make((2, 2048, 2048), 6144, device="cuda", seed=4)
    y64, dx64, dw64, db64 = reference(x, w, b, dy)
    y_ref, (dx_ref, _, _) = run(F.linear, x, w, b, dy, mode="reference")
    for tune in (False, True):
        monkeypatch.setattr(cublaslt, "TUNE", tune)
        planned = len(cublaslt._PLANS)
        y, (dx, dw, db) = run(ops.linear, x, w, b, dy)
        assert tune or len(cublaslt._PLANS) >= planned + 3   # forward, data and weight gradients planned
        assert all(plan is not None and plan[5] == tune for plan in list(cublaslt._PLANS.values())[-3:])
        assert rel_err(y, y64) <= 1.5 * max(rel_err(y_ref, y64), 2 ** -9)
        assert rel_err(dx, dx64) <= 1.5 * max(rel_err(dx_ref, dx64), 2 ** -9)
        assert dw.dtype == db.dtype == torch.float32 and rel_err(dw, dw64) < 1e-4 and rel_err(db, db64) < 1e-4
