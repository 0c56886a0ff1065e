"""The fused FP8 cast kernels (tilewise.ops.fp8_cast) against the PyTorch reference and float64 bounds.

On CPU the Triton kernels run in the interpreter (small shapes); gpu-marked tests repeat them at real
sizes with the default tiles and every sweep candidate.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tilewise import ops
from tilewise.ops import fp8_cast as fp8_cast_module
from tilewise.ops.fp8_cast import (FP8_MAX, block_dequantize_reference, fallbacks, fp8_block_cast,
                                   fp8_block_cast_reference, fp8_cast, fp8_cast_current, fp8_cast_current_reference,
                                   fp8_cast_reference)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IN_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (smallest normal exponent, mantissa bits)
GRID = {torch.float8_e4m3fn: (-6, 3), torch.float8_e5m2: (-14, 2)}


def bits(t):
    return t.view(torch.uint8)


def nan_fp8(shape, dtype, device):
    """An output buffer of NaN (0x7F in both formats), so an element the kernel skips fails."""
    return torch.full(shape, 0x7F, dtype=torch.uint8, device=device).view(dtype)


def spread(shape, dtype, device, lo=-6, hi=3, seed=0):
    """Random values whose magnitudes span 10^lo..10^hi (column-wise), never zero-filled."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(lo, hi, shape[1])
    return x.to(device=device, dtype=dtype)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference_bits(fp8_dtype, in_dtype, device):
    M, N = 45, 70  # not multiples of the 32x32 interpreter tile
    x = spread((M, N), in_dtype, device)
    x[3, 4], x[5, 5], x[6, 6] = float("nan"), float("inf"), -1e7
    scale = torch.tensor([1.7], device=device)
    out, out_t = nan_fp8((M, N), fp8_dtype, device), nan_fp8((N, M), fp8_dtype, device)
    amax = torch.zeros(1, device=device)
    with ops.use("triton"):
        y, yt = fp8_cast(x, fp8_dtype, scale, amax=amax, transpose=True, out=out, out_t=out_t)
    yr, ytr = fp8_cast_reference(x, fp8_dtype, scale, transpose=True)
    assert y is out and yt is out_t
    assert torch.equal(bits(y), bits(yr))
    assert torch.equal(bits(yt), bits(ytr))
    assert torch.equal(bits(yt), bits(y).t().contiguous())  # the transposed copy is the copy transposed
    assert torch.isnan(y.float()[3, 4]) and y.float()[5, 5] == FP8_MAX[fp8_dtype]
    assert math.isnan(amax.item())  # NaN wins the amax, so the scale update can skip it


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_dequantize_error_bound(fp8_dtype, device):
    """|dequant(q(x)) - x| <= half an FP8 ulp: 2^-(m+1) relative for normals, 2^(emin-m-1)/scale absolute
    below the normal range; float64 reference, random data over 9 decades."""
    M, N = 64, 96
    x = spread((M, N), torch.float32, device, lo=-4, hi=2, seed=1)
    fmax = FP8_MAX[fp8_dtype]
    amax = x.abs().max()
    scale = (fmax / amax).reshape(1).float()
    with ops.use("triton"):
        y, _ = fp8_cast(x, fp8_dtype, scale, out=nan_fp8((M, N), fp8_dtype, device))
    deq = y.double() / scale.double()
    x64 = x.double()
    emin, m = GRID[fp8_dtype]
    bound = torch.maximum(x64.abs() * 2.0 ** -(m + 1), torch.full_like(x64, 2.0 ** (emin - m - 1)) / scale.double())
    err = (deq - x64).abs()
    assert not torch.isnan(deq).any()
    assert (err <= bound * (1 + 1e-6)).all(), (err / bound).max()
    # Gaussian data fills the normal range: the relative error norm sits near 2^-(m+1)/sqrt(3).
    rel = ((deq - x64).norm() / x64.norm()).item()
    assert rel < 2.0 ** -(m + 1)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_saturation_at_fp8_max(fp8_dtype, device):
    fmax = FP8_MAX[fp8_dtype]
    x = torch.randn(32, 48, device=device) * fmax  # a third of |x| lies beyond fmax at scale 1
    x[0, :4] = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30])
    scale = torch.ones(1, device=device)
    with ops.use("triton"):
        y, yt = fp8_cast(x, fp8_dtype, scale, transpose=True)
    yf = y.float()
    over = x.abs() >= fmax
    assert over.sum() > 100
    assert torch.equal(yf[over], torch.sign(x[over]) * fmax)
    assert torch.isfinite(yf).all()
    assert yf.abs().max() == fmax and torch.equal(bits(yt), bits(y).t().contiguous())


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_amax_exact_and_folded(in_dtype, device):
    x = spread((50, 33), in_dtype, device, seed=2)
    want = x.float().abs().max()
    with ops.use("triton"):
        amax = torch.zeros(1, device=device)
        fp8_cast(x, torch.float8_e4m3fn, torch.ones(1, device=device), amax=amax)
        assert amax.item() == want.item()  # exact: a max, no rounding
        bigger = torch.full((1,), want.item() * 2, device=device)
        fp8_cast(x, torch.float8_e4m3fn, torch.ones(1, device=device), amax=bigger)
        assert bigger.item() == want.item() * 2  # folding keeps the larger running amax
        x[7, 7] = -float("inf")
        fp8_cast(x, torch.float8_e4m3fn, torch.ones(1, device=device), amax=amax)
        assert amax.item() == float("inf")


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("margin", [0, 2])
def test_current_scaling(fp8_dtype, margin, device):
    M, N = 40, 64
    x = spread((M, N), torch.bfloat16, device, lo=-3, hi=1, seed=3)
    fallback = torch.tensor([3.0], device=device)
    amax_acc = torch.zeros(1, device=device)
    with ops.use("triton"):
        y, yt, scales = fp8_cast_current(x, fp8_dtype, fallback, margin=margin, amax=amax_acc, transpose=True,
                                         out=nan_fp8((M, N), fp8_dtype, device),
                                         out_t=nan_fp8((N, M), fp8_dtype, device))
    amax = x.float().abs().max()
    want = FP8_MAX[fp8_dtype] / amax / 2 ** margin
    assert torch.allclose(scales[0], want, rtol=1e-6, atol=0)
    assert torch.allclose(scales[1], 1 / want, rtol=1e-6, atol=0)
    assert amax_acc.item() == amax.item()
    assert y.float().abs().max() <= FP8_MAX[fp8_dtype] / 2 ** margin  # the largest element lands at max/2^margin
    yr, ytr, sr = fp8_cast_current_reference(x, fp8_dtype, fallback, margin=margin, transpose=True)
    assert torch.equal(bits(y), bits(yr)) and torch.equal(bits(yt), bits(ytr)) and torch.equal(scales, sr)


