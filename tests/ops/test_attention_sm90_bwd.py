"""ops.attention_sm90_bwd: the Gluon Hopper backward against a float64 reference and attention.py's Triton backward.

The kernels run only on a CUDA sm_90 GPU (the interpreter cannot run Gluon): those tests are gpu-marked and
skip elsewhere, or where available() says no. Outputs start as NaN (_NAN_FILL), so an element no program
writes fails. Both backwards consume the same forward outputs (attention.py's o and lse); the error bound:
2x the Triton backward's error against the same float64 reference (plus a floor), for dq, dk and dv.
"""
import math

import pytest
import torch

from tilewise.ops import attention as att
from tilewise.ops import attention_sm90_bwd as b9
from tilewise.ops.attention import flash_attention

ABS_FLOOR = 1e-5


@pytest.fixture(autouse=True)
def _seed_and_nan_fill(monkeypatch):
    torch.manual_seed(1234)
    monkeypatch.setattr(b9, "_NAN_FILL", True)
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")
    with att.triton_kernels_only():   # attention.py's calls: the Triton kernels to compare with
        yield


def test_imports_and_is_unavailable_on_cpu():
    assert b9.available(torch.device("cpu")) is False
    assert b9.available("cpu") is False
    q = torch.randn(1, 16, 2, 64)
    lse = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError):
        b9.backward(q, q, q, q, q, lse, causal=False, softmax_scale=0.125)
    assert set(b9.CONFIGS) == {"dkdv", "dq", "dkdv_dq"}


def test_unknown_dq_mode_raises_value_error_naming_it():
    """Checked before anything else, so on any machine."""
    q = torch.randn(1, 16, 2, 64)
    lse = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="'fused'"):
        b9.backward(q, q, q, q, q, lse, causal=False, softmax_scale=0.125, dq_mode="fused")
    with pytest.raises(ValueError, match="dq_mode"):
        b9.backward(q, q, q, q, q, lse, causal=False, softmax_scale=0.125, dq_mode=None)


def test_dkdv_dq_configs_are_well_formed():
    """(BLOCK_N, BLOCK_M, STAGES, SPLIT[, DQ_SLOTS]) for d64 and d128; SPLIT needs BLOCK_M 64 (a wgmma's M);
    each head_dim has a writer-warp config (DQ_SLOTS > 0) for the atomic_writer tests."""
    for d in (64, 128):
        cfgs = b9.CONFIGS["dkdv_dq"][d]
        assert cfgs and len(set(cfgs)) == len(cfgs)
        for bn, bm, stages, split, *slots in cfgs:
            assert bn == 64 and bm in (64, 128) and stages >= 2 and split in (0, 1)
            assert not split or bm == 64
            assert slots in ([], [1], [2])
        assert _writer_config(d)[4] > 0


def _writer_config(d):
    return next(c for c in b9.CONFIGS["dkdv_dq"][d] if len(c) > 4 and c[4] > 0)


def _reference(q, k, v, dout, causal, scale):
    """float64 dq, dk, dv (the inputs' layouts) by autograd."""
    group = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2) for t in (qd, kd, vd))   # (batch, heads, seqlen, d)
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    s = qt @ kt.transpose(-1, -2) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    o = (torch.softmax(s, -1) @ vt).transpose(1, 2)
    o.backward(dout.double())
    return qd.grad, kd.grad, vd.grad


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


