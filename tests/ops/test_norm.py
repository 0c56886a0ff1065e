"""add_dropout_norm: the Triton kernels (the interpreter on CPU) against float64 references.

Tolerances (shared/BENCH.md): fp32 below 1e-5 relative error norm; bf16/fp16 at most 2x the error of the
PyTorch reference run in the same dtype, against the same float64 reference. Every torch.empty in the
kernels' launchers is NaN-filled here, so an element a kernel leaves unwritten fails.

Two refinements. fp32 gets max(1e-5, 2x PyTorch's fp32 error), which only matters for ill-conditioned
rows (a mean far from zero). And for the interpreter only: Triton's interpreter (3.9) converts fp32 to bf16
by truncation where the GPU rounds to nearest even, so there bf16 results may also reach 2x the error of
truncating the float64 result itself (for values next to a bf16 number, truncation costs a whole ulp where
rounding costs nothing). The gpu-marked tests hold bf16 to plain 2x.
"""
import gc
import json
import math
import os
import weakref

import pytest
import torch

from tilewise import ops
from tilewise.ops import launch, native, norm
from tilewise.ops.norm import Config, add_dropout_norm, add_dropout_norm_reference, keep_mask

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"      # as conftest's device fixture: kernels need it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def truncated_bf16(t):
    """float64 -> bf16 by truncation of the fp32 bits, as the interpreter converts."""
    bits = t.float().view(torch.int32) & -65536
    return bits.view(torch.float32)


def tolerance(got, same_dtype, ref):
    """The allowed relative error of `got` given the PyTorch op's result in the same dtype."""
    torch_err = rel_err(same_dtype, ref)
    if got.dtype == torch.float32 and same_dtype.dtype == torch.float32:
        return max(1e-5, 2 * torch_err)
    tol = max(2 * torch_err, 1e-6)
    if INTERPRETED and got.dtype == torch.bfloat16:
        tol = max(tol, 2 * rel_err(truncated_bf16(ref), ref))
    return tol


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled (floats) or -1-filled (ints) tensors during the test."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def rel_err(got, ref):
    """Relative error norm in float64; absolute where the reference is (round-off away from) zero, as
    dweight of a width-1 LayerNorm is. NaN stays NaN."""
    got, ref = got.double(), ref.double()
    den = ref.norm().item()
    num = (got - ref).norm().item()
    return num / den if den > 1e-8 else num


def run(fn, inputs, grads):
    """fn(*inputs) -> (y, h); backward with the given (dy, dh). Returns y, h and the inputs' grads."""
    y, h = fn(*inputs)
    torch.autograd.backward([y, h], [g for g in grads])
    out = [y.detach(), h.detach()] + [t.grad for t in inputs if t is not None]
    for t in inputs:
        if t is not None:
            t.grad = None
    return out


def leaf(t, dtype=None):
    return None if t is None else t.detach().to(dtype or t.dtype).requires_grad_()


def make(rows, width, dtype, *, residual=True, bias=True, res_dtype=None, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g).to(device, dtype)
    r = torch.randn(rows, width, generator=g).to(device, res_dtype or dtype) if residual else None
    w = (1 + 0.2 * torch.randn(width, generator=g)).to(device, dtype)
    b = (0.2 * torch.randn(width, generator=g)).to(device, dtype) if bias else None
    return x, r, w, b


def check_against_float64(x, r, w, b, *, kind, residual_dtype=None, dropout_p=0.0, seed=None, mask=None,
                          kernel=None, grads=None, xb=None):
    """Runs the kernel and the reference (same dtypes, and float64) and compares outputs and gradients;
    grads: the (dy, dh) to use instead of fresh ones; xb: an x_bias (its gradient is compared last)."""
    h_dtype = residual_dtype or (r.dtype if r is not None else x.dtype)
    y_shape = x.shape
    g = torch.Generator().manual_seed(123)
    dy = torch.randn(y_shape, generator=g).to(x.device, x.dtype)
    dh = torch.randn(y_shape, generator=g).to(x.device, h_dtype)
    if grads is not None:
        dy, dh = grads

    def kernel_fn(x, r, w, b, xb=None):
        with ops.use("triton"):
            return add_dropout_norm(x, r, w, b, x_bias=xb, kind=kind, residual_dtype=residual_dtype,
                                    dropout_p=dropout_p, seed=seed)

    def ref_fn(x, r, w, b, xb=None):
        return add_dropout_norm_reference(x, r, w, b, x_bias=xb, kind=kind, residual_dtype=residual_dtype,
                                          dropout_p=dropout_p, keep_mask=mask)

    tensors = (x, r, w, b) + ((xb,) if xb is not None else ())
    inputs = [leaf(t) for t in tensors]
    got = run(kernel or kernel_fn, inputs, (dy, dh))
    names = ["y", "h", "dx"] + (["dresidual"] if r is not None else []) + ["dweight"]
    names += ["dbias"] if b is not None else []
    names += ["dx_bias"] if xb is not None else []
    assert len(got) == len(names)
    ref64 = run(ref_fn, [leaf(t, torch.float64) for t in tensors], (dy.double(), dh.double()))
    same = run(ref_fn, inputs, (dy, dh))
    assert got[0].dtype == x.dtype and got[1].dtype == h_dtype
    for name, a, ref, t in zip(names, got, ref64, same):
        assert a.shape == ref.shape, name
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err, tol = rel_err(a, ref), tolerance(a, t, ref)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    return got


@pytest.mark.parametrize("kind", norm.NORM_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 100, 1000, 5000])
@pytest.mark.parametrize("residual,bias", [(True, True), (True, False), (False, True), (False, False)])
def test_matches_float64(kind, dtype, width, residual, bias):
    rows = 13 if width < 5000 else 5
    x, r, w, b = make(rows, width, dtype, residual=residual, bias=bias, seed=width)
    check_against_float64(x, r, w, b, kind=kind)


@pytest.mark.parametrize("kind", norm.NORM_KINDS)
@pytest.mark.parametrize("rows", [1, 2, 40])
def test_row_counts_and_leading_dims(kind, rows):
    """(rows, 3, 96) inputs; fp32 weight and bias with bf16 activations, as in mixed-precision training."""
    x, r, w, b = make(rows * 3, 96, torch.bfloat16)
    check_against_float64(x.view(rows, 3, 96), r.view(rows, 3, 96), w.float(), b.float(), kind=kind)