@pytest.mark.parametrize("bad", ["zeros", "inf", "nan"])
def test_current_scaling_falls_back_on_bad_amax(bad, device):
    x = torch.randn(32, 32, device=device)
    if bad == "zeros":
        x.zero_()
    else:
        x[1, 2] = float(bad)
    fallback = torch.tensor([5.0], device=device)
    with ops.use("triton"):
        _, _, scales = fp8_cast_current(x, torch.float8_e4m3fn, fallback)
    assert torch.equal(scales, torch.tensor([5.0, 0.2], device=device))


def cast_for_sums(x, fp8_dtype, current, copies, col_sums=None):
    """One per-tensor cast of x (delayed at scale 2.5, or current with margin 1 and 2.5 as the fallback) into
    NaN-filled outputs; copies "y", "t" or "both". Returns (y, y_t, amax, scales; None where not made)."""
    M, N = x.shape
    rowwise, transpose = copies in ("y", "both"), copies in ("t", "both")
    out = nan_fp8((M, N), fp8_dtype, x.device) if rowwise else None
    out_t = nan_fp8((N, M), fp8_dtype, x.device) if transpose else None
    scale, amax = torch.tensor([2.5], device=x.device), torch.zeros(1, device=x.device)
    kw = dict(amax=amax, rowwise=rowwise, transpose=transpose, out=out, out_t=out_t, col_sums=col_sums)
    with ops.use("triton"):
        if current:
            y, yt, scales = fp8_cast_current(x, fp8_dtype, scale, margin=1, **kw)
        else:
            (y, yt), scales = fp8_cast(x, fp8_dtype, scale, **kw), None
    return y, yt, amax, scales


def tiles_per_program(x, copies, col_sums):
    """How many row tiles a program of the column-sums cast walks for x here."""
    y = x if copies in ("y", "both") else None
    yt = x if copies in ("t", "both") else None
    bm, bn, _ = fp8_cast_module.cast_tiles(x, y, yt, col_sums)[0]
    return fp8_cast_module._row_split(*x.shape, bm, bn)[0]


