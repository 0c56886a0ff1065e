"""ops.fp8_attention_sm90_bwd: the Gluon FP8 Hopper backward against fp8_attention.py's Triton FP8 backward (same
inputs, same prep and quantization passes) and against a float64 reference.

The kernels run only on a CUDA sm_90 GPU (the interpreter cannot run Gluon): those tests are gpu-marked and
skip elsewhere, or where available() says no. Gradients start as NaN (_NAN_FILL), so an element no program
writes fails. Both backwards consume one forward's outputs (fp8_attention's Triton FP8 forward: o, lse).
Tolerances (the module docstring says why):
- Against the Triton FP8 backward (`_fp8_backward`, the same E4M3 operands and scale rules): dV and every
  S, P, dP, dS value agree to float32 rounding, so only rare E4M3 roundings of a P or dS element one ulp from
  a boundary differ; dK's (and, at another BLOCK_N, dQ's) running-maximum rescale points follow the tiling,
  which moves dS's E4M3 rounding only in the subnormal range and the accumulator's reduced-precision adds.
  So: relative error norm <= VS_TRITON_REL and max |diff| <= VS_TRITON_MAX max |triton| for each gradient.
- Against float64 exact attention (autograd on the unquantized inputs): each gradient's relative error norm at
  most REF_FACTOR x the Triton FP8 backward's own + REF_FLOOR (both carry the same ~5-6% quantization error; a
  broken kernel is ~100%).
"""
import math

import pytest
import torch

from tilewise.ops import fp8_attention as f8
from tilewise.ops import fp8_attention_sm90_bwd as fb

VS_TRITON_REL = 1e-2
VS_TRITON_MAX = 2.0 ** -4
REF_FACTOR, REF_FLOOR = 1.05, 2e-3


@pytest.fixture(autouse=True)
def _seed_and_nan_fill(monkeypatch):
    torch.manual_seed(1234)
    monkeypatch.setattr(fb, "_NAN_FILL", True)
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")
    with f8.attn.triton_kernels_only():   # fp8_attention's calls: the Triton kernels to compare with
        yield


def test_imports_and_is_unavailable_on_cpu():
    assert fb.available(torch.device("cpu")) is False
    assert fb.available("cpu") is False
    assert set(fb.CONFIGS) == {"dkdv", "dq"}
    q = torch.randn(1, 16, 2, 64)
    lse = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError):
        fb.backward(q, q, q, q, q, lse, causal=False, softmax_scale=0.125)
    with pytest.raises(ValueError):
        fb.backward(q, q, q, q, q, lse, causal=False, softmax_scale=0.125, rotate=True)
    with pytest.raises(ValueError):
        fb.backward(q, q[..., :32], q, q, q, lse, causal=False, softmax_scale=0.125)


def test_configs_are_well_formed():
    """Every config passes the host-side checks (key tiles divide 128, reductions >= 32, 64-row consumers)."""
    for kind, per_d in fb.CONFIGS.items():
        for d, cfgs in per_d.items():
            for cfg in cfgs:
                assert fb._config(kind, d, cfg) == tuple(cfg)
    with pytest.raises(ValueError):
        fb._config("dkdv", 128, (64, 64, 3, 0))   # the register path is dQ's only
    with pytest.raises(ValueError):
        fb._config("dq", 128, (64, 96, 3, 1))


def _skip_without_gpu():
    if not fb.available("cuda"):
        pytest.skip(f"no sm_90 GPU with Gluon: {fb._GLUON_ERROR}")