@pytest.mark.parametrize("layout", ["strided_3d", "strided_rows", "mixed"])
def test_strided_inputs(layout):
    """Contiguous inputs go to the kernels as they are (no reshape); strided ones are copied to rows. x and the
    residual in different layouts, a 3-D slice of a wider tensor, 2-D rows at a stride over their width."""
    x, r, w, b = make(24, 64, torch.bfloat16)
    if layout == "strided_3d":      # every other column block of a (4, 6, 128) tensor: not contiguous
        x = torch.cat([x.view(4, 6, 64), torch.zeros(4, 6, 64, dtype=x.dtype)], -1)[..., :64]
        r = r.view(4, 6, 64)
    elif layout == "strided_rows":  # rows 64 wide at a stride of 80
        x = torch.cat([x, torch.zeros(24, 16, dtype=x.dtype)], -1)[:, :64]
    else:                           # contiguous 3-D x, strided 3-D residual
        x = x.view(4, 6, 64)
        r = torch.cat([r.view(4, 6, 64), torch.zeros(4, 6, 64, dtype=r.dtype)], -1)[..., :64]
    assert not (x.is_contiguous() and r.is_contiguous())
    got = check_against_float64(x, r, w, b, kind="layernorm")
    assert got[0].shape == x.shape and got[2].shape == x.shape


@pytest.mark.parametrize("kind", norm.NORM_KINDS)
@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32], ids=str)
def test_fp32_residual_stream_with_bf16_x(kind, stored):
    """residual_dtype=fp32: h in fp32 while x and y are bf16; the residual may come in either dtype."""
    x, r, w, b = make(11, 300, torch.bfloat16, res_dtype=stored)
    got = check_against_float64(x, r, w, b, kind=kind, residual_dtype=torch.float32)
    assert got[1].dtype == torch.float32 and got[0].dtype == torch.bfloat16
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == stored     # dx, dresidual


def test_wide_rows_take_the_chunked_path():
    """Width over the in-register limits: forward by chunks, backward with split columns."""
    assert norm.forward_config(20000).chunked and norm.backward_config(20000).chunked
    for kind in norm.NORM_KINDS:
        x, r, w, b = make(3, 20000, torch.float32, seed=5)
        check_against_float64(x, r, w, b, kind=kind)


@pytest.mark.parametrize("kind", norm.NORM_KINDS)
@pytest.mark.parametrize("width", [1, 130, 520])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_chunked_kernels_at_small_widths(kind, width, dropout_p):
    """The chunked forward and split backward, forced with 64-wide chunks (a partial last chunk), against
    the reference; Chan's merge of chunk statistics keeps a large mean from swamping the variance."""
    x, r, w, b = make(6, width, torch.float32, seed=width)
    x = x + 300.0                                    # a mean far from zero
    cfg = Config(1, 64, 2, chunked=True)
    seed = 77
    mask = keep_mask(6, width, dropout_p, seed, DEVICE) if dropout_p else None

    def kernel(x, r, w, b):
        return _ChunkedForTest.apply(x, r, w, b, kind == "rmsnorm", dropout_p, seed, cfg)

    check_against_float64(x, r, w, b, kind=kind, dropout_p=dropout_p, mask=mask, kernel=kernel)


class _ChunkedForTest(torch.autograd.Function):
    """The launchers with an explicit Config (the public op picks its own from the width)."""

    @staticmethod
    def forward(ctx, x, r, w, b, is_rms, p, seed, cfg, xb=None):
        y, h, stats = norm._forward(x, r, w, b, is_rms, 1e-5, p, seed, r.dtype, cfg, x_bias=xb)
        ctx.save_for_backward(h, w, stats)
        ctx.args = (is_rms, p, seed, x.dtype, r.dtype, b.dtype, cfg, None if xb is None else xb.dtype)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, w, stats = ctx.saved_tensors
        is_rms, p, seed, x_dtype, r_dtype, b_dtype, cfg, xb_dtype = ctx.args
        dx, dr, dw, db, dxb = norm._backward(dy, dh, h, w, stats, is_rms, p, seed, x_dtype, r_dtype, b_dtype,
                                             cfg=cfg, xb_dtype=xb_dtype)
        return dx, (dx if dr is None else dr), dw, db, None, None, None, None, dxb


@pytest.mark.parametrize("cfg", [Config(1, 128, 4), Config(4, 128, 4), Config(8, 128, 2, num_stages=1)], ids=str)
def test_tile_shapes_agree(cfg):
    """Several rows a tile and a persistent loop over tiles give the reference's result."""
    x, r, w, b = make(37, 100, torch.float32, seed=9)

    def kernel(x, r, w, b):
        return _ChunkedForTest.apply(x, r, w, b, False, 0.1, 4, cfg)

    check_against_float64(x, r, w, b, kind="layernorm", dropout_p=0.1, mask=keep_mask(37, 100, 0.1, 4, DEVICE),
                          kernel=kernel)


def _x_bias(width, dtype, seed=4):
    return (0.5 * torch.randn(width, generator=torch.Generator().manual_seed(seed))).to(DEVICE, dtype)