def no_second_pass(*args):
    raise AssertionError("a per-tensor cast read x again for its column sums")


@pytest.mark.parametrize("programs", [1024, 2, 5])
@pytest.mark.parametrize("copies", ["y", "t", "both"])
@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_column_sums(in_dtype, fp8_dtype, current, copies, programs, device, monkeypatch):
    """col_sums gets x.sum(0) in fp32 (the bias gradient of dy) from the cast's own read, and the copies, the
    amax and the scales are bitwise those of the cast without it. With few programs each one walks several
    row tiles: on the interpreter's 32 x 32 tiles, 200 x 40 is 7 row tiles (the last partial) by 2 column
    blocks; 2 programs: one a column block, 7 tiles each; 5: two a column block, 4 and 3 tiles. float32
    input with both copies is the split case: the sums ride on the row-major launch."""
    monkeypatch.setattr(fp8_cast_module, "_COL_SUMS_PROGRAMS", programs)
    monkeypatch.setattr(fp8_cast_module, "column_sums", no_second_pass)
    M, N = 200, 40
    x = spread((M, N), in_dtype, device, lo=-2, hi=2, seed=5)
    sums = torch.full((N,), float("nan"), device=device)
    if programs == 2:
        assert tiles_per_program(x, copies, sums) > 1
    y, yt, amax, scales = cast_for_sums(x, fp8_dtype, current, copies, col_sums=sums)
    ry, ryt, ramax, rscales = cast_for_sums(x, fp8_dtype, current, copies)
    for got, want in ((y, ry), (yt, ryt)):
        assert (got is None) == (want is None)
        assert got is None or not mismatch(got, want), mismatch(got, want)
    assert amax.item() == ramax.item() == x.float().abs().max().item()
    assert scales is None or torch.equal(scales, rscales)
    want = x.double().sum(0)
    # fp32 summation in any order: within (M - 1) units of 2^-24 of sum |x| per column
    bound = x.double().abs().sum(0) * (M * 2.0 ** -24)
    assert ((sums.double() - want).abs() <= bound).all(), ((sums.double() - want).abs() / bound).max()


