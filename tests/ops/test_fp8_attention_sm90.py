"""ops.fp8_attention_sm90: the Gluon FP8 Hopper forward against fp8_attention.py's Triton FP8 forward (same
inputs, same quantization pass) and against a float64 reference.

The kernel runs only on a CUDA sm_90 GPU (the interpreter cannot run Gluon): those tests are gpu-marked and
skip elsewhere, or where available() says no. Outputs start as NaN (_NAN_FILL), so an element no program
writes fails. Tolerances:
- Against the Triton FP8 forward (`_fp8_forward`, same E4M3 K, V^T and block scales from the same pass, Q
  quantized per row with the same arithmetic): the two run the same float operations on the same E4M3
  wgmma; what may differ is the order of the reductions inside a tile (row sums: float32 rounding, ~1e-7)
  and hence, very rarely, a P element one float32 ulp from an E4M3 rounding boundary landing one E4M3 step
  (2^-4 relative) away, plus the final bf16 rounding of o (2^-9 relative) flipping with them. So: relative
  error norm <= VS_TRITON_REL (a few bf16 roundings), max |diff| <= 2^-4 max |o| (one E4M3 step of P on the
  largest element), lse within VS_TRITON_LSE.
- Against float64 exact attention: at most REF_FACTOR x the Triton FP8 forward's own error + REF_FLOOR
  (both carry the same ~3-5% quantization error; a broken kernel is ~100%).
"""
import math

import pytest
import torch

from tilewise.ops import fp8_attention as f8
from tilewise.ops import fp8_attention_sm90 as f9

VS_TRITON_REL = 4e-3
VS_TRITON_MAX = 2.0 ** -4
VS_TRITON_LSE = 1e-3
REF_FACTOR, REF_FLOOR = 1.05, 1e-3


@pytest.fixture(autouse=True)
def _seed_and_nan_fill(monkeypatch):
    torch.manual_seed(1234)
    monkeypatch.setattr(f9, "_NAN_FILL", True)
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")
    with f8.attn.triton_kernels_only():   # fp8_attention's calls: the Triton kernels to compare with
        yield


def test_imports_and_is_unavailable_on_cpu():
    assert f9.available(torch.device("cpu")) is False
    assert f9.available("cpu") is False
    q = torch.randn(1, 16, 2, 64)
    with pytest.raises(ValueError):
        f9.fp8_forward(q, q, q, causal=False, softmax_scale=0.125)
    with pytest.raises(ValueError):
        f9.fp8_forward(q, q, q, causal=False, softmax_scale=0.125, rotate=True)


def _skip_without_gpu():
    if not f9.available("cuda"):
        pytest.skip(f"no sm_90 GPU with Gluon: {f9._GLUON_ERROR}")


def _reference(q, k, v, causal, scale):
    """float64 o (q's layout) and natural-log lse (batch, heads_q, seqlen) of exact attention."""
    group = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(1, 2), torch.logsumexp(s, -1)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _triton_fp8(q, k, v, causal, scale):
    left, right = (-1, 0) if causal else (-1, -1)
    return f8._fp8_forward(q, k, v, None, 0, scale, left, right, False)