@pytest.mark.parametrize("kind", norm.NORM_KINDS)
@pytest.mark.parametrize("dtype,xb_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                            (torch.float16, torch.float16)], ids=str)
@pytest.mark.parametrize("residual,bias", [(True, True), (True, False), (False, False)])
def test_x_bias_matches_float64(kind, dtype, xb_dtype, residual, bias):
    """x_bias (the bias of the linear layer that made x) added before the norm; its gradient, the column sums
    of dx, comes out of the backward's partial sums as their second section (no norm bias) or third."""
    x, r, w, b = make(13, 300, dtype, residual=residual, bias=bias, seed=3)
    got = check_against_float64(x, r, w, b, kind=kind, xb=_x_bias(300, xb_dtype))
    assert got[-1].dtype == xb_dtype and got[-1].shape == (300,)


@pytest.mark.parametrize("kind", norm.NORM_KINDS)
@pytest.mark.parametrize("chunked", [False, True])
def test_x_bias_goes_under_the_dropout(kind, chunked):
    """h = residual + dropout(x + x_bias), in the row-tile kernels and in the chunked forward and split
    backward (forced with 64-wide chunks at width 130); dx_bias sums the dropped, rescaled dx."""
    rows, width, p, seed = 9, 130, 0.3, 21
    x, r, w, b = make(rows, width, torch.float32, seed=6)
    mask = keep_mask(rows, width, p, seed, DEVICE)
    kernel = None
    if chunked:
        def kernel(x, r, w, b, xb):
            return _ChunkedForTest.apply(x, r, w, b, kind == "rmsnorm", p, seed, Config(1, 64, 2, chunked=True), xb)
    check_against_float64(x, r, w, b, kind=kind, dropout_p=p, seed=seed, mask=mask, kernel=kernel,
                          xb=_x_bias(width, torch.float32))


def test_launch_configs():
    """Chunks beyond 8192-wide rows (the table may choose them for narrower rows too); otherwise whole rows
    in a power-of-two tile that covers the width, 1 to 64 elements a thread, warps a power of two up to 32,
    a pipelined loop."""
    for width in [1, 7, 16, 100, 768, 1000, 1024, 2048, 3000, 4096, 5000, 8192, 8193, 20000, 65536]:
        for is_rms, stream in ((False, False), (True, False), (False, True), (True, True)):
            for cfg in (norm.forward_config(width, is_rms, stream), norm.backward_config(width, is_rms, stream)):
                assert cfg.chunked or width <= 8192, (width, cfg)
                assert cfg.num_stages >= 2 and cfg.waves >= 0, (width, cfg)
                assert cfg.num_warps in (1, 2, 4, 8, 16, 32), (width, cfg)
                assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_m & (cfg.block_m - 1) == 0, (width, cfg)
                if not cfg.chunked:
                    assert width <= cfg.block_n <= 8192, (width, cfg)
                    assert 1 <= cfg.block_m * cfg.block_n // (32 * cfg.num_warps) <= 64, (width, cfg)
    for table in (norm._CONFIGS, norm._RMS_CONFIGS, norm._FP32_STREAM_CONFIGS):
        for width, pair in table.items():
            assert len(pair) == 2 and all(c.chunked or width <= c.block_n for c in pair), (width, pair)
    assert norm.forward_config(768) == norm._CONFIGS.get(768, norm._CONFIGS[1024])[0]


_SM90_BUILD = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tilewise.ops import norm

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
def build(fn, ptrs, constexprs, cfg):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = ptrs.get(name, "fp32" if name in ("eps", "scale") else "i32")
            if sig[name].startswith("*") or name in ("N", "stride_x", "stride_r"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    waits = [int(w) for w in re.findall(r"cp\.async\.wait_group\s+(\d+)", k.asm["ptx"])]
    return {"spills": sass.count("LDL") + sass.count("STL"), "sass": len(sass), "max_wait": max(waits or [0])}

out = []
# every width with and without the norm's bias, bf16 throughout; and GPT-2's norms (768, 2048) as the model runs
# them: fp32 parameters and residual stream, bf16 x and y, the previous linear's bias as an fp32 x_bias
cases = [(w, rms, False) for w in (768, 4096, 8192) for rms in (False, True)]
cases += [(768, False, True), (2048, False, True)]
for width, is_rms, model in cases:
    cfg = norm.forward_config(width, is_rms, model)
    wide = "*fp32" if model else "*bf16"
    ptrs = dict.fromkeys(["X", "Y"], "*bf16") | dict.fromkeys(["R", "W", "B", "H"], wide)
    ptrs |= {"Stats": "*fp32", "XB": "*fp32"}
    cx = dict(HAS_RES=True, HAS_BIAS=not is_rms, HAS_XB=model, IS_RMS=is_rms, HAS_DROP=False,
              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages)
    out.append(["fwd", width, is_rms, build(norm._fwd_kernel, ptrs, cx, cfg)])
    cfg = norm.backward_config(width, is_rms, model)
    ptrs = dict.fromkeys(["DY", "DX"], "*bf16") | dict.fromkeys(["DHIN", "H", "W", "DR"], wide)
    ptrs |= dict.fromkeys(["Stats", "C", "Part"], "*fp32")
    cx = dict(HAS_DHIN=True, HAS_DR=model, HAS_BIAS=not is_rms, HAS_XB=model, IS_RMS=is_rms, HAS_DROP=False,
              SPLIT=False, SUM_EACH_TILE=cfg.block_n >= norm._SUM_EACH_TILE_FROM, BLOCK_M=cfg.block_m,
              BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages)
    out.append(["bwd", width, is_rms, build(norm._bwd_kernel, ptrs, cx, cfg)])
    for entry in out[-2:]:
        entry[-1]["model"] = model
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90_builds_pipeline_and_do_not_spill():
    """The default configs compiled for sm_90 (ahead of time, with Triton's own ptxas; no GPU needed): no
    register spills, and the tile loop waits on its async copies leaving later tiles' loads in flight (a
    cp.async.wait_group above 0; a 2-stage pipeline waits for everything and idles a memory latency a tile).
    Runs in a subprocess, as the interpreter (set for this test session) cannot compile. The model's
    fp32-stream entries were chosen under the H200's Triton (3.6) and must not spill there; another Triton's
    compiler may spill them (3.9 does at 768), so elsewhere they only have to build."""
    import subprocess
    import sys
    import triton
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")):
        pytest.skip("this Triton has no NVIDIA toolchain")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", _SM90_BUILD], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind, width, is_rms, got in json.loads(done.stdout.strip().splitlines()[-1]):
        what = f"{kind} width {width} {'rmsnorm' if is_rms else 'layernorm'}{' (model)' if got['model'] else ''}"
        assert got["sass"] > 1000, what
        if not got["model"] or triton.__version__.startswith("3.6."):
            assert got["spills"] == 0, f"{what}: {got['spills']} local loads/stores (register spills)"
        cfg = (norm.forward_config if kind == "fwd" else norm.backward_config)(width, is_rms, got["model"])
        if cfg.num_stages > 2:   # a 2-stage entry is a measured choice (the H200 sweep)
            assert got["max_wait"] > 0, f"{what}: the loop waits for all its copies (no loads in flight)"


def test_gradient_arriving_as_strided_view():
    """dy and dh that are slices of a larger gradient (row stride 2N) are read correctly."""
    x, r, w, b = make(9, 64, torch.float32)
    leaves = [leaf(t) for t in (x, r, w, b)]
    with ops.use("triton"):
        y, h = add_dropout_norm(*leaves, kind="rmsnorm")
    (torch.cat([y, h], dim=-1) * torch.arange(128.0, device=DEVICE)).sum().backward()
    got = [t.grad for t in leaves]
    ref_leaves = [leaf(t, torch.float64) for t in (x, r, w, b)]
    y, h = add_dropout_norm_reference(*ref_leaves, kind="rmsnorm")
    (torch.cat([y, h], dim=-1) * torch.arange(128.0, dtype=torch.float64, device=DEVICE)).sum().backward()
    for a, t in zip(got, ref_leaves):
        assert rel_err(a, t.grad) < 1e-5


def test_shared_gradient_does_not_alias_leaves():
    """Without dropout dx and dresidual are one tensor in the backward; two leaves' .grad must not share it."""
    x, r, w, b = [leaf(t) for t in make(4, 32, torch.float32)]
    with ops.use("triton"):
        y, h = add_dropout_norm(x, r, w, b)
    (y.sum() + h.sum()).backward()
    before = r.grad.clone()
    x.grad.zero_()
    assert torch.equal(r.grad, before) and before.abs().sum() > 0


@pytest.mark.parametrize("leaves", ["both leaves", "x a leaf", "no leaf"])
def test_dresidual_written_beside_dx_only_for_leaves(leaves):
    """Without dropout the backward hands one tensor to x and residual where neither is a leaf (no copy);
    where one is, it writes dresidual itself (autograd would copy the shared one). The gradients match the
    float64 reference either way, on the first call and on the repeat (the prepared path)."""
    x0, r0, w, b = make(6, 40, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    dy, dh = torch.randn(6, 40, generator=g), torch.randn(6, 40, generator=g)
    ref = run(add_dropout_norm_reference, [leaf(t, torch.float64) for t in (x0, r0, w, b)],
              (dy.double(), dh.double()))
    for _ in range(2):
        xl, rl = leaf(x0), leaf(r0)
        x = xl if leaves != "no leaf" else xl * 1.0
        r = rl if leaves == "both leaves" else rl * 1.0
        returned = []
        with ops.use("triton"):
            y, h = add_dropout_norm(x, r, leaf(w), leaf(b))
        y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: returned.append(grad_inputs))
        torch.autograd.backward([y, h], [dy, dh])
        dx, dres = returned[0][0], returned[0][1]
        assert (dx is dres) == (leaves == "no leaf")
        for got, want in ((xl.grad, ref[2]), (rl.grad, ref[3])):
            assert rel_err(got, want) < 1e-5


def test_only_h_used_and_no_rows():
    """y unused (its gradient None): dx = dh; zero rows: empty outputs and zero weight gradients."""
    x, r, w, b = make(5, 40, torch.float32)
    leaves = [leaf(t) for t in (x, r, w, b)]
    with ops.use("triton"):
        y, h = add_dropout_norm(*leaves)
    h.sum().backward()
    assert torch.equal(leaves[0].grad, torch.ones_like(x)) and torch.equal(leaves[1].grad, torch.ones_like(x))
    assert torch.equal(leaves[2].grad, torch.zeros_like(w))
    x, r, w, b = [leaf(t) for t in make(0, 40, torch.float32)]
    with ops.use("triton"):
        y, h = add_dropout_norm(x, r, w, b)
    (y.sum() + h.sum()).backward()
    assert y.shape == (0, 40) and torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


# ------------------------------------------------------------------------------------------------- dropout

def test_dropout_backward_uses_the_forward_mask():
    """Forward and backward match the float64 reference run with the mask keep_mask() reports."""
    for kind, dtype in (("layernorm", torch.float32), ("rmsnorm", torch.bfloat16)):
        x, r, w, b = make(21, 333, dtype, seed=3)
        check_against_float64(x, r, w, b, kind=kind, dropout_p=0.3, seed=1234,
                              mask=keep_mask(21, 333, 0.3, 1234, DEVICE))


def test_keep_mask_is_what_the_kernel_applies():
    """x = ones, no residual: h = keep / (1 - p) exactly where keep_mask says, 0 elsewhere."""
    p, rows, width = 0.4, 33, 517
    x = torch.ones(rows, width, device=DEVICE)
    w = torch.ones(width, device=DEVICE)
    with ops.use("triton"):
        _, h = add_dropout_norm(x, None, w, dropout_p=p, seed=99)
    keep = keep_mask(rows, width, p, 99, DEVICE)
    assert torch.equal(h != 0, keep)
    assert torch.allclose(h[keep], torch.full_like(h[keep], 1 / (1 - p)))


def test_same_seed_same_mask_other_seed_other_mask():
    x, r, w, b = make(16, 256, torch.float32)
    with ops.use("triton"):
        h1 = add_dropout_norm(x, r, w, b, dropout_p=0.5, seed=7)[1]
        h2 = add_dropout_norm(x, r, w, b, dropout_p=0.5, seed=7)[1]
        h3 = add_dropout_norm(x, r, w, b, dropout_p=0.5, seed=8)[1]
        h4 = add_dropout_norm(x, r, w, b, dropout_p=0.5)[1]          # seed drawn on the host
        h5 = add_dropout_norm(x, r, w, b, dropout_p=0.5)[1]
        h_eval = add_dropout_norm(x, r, w, b, dropout_p=0.5, training=False)[1]
    assert torch.equal(h1, h2)
    k1, k3 = keep_mask(16, 256, 0.5, 7, DEVICE), keep_mask(16, 256, 0.5, 8, DEVICE)
    differ = (k1 != k3).float().mean().item()                      # about 2 p (1 - p) = 0.5
    assert 0.4 < differ < 0.6
    assert not torch.equal(h1, h3) and not torch.equal(h4, h5)
    assert torch.equal(h_eval, x + r)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_and_independence(p):
    """Kept fraction 1 - p within 5 sigma, overall, for each of the 4 columns sharing a Philox call, for
    neighbouring columns jointly, and across rows: the interleaving of the four words must not repeat."""
    rows, width = 64, 1000
    keep = keep_mask(rows, width, p, seed=2024, device=DEVICE).double()
    n = keep.numel()

    def within(frac, q, count):
        sigma = math.sqrt(q * (1 - q) / count)
        return abs(frac - q) < 5 * sigma

    assert within(keep.mean().item(), 1 - p, n)
    for lane in range(4):
        lane_keep = keep[:, lane::4]
        assert within(lane_keep.mean().item(), 1 - p, lane_keep.numel())
    pairs = keep[:, :-1] * keep[:, 1:]
    assert within(pairs.mean().item(), (1 - p) ** 2, pairs.numel())
    rows_pair = keep[:-1] * keep[1:]
    assert within(rows_pair.mean().item(), (1 - p) ** 2, rows_pair.numel())


# ---------------------------------------------------------------------------------------- bad inputs

def test_bad_inputs_raise():
    x, r, w, b = make(4, 32, torch.float32)
    cases = [
        (dict(kind="batchnorm"), ValueError, "kind"),
        (dict(dropout_p=1.0), ValueError, "dropout_p"),
        (dict(dropout_p=-0.1), ValueError, "dropout_p"),
        (dict(residual_dtype=torch.float16), ValueError, "residual_dtype"),
    ]
    for kwargs, exc, word in cases:
        with pytest.raises(exc, match=word), ops.use("triton"):
            add_dropout_norm(x, r, w, b, **kwargs)
    bad_args = [
        ((x.long(), None, w), ValueError, "dtype"),
        ((x, r[:, :16], w), ValueError, "residual shape"),
        ((x, r, w[:16]), ValueError, "weight shape"),
        ((x, r, w, b[:3]), ValueError, "bias shape"),
        ((x, r, w, b, b[:3]), ValueError, "x_bias shape"),
        ((x, r, w, b, b.int()), ValueError, "x_bias dtype"),
        ((x.cpu().numpy(), r, w), TypeError, "torch.Tensor"),
        ((x, r, w.to("meta")), ValueError, "meta"),
        ((torch.empty(2, 65537), None, torch.empty(65537)), ValueError, "65536"),
        ((torch.empty(2, 0), None, torch.empty(0)), ValueError, "width"),
        ((x, r.int(), w), ValueError, "residual dtype"),
    ]
    for args, exc, word in bad_args:
        with pytest.raises(exc, match=word), ops.use("triton"):
            add_dropout_norm(*args[:4], **({"x_bias": args[4]} if len(args) > 4 else {}))
    with pytest.raises(ValueError, match="p="):
        keep_mask(2, 2, 1.5, 0)


# ----------------------------------------------------------------------------- custom op registration

def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementations and autograd registration, as torch.compile relies on them."""
    x, r, w, b = make(5, 40, torch.float32)
    for xb in (None, b.clone()):
        fwd_args = (x, r, w, b, False, 1e-5, 0.1, 3, torch.float32, xb)
        torch.library.opcheck(torch.ops.tilewise.add_dropout_norm_fwd.default, fwd_args)
    y, h, stats = torch.ops.tilewise.add_dropout_norm_fwd(*fwd_args)
    assert stats.shape == (2, 5)
    for dh, res_dtype, bias_dtype, xb_dtype in ((torch.randn_like(h), torch.float32, torch.float32, None),
                                                (None, None, None, torch.float32),
                                                (torch.randn_like(h), None, torch.float32, torch.float32)):
        torch.library.opcheck(torch.ops.tilewise.add_dropout_norm_bwd.default,
                              (torch.randn_like(y), dh, h, w, stats, False, 0.1, 3, torch.float32, res_dtype,
                               bias_dtype, False, xb_dtype))
    rms = torch.ops.tilewise.add_dropout_norm_fwd(x, None, w, None, True, 1e-5, 0.0, 0, torch.float32, None)
    assert rms[2].shape == (1, 5)
    for split_dr in (False, True):      # dresidual written beside dx, or dx serving for both
        torch.library.opcheck(torch.ops.tilewise.add_dropout_norm_bwd.default,
                              (torch.randn_like(y), torch.randn_like(h), rms[1], w, rms[2], True, 0.0, 0,
                               torch.float32, torch.float32, None, split_dr, None))


def test_torch_compile_keeps_one_graph():
    x, r, w, b = make(6, 48, torch.float32)

    def f(x, r, w, b):
        y, h = add_dropout_norm(x, r, w, b, kind="rmsnorm", dropout_p=0.2, seed=11)
        return (y * y).sum() + h.sum()

    eager_leaves = [leaf(t) for t in (x, r, w, b)]
    compiled_leaves = [leaf(t) for t in (x, r, w, b)]
    with ops.use("triton"):
        f(*eager_leaves).backward()
        torch.compile(f, backend="aot_eager", fullgraph=True)(*compiled_leaves).backward()
    for a, c in zip(eager_leaves, compiled_leaves):
        assert torch.equal(a.grad, c.grad)


# ------------------------------------------------------------------------------------ real sizes (H200)

BENCH_SHAPES = [(16384, 4096), (32768, 1024), (8192, 8192), (65536, 768)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BENCH_SHAPES + [(64, 65536), (512, 20000)], ids=str)
@pytest.mark.parametrize("kind", norm.NORM_KINDS)
def test_gpu_benchmark_sizes(shape, kind, device):
    x, r, w, b = make(*shape, torch.bfloat16, device=device, seed=shape[1])
    w, b = w.float(), b.float()       # fp32 parameters with bf16 activations, as in mixed-precision training
    check_against_float64(x, r, w, b, kind=kind)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dropout_p", [((32768, 768), 0.0), ((16384, 2048), 0.0), ((4096, 2048), 0.1),
                                             ((512, 20000), 0.0)], ids=str)
def test_gpu_x_bias_at_model_sizes(shape, dropout_p, device):
    """GPT-2's norms as the model runs them: bf16 activations, fp32 weight, bias and x_bias (the previous
    linear's), at the e2e widths (one tile a row), and chunked at 20000."""
    x, r, w, b = make(*shape, torch.bfloat16, device=device, seed=7)
    seed = 99
    mask = keep_mask(*shape, dropout_p, seed, device=device) if dropout_p else None
    check_against_float64(x, r, w.float(), b.float(), kind="layernorm", dropout_p=dropout_p, seed=seed, mask=mask,
                          xb=(0.5 * torch.randn(shape[1], generator=torch.Generator().manual_seed(8))).to(device))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", norm.NORM_KINDS)
def test_gpu_dropout_and_fp32_residual(kind, device):
    x, r, w, b = make(4096, 4096, torch.bfloat16, res_dtype=torch.float32, device=device)
    mask = keep_mask(4096, 4096, 0.1, 31337, device=device)
    check_against_float64(x, r, w, b, kind=kind, residual_dtype=torch.float32, dropout_p=0.1, seed=31337,
                          mask=mask)
    assert abs(mask.float().mean().item() - 0.9) < 5 * math.sqrt(0.09 / mask.numel())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 1000])
