"""bias_gelu and swiglu: the Triton kernels (the interpreter on CPU) against float64 references.

Tolerances as in test_norm.py, whose helpers this file imports (pytest puts this folder on sys.path):
fp32 below 1e-5 relative error norm, bf16/fp16 at most 2x the PyTorch op's error in the same dtype; the
launchers' torch.empty is NaN-filled.
"""
import pytest
import torch

from tilewise import ops
from tilewise.ops import activation, launch
from tilewise.ops.activation import bias_gelu, bias_gelu_reference, swiglu, swiglu_reference

from test_norm import DEVICE, DTYPES, nan_empty, odd_view, rel_err, tolerance  # noqa: F401  (nan_empty: autouse)


def compare(kernel, reference, inputs, dy_shape, dy_dtype):
    """Outputs and input gradients of kernel vs reference, in the inputs' dtypes and in float64."""
    g = torch.Generator().manual_seed(5)
    dy = torch.randn(dy_shape, generator=g).to(inputs[0].device, dy_dtype)

    def run(fn, ts, dy):
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in ts]
        y = fn(*leaves)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves if t is not None]

    with ops.use("triton"):
        got = run(kernel, inputs, dy)
    same = run(reference, inputs, dy)
    ref = run(reference, [None if t is None else t.double() for t in inputs], dy.double())
    for name, a, t, r in zip(["y", "dx", "dbias"], got, same, ref):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err, tol = rel_err(a, r), tolerance(a, t, r)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def gelu_inputs(rows, width, dtype, bias=True, bias_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, width, generator=g)).to(DEVICE, dtype)
    b = torch.randn(width, generator=g).to(DEVICE, bias_dtype or dtype) if bias else None
    return x, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 100, 1000, 3000])
@pytest.mark.parametrize("bias", [True, False])
def test_bias_gelu_matches_float64(dtype, width, bias):
    rows = 37 if width < 3000 else 9
    x, b = gelu_inputs(rows, width, dtype, bias, seed=width)
    y_dtype = dtype
    compare(bias_gelu, bias_gelu_reference, [x, b], x.shape, y_dtype)


def test_bias_gelu_fp32_bias_bf16_x_and_leading_dims():
    """An fp32 bias does not promote a bf16 activation (the model's fp32 master bias under autocast): y and dx
    stay bf16, dbias is fp32."""
    x, b = gelu_inputs(2 * 5 * 7, 64, torch.bfloat16, bias_dtype=torch.float32)
    x = x.view(2, 5, 7, 64)
    compare(bias_gelu, bias_gelu_reference, [x, b], x.shape, torch.bfloat16)