def check(batch, seqlen, hq, hkv, d, causal, dtype=torch.bfloat16, dkdv_config=None, dq_config=None,
          dq_mode="split", dkdv_dq_config=None):
    if dq_mode == "atomic_writer":   # the atomic kernel with its writer warp
        dq_mode, dkdv_dq_config = "atomic", _writer_config(d)
    if not b9.available("cuda") or (dq_mode == "atomic" and not b9.available_atomic("cuda")):
        pytest.skip(f"no sm_90 GPU with Gluon: {b9._GLUON_ERROR}")
    q = torch.randn(batch, seqlen, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, seqlen, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, seqlen, hkv, d, dtype=dtype, device="cuda")
    dout = torch.randn(batch, seqlen, hq, d, dtype=dtype, device="cuda")
    scale = 1.0 / math.sqrt(d)
    with torch.no_grad():
        o, lse = flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    dq, dk, dv = b9.backward(dout, q, k, v, o, lse, causal=causal, softmax_scale=scale,
                             dkdv_config=dkdv_config, dq_config=dq_config, dq_mode=dq_mode,
                             dkdv_dq_config=dkdv_dq_config)
    torch.cuda.synchronize()
    for name, g, t in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.is_contiguous(), name
        assert not g.isnan().any(), f"unwritten or NaN {name} elements"
    # attention.py's own backward on the same forward outputs (dLSE None, no window; causal: right = 0)
    t_dq, t_dk, t_dv = att._attn_backward(dout, q, k, v, o, lse, None, None, 0, scale, -1, 0 if causal else -1)
    refs = _reference(q, k, v, dout, causal, scale)
    for name, got, tri, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), (t_dq, t_dk, t_dv), refs):
        e, e_tri = _err(got, ref), _err(tri, ref)
        assert e <= 2 * e_tri + ABS_FLOOR, (name, e, e_tri)
    return dq, dk, dv


# dq_mode="atomic" (dQ added by the dK/dV kernel with float32 atomics; their order varies, so the checks are
# tolerances only) takes the same cases as the split kernels, with the consumers' atomics and with the writer
# warp's ("atomic_writer").
DQ_MODES = pytest.mark.parametrize("dq_mode", ["split", "atomic", "atomic_writer"])


@pytest.mark.gpu
@DQ_MODES
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_matches_reference(head_dim, causal, dq_mode):
    check(2, 1024, 4, 4, head_dim, causal, dq_mode=dq_mode)


@pytest.mark.gpu
@DQ_MODES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_dtypes(dtype, causal, head_dim, dq_mode):
    check(1, 512, 2, 2, head_dim, causal, dtype=dtype, dq_mode=dq_mode)


@pytest.mark.gpu
@DQ_MODES
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gqa(head_dim, causal, dq_mode):
    """dK, dV summed over the group's query heads (4 per kv head), and a group of 8 with one kv head (atomic:
    each query head's dQ from the one kv head's program)."""
    check(2, 768, 8, 2, head_dim, causal, dq_mode=dq_mode)
    check(1, 300, 8, 1, head_dim, causal, dq_mode=dq_mode)