@pytest.mark.parametrize("width", [768, 4096, 8192])
def test_gpu_pipelined_loops_with_few_tiles(rows, width, device):
    """Fewer tiles a program than pipeline stages (1 and 3 rows: one tile each; 1000 rows: a handful), the
    compiled pipeline's prologue and its predicated-off copies; and dropout with an fp32 residual stream."""
    for kind in norm.NORM_KINDS:
        x, r, w, b = make(rows, width, torch.bfloat16, device=device, seed=rows + width)
        check_against_float64(x, r, w.float(), b.float(), kind=kind)
    x, r, w, b = make(rows, width, torch.bfloat16, res_dtype=torch.float32, device=device, seed=rows)
    check_against_float64(x, r, w, b, kind="layernorm", residual_dtype=torch.float32, dropout_p=0.2, seed=5,
                          mask=keep_mask(rows, width, 0.2, 5, device=device))


def odd_view(t):
    """A copy of t as a view starting at element 1 of its storage: a pointer off 16-byte alignment."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    return view


def norm_launchers():
    return [norm._fwd_launch, norm._fwd_chunked_launch, norm._bwd_launch, norm._bwd_row_sums_launch,
            norm._sum_partials_launch]


@pytest.fixture
def interpreted_direct_launches(monkeypatch):
    """BoundLauncher.direct hands its arguments to the kernel through Triton's own launch (the interpreter
    here; the GPU's direct launch is tests/ops/test_launch.py's), and the call plans and prepared calls start
    empty."""
    monkeypatch.setattr(launch.BoundLauncher, "direct",
                        lambda self, args: lambda grid, *a: self.launcher.kernel[grid](*a, **self.meta))
    monkeypatch.setattr(norm, "_CALLS", {})
    monkeypatch.setattr(norm, "_PREPARED", {})


def fwd_bwd(x, r, w, b, kind, residual_dtype=None, grads=None, dh=True, xb=None):
    """y, h and every gradient of one add_dropout_norm call (leaves made from the given tensors)."""
    leaves = [leaf(t) for t in (x, r, w, b, xb)]
    with ops.use("triton"):
        y, h = add_dropout_norm(*leaves[:4], x_bias=leaves[4], kind=kind, residual_dtype=residual_dtype)
        dy, dh_ = grads
        torch.autograd.backward([y, h] if dh else [y], [dy, dh_] if dh else [dy])
    return [y.detach(), h.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("case", ["layernorm", "rmsnorm, no bias", "no residual", "fp32 residual stream",
                                  "no dh", "3-d rows", "x_bias", "rmsnorm, x_bias"])
def test_call_plans_pass_the_keyed_paths_arguments(case, interpreted_direct_launches):
    """A call signature's second call runs its forward and backward plans (_CALLS), which rebuild each
    launch's arguments from the signature's constants and the new tensors: outputs and gradients bitwise the
    keyed path's on new values, in each layout the plans key on. From then on the call is prepared
    (_PREPARED): its third call runs the forward's plan through PreparedAddDropoutNorm and the backward's
    through the general path once (which keeps it for the gradients' layout), the fourth both directly."""
    kind = "rmsnorm" if case.startswith("rmsnorm") else "layernorm"
    res_dtype = torch.float32 if case == "fp32 residual stream" else None
    xb = _x_bias(48, torch.float32) if case.endswith("x_bias") else None
    shape = (2, 19, 48) if case == "3-d rows" else (37, 48)

    def inputs(seed):
        x, r, w, b = make(math.prod(shape[:-1]), shape[-1], torch.bfloat16, res_dtype=res_dtype, seed=seed,
                          residual=case != "no residual", bias=case != "rmsnorm, no bias")
        g = torch.Generator().manual_seed(seed + 1)
        grads = [torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16),
                 torch.randn(shape, generator=g).to(DEVICE, res_dtype or torch.bfloat16)]
        return [None if t is None or t.dim() == 1 else t.view(shape) for t in (x, r)] + [w, b], grads
    args, grads = inputs(0)
    fwd_bwd(*args, kind, res_dtype, grads, dh=case != "no dh", xb=xb)
    assert len(norm._CALLS) == 2 and all(norm._CALLS.values())      # a forward and a backward plan
    args, grads = inputs(5)
    plans, used = dict(norm._CALLS), []
    for sig in plans:
        norm._CALLS[sig] = False                                    # the keyed path
    norm._PREPARED.clear()
    want = fwd_bwd(*args, kind, res_dtype, grads, dh=case != "no dh", xb=xb)
    assert norm._PREPARED == {}                                     # no plan: nothing to prepare
    for sig, plan in plans.items():
        norm._CALLS[sig] = lambda *a, plan=plan: used.append(1) or plan(*a)
    for calls in (1, 2, 3):
        got = fwd_bwd(*args, kind, res_dtype, grads, dh=case != "no dh", xb=xb)
        assert used == [1, 1] * calls
        (prepared,) = norm._PREPARED.values()
        assert len(prepared.backward) == (calls > 1)
        assert len(got) == len(want)
        for i, (a, e) in enumerate(zip(got, want)):
            assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), (calls, i)
    check_against_float64(*args, kind=kind, residual_dtype=res_dtype, grads=tuple(grads), xb=xb)