@pytest.mark.parametrize("programs", [1024, 3, 2])
@pytest.mark.parametrize("current", [False, True])
def test_column_sums_count_every_row_tile_once(current, programs, device, monkeypatch):
    """Small integers add up exactly in fp32 in any order, so col_sums must equal the float64 sum exactly; each
    32-row slab adds its own offset, so a row tile skipped or counted twice, or rows read past the end (230:
    a partial last tile either way), change a column by at least 1."""
    monkeypatch.setattr(fp8_cast_module, "_COL_SUMS_PROGRAMS", programs)
    M, N = 230, 72
    i, j = torch.arange(M)[:, None], torch.arange(N)[None, :]
    x = ((i * 7 + j * 3) % 11 + 1 + (i // 32) * (j % 3 + 1)).to(device=device, dtype=torch.bfloat16)
    assert torch.equal(x.double(), x.double().round()) and x.double().abs().max() < 256  # exact in bf16
    sums = torch.full((N,), float("nan"), device=device)
    if programs < 1024:
        assert tiles_per_program(x, "both", sums) > 1
    cast_for_sums(x, torch.float8_e5m2, current, "both", col_sums=sums)
    assert torch.equal(sums.double(), x.double().sum(0))


def test_gelu_cast_refuses_column_sums(device):
    """The bias gradient is of dy, which is never cast through a GELU: the sums of x would not be the sums of
    what the cast quantizes."""
    from tilewise.ops.fp8_cast import cast_delayed
    x = torch.randn(32, 32, device=device, dtype=torch.bfloat16)
    with ops.use("triton"), pytest.raises(ValueError, match="col_sums"):
        cast_delayed(x, torch.float8_e4m3fn, torch.ones(1, device=device), None, True, True,
                     col_sums=torch.empty(32, device=device), gelu=True)


@pytest.mark.parametrize("with_bias", [True, False])
def test_gelu_cast_quantizes_the_activation_of_its_input(with_bias, device):
    """gelu=True: the copies and the amax are of gelu_tanh(x + bias), from x (the pre-activation). Rows and
    columns outside full tiles (gelu(bias) is not 0 there) stay out of the amax. Against float64 GELU, each
    FP8 code is the nearest or next-nearest (the kernel's fp32 GELU may round differently at a tie)."""
    from tilewise.ops.fp8_cast import cast_delayed, gelu_fp32
    # 70 x 48: partial tiles both ways. x + bias stays within about +-0.3 where gelu(bias) alone is ~4
    bias = (torch.rand(48, device=device) + 4.0) if with_bias else None
    x = torch.randn(70, 48, device=device) * 0.1 - (bias if with_bias else 0.0)
    x = x.to(torch.bfloat16)
    scale = torch.tensor([20.0], device=device)
    amax = torch.zeros(1, device=device)
    with ops.use("triton"):
        y, yt = cast_delayed(x, torch.float8_e4m3fn, scale, amax.view(torch.int32), True, True, gelu=True,
                             gelu_bias=bias)
    g = torch.nn.functional.gelu(x.double() + (bias.double() if with_bias else 0.0), approximate="tanh")
    want = (g * 20.0).clamp(-448, 448)
    got = y.double()
    step = torch.where(want.abs() < 2 ** -6, torch.full_like(want, 2 ** -9), want.abs() * 2 ** -3)  # ~1 code
    assert ((got - want).abs() <= step * 1.01).all()
    assert torch.equal(bits(yt), bits(y.t().contiguous()))
    assert amax.item() == pytest.approx(gelu_fp32(x, bias).abs().max().item(), rel=1e-6)
    ref, _ = fp8_cast_reference(gelu_fp32(x, bias), torch.float8_e4m3fn, scale, transpose=True)
    assert (bits(y) != bits(ref)).float().mean().item() < 0.01


def test_rowwise_false_writes_only_transpose(device):
    x = torch.randn(48, 16, device=device)
    with ops.use("triton"):
        y, yt = fp8_cast(x, torch.float8_e5m2, torch.ones(1, device=device), rowwise=False, transpose=True)
    assert y is None and yt.shape == (16, 48)
    assert torch.equal(bits(yt), bits(x.t().contiguous().to(torch.float8_e5m2)))


def test_bad_arguments_raise():
    x = torch.randn(8, 16)
    one = torch.ones(1)
    with pytest.raises(TypeError, match="fp8_dtype"):
        fp8_cast(x, torch.bfloat16, one)
    with pytest.raises(TypeError, match="x dtype"):
        fp8_cast(x.double(), torch.float8_e4m3fn, one)
    with pytest.raises(ValueError, match="2-D"):
        fp8_cast(x[None], torch.float8_e4m3fn, one)
    with pytest.raises(TypeError, match="scale"):
        fp8_cast(x, torch.float8_e4m3fn, 1.0)
    with pytest.raises(TypeError, match="scale"):
        fp8_cast(x, torch.float8_e4m3fn, torch.ones(2))
    with pytest.raises(ValueError, match="no output"):
        fp8_cast(x, torch.float8_e4m3fn, one, rowwise=False)
    with pytest.raises(ValueError, match="out_t"):
        fp8_cast(x, torch.float8_e4m3fn, one, transpose=True, out_t=torch.empty(8, 16, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="col_sums"):
        fp8_cast(x, torch.float8_e4m3fn, one, col_sums=torch.empty(8))
    with pytest.raises(ValueError, match="margin"):
        fp8_cast_current(x, torch.float8_e4m3fn, one, margin=-1)


# ----------------------------------------------------------------------------------------------------
# 1x128 block scaling (recipe "blockwise")
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_block_cast_matches_reference_bits(fp8_dtype, in_dtype, device):
    """Both copies and both scale grids bit-equal to the reference, partial blocks at both ends, a zero
    segment (scale 1, zeros), an inf (scale 1: saturates) and a NaN (stays NaN, wins the amax)."""
    M, N = 200, 300
    x = spread((M, N), in_dtype, device, lo=-5, hi=3)  # column magnitudes over 8 decades: scales differ a lot
    x[64, 128:256] = 0           # row 64's second 128-column segment
    x[128:, 7] = 0               # column 7's second 128-row segment (72 rows: a partial block)
    x[130, 5], x[3, 40] = float("inf"), float("nan")
    amax = torch.zeros(1, device=device)
    with ops.use("triton"):
        y, ys, yt, yts = fp8_block_cast(x, fp8_dtype, amax=amax, transpose=True)
    ry, rys, ryt, ryts = fp8_block_cast_reference(x, fp8_dtype, transpose=True)
    assert ys.shape == (3, M) and yts.shape == (2, N) and y.shape == (M, N) and yt.shape == (N, M)
    assert not mismatch(y, ry), mismatch(y, ry)
    assert not mismatch(yt, ryt), mismatch(yt, ryt)
    assert torch.equal(ys, rys) and torch.equal(yts, ryts)
    assert ys[1, 64] == 1 and (y[64, 128:256].float() == 0).all()
    assert yts[1, 7] == 1 and (yt[7, 128:].float() == 0).all()
    assert y.float()[130, 5] == FP8_MAX[fp8_dtype] and ys[0, 130] == 1  # inf saturates, its block keeps scale 1
    assert torch.isnan(y.float()[3, 40]) and math.isnan(amax.item())


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_block_dequantize_error_bound_and_outlier_isolation(fp8_dtype, device):
    """Every element within half an FP8 ulp of its own block's grid (float64 reference); a row of outliers
    (x1e6, E5M2 x1e10) costs the other rows' row-wise copy nothing, where a per-tensor cast flushes them
    toward zero."""
    M, N = 256, 256
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, N, generator=g)
    x[5] *= 1e6 if fp8_dtype == torch.float8_e4m3fn else 1e10  # past the format's range below its max
    x = x.to(device)
    with ops.use("triton"):
        y, ys, yt, yts = fp8_block_cast(x, fp8_dtype, transpose=True)
    emin, m = GRID[fp8_dtype]
    x64 = x.double()
    for q, s, ref in ((y, ys, x64), (yt, yts, x64.t())):
        deq = block_dequantize_reference(q, s).double()
        inv = s.double().t().repeat_interleave(128, dim=1)[:, :ref.shape[1]]
        bound = torch.maximum(ref.abs() * 2.0 ** -(m + 1), 2.0 ** (emin - m - 1) * inv)
        assert ((deq - ref).abs() <= bound * (1 + 1e-6)).all()
    others = torch.ones(M, dtype=torch.bool)
    others[5] = False
    deq = block_dequantize_reference(y, ys).double()
    block_err = ((deq - x64)[others].norm() / x64[others].norm()).item()
    scale = torch.tensor([FP8_MAX[fp8_dtype] / x.abs().max().item()], device=device)
    with ops.use("triton"):
        yp, _ = fp8_cast(x, fp8_dtype, scale)
    tensor_err = ((yp.double() / scale.double() - x64)[others].norm() / x64[others].norm()).item()
    assert block_err < 2.0 ** -(m + 1) and tensor_err > 4 * block_err, (block_err, tensor_err)


def test_block_cast_column_sums_and_transpose_only(device):
    x = torch.randn(160, 136, device=device, dtype=torch.bfloat16)
    sums = torch.full((136,), float("nan"), device=device)
    with ops.use("triton"):
        y, ys, yt, yts = fp8_block_cast(x, torch.float8_e5m2, rowwise=False, transpose=True, col_sums=sums)
    want = x.double().sum(0)
    assert y is None and ys is None and yt.shape == (136, 160) and yts.shape == (2, 136)
    assert ((sums.double() - want).norm() / want.norm()).item() < 1e-6
    _, _, ryt, ryts = fp8_block_cast_reference(x, torch.float8_e5m2, rowwise=False, transpose=True)
    assert not mismatch(yt, ryt) and torch.equal(yts, ryts)


def test_block_cast_bad_arguments():
    x = torch.randn(8, 16)
    with pytest.raises(TypeError, match="fp8_dtype"):
        fp8_block_cast(x, torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        fp8_block_cast(x[None], torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no output"):
        fp8_block_cast(x, torch.float8_e4m3fn, rowwise=False)
    with pytest.raises(TypeError, match="amax"):
        fp8_block_cast(x, torch.float8_e4m3fn, amax=torch.zeros(2))


def run_tiles(x, fp8_dtype, scale, tiles, current, margin=0):
    """The cast with fixed tiles, run in turn on the same buffers (as a sweep's timing runs do).
    Returns (y, y_t, col_sums, amax, scales); outputs start as NaN."""
    M, N = x.shape
    dev = x.device
    y, yt = nan_fp8((M, N), fp8_dtype, dev), nan_fp8((N, M), fp8_dtype, dev)
    sums = torch.full((N,), float("nan"), device=dev)
    amax = torch.zeros(1, device=dev)
    scratch = fp8_cast_module.current_scratch(dev)  # [scale, 1/scale, amax partials of the amax pass]
    n_parts = fp8_cast_module._launch_amax(x, scratch) if current else 0
    assert n_parts or not current
    assert fp8_cast_module._launch_cast(x, y, yt, scale, scratch if current else None, n_parts,
                                        amax.view(torch.int32), sums, fp8_dtype, margin, current, tiles=tiles)
    return y, yt, sums, amax, fp8_cast_module.current_scales(scratch)


def mismatch(a, b):
    """'' when the FP8 tensors are bit-identical, else how many bytes differ and the first one."""
    diff = bits(a) != bits(b)
    if not diff.any():
        return ""
    idx = tuple(int(i) for i in diff.nonzero()[0])
    return (f"{int(diff.sum())} of {diff.numel()} differ, first at {idx}: "
            f"{a[idx].float().item()} vs {b[idx].float().item()}")


def check_tiles(x, fp8_dtype, tiles, current):
    """Problems (strings) of one run_tiles against the reference and float64."""
    scale = torch.tensor([37.5], device=x.device)
    y, yt, sums, amax, scales = run_tiles(x, fp8_dtype, scale, tiles, current, margin=1 if current else 0)
    if current:
        yr, ytr, sr = fp8_cast_current_reference(x, fp8_dtype, scale, margin=1, transpose=True)
    else:
        (yr, ytr), sr = fp8_cast_reference(x, fp8_dtype, scale, transpose=True), None
    want = x.double().sum(0)
    err = ((sums.double() - want).norm() / want.norm()).item()
    problems = []
    for name, a, b in (("y", y, yr), ("y_t", yt, ytr)):
        if mismatch(a, b):
            problems.append(f"{name} bits: {mismatch(a, b)}")
    if not err < 1e-6:
        problems.append(f"col_sums rel err {err:.3g} (want < 1e-6)")
    if amax.item() != x.float().abs().max().item():
        problems.append(f"amax {amax.item()} vs {x.float().abs().max().item()}")
    if sr is not None and not torch.equal(scales, sr):
        problems.append(f"scales {scales.tolist()} vs {sr.tolist()}")
    return problems


@pytest.mark.parametrize("current", [False, True])
def test_reruns_with_other_tiles_leave_the_right_result(current, device):
    """Larger tiles alone, then tile sequences on the same buffers (a sweep, or a replayed CUDA graph, reruns
    the kernel): any sequence of tiles leaves the same correct values."""
    x = torch.randn(200, 40, device=device, dtype=torch.bfloat16) * 3  # 200 rows: 7 blocks of 32, one partial
    problems = []
    for tiles in ([(64, 32, 4)], [(128, 64, 4)],
                  [(32, 32, 4), (64, 32, 4)], [(128, 32, 4), (32, 32, 4), (64, 32, 4)]):
        problems += [f"tiles {tiles}: {p}" for p in check_tiles(x, torch.float8_e4m3fn, tiles, current)]
    assert not problems, "; ".join(problems)


def test_tile_table_is_sound():
    """Every default tile and sweep candidate: BLOCK_M at least a 32-byte sector of the transposed FP8 copy,
    powers of two, at most 64K elements a tile."""
    for bm, bn, warps in fp8_cast_module._CAST_CONFIGS + list(fp8_cast_module._TILES.values()):
        assert bm >= 32
        assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0 and warps in (1, 2, 4, 8, 16)
        assert bm * bn <= 65536


# Compiles (not runs) every candidate config of the cast kernels, with the column sums and both scalings,
# for sm_90 with the Triton at hand: Triton's own LLVM and ptxas, no GPU needed (TRITON_INTERPRET unset).
# Pointers 16-byte aligned and M, N multiples of 16, as Fp8Linear calls them; for each build the SASS's
# local loads/stores (register spills) and the registers a thread.
_COMPILE_FOR_HOPPER = """
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tilewise.ops import fp8_cast as m
target = GPUTarget("cuda", 90, 32)
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
types = {"x_ptr": "*bf16", "y_ptr": "*fp8e4nv", "yt_ptr": "*fp8e4nv", "M": "i32", "N": "i32", "scale_ptr": "*fp32",
         "scratch_ptr": "*fp32", "n_parts": "i32", "amax_acc_ptr": "*i32", "colsum_ptr": "*fp32", "fp8_max": "fp32",
         "inv_margin": "fp32", "ys_ptr": "*fp32", "yts_ptr": "*fp32", "numel": "i32", "gelu_bias_ptr": "*fp32",
         "part_ptr": "*fp32", "tiles_per_program": "i32"}

def build(fn, consts, warps, **retype):
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = retype.get(name, types[name])
            if sig[name].startswith("*") or name in ("M", "N", "numel"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                       options={"num_warps": warps})
    if not os.path.exists(cuobjdump):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.findall(r"REG:(\\d+)", res)
    return {"spills": sass.count("LDL") + sass.count("STL"), "regs": int(regs[0]) if regs else None}

out = []
common = dict(EXACT_ROUND=False)
for bm, bn, warps in m._CAST_CONFIGS:
    # current scaling or not; "gelu": delayed, of gelu_tanh(x + bias); "sums": with the column sums (kind "sums")
    for variant in (False, True, "gelu", "sums", "current sums"):
        sums = variant in ("sums", "current sums")
        consts = dict(CURRENT=variant in (True, "current sums"), WRITE_Y=True, WRITE_T=True, ACC_AMAX=True,
                      GELU=variant == "gelu", GELU_BIAS=variant == "gelu", COL_SUMS=sums, EMIN=-6, MBITS=3,
                      PARTS=m._PARTS, PARTS_AT=m._PARTS_AT, SCALE_INV_AT=m.SCALE_INV_OFFSET, BLOCK_M=bm, BLOCK_N=bn,
                      **common)
        out.append(["sums" if sums else "cast", [bm, bn, warps], variant, build(m._fp8_cast_kernel, consts, warps)])
for x_ty, y_ty, emin, mbits in (("*bf16", "*fp8e4nv", -6, 3), ("*fp32", "*fp8e5", -14, 2)):
    for warps in m._BLOCK_WARPS_CONFIGS:
        consts = dict(WRITE_Y=True, WRITE_T=True, ACC_AMAX=True, EMIN=emin, MBITS=mbits,
                      BLOCK_S=m.BLOCK, **common)
        out.append(["block", warps, x_ty, build(m._fp8_block_cast_kernel, consts, warps, x_ptr=x_ty, y_ptr=y_ty,
                                                yt_ptr=y_ty)])
out.append(["amax", 8, None, build(m._amax_partials_kernel, {"PARTS_AT": m._PARTS_AT, "BLOCK_E": 4096}, 8)])
bm, bn, warps = m._COL_SUMS_TILE
out.append(["col_sums", warps, None, build(m._col_sums_kernel, {"BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": 3}, warps,
                                           x_ptr="*bf16")])
print("compiled", triton.__version__)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper_and_defaults_do_not_spill():
    """Every candidate builds for sm_90; the default tiles and warps do not spill, and the per-tensor default
    leaves room for at least four programs an SM (<= 64 registers at 8 warps; three for the GELU variant), the
    column sums' default for at least two."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                       timeout=900)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("this Triton has no ptxas to compile for sm_90")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
    builds = json.loads(r.stdout.strip().splitlines()[-1])
    if not builds[0][3]:
        pytest.skip("this Triton has no cuobjdump to read the builds")
    defaults = [list(t) for t in fp8_cast_module._TILES.values()]
    sums_tile = list(fp8_cast_module._TILES["sums"])
    for kind, cfg, variant, got in builds:
        if (kind == "cast" and cfg in defaults) or (kind == "block" and cfg == fp8_cast_module._BLOCK_WARPS) \
                or (kind == "sums" and cfg == sums_tile) or kind in ("amax", "col_sums"):
            assert got["spills"] == 0, f"{kind} {cfg} {variant}: {got['spills']} local loads/stores (spills)"
        if kind == "cast" and cfg == list(fp8_cast_module._TILES["t"]):
            # GELU's tanh takes more: 80 registers at 64 x 128 x 8 under Triton 3.6, three programs an SM
            programs = 3 if variant == "gelu" else 4
            assert got["regs"] * cfg[2] * 32 * programs <= 65536, f"{cfg} {variant}: {got['regs']} registers a thread"
        if kind == "sums" and cfg == sums_tile:
            assert got["regs"] * cfg[2] * 32 * 2 <= 65536, f"sums {cfg}: {got['regs']} registers a thread"


# ----------------------------------------------------------------------------------------------------
# The H200: real sizes, the default tiles. Each test gathers every measurement and fails once with
# all of them, so one log line tells what went wrong and by how much.
# ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape", [(16384, 768), (4096, 14336), (8192, 2048), (1000, 3000)])
def test_gpu_kernel_matches_reference(fp8_dtype, shape, in_dtype):
    """Every input dtype: Triton 3.6 transposed 8-bit register tiles wrongly for fp32 input only."""
    M, N = shape
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=in_dtype) * 3
    x[17, 5] = float("nan")
    scale = torch.tensor([37.5], device="cuda")
    problems = []
    amax = torch.zeros(1, device="cuda")
    y, yt = fp8_cast(x, fp8_dtype, scale, amax=amax, transpose=True, out=nan_fp8((M, N), fp8_dtype, "cuda"),
                     out_t=nan_fp8((N, M), fp8_dtype, "cuda"))
    yr, ytr = fp8_cast_reference(x, fp8_dtype, scale, transpose=True)
    for name, a, b in (("delayed y", y, yr), ("delayed y_t", yt, ytr)):
        if mismatch(a, b):
            problems.append(f"{name} bits: {mismatch(a, b)}")
    if not math.isnan(amax.item()):
        problems.append(f"amax with a NaN in x is {amax.item()}, not NaN")
    x[17, 5] = 1.0
    want = x.double().sum(0)
    for transpose in (False, True):  # the bias gradient: alone, and with the copies Fp8Linear's dy cast makes
        sums = torch.full((N,), float("nan"), device="cuda")
        fp8_cast(x, fp8_dtype, scale, transpose=transpose, col_sums=sums)
        err = ((sums.double() - want).norm() / want.norm()).item()
        if not err < 1e-6:
            problems.append(f"col_sums (transpose={transpose}) rel err {err:.3g} (want < 1e-6)")
    sums = torch.full((N,), float("nan"), device="cuda")
    y, yt, s = fp8_cast_current(x, fp8_dtype, scale, margin=1, transpose=True, col_sums=sums)
    yr, ytr, sr = fp8_cast_current_reference(x, fp8_dtype, scale, margin=1, transpose=True)
    if not torch.equal(s, sr):
        problems.append(f"current scales {s.tolist()} vs reference {sr.tolist()}")
    for name, a, b in (("current y", y, yr), ("current y_t", yt, ytr)):
        if mismatch(a, b):
            problems.append(f"{name} bits: {mismatch(a, b)}")
    err = ((sums.double() - want).norm() / want.norm()).item()
    if not err < 1e-6:
        problems.append(f"current col_sums rel err {err:.3g} (want < 1e-6)")
    if fallbacks():
        problems.append(f"kernels replaced by slower paths: {fallbacks()}")
    assert not problems, f"{shape} {fp8_dtype}: " + "; ".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("shape", [(1000, 3000), (16384, 768)])
def test_gpu_every_config_and_reruns(current, shape, in_dtype):
    """Each candidate config alone, then all of them in turn on the same buffers (what a sweep does)."""
    torch.manual_seed(1)
    x = torch.randn(shape, device="cuda", dtype=in_dtype) * 3
    tiles = list(fp8_cast_module._CAST_CONFIGS)
    problems = []
    for run in [[t] for t in tiles] + [tiles, tiles[::-1]]:
        problems += [f"tiles {run}: {p}" for p in check_tiles(x, torch.float8_e4m3fn, run, current)]
    assert not problems, f"{shape} current={current}: " + "; ".join(problems)


@pytest.mark.parametrize("triton_path", [True, False])
def test_current_scales_are_16_byte_aligned(device, triton_path):
    """cuBLASLt (torch._scaled_mm) rejects scale pointers that are not 16-byte aligned."""
    x = torch.randn(64, 48, device=device)
    with ops.use("triton" if triton_path else "reference"):
        _, _, scales = fp8_cast_current(x, torch.float8_e4m3fn, torch.ones(1, device=device))
    assert scales.shape == (2,)
    assert scales[1:2].data_ptr() % 16 == 0
    assert torch.allclose(scales[0] * scales[1], torch.ones((), device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_gpu_block_cast_matches_reference_bits(fp8_dtype, in_dtype):
    test_block_cast_matches_reference_bits(fp8_dtype, in_dtype, "cuda")
    for M, N in ((4096, 2048), (16384, 768)):  # aligned: vectorized loads, where ptxas 12.8 went wrong
        x = torch.randn(M, N, device="cuda", dtype=in_dtype) * torch.logspace(-3, 3, N, device="cuda").to(in_dtype)
        got = fp8_block_cast(x, fp8_dtype, transpose=True)
        want = fp8_block_cast_reference(x, fp8_dtype, transpose=True)
        for name, a, b in zip(("y", "y_scales", "y_t", "y_t_scales"), got, want):
            bad = mismatch(a, b) if a.dtype == fp8_dtype else ("" if torch.equal(a, b) else "scales differ")
            assert not bad, f"({M}, {N}) {name}: {bad}"