def check(batch, seqlen, hq, hkv, d, causal, dtype=torch.bfloat16, config=None, inputs=None, vs_triton=True):
    """vs_triton=False: only the float64 bounds (for a BLOCK_N other than the Triton kernel's, see
    test_gpu_every_config)."""
    _skip_without_gpu()
    if inputs is None:
        inputs = [torch.randn(batch, seqlen, h, d, dtype=dtype, device="cuda") for h in (hq, hkv, hkv)]
    q, k, v = inputs
    scale = 1.0 / math.sqrt(d)
    with torch.no_grad():
        o, lse = f9.fp8_forward(q, k, v, causal, scale, config=config)
        torch.cuda.synchronize()
        assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
        assert lse.shape == (batch, hq, seqlen) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert not o.isnan().any(), "unwritten or NaN output elements"
        assert not lse.isnan().any(), "unwritten or NaN lse elements"
        t_o, t_lse = _triton_fp8(q, k, v, causal, scale)
    rel = _rel(o, t_o)
    big = (o.float() - t_o.float()).abs().max().item() / t_o.float().abs().max().item()
    gap = (lse - t_lse).abs().max().item()
    if vs_triton:
        assert rel <= VS_TRITON_REL and big <= VS_TRITON_MAX and gap <= VS_TRITON_LSE, (rel, big, gap)
    ref_o, ref_lse = _reference(q, k, v, causal, scale)
    e, e_tri = _rel(o, ref_o), _rel(t_o, ref_o)
    assert e <= REF_FACTOR * e_tri + REF_FLOOR, (e, e_tri)
    le, le_tri = (lse.double() - ref_lse).abs().max().item(), (t_lse.double() - ref_lse).abs().max().item()
    assert le <= REF_FACTOR * le_tri + REF_FLOOR, (le, le_tri)
    return o, lse


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
    check(2, 768, 8, 2, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [1, 37, 130, 1000, 1100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_ragged_seqlen(seqlen, head_dim, causal):
    """Lengths that are no multiple of any tile (nor of KV_BLOCK): the last key block is masked, the last
    query rows unstored, V^T's padding read (and the next sequence's rows must not leak in: batch 3)."""
    check(3, seqlen, 4, 2, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (64, 64, 3, 1), (64, 128, 2, 1)])
@pytest.mark.parametrize("seqlen", [130, 1100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_tree_rows(head_dim, causal, seqlen, config, monkeypatch):
    """TREE_ROWS (gluon_sm90.row_max / row_sum's trees): the chains' bounds, masked blocks included, at
    BLOCK_N 128 (three folds) and 64 (two; float64 bounds only, as test_gpu_every_config)."""
    monkeypatch.setattr(f9, "TREE_ROWS", True)
    check(3, seqlen, 4, 2, head_dim, causal, config=config, vs_triton=config is None or config[1] == 128)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_every_config(head_dim):
    """Every config against the float64 reference; those with the default's BLOCK_N (the Triton kernel's) also
    against the Triton FP8 forward. Another BLOCK_N moves the online softmax's running max at other keys, so P
    is scaled by other (not power-of-two) factors before its E4M3 rounding: a different, equally good
    quantization (measured ~0.9% apart at BLOCK_N 64, beyond VS_TRITON_REL)."""
    for cfg in f9.CONFIGS[head_dim]:
        for causal in (False, True):
            check(2, 1000, 4, 2, head_dim, causal, config=cfg, vs_triton=cfg[1] == f9.CONFIGS[head_dim][0][1])


@pytest.mark.gpu
def test_gpu_outlier_channels():
    """Large channels (the case block scales exist for): the K/V block scales and Q's row scales differ
    widely between blocks and rows, so the V-scale rescaling of the running output is exercised."""
    _skip_without_gpu()
    q, k, v = (t.cuda() for t in _outliers(1, 2048, 4, 128))
    check(1, 2048, 4, 4, 128, True, inputs=[q, k, v])
    check(1, 2048, 4, 4, 128, False, inputs=[q, k, v])


def _outliers(b, n, h, d, channels=4, factor=20.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, generator=gen) for _ in range(3))
    for head in range(h):
        ch = torch.randperm(d, generator=gen)[:channels]
        for t in (q, k, v):
            t[:, :, head, ch] *= factor
    v[:, n // 2:] *= 64.0   # later V blocks on other scales
    return [t.to(torch.bfloat16) for t in (q, k, v)]


@pytest.mark.gpu
def test_gpu_real_size():
    check(2, 4096, 16, 16, 128, True)
    check(1, 4096, 16, 4, 128, False)


@pytest.mark.gpu
def test_gpu_prepared_inputs_and_backward():
    """forward() on the prepared operands equals fp8_forward, and fp8_attention's FP8 backward fed this
    kernel's (o, lse) gives the gradients it gives from the Triton forward's."""
    _skip_without_gpu()
    b, n, h, d = 2, 1000, 4, 128
    q, k, v = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    k8, v8t, ks, vs = f9.quantize_kv(k, v)
    o, lse = f9.forward(q, k8, v8t, ks, vs, True, scale)
    o2, lse2 = f9.fp8_forward(q, k, v, True, scale)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    t_o, t_lse = _triton_fp8(q, k, v, True, scale)
    dout = torch.randn_like(q)
    ours = f8._fp8_backward(dout, q, k, v, o, lse, None, None, 0, scale, -1, 0, False)
    theirs = f8._fp8_backward(dout, q, k, v, t_o, t_lse, None, None, 0, scale, -1, 0, False)
    for name, x, y in zip(("dq", "dk", "dv"), ours, theirs):
        assert not x.isnan().any(), name
        assert _rel(x, y) <= 1e-2, (name, _rel(x, y))


@pytest.mark.gpu
def test_gpu_unsupported_raises_value_error():
    _skip_without_gpu()
    q = torch.randn(1, 128, 2, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="seqlen"):
        f9.fp8_forward(q, k, k, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(1, 128, 2, 96, dtype=torch.bfloat16, device="cuda")
        f9.fp8_forward(x, x, x, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="rotate"):
        f9.fp8_forward(q, q, q, causal=False, softmax_scale=0.1, rotate=True)
    with pytest.raises(ValueError, match="bf16"):
        x = torch.randn(1, 128, 2, 128, device="cuda")
        f9.fp8_forward(x, x, x, causal=False, softmax_scale=0.1)
    k8, v8t, ks, vs = f9.quantize_kv(q, q)   # the plain V^T copy: a P_SMEM=3 config must refuse it
    with pytest.raises(ValueError, match="v_permuted"):
        f9.forward(q, k8, v8t, ks, vs, False, 0.1, config=(64, 128, 2, f9.P_PERMUTED))
    with pytest.raises(ValueError, match="v_permuted"):
        f9.forward(q, k8, v8t, ks, vs, False, 0.1, config=(64, 128, 2, 1), v_permuted=True)