def test_call_plans_keep_no_tensor_of_the_call_that_made_them(interpreted_direct_launches):
    """Call plans (and their specs for the C++ node) hold plain values only: the outputs of the call that made
    them, and with their grad_fn that call's autograd graph and the leaves' gradient accumulators, are freed
    once the caller drops them. (Kept, they held every leaf's accumulator on the stream of that first call,
    which broke CUDA graph captures of later backwards on another stream.)"""
    x, r, w, b = make(37, 48, torch.bfloat16, seed=2)
    leaves = [leaf(t) for t in (x, r, w, b)]
    with ops.use("triton"):
        y, h = add_dropout_norm(*leaves)
        torch.autograd.backward([y, h], [torch.ones_like(y), torch.ones_like(h)])
    assert len(norm._CALLS) == 2 and all(norm._CALLS.values())
    refs = [weakref.ref(t) for t in (y, h, leaves[0].grad)]
    del y, h
    leaves[0].grad = None
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True, True]


def test_call_plans_only_where_the_signature_fixes_every_argument(interpreted_direct_launches):
    """Dropout (a new seed each call) and an explicit launch config make no plan; an input off 16-byte
    alignment or of another shape is a new signature, which takes the keyed path and gets its own plans."""
    x, r, w, b = make(37, 48, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    dy, dh = (torch.randn(37, 48, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    leaves = [leaf(t) for t in (x, r, w, b)]
    with ops.use("triton"):
        y, h = add_dropout_norm(*leaves, dropout_p=0.1, seed=3)
        torch.autograd.backward([y, h], [dy, dh])
        norm._forward(x, r, w, b, False, 1e-5, 0.0, 0, torch.bfloat16, cfg=norm.forward_config(48))
    assert norm._CALLS == {}
    fwd_bwd(x, r, w, b, "layernorm", grads=(dy, dh))
    assert len(norm._CALLS) == 2
    fwd_bwd(odd_view(x), r, w, b, "layernorm", grads=(odd_view(dy), dh))
    assert len(norm._CALLS) == 4
    fwd_bwd(*make(36, 48, torch.bfloat16), "layernorm", grads=(dy[:36], dh[:36]))
    assert len(norm._CALLS) == 6


def test_partial_rows_keeps_one_buffer_a_size_and_never_replaces_it(monkeypatch):
    """A repeat of (device, stream, size) gets the same buffer; another size gets its own and the first stays
    (a captured CUDA graph may still use its address); past the table's limit a call gets a fresh one."""
    monkeypatch.setattr(norm, "_PARTIALS", {})
    monkeypatch.setattr(norm, "_MAX_PARTIALS", 2)
    dev = torch.device(DEVICE)
    a = norm.partial_rows(dev, 96)
    assert a.dtype == torch.float32 and a.numel() == 96 and norm.partial_rows(dev, 96) is a
    b = norm.partial_rows(dev, 192)
    assert b is not a and norm.partial_rows(dev, 96) is a and norm.partial_rows(dev, 192) is b
    c = norm.partial_rows(dev, 48)
    assert c.numel() == 48 and norm.partial_rows(dev, 48) is not c and len(norm._PARTIALS) == 2


def test_prepared_calls_leave_every_other_call_to_the_general_path(interpreted_direct_launches):
    """Once a signature is prepared, only its repeats without dropout take PreparedAddDropoutNorm: dropout, the
    reference mode, another kind and bad arguments do not (and still raise), and a strided gradient runs the
    general backward without being kept for the call; all of them still match float64."""
    x, r, w, b = make(37, 48, torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    dy, dh = (torch.randn(37, 48, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))

    def grad_fn(**kw):
        with ops.use(kw.pop("mode", "triton")):
            y, _ = add_dropout_norm(*[leaf(t) for t in (x, r, w, b)], **kw)
        return type(y.grad_fn).__name__
    fwd_bwd(x, r, w, b, "layernorm", grads=(dy, dh))
    assert grad_fn() == "PreparedAddDropoutNormBackward"
    assert grad_fn(training=False, dropout_p=0.5) == "PreparedAddDropoutNormBackward"
    assert grad_fn(dropout_p=0.1, seed=1) == "AddDropoutNormBackward"
    assert grad_fn(kind="rmsnorm") == "AddDropoutNormBackward"
    assert grad_fn(mode="reference") != "PreparedAddDropoutNormBackward"
    for bad in ({"dropout_p": 1.5}, {"kind": "batchnorm"}, {"residual_dtype": torch.float16}):
        with pytest.raises(ValueError), ops.use("triton"):
            add_dropout_norm(x, r, w, b, **bad)
    wide = torch.randn(37, 96, generator=g).to(DEVICE, torch.bfloat16)
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    check_against_float64(x, r, w, b, kind="layernorm", grads=(strided, dh))
    prepared = norm._PREPARED[norm._op_signature(*[leaf(t) for t in (x, r, w, b)], "layernorm", 1e-5, None)]
    assert list(prepared.backward) == []
    check_against_float64(x, r, w, b, kind="layernorm", grads=(dy, dh))
    assert len(prepared.backward) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (65536, 768), (8192, 8192), (512, 20000)], ids=str)
@pytest.mark.parametrize("kind", norm.NORM_KINDS)
def test_gpu_fast_launch_matches_normal_launch_bitwise(shape, kind, device):
    """Triton's own launches and FastLauncher's direct ones give bit for bit the same outputs and gradients
    (dropout and an fp32 residual stream included), and the direct path is the one taken."""
    x, r, w, b = make(*shape, torch.bfloat16, res_dtype=torch.float32, device=device, seed=shape[1])
    g = torch.Generator(device=device).manual_seed(1)
    dy = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
    dh = torch.randn(shape, device=device, generator=g)

    def run_once():
        leaves = [leaf(t) for t in (x, r, w.float(), b.float())]
        y, h = add_dropout_norm(*leaves, kind=kind, dropout_p=0.1, seed=77)
        torch.autograd.backward([y, h], [dy, dh])
        return [y, h] + [t.grad for t in leaves]

    with launch.normal_launches():
        expected = run_once()
    run_once()
    fast = sum(lc.fast_launches for lc in norm_launchers())
    normal = sum(lc.normal_launches for lc in norm_launchers())
    got = run_once()
    assert sum(lc.normal_launches for lc in norm_launchers()) == normal
    assert sum(lc.fast_launches for lc in norm_launchers()) >= fast + 3        # forward, backward, sums
    for name, a, e in zip(["y", "h", "dx", "dresidual", "dweight", "dbias"], got, expected):
        assert torch.equal(a, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("kind", norm.NORM_KINDS)
def test_gpu_call_plans_match_normal_launches_bitwise(kind, device):
    """Without dropout a signature's third call runs through its call plans (direct launches of the forward,
    the backward and the sums, no normal launch) and gives bit for bit what Triton's own launches give.
    (The Python node's plans: the C++ node's are test_gpu_native_node_matches_the_python_node_bitwise's.)"""
    x, r, w, b = make(8192, 1024, torch.bfloat16, device=device, seed=3, bias=kind == "layernorm")
    g = torch.Generator(device=device).manual_seed(4)
    grads = [torch.randn(x.shape, device=device, generator=g).to(torch.bfloat16) for _ in range(2)]
    with launch.normal_launches():
        expected = fwd_bwd(x, r, w, b, kind, grads=grads)
    fwd_bwd(x, r, w, b, kind, grads=grads)
    fast = sum(lc.fast_launches for lc in norm_launchers())
    normal = sum(lc.normal_launches for lc in norm_launchers())
    with native.python_nodes():
        got = fwd_bwd(x, r, w, b, kind, grads=grads)
    assert sum(lc.normal_launches for lc in norm_launchers()) == normal
    assert sum(lc.fast_launches for lc in norm_launchers()) == fast + 3
    assert sum(1 for sig, call in norm._CALLS.items() if call and sig[1][-1] == 1024) >= 2
    for i, (a, e) in enumerate(zip(got, expected)):
        assert torch.equal(a, e), i


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["layernorm", "rmsnorm", "model's: fp32 stream, x_bias", "no dh", "no residual"])
@pytest.mark.parametrize("thread", ["worker", "calling"])
def test_gpu_native_node_matches_the_python_node_bitwise(case, thread, device, monkeypatch):
    """From a prepared signature's second call on, its forward runs in the C++ node (norm_node.cpp); the
    backward too once its first C++-node call has handed it the gradients' layout. Such a call launches
    nothing through FastLauncher, its grad_fn is the C++ node, and its outputs and gradients are bit for
    bit the Python node's, with the backward on autograd's worker thread or on the calling thread."""
    if native.norm_extension() is None:
        pytest.skip("the C++ norm node did not build")
    monkeypatch.setattr(norm, "_CALLS", {})
    monkeypatch.setattr(norm, "_PREPARED", {})
    kind = "rmsnorm" if case == "rmsnorm" else "layernorm"
    model = case.startswith("model")
    x, r, w, b = make(4096, 768, torch.bfloat16, device=device, seed=21, residual=case != "no residual",
                      res_dtype=torch.float32 if model else None, bias=case != "rmsnorm")
    if model:
        w, b = w.float(), b.float()
    xb = _x_bias(768, torch.float32).to(device) if model else None
    g = torch.Generator(device=device).manual_seed(22)
    dy = torch.randn(x.shape, device=device, generator=g).to(torch.bfloat16)
    dh = None if case == "no dh" else torch.randn(x.shape, device=device, generator=g).to(
        torch.float32 if model else torch.bfloat16)

    def run():
        leaves = [leaf(t) for t in (x, r, w, b, xb)]
        y, h = add_dropout_norm(*leaves[:4], x_bias=leaves[4], kind=kind,
                                residual_dtype=torch.float32 if model else None)
        with torch.autograd.set_multithreading_enabled(thread == "worker"):
            torch.autograd.backward([y, h] if dh is not None else [y], [dy, dh] if dh is not None else [dy])
        return y.grad_fn.name(), [y.detach(), h.detach()] + [t.grad for t in leaves if t is not None]

    with native.python_nodes():
        node, expected = run()
        run()
    assert "NormNode" not in node
    for call in range(3):
        fast = sum(lc.fast_launches for lc in norm_launchers())
        node, got = run()
        assert "NormNode" in node, node
        # the C++ node's first call hands its backward to the Python path, which launches two kernels
        assert sum(lc.fast_launches for lc in norm_launchers()) == fast + (2 if call == 0 else 0), call
        for i, (a, e) in enumerate(zip(got, expected)):
            assert a.dtype == e.dtype and torch.equal(a, e), (call, i)


@pytest.mark.gpu
def test_gpu_backwards_on_two_streams_keep_their_own_partial_sums(device):
    """Forward+backwards issued on two streams at once write their partial sums to a buffer of their own
    stream (norm.partial_rows), and both give bit for bit what one call alone gives."""
    x, r, w, b = make(16384, 1024, torch.bfloat16, device=device, seed=5)
    g = torch.Generator(device=device).manual_seed(6)
    grads = [torch.randn(x.shape, device=device, generator=g).to(torch.bfloat16) for _ in range(2)]
    expected = fwd_bwd(x, r, w, b, "layernorm", grads=grads)
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    results = []
    for stream in streams:
        with torch.cuda.stream(stream):
            results.append(fwd_bwd(x, r, w, b, "layernorm", grads=grads))
    torch.cuda.synchronize()
    keys = {key for key in norm._PARTIALS if key[1] in {s.cuda_stream for s in streams}}
    assert len(keys) == 2
    for got in results:
        for i, (a, e) in enumerate(zip(got, expected)):
            assert torch.equal(a, e), i


@pytest.mark.gpu
@pytest.mark.parametrize("kind", norm.NORM_KINDS)
def test_gpu_unaligned_views_get_their_own_kernels(kind, device):
    """After aligned calls of one shape have kernels built for 16-byte aligned pointers, inputs and
    gradients that are views starting at element 1 take a normal launch first (a new key), run a kernel
    compiled for them, and still match the float64 reference; aligned calls then still launch directly."""
    x, r, w, b = make(4096, 768, torch.bfloat16, device=device, seed=11)
    check_against_float64(x, r, w, b, kind=kind)
    check_against_float64(x, r, w, b, kind=kind)                     # direct launches, aligned kernels
    normal = [norm._fwd_launch.normal_launches, norm._bwd_launch.normal_launches]
    xo, ro = odd_view(x), odd_view(r)
    g = torch.Generator(device=device).manual_seed(2)
    dy, dh = (odd_view(torch.randn(x.shape, device=device, generator=g).to(torch.bfloat16)) for _ in range(2))
    assert xo.data_ptr() % 16 and dy.data_ptr() % 16
    check_against_float64(xo, ro, w, b, kind=kind, grads=(dy, dh))
    assert [norm._fwd_launch.normal_launches, norm._bwd_launch.normal_launches] == [n + 1 for n in normal]

    def compiled(launcher, aligned):
        """The kernels kept for keys whose bf16 tensor arguments are all aligned (or not all)."""
        out = set()
        for key, entry in launcher._entries.items():
            flags = [c[1] for c in key[3] if isinstance(c, tuple) and c[0] == torch.bfloat16]
            if entry is not launch._NORMAL and flags and all(flags) == aligned:
                out.add(id(entry.compiled))
        return out
    for launcher in (norm._fwd_launch, norm._bwd_launch):
        assert compiled(launcher, False) and not compiled(launcher, False) & compiled(launcher, True)
    fast = norm._fwd_launch.fast_launches
    with native.python_nodes():                 # (the C++ node's launches are not FastLauncher's)
        check_against_float64(x, r, w, b, kind=kind)
    assert norm._fwd_launch.fast_launches == fast + 1