@pytest.mark.gpu
@DQ_MODES
@pytest.mark.parametrize("seqlen", [1, 37, 130, 1000, 1100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_ragged_seqlen(seqlen, head_dim, causal, dq_mode):
    """Lengths that are no multiple of any tile: the last blocks are masked, rows past the end unstored (and
    the next sequence's rows, which the tiles read, must not leak in: batch 3). Atomic: dq_acc starts at zero,
    so a stray add shows as an error in another sequence's dq, not as a NaN."""
    check(3, seqlen, 4, 2, head_dim, causal, dq_mode=dq_mode)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_every_config(head_dim):
    for cfg in b9.CONFIGS["dkdv"][head_dim]:
        for causal in (False, True):
            check(2, 1000, 4, 2, head_dim, causal, dkdv_config=cfg)
    for cfg in b9.CONFIGS["dq"][head_dim]:
        for causal in (False, True):
            check(2, 1000, 4, 2, head_dim, causal, dq_config=cfg)


@pytest.mark.gpu
def test_gpu_real_size():
    check(2, 4096, 16, 16, 128, True)
    check(1, 4096, 16, 4, 128, False)


@pytest.mark.gpu
def test_gpu_matches_sm90_forward_outputs():
    """The backward takes attention_sm90.py's forward outputs as well (natural-log lse, the same layout)."""
    from tilewise.ops import attention_sm90 as a9
    if not (b9.available("cuda") and a9.available("cuda")):
        pytest.skip("no sm_90 GPU with Gluon")
    q, k, v, dout = (torch.randn(2, 512, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    o, lse = a9.forward(q, k, v, causal=True, softmax_scale=0.1)
    grads = b9.backward(dout, q, k, v, o, lse, causal=True, softmax_scale=0.1)
    refs = _reference(q, k, v, dout, True, 0.1)
    tri = att._attn_backward(dout, q, k, v, o, lse, None, None, 0, 0.1, -1, 0)
    for g, t, r in zip(grads, tri, refs):
        assert _err(g, r) <= 2 * _err(t, r) + ABS_FLOOR


@pytest.mark.gpu
def test_gpu_unsupported_raises_value_error():
    if not b9.available("cuda"):
        pytest.skip("no sm_90 GPU with Gluon")
    x = torch.randn(1, 128, 2, 128, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(1, 2, 128, device="cuda")
    k = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="seqlen"):
        b9.backward(x, x, k, k, x, lse, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        y = torch.randn(1, 128, 2, 96, dtype=torch.bfloat16, device="cuda")
        b9.backward(y, y, y, y, y, lse, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="bf16"):
        y = torch.randn(1, 128, 2, 128, device="cuda")
        b9.backward(y, y, y, y, y, lse, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="dense"):
        y = x.view(128, 2, 128)
        b9.backward(y, y, y, y, y, lse, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="lse"):
        b9.backward(x, x, x, x, x, lse.double(), causal=False, softmax_scale=0.1)


# dq_mode="atomic" beyond the shared cases above: its configs, a real size, and its agreement with the split mode

def check_atomic(batch, seqlen, hq, hkv, d, causal, dtype=torch.bfloat16, config=None):
    return check(batch, seqlen, hq, hkv, d, causal, dtype=dtype, dq_mode="atomic", dkdv_dq_config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_atomic_every_config(head_dim):
    for cfg in b9.CONFIGS["dkdv_dq"][head_dim]:
        for causal in (False, True):
            check_atomic(2, 1000, 4, 2, head_dim, causal, config=cfg)
            check_atomic(1, 200, 8, 1, head_dim, causal, dtype=torch.float16, config=cfg)


@pytest.mark.gpu
def test_gpu_atomic_real_size():
    check_atomic(2, 4096, 16, 16, 128, True)
    check_atomic(1, 4096, 16, 4, 128, False)


@pytest.mark.gpu
@pytest.mark.parametrize("dq_mode", ["split", "atomic"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_grads_views_written_in_place(head_dim, dq_mode):
    """grads= views of one fused QKV gradient (token rows of stride 3 * heads * head_dim, as
    FlashAttnQKVFunction passes them): written in place, nothing outside them touched."""
    if not b9.available("cuda") or (dq_mode == "atomic" and not b9.available_atomic("cuda")):
        pytest.skip("no sm_90 GPU with Gluon")
    batch, seqlen, heads = 2, 333, 4
    qkv = torch.randn(batch, seqlen, 3, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(2)
    dout = torch.randn(batch, seqlen, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    scale = 1.0 / math.sqrt(head_dim)
    with torch.no_grad():
        o, lse = flash_attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
    dqkv = torch.full_like(qkv, float("nan"))
    views = tuple(dqkv.unbind(2))
    got = b9.backward(dout, q, k, v, o, lse, causal=True, softmax_scale=scale, grads=views, dq_mode=dq_mode)
    torch.cuda.synchronize()
    assert all(g.data_ptr() == w.data_ptr() for g, w in zip(got, views))
    assert not dqkv.isnan().any()
    refs = _reference(q, k, v, dout, True, scale)
    tri = att._attn_backward(dout, q, k, v, o, lse, None, None, 0, scale, -1, 0)
    for g, t, r in zip(views, tri, refs):
        assert _err(g, r) <= 2 * _err(t, r) + ABS_FLOOR


@pytest.mark.gpu
def test_gpu_atomic_agrees_with_split():
    """The two modes' dk, dv come from the same math in another order of the GEMMs' issue: close, and dq within
    the atomics' rounding of the split kernel's."""
    if not b9.available_atomic("cuda"):
        pytest.skip("no sm_90 GPU with Gluon")
    q, k, v, dout = (torch.randn(2, 1000, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    with torch.no_grad():
        o, lse = flash_attention(q, k, v, causal=True, softmax_scale=0.09, return_lse=True)
    a = b9.backward(dout, q, k, v, o, lse, causal=True, softmax_scale=0.09, dq_mode="atomic")
    s = b9.backward(dout, q, k, v, o, lse, causal=True, softmax_scale=0.09)
    for x, y in zip(a, s):
        assert (x.float() - y.float()).abs().max() <= 2e-2 * y.float().abs().max()