def test_bias_gelu_backward_persistent_programs_cover_every_row():
    """More row tiles than programs: the dbias partial sums must include every tile exactly once."""
    x, b = gelu_inputs(300, 40, torch.float32)   # tiles of 16 rows: 19 tiles over 3 programs
    assert activation._bias_gelu_bwd_tile(40)[0] == 16
    compare(bias_gelu, bias_gelu_reference, [x, b], x.shape, torch.float32)
    x, b = gelu_inputs(7, 2500, torch.float32)   # three column blocks (of 1024), 7 one-row tiles
    compare(bias_gelu, bias_gelu_reference, [x, b], x.shape, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("half", [1, 100, 1000, 3000])
def test_swiglu_matches_float64(dtype, half):
    rows = 37 if half < 3000 else 9
    g = torch.Generator().manual_seed(half)
    gu = (2 * torch.randn(rows, 2 * half, generator=g)).to(DEVICE, dtype)
    compare(swiglu, swiglu_reference, [gu], (rows, half), dtype)


def test_swiglu_leading_dims_and_halves():
    """gate is the first half, up the second: swapping them must change the result."""
    gu = torch.randn(3, 4, 2 * 48, device=DEVICE)
    compare(swiglu, swiglu_reference, [gu], (3, 4, 48), torch.float32)
    with ops.use("triton"):
        y = swiglu(gu)
    gate, up = gu[..., :48], gu[..., 48:]
    assert torch.allclose(y, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y, torch.nn.functional.silu(up) * gate, rtol=1e-2)


@pytest.mark.parametrize("op", ["bias_gelu", "swiglu"])
def test_strided_inputs_and_gradients(op):
    """Contiguous inputs go to the kernels as they are, strided ones as 2-D copies: a 3-D slice of a wider
    tensor and a strided output gradient give what the contiguous copies give."""
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(3, 5, 2 * 64, generator=g).to(DEVICE)
    x = wide[..., :64]                                             # not contiguous
    dy_full = torch.randn(3, 5, 64 if op == "bias_gelu" else 64, 2, generator=g).to(DEVICE)
    dy = dy_full[..., 0] if op == "bias_gelu" else dy_full[..., :32, 0]
    b = torch.randn(64, generator=g).to(DEVICE) if op == "bias_gelu" else None
    fn = (lambda t: bias_gelu(t, b)) if op == "bias_gelu" else swiglu
    assert not x.is_contiguous() and not dy.is_contiguous()
    results = []
    for inp, grad in ((x, dy), (x.contiguous(), dy.contiguous())):
        leaf = inp.detach().requires_grad_()
        with ops.use("triton"):
            y = fn(leaf)
        y.backward(grad)
        results.append((y.detach(), leaf.grad))
    for a, c in zip(*results):
        assert a.shape == c.shape and torch.equal(a, c)


def test_empty_rows():
    with ops.use("triton"):
        x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
        b = torch.randn(16, device=DEVICE, requires_grad=True)
        bias_gelu(x, b).sum().backward()
        assert torch.equal(b.grad, torch.zeros_like(b))
        gu = torch.randn(0, 32, device=DEVICE, requires_grad=True)
        assert swiglu(gu).shape == (0, 16)


def test_bad_inputs_raise():
    x = torch.randn(4, 10, device=DEVICE)
    with pytest.raises(ValueError, match="bias shape"):
        bias_gelu(x, torch.randn(9, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        bias_gelu(x.long())
    with pytest.raises(TypeError, match="torch.Tensor"):
        bias_gelu(x.cpu().numpy())
    with pytest.raises(ValueError, match="meta"):
        bias_gelu(x, torch.randn(10, device="meta"))
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        swiglu(torch.ones(4, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="0-dim"):
        swiglu(torch.tensor(1.0))


def test_custom_ops_pass_opcheck():
    x, b = gelu_inputs(6, 40, torch.float32)
    torch.library.opcheck(torch.ops.tilewise.bias_gelu_fwd.default, (x, b, torch.float32))
    torch.library.opcheck(torch.ops.tilewise.bias_gelu_bwd.default, (torch.randn_like(x), x, b))
    torch.library.opcheck(torch.ops.tilewise.bias_gelu_bwd.default, (torch.randn_like(x), x, None))
    torch.library.opcheck(torch.ops.tilewise.swiglu_fwd.default, (x,))
    torch.library.opcheck(torch.ops.tilewise.swiglu_bwd.default, (torch.randn(6, 20, device=DEVICE), x))
    x3 = x.view(2, 3, 40)    # leading dims go to the kernels as they are
    torch.library.opcheck(torch.ops.tilewise.bias_gelu_fwd.default, (x3, b, torch.float32))
    torch.library.opcheck(torch.ops.tilewise.swiglu_fwd.default, (x3,))
    torch.library.opcheck(torch.ops.tilewise.swiglu_bwd.default, (torch.randn(2, 3, 20, device=DEVICE), x3))


def test_torch_compile_keeps_one_graph():
    x, b = gelu_inputs(6, 48, torch.float32)

    def f(x, b):
        return swiglu(bias_gelu(x, b)).pow(2).sum()

    leaves = [x.clone().requires_grad_(), b.clone().requires_grad_()]
    compiled = [x.clone().requires_grad_(), b.clone().requires_grad_()]
    with ops.use("triton"):
        f(*leaves).backward()
        torch.compile(f, backend="aot_eager", fullgraph=True)(*compiled).backward()
    for a, c in zip(leaves, compiled):
        assert torch.equal(a.grad, c.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_benchmark_sizes(dtype, device):
    x, b = gelu_inputs(16384, 3072, dtype)
    compare(bias_gelu, bias_gelu_reference, [x, b], x.shape, dtype)
    gu = torch.randn(16384, 2 * 8192, device=device, dtype=dtype)
    compare(swiglu, swiglu_reference, [gu], (16384, 8192), dtype)


@pytest.mark.gpu
def test_gpu_fast_launch_matches_normal_launch_bitwise(device):
    """bias_gelu and swiglu at the benchmark's sizes: bit for bit the same through Triton's launch and the
    direct one, and the direct one is taken; inputs at an odd element offset are still right."""
    x, b = gelu_inputs(16384, 3072, torch.bfloat16)
    gu = torch.randn(16384, 2 * 8192, device=device, dtype=torch.bfloat16)
    dy_gelu = torch.randn_like(x)
    dy_swiglu = torch.randn(16384, 8192, device=device, dtype=torch.bfloat16)

    def run_once():
        leaves = [t.detach().clone().requires_grad_() for t in (x, b, gu)]
        y1 = bias_gelu(leaves[0], leaves[1])
        y1.backward(dy_gelu)
        y2 = swiglu(leaves[2])
        y2.backward(dy_swiglu)
        return [y1, y2] + [t.grad for t in leaves]

    launchers = [activation._bias_gelu_fwd_launch, activation._bias_gelu_bwd_launch, activation._swiglu_fwd_launch,
                 activation._swiglu_bwd_launch]
    with launch.normal_launches():
        expected = run_once()
    run_once()
    fast = [lc.fast_launches for lc in launchers]
    got = run_once()
    assert all(lc.fast_launches == f + 1 for lc, f in zip(launchers, fast))
    for name, a, e in zip(["gelu y", "swiglu y", "dx", "dbias", "dgate_up"], got, expected):
        assert torch.equal(a, e), name
    for fn, ref_fn, inputs, dy in ((bias_gelu, bias_gelu_reference, [x[:512], b], dy_gelu[:512]),
                                   (swiglu, swiglu_reference, [gu[:512]], dy_swiglu[:512])):
        odd = [odd_view(inputs[0]).requires_grad_()] + [t.detach().clone().requires_grad_() for t in inputs[1:]]
        assert odd[0].data_ptr() % 16
        y = fn(*odd)
        y.backward(odd_view(dy))
        same = [t.detach().clone().requires_grad_() for t in inputs]
        y_same = ref_fn(*same)
        y_same.backward(dy)
        ref = [t.detach().double().requires_grad_() for t in inputs]
        y_ref = ref_fn(*ref)
        y_ref.backward(dy.double())
        for a, t, r in zip([y] + [t.grad for t in odd], [y_same] + [t.grad for t in same],
                           [y_ref] + [t.grad for t in ref]):
            assert rel_err(a, r) <= tolerance(a, t, r)