def _reference(q, k, v, dout, causal, scale):
    """float64 dq, dk, dv (the inputs' layouts) of exact attention, by autograd."""
    group = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (qd, kd, vd))
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    s = qt @ kt.transpose(-1, -2) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    o = (torch.softmax(s, -1) @ vt).transpose(1, 2)
    o.backward(dout.double())
    return qd.grad, kd.grad, vd.grad


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _max_rel(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def check(batch, seqlen, hq, hkv, d, causal, dtype=torch.bfloat16, dkdv_config=None, dq_config=None, inputs=None,
          vs_triton=True):
    """vs_triton=False: only the float64 bounds."""
    _skip_without_gpu()
    if inputs is None:
        inputs = [torch.randn(batch, seqlen, h, d, dtype=dtype, device="cuda") for h in (hq, hkv, hkv, hq)]
    q, k, v, dout = inputs
    scale = 1.0 / math.sqrt(d)
    left, right = (-1, 0) if causal else (-1, -1)
    with torch.no_grad():
        o, lse = f8._fp8_forward(q, k, v, None, 0, scale, left, right, False)
        grads = fb.backward(dout, q, k, v, o, lse, causal, scale, dkdv_config=dkdv_config, dq_config=dq_config)
        torch.cuda.synchronize()
        tri = f8._fp8_backward(dout, q, k, v, o, lse, None, None, 0, scale, left, right, False)
    refs = _reference(q, k, v, dout, causal, scale)
    for name, g, t, tr, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), tri, refs):
        assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous(), name
        assert not g.isnan().any(), f"unwritten or NaN {name} elements"
        if vs_triton:
            rel, big = _rel(g, tr), _max_rel(g, tr)
            assert rel <= VS_TRITON_REL and big <= VS_TRITON_MAX, (name, rel, big)
        e, e_tri = _rel(g, ref), _rel(tr, ref)
        assert e <= REF_FACTOR * e_tri + REF_FLOOR, (name, e, e_tri)
    return grads


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_matches_triton_fp8(head_dim, causal):
    check(2, 1024, 4, 4, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dtypes(dtype, causal):
    check(1, 512, 2, 2, 128, causal, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gqa(head_dim, causal):
    """dK, dV summed over a group of 4 query heads in one accumulator (dO^T's group-wide head scale)."""
    check(2, 768, 8, 2, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [1, 37, 130, 1000, 1100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_ragged_seqlen(seqlen, head_dim, causal):
    """Lengths no multiple of any tile nor of KV_BLOCK: boundary blocks masked, key tiles past the end computed
    and unstored, the 1-D vector tiles running into the next head (batch 3, GQA 2)."""
    check(3, seqlen, 4, 2, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_every_config(head_dim):
    """Every config of each kernel (the other kernel at its default) against the Triton FP8 backward and the
    float64 reference, causal and not, with GQA and a ragged length."""
    for kind in ("dkdv", "dq"):
        for cfg in fb.CONFIGS[kind][head_dim]:
            kw = {"dkdv_config": cfg} if kind == "dkdv" else {"dq_config": cfg}
            for causal in (False, True):
                check(2, 1000, 4, 2, head_dim, causal, **kw)


def _outliers(b, n, h, d, channels=4, factor=20.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, n, h, d, generator=gen) for _ in range(4))
    for head in range(h):
        ch = torch.randperm(d, generator=gen)[:channels]
        for t in (q, k, v):
            t[:, :, head, ch] *= factor
    v[:, n // 2:] *= 64.0   # later V blocks on other scales
    do[:, : n // 3] *= 16.0   # dO rows on other scales: dS's running maxima grow mid-loop
    return [t.to(torch.bfloat16) for t in (q, k, v, do)]


@pytest.mark.gpu
def test_gpu_outlier_channels():
    """Large channels and row scales that differ widely: the dK / dQ running maxima rescale their
    accumulators, the K/V block scales differ between tiles."""
    _skip_without_gpu()
    inputs = [t.cuda() for t in _outliers(1, 2048, 4, 128)]
    check(1, 2048, 4, 4, 128, True, inputs=inputs)
    check(1, 2048, 4, 4, 128, False, inputs=inputs)


@pytest.mark.gpu
def test_gpu_real_size():
    check(2, 4096, 16, 16, 128, True)
    check(1, 4096, 16, 4, 128, False)


@pytest.mark.gpu
def test_gpu_prepared_inputs():
    """backward() with prepare()'s operands passed in equals backward() making them."""
    _skip_without_gpu()
    b, n, h, d = 2, 1000, 4, 128
    q, k, v, dout = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    o, lse = f8._fp8_forward(q, k, v, None, 0, scale, -1, 0, False)
    prep = fb.prepare(dout, q, k, v, o, lse)
    a = fb.backward(dout, q, k, v, o, lse, True, scale, prepared=prep)
    c = fb.backward(dout, q, k, v, o, lse, True, scale)
    for x, y in zip(a, c):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_gpu_unsupported_raises_value_error():
    _skip_without_gpu()
    q = torch.randn(1, 128, 2, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(1, 2, 128, device="cuda")
    k = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="seqlen"):
        fb.backward(q, q, k, k, q, lse, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(1, 128, 2, 96, dtype=torch.bfloat16, device="cuda")
        fb.backward(x, x, x, x, x, lse, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="rotate"):
        fb.backward(q, q, q, q, q, lse, causal=False, softmax_scale=0.1, rotate=True)
    with pytest.raises(ValueError, match="bf16"):
        x = torch.randn(1, 128, 2, 128, device="cuda")
        fb.backward(x, x, x, x, x, lse, causal=False, softmax_scale=0.1)
