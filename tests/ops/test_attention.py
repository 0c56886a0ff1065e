"""flash_attention: Triton forward and backward against a float64 reference.

On CPU the kernels run in the Triton interpreter at tiny sizes (and its outputs start as NaN, so an element
no program writes fails). Low-precision errors are held to 2x the error of torch SDPA in the same dtype
(given the same boolean mask) against the same float64 reference; fp32 to 1e-5 (the fp32 dots are IEEE).
"""
import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.testing
import triton.language as tl

from tilewise import ops
from tilewise.ops import attention as attn
from tilewise.ops.attention import (_dense_attention, attention_mask, attention_reference, flash_attention,
                                    flash_attention_qkv)

# Both errors can be ~0 where an output is exactly representable (a row that sees one key returns v
# itself), so 2 * 0 would fail a correct kernel one fp32 ulp away; 1e-6 is far below any bf16/fp16 error.
ABS_FLOOR = 1e-6
FP32_TOL = 1e-5


@pytest.fixture(autouse=True)
def _seed_and_no_tuning(monkeypatch):
    """Fixed seed; on the GPU one config per kernel (autotuning every key would take minutes: the
    benchmark checks the tuned configs against SDPA before it times them)."""
    torch.manual_seed(1234)
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")


@pytest.fixture
def tma(monkeypatch):
    """Select the Triton kernels' load path, 'ptr' or 'tma' (host tensor descriptors; the interpreter runs
    them too), or 'gluon': descriptors, and the Gluon forward (attention_sm90) on the padded-batch calls it
    covers on sm_90. 'ptr' and 'tma' keep every call on the Triton kernels."""
    def select(path):
        monkeypatch.setenv("TILEWISE_ATTN_TMA", "0" if path == "ptr" else "1")
        monkeypatch.setattr(attn, "_GLUON", path == "gluon")
    return select


# ------------------------------------------------------------------------------------------ helpers

def _rand(*shape, dtype, device):
    return torch.randn(*shape, dtype=dtype, device=device)


def _keep_mask(sq, sk, causal, window, cu_seqlens, device):
    """(sq, sk) boolean mask; packed: block-diagonal over documents, each masked like a batch of one."""
    if cu_seqlens is None:
        return attention_mask(sq, sk, causal, window, device)
    keep = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        keep[s:e, s:e] = attention_mask(e - s, e - s, causal, window, device)
    return keep


def _sdpa(q, k, v, causal, window, cu_seqlens, scale):
    """torch SDPA with an explicit boolean mask (rows that see no key give 0); packed = one long batch."""
    if cu_seqlens is not None:
        q, k, v = q[None], k[None], v[None]
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    if window is None and cu_seqlens is None and (not causal or q.shape[1] == k.shape[1]):
        # no mask tensor, so CUDA picks SDPA's flash backend: the closest peer to this kernel
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
    else:
        keep = _keep_mask(q.shape[1], k.shape[1], causal, window, cu_seqlens, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep, scale=scale).transpose(1, 2)
    return out[0] if cu_seqlens is not None else out


def _grads(fn, inputs, dout, dlse=None):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    res = fn(*xs)
    out, lse = res if isinstance(res, tuple) else (res, None)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse.double().nan_to_num(0.0, 0.0, 0.0) * dlse.double()).sum()
    loss.backward()
    return [out.detach()] + [x.grad for x in xs], (None if lse is None else lse.detach())


def _rel(x, ref):
    assert not torch.isnan(x).any(), "NaN in the result"
    den = ref.double().norm()
    num = (x.double() - ref.double()).norm()
    return (num / den).item() if den > 0 else num.item()


def check(q, k, v, *, causal=False, window=None, cu_seqlens=None, softmax_scale=None, with_lse=False):
    """Forward, LSE and the three gradients of the Triton path against the float64 reference."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    dout = torch.randn_like(q)
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
    dlse = torch.randn(lse_shape, device=q.device) if with_lse else None
    kw = dict(causal=causal, window=window, cu_seqlens=cu_seqlens, softmax_scale=softmax_scale)

    def ours(q_, k_, v_):
        with ops.use("triton"):
            return flash_attention(q_, k_, v_, return_lse=True, **kw)

    def ref64(q_, k_, v_):
        if cu_seqlens is not None:
            return attention_reference(q_, k_, v_, return_lse=True, **kw)
        return _dense_attention(q_, k_, v_, causal, scale, window)

    got, lse = _grads(ours, (q, k, v), dout, dlse)
    want, lse64 = _grads(ref64, [t.double() for t in (q, k, v)], dout, dlse)
    # The LSE: natural log, -inf exactly where a row sees no key.
    assert lse.dtype == torch.float32 and lse.shape == lse64.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64))
    finite = torch.isfinite(lse64)
    if finite.any():
        assert (lse[finite].double() - lse64[finite]).abs().max().item() < 1e-4
    names = ("out", "dq", "dk", "dv")
    if q.dtype == torch.float32:
        for name, x, r in zip(names, got, want):
            assert _rel(x, r) < FP32_TOL, f"{name}: {_rel(x, r):.3g}"
        return
    if with_lse:  # SDPA has no LSE output to differentiate; the fp32-compute reference is the baseline
        base, _ = _grads(lambda *t: _dense_attention(*t, causal, scale, window) if cu_seqlens is None
                         else attention_reference(*t, return_lse=True, **kw), (q, k, v), dout, dlse)
    else:
        base, _ = _grads(lambda *t: _sdpa(*t, causal, window, cu_seqlens, scale), (q, k, v), dout)
    for name, x, b, r in zip(names, got, base, want):
        err, err_base = _rel(x, r), _rel(b, r)
        assert err <= 2 * err_base + ABS_FLOOR, f"{name}: error {err:.3g} vs torch {err_base:.3g}"
    for x, t in zip(got, (q, q, k, v)):
        assert x.dtype == t.dtype and x.shape == t.shape


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, device="cpu"):
    return (_rand(b, sq, hq, d, dtype=dtype, device=device), _rand(b, sk, hkv, d, dtype=dtype, device=device),
            _rand(b, sk, hkv, d, dtype=dtype, device=device))


# ------------------------------------------------------------------------------------------ interpreter

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward(dtype, causal, device, tma):
    tma("ptr")
    check(*qkv(2, 37, 37, 2, 2, 32, dtype, device), causal=causal)


@pytest.mark.parametrize("sq,sk", [(17, 50), (50, 17), (1, 33), (33, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_q_differs_from_seqlen_k(sq, sk, causal, device, tma):
    tma("ptr")  # causal with sq > sk: the first sq - sk rows see no key (output 0, lse -inf)
    check(*qkv(1, sq, sk, 2, 1, 16, device=device), causal=causal)


@pytest.mark.parametrize("seqlen", [1, 17, 100])
def test_odd_lengths(seqlen, device, tma):
    tma("ptr")
    check(*qkv(1, seqlen, seqlen, 2, 2, 16, device=device), causal=True)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa(hq, hkv, causal, device, tma):
    tma("ptr")
    check(*qkv(2, 23, 29, hq, hkv, 16, device=device), causal=causal)


@pytest.mark.parametrize("head_dim", [8, 40, 64, 128, 256])
def test_head_dims(head_dim, device, tma):
    tma("ptr")
    check(*qkv(1, 19, 19, 2, 1, head_dim, device=device), causal=True)


@pytest.mark.parametrize("causal,window", [(False, (3, -1)), (False, (-1, 2)), (False, (4, 1)), (False, (0, 0)),
                                           (True, (5, -1)), (True, (6, 3)), (False, (2, 40))])
def test_sliding_window(causal, window, device, tma):
    tma("ptr")
    check(*qkv(1, 45, 41, 2, 1, 16, device=device), causal=causal, window=window)


@pytest.mark.parametrize("scale", [0.7, -0.5, 0.0])
def test_softmax_scale(scale, device, tma):
    """A negative scale makes the smallest raw score the largest; zero gives uniform weights (and must not
    turn a masked -inf into NaN). 40 rows: both the unmasked and the diagonal key blocks run."""
    tma("ptr")
    check(*qkv(1, 40, 40, 2, 1, 16, dtype=torch.float32, device=device), causal=True, softmax_scale=scale)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (4, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen(causal, window, dtype, device, tma):
    tma("ptr")
    cu = torch.tensor([0, 1, 18, 18, 50, 51, 83], dtype=torch.int32, device=device)  # lengths 1, 17, 0, 32, 1, 32
    q, k, v = (_rand(83, h, 16, dtype=dtype, device=device) for h in (4, 2, 2))
    check(q, k, v, causal=causal, window=window, cu_seqlens=cu)


@pytest.mark.parametrize("path", ["ptr", "tma"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_qkv_views(path, causal, device, tma):
    """q, k, v split from one (B, S, Hq + 2 Hkv, D) projection: strided views, no copy."""
    tma(path)
    fused = _rand(2, 33, 4 + 2 + 2, 32, dtype=torch.bfloat16, device=device)
    q, k, v = fused.split([4, 2, 2], dim=2)
    assert not q.is_contiguous() and not k.is_contiguous()
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("packed", [False, True])
def test_tma_and_pointer_paths_agree(packed, device, tma):
    """The descriptor loads and the pointer loads are one kernel: in the interpreter, bitwise equal."""
    if packed:
        cu = torch.tensor([0, 20, 21, 54], dtype=torch.int32, device=device)
        q, k, v = (_rand(54, h, 32, dtype=torch.bfloat16, device=device) for h in (2, 1, 1))
    else:
        cu = None
        q, k, v = qkv(2, 37, 37, 2, 1, 32, device=device)
    dout = torch.randn_like(q)
    results = []
    for path in ("ptr", "tma"):
        tma(path)
        with ops.use("triton"):
            got, lse = _grads(lambda *t: flash_attention(*t, causal=True, cu_seqlens=cu, return_lse=True),
                              (q, k, v), dout)
        results.append(got + [lse])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["ptr", "tma"])
@pytest.mark.parametrize("hq,hkv,packed", [(4, 2, False), (2, 2, True), (3, 1, False)])
def test_qkv_entry_point_matches_split_views(path, hq, hkv, packed, device, tma):
    """flash_attention_qkv (one gradient written for qkv) and flash_attention on split views of qkv (three
    gradients, concatenated by the split's backward) are the same computation: bitwise equal outputs, LSE and
    qkv gradient, window and a dLSE included."""
    tma(path)
    cu = torch.tensor([0, 20, 21, 54], dtype=torch.int32, device=device) if packed else None
    shape = (54, hq + 2 * hkv, 32) if packed else (2, 37, hq + 2 * hkv, 32)
    qkv = _rand(*shape, dtype=torch.bfloat16, device=device)
    dout = torch.randn(*shape[:-2], hq, 32, device=device)
    dlse = torch.randn((hq, 54) if packed else (2, hq, 37), device=device)
    kw = dict(causal=True, window=(9, -1), cu_seqlens=cu, return_lse=True)
    with ops.use("triton"):
        got, lse = _grads(lambda t: flash_attention_qkv(t, hkv, **kw), (qkv,), dout, dlse)
        want, lse_want = _grads(lambda t: flash_attention(*t.split([hq, hkv, hkv], dim=-2), **kw), (qkv,), dout,
                                dlse)
    for a, b in zip(got + [lse], want + [lse_want]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="heads_kv"):
        flash_attention_qkv(qkv, hq + 2 * hkv)   # no head left for q


def test_autograd_function_matches_the_custom_op(device, tma):
    """Eager flash_attention (FlashAttnFunction.apply, no op dispatch) and the registered custom op with its
    autograd formula (what torch.compile traces) are the same computation."""
    tma("ptr")
    q, k, v = qkv(1, 21, 21, 2, 1, 16, device=device)
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(16)
    with ops.use("triton"):
        a, lse_a = _grads(lambda *t: flash_attention(*t, causal=True, return_lse=True), (q, k, v), dout)
    b, lse_b = _grads(lambda *t: torch.ops.tilewise.flash_attn_fwd(*t, None, 0, scale, -1, 0), (q, k, v), dout)
    for x, y in zip(a + [lse_a], b + [lse_b]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("entry", ["split", "qkv"])
def test_unused_lse_gets_no_gradient(entry, device, tma, monkeypatch):
    """Without return_lse the backward gets dLSE = None, not a materialized zero tensor (which the kernels
    would read, and which would keep a call off the Gluon backward); a used LSE still gets its gradient."""
    tma("ptr")
    seen = []
    real = attn._attn_backward
    monkeypatch.setattr(attn, "_attn_backward", lambda *a, **kw: seen.append(a[6]) or real(*a, **kw))
    qkv_ = _rand(1, 20, 4, 16, dtype=torch.bfloat16, device=device).requires_grad_()
    for return_lse in (False, True):
        with ops.use("triton"):
            if entry == "qkv":
                res = flash_attention_qkv(qkv_, 1, causal=True, return_lse=return_lse)
            else:
                res = flash_attention(*qkv_.split([2, 1, 1], dim=-2), causal=True, return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        loss = out.float().sum() + (lse.sum() if return_lse else 0)
        loss.backward()
    assert seen[0] is None
    assert isinstance(seen[1], torch.Tensor) and seen[1].shape == lse.shape


def test_lse_gradient(device, tma):
    """return_lse: the LSE matches and its gradient (dLSE_i * P_ij into dS) flows into q and k."""
    tma("ptr")
    check(*qkv(1, 30, 30, 2, 1, 16, dtype=torch.float32, device=device), causal=True, with_lse=True)
    check(*qkv(1, 30, 30, 2, 1, 16, device=device), causal=True, with_lse=True)


def test_packed_lse_layout(device, tma):
    tma("ptr")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    q, k, v = (_rand(12, 3, 16, dtype=torch.float32, device=device) for _ in range(3))
    with ops.use("triton"):
        out, lse = flash_attention(q, k, v, cu_seqlens=cu, return_lse=True)
    assert out.shape == q.shape and lse.shape == (3, 12)
    _, lse_ref = attention_reference(q, k, v, cu_seqlens=cu, return_lse=True)
    assert torch.allclose(lse, lse_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_are_bitwise_repeatable(deterministic, device, tma):
    tma("ptr")
    q, k, v = qkv(1, 40, 40, 4, 1, 16, device=device)  # GQA: dK/dV sum 4 query heads
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        with ops.use("triton"):
            got, _ = _grads(lambda *t: flash_attention(*t, causal=True, deterministic=deterministic),
                            (q, k, v), dout)
        runs.append(got)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_no_keys(device, tma):
    """seqlen_k = 0: every row sees no key: output 0, lse -inf, zero gradients."""
    tma("ptr")
    q, k, v = qkv(1, 5, 0, 2, 2, 16, dtype=torch.float32, device=device)
    q.requires_grad_()
    with ops.use("triton"):
        out, lse = flash_attention(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_cpu_dispatch_runs_the_reference():
    q, k, v = qkv(1, 9, 9, 2, 2, 16, dtype=torch.float32)
    with ops.use("reference"):
        ref = flash_attention(q, k, v, causal=True)
    assert torch.equal(flash_attention(q, k, v, causal=True), ref)  # auto mode, CPU tensors: the reference
    q64, k64, v64 = (t.double() for t in (q, k, v))
    with ops.use("triton"):  # float64 has no Triton path: the reference serves it
        out = flash_attention(q64, k64, v64, causal=True)
    assert out.dtype == torch.float64 and torch.allclose(out, ref.double(), atol=1e-6)


@pytest.mark.parametrize("q_len,k_len,heads_kv", [(17, 17, 4), (17, 17, 1), (5, 21, 2)])
def test_sdpa_attention_matches_float64(q_len, k_len, heads_kv):
    """ops.sdpa_attention (model.attention='sdpa'): torch's SDPA in the (B, S, H, D) layout, GQA without
    repeated K/V, a causal block of the last queries (decoding) aligned to the last key, against float64."""
    from tilewise.ops import sdpa_attention
    q, k, v = qkv(2, q_len, k_len, 4, heads_kv, 16, dtype=torch.float32)
    out = sdpa_attention(q, k, v, causal=True)
    ref, _ = _dense_attention(q.double(), k.double(), v.double(), True, 16 ** -0.5, None)
    assert out.shape == q.shape and (out.double() - ref).norm() / ref.norm() < 1e-5
    with pytest.raises(ValueError, match="sdpa_attention: q has shape"):
        sdpa_attention(q[0], k, v)


def test_torch_compile_fullgraph(device, tma):
    """The custom op traces without a graph break (fullgraph=True); aot_eager keeps CPU free of codegen."""
    tma("ptr")
    q, k, v = qkv(1, 20, 20, 2, 1, 16, dtype=torch.float32, device=device)
    dout = torch.randn_like(q)

    def fn(q_, k_, v_):
        return flash_attention(q_, k_, v_, causal=True) * 2.0

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    with ops.use("triton"):
        got, _ = _grads(compiled, (q, k, v), dout)
        want, _ = _grads(fn, (q, k, v), dout)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_opcheck(device, tma):
    """Schema, fake (meta) implementations, autograd registration and AOT dispatch of both custom ops."""
    tma("ptr")
    q, k, v = (t.requires_grad_() for t in qkv(1, 9, 9, 2, 1, 16, dtype=torch.float32, device=device))
    torch.library.opcheck(torch.ops.tilewise.flash_attn_fwd.default, (q, k, v, None, 0, 0.25, -1, 0))
    out, lse = attn._attn_forward(q.detach(), k.detach(), v.detach(), None, 0, 0.25, -1, 0)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None, None, 0, 0.25, -1, 0)
    torch.library.opcheck(torch.ops.tilewise.flash_attn_bwd.default, args)


def test_batch_split_over_grid_launches(device, tma, monkeypatch):
    """A batch larger than CUDA's grid limit (65535) is launched in chunks; here the limit is 2."""
    tma("ptr")
    monkeypatch.setattr(attn, "_MAX_GRID_YZ", 2)
    check(*qkv(5, 9, 9, 2, 1, 16, device=device), causal=True)


# ------------------------------------------------------------------------------------------ config choice

def test_fast_descriptor_matches_the_constructor():
    """Descriptors are filled without TensorDescriptor's checks (the layout test made them): the same fields."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    t = _rand(2, 24, 3, 32, dtype=torch.bfloat16, device="cpu")
    assert attn._tma_layout_ok(t, False)
    fast, ref = attn._descriptor(t, False, 64), TensorDescriptor(t, [48, 96], [96, 1], [64, 32])
    assert type(fast) is TensorDescriptor and fast.base is t
    for name in ("shape", "strides", "block_shape", "padding"):
        assert getattr(fast, name) == getattr(ref, name)


def test_config_tables(monkeypatch):
    """Each head_dim class has its own candidates (the interpreter runs one small config instead);
    TILEWISE_ATTN_CONFIGS replaces a kernel's list, and a malformed value is a ValueError."""
    monkeypatch.setattr(attn, "_INTERPRET", False)
    monkeypatch.delenv("TILEWISE_ATTN_CONFIGS", raising=False)
    for kern in attn._KERNELS:
        for block_d, cls in ((16, 64), (64, 64), (128, 128), (256, 256)):
            table = attn.CONFIGS[kern.name][cls]
            for use_tma, path in ((False, "ptr"), (True, "tma")):
                got = kern.candidates(block_d, use_tma)
                assert got and got == [c[:4] for c in table if c[4:] in ((), (path,))]
                assert len(set(got)) == len(got)
                for bm, bn, warps, stages in got:
                    assert bm in (16, 32, 64, 128) and bn in (16, 32, 64, 128) and warps in (4, 8)
                    assert 1 <= stages <= 4
    monkeypatch.setenv("TILEWISE_ATTN_CONFIGS", "fwd=64,32,4,2/128,64,8,3;dq=16,16,4,1")
    assert attn._FWD.candidates(128, True) == [(64, 32, 4, 2), (128, 64, 8, 3)]
    assert attn._DQ.candidates(64, False) == [(16, 16, 4, 1)]
    assert attn._DKDV.candidates(64, False) == attn.CONFIGS["dkdv"][64]
    for bad in ("fwd=64,32", "nope=64,32,4,2", "fwd"):
        monkeypatch.setenv("TILEWISE_ATTN_CONFIGS", bad)
        with pytest.raises(ValueError, match="TILEWISE_ATTN_CONFIGS"):
            attn._FWD.candidates(64, False)


class _FakeKernel:
    """Stands in for a Triton kernel: records launches; configs in `broken`, and every descriptor
    launch when `tma_broken`, raise as a compile failure would."""

    def __init__(self, broken=(), tma_broken=False):
        self.launches, self.broken, self.tma_broken = [], set(broken), tma_broken

    def __getitem__(self, grid):
        def launch(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, USE_TMA=False, **consts):
            cfg = (BLOCK_M, BLOCK_N, num_warps, num_stages)
            if cfg in self.broken or (USE_TMA and self.tma_broken):
                raise RuntimeError(f"cannot compile {cfg}")
            self.launches.append((cfg, USE_TMA, grid, args))
        return launch


_CANDS = [(64, 64, 4, 3), (128, 64, 8, 3), (32, 32, 4, 2)]


@pytest.fixture
def fake_gpu(monkeypatch):
    """The config machinery as on the GPU (no interpreter shortcut), over _CANDS, with do_bench timing a
    launch by a fixed table: (32, 32, 4, 2) is the fastest."""
    monkeypatch.setattr(attn, "_INTERPRET", False)
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "1")
    monkeypatch.setenv("TILEWISE_ATTN_CONFIGS", "fwd=" + "/".join(",".join(map(str, c)) for c in _CANDS))
    monkeypatch.setattr(attn, "fallbacks", [])
    speed = {(64, 64, 4, 3): 3.0, (128, 64, 8, 3): 2.0, (32, 32, 4, 2): 1.0}
    timed = []

    def fake_bench(fn, **kwargs):
        fn()
        timed.append(fake.launches[-1][0])
        return speed[fake.launches[-1][0]]
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    fake = _FakeKernel()
    return fake, attn._Kernel("fwd", fake), timed


def _launch(kern, tma, batch=3, key=("k",)):
    consts = {"BLOCK_D": 64}
    attn._run(kern, tma, key, batch, lambda bm, bn, nb: (1, 2, nb), lambda bm, bn, t, b0: ("x", b0), consts)


def test_config_choice_times_skips_and_caches(fake_gpu):
    fake, kern, timed = fake_gpu
    fake.broken = {(64, 64, 4, 3)}
    _launch(kern, "off")
    assert kern.chosen[("k", False)] == (32, 32, 4, 2)
    assert sorted(timed) == [(32, 32, 4, 2), (128, 64, 8, 3)]
    assert "cannot compile" in kern.timings[("k", False)][(64, 64, 4, 3)]
    fake.launches.clear()
    timed.clear()
    _launch(kern, "off")  # the key is known: one launch, nothing timed
    assert [x[0] for x in fake.launches] == [(32, 32, 4, 2)] and timed == []
    report = attn.tuning_report()
    assert set(report) == {"fwd", "dkdv", "dq", "gluon_vs_triton"}


def test_gluon_race_keeps_the_faster_kernel_per_key(monkeypatch):
    """_gluon_wins times the Gluon and the Triton call once per key (shape class) and keeps the faster: a
    second call of the key runs nothing extra; another key races again; triton_kernels_only() takes the
    Triton call; untimed (AUTOTUNE=0) Gluon runs. tuning_report(races=prefix) lists the races of a prefix."""
    monkeypatch.setattr(attn, "_GLUON_RACES", {})
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "1")
    speed = {}
    ran = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or speed[ran[-1]])
    gluon, tri = (lambda: ran.append("gluon")), (lambda: ran.append("triton"))
    q, k = torch.empty(2, 1024, 8, 64), torch.empty(2, 1024, 2, 64)
    speed.update(gluon=2.0, triton=1.0)
    assert attn._gluon_wins("fwd", q, k, 0, gluon, tri) is False
    assert ran == ["triton", "triton", "gluon", "gluon"]   # a warm-up call each, then the timed ones
    speed.update(gluon=0.5)                                 # decided: no new timing for the same key
    assert attn._gluon_wins("fwd", q, k, 0, gluon, tri) is False and len(ran) == 4
    long_q, long_k = torch.empty(2, 4096, 8, 64), torch.empty(2, 4096, 2, 64)
    assert attn._gluon_wins("fwd", long_q, long_k, 0, gluon, tri) is True and len(ran) == 8
    assert attn._gluon_wins("bwd", q, k, 0, gluon, tri) is True        # the backward is its own key
    rows = attn.tuning_report()["gluon_vs_triton"]
    assert [(r["key"]["pass"], r["key"]["seqlen_bucket"], r["chosen"]) for r in rows] == [
        ("fwd", 1024, "triton"), ("fwd", 4096, "gluon"), ("bwd", 1024, "gluon")]
    assert rows[0]["ms"] == {"gluon": 2.0, "triton": 1.0}
    assert attn._gluon_wins("fp8_bwd", q, k, 0, gluon, tri) is True and len(ran) == 16
    assert [r["key"]["pass"] for r in attn.tuning_report([], races="fp8_")["gluon_vs_triton"]] == ["fp8_bwd"]
    assert "gluon_vs_triton" not in attn.tuning_report([])
    with attn.triton_kernels_only():      # the benchmarks' Triton baselines: the Triton call, no race
        assert attn._gluon_wins("fwd", long_q, long_k, 0, gluon, tri) is False
        assert attn._gluon_wins("fwd", q, k, 1, gluon, tri) is False and len(ran) == 16
    assert attn._gluon_wins("fwd", long_q, long_k, 0, gluon, tri) is True
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")
    assert attn._gluon_wins("fwd", q, k, -1, gluon, tri) is True and len(ran) == 16


def test_config_choice_untimed_takes_the_first_that_compiles(fake_gpu, monkeypatch):
    fake, kern, timed = fake_gpu
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")
    fake.broken = {(64, 64, 4, 3)}
    _launch(kern, "off")
    assert kern.chosen[("k", False)] == (128, 64, 8, 3) and timed == []


def test_descriptor_failure_falls_back_to_pointer_loads(fake_gpu):
    """'auto': no descriptor config compiles -> pointer loads, noted once; 'on' raises; every config
    broken raises NoConfigError, and again at once on the next call (no recompiling)."""
    fake, kern, timed = fake_gpu
    fake.tma_broken = True
    _launch(kern, "auto")
    assert ("k", True) in kern.failed and kern.chosen[("k", False)] == (32, 32, 4, 2)
    assert all(not used_tma for _, used_tma, _, _ in fake.launches)
    _launch(kern, "auto")
    assert len(attn.fallbacks) == 1 and attn.fallbacks[0][0] == "fwd"
    with pytest.raises(attn.NoConfigError):
        _launch(kern, "on")
    fake.broken = set(_CANDS)
    with pytest.raises(attn.NoConfigError, match="no fwd config"):
        _launch(kern, "off", key=("other",))
    fake.launches.clear()
    with pytest.raises(attn.NoConfigError):
        _launch(kern, "off", key=("other",))
    assert fake.launches == []


def test_batch_chunks_reach_the_kernel(fake_gpu, monkeypatch):
    fake, kern, _ = fake_gpu
    monkeypatch.setattr(attn, "_MAX_GRID_YZ", 2)
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")
    _launch(kern, "off", batch=5)
    assert [(grid[2], args[1]) for _, _, grid, args in fake.launches] == [(2, 0), (2, 2), (1, 4)]


def _bad_cases():
    t4 = torch.randn(1, 8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    p3 = torch.randn(8, 2, 16)
    return {
        "rank": dict(q=torch.randn(8, 2, 16), k=t4, v=t4),
        "packed rank": dict(q=t4, k=t4, v=t4, cu_seqlens=cu),
        "dtype mismatch": dict(q=t4.half(), k=t4, v=t4),
        "int dtype": dict(q=t4.int(), k=t4.int(), v=t4.int()),
        "head_dim not multiple of 8": dict(q=torch.randn(1, 8, 2, 12), k=torch.randn(1, 8, 2, 12),
                                           v=torch.randn(1, 8, 2, 12)),
        "head_dim over 256": dict(q=torch.randn(1, 2, 1, 264), k=torch.randn(1, 2, 1, 264),
                                  v=torch.randn(1, 2, 1, 264)),
        "k v shapes": dict(q=t4, k=t4, v=torch.randn(1, 9, 2, 16)),
        "k head_dim": dict(q=t4, k=torch.randn(1, 8, 2, 24), v=torch.randn(1, 8, 2, 24)),
        "batch": dict(q=t4, k=torch.randn(2, 8, 2, 16), v=torch.randn(2, 8, 2, 16)),
        "heads": dict(q=torch.randn(1, 8, 3, 16), k=t4, v=t4),
        "window length": dict(q=t4, k=t4, v=t4, window=(1, 2, 3)),
        "window value": dict(q=t4, k=t4, v=t4, window=(-2, 0)),
        "window type": dict(q=t4, k=t4, v=t4, window=(1.5, 0)),
        "cu_seqlens 2-d": dict(q=p3, k=p3, v=p3, cu_seqlens=cu[None]),
        "cu_seqlens too short": dict(q=p3, k=p3, v=p3, cu_seqlens=cu[:1]),
        "cu_seqlens dtype": dict(q=p3, k=p3, v=p3, cu_seqlens=cu.long()),
        "packed token count": dict(q=p3, k=torch.randn(9, 2, 16), v=torch.randn(9, 2, 16), cu_seqlens=cu),
        "cu_seqlens decreasing": dict(q=p3, k=p3, v=p3, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32)),
        "cu_seqlens end": dict(q=p3, k=p3, v=p3, cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32)),
        "cu_seqlens start": dict(q=p3, k=p3, v=p3, cu_seqlens=torch.tensor([1, 3, 8], dtype=torch.int32)),
        "max_seqlen": dict(q=p3, k=p3, v=p3, cu_seqlens=cu, max_seqlen=4),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
@pytest.mark.parametrize("mode", ["triton", "reference"])
def test_bad_input_raises_value_error(case, mode):
    kw = dict(_bad_cases()[case])
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    with ops.use(mode), pytest.raises(ValueError, match="flash_attention"):
        flash_attention(q, k, v, **kw)


def test_not_a_tensor_raises_type_error():
    t4 = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attention(t4.numpy(), t4, t4)


def test_devices_differ_raises():
    t4 = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="different devices"):
        flash_attention(t4, t4.to("meta"), t4)


# ------------------------------------------------------------------------------------------ H200

# Few distinct (head_dim, mask, load path) keys: each compiles three kernels.

@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "gluon"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_real_size(causal, path, tma):
    tma(path)
    check(*qkv(2, 2048, 2048, 16, 16, 128, device="cuda"), causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "gluon"])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_gpu_head_dims_gqa(head_dim, path, tma):
    tma(path)  # 96 is not a power of two: the pointer path; Gluon takes head_dim 64 only of these
    check(*qkv(2, 1000, 1000, 8, 2, head_dim, device="cuda"), causal=True)


@pytest.mark.gpu
def test_gpu_gluon_kernels_take_the_calls_they_cover(tma, calls_taken):
    """flash_attention's forward goes to attention_sm90 and its backward to attention_sm90_bwd for a dense
    causal or full call with equal lengths, fused-QKV views included (no copy); windows, unequal lengths,
    head_dim 96 and a dLSE stay on the Triton kernels. Either way the results match the float64 reference
    (check)."""
    from tilewise.ops import attention_sm90, attention_sm90_bwd
    if not (attention_sm90.available("cuda") and attention_sm90_bwd.available("cuda")):
        pytest.skip(f"no Gluon kernels here ({attention_sm90._GLUON_ERROR})")
    tma("gluon")
    taken = calls_taken(check, fwd=(attention_sm90, "forward"), bwd=(attention_sm90_bwd, "backward"))
    fused = _rand(2, 777, 12, 128, dtype=torch.bfloat16, device="cuda")
    assert taken(*fused.split([8, 2, 2], dim=2), causal=True) == (True, True)
    assert taken(*qkv(1, 300, 300, 4, 4, 64, dtype=torch.float16, device="cuda")) == (True, True)
    assert taken(*qkv(1, 300, 300, 4, 2, 128, device="cuda"), causal=True, with_lse=True) == (True, False)
    assert taken(*qkv(1, 300, 300, 4, 4, 128, device="cuda"), window=(64, 0)) == (False, False)
    assert taken(*qkv(1, 200, 300, 4, 4, 128, device="cuda"), causal=True) == (False, False)
    assert taken(*qkv(1, 300, 300, 4, 4, 96, device="cuda")) == (False, False)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 8, 2), (64, 6, 6)])
def test_gpu_gluon_backward_writes_the_fused_qkv_gradient(head_dim, hq, hkv, tma):
    """flash_attention_qkv's backward writes dQ, dK, dV through the Gluon kernels straight into views of one
    qkv gradient: bitwise what the split views' three gradients give (the Gluon backward has no atomics),
    and close to the float64 reference."""
    from tilewise.ops import attention_sm90_bwd
    if not attention_sm90_bwd.available("cuda"):
        pytest.skip(f"no Gluon backward here ({attention_sm90_bwd._GLUON_ERROR})")
    tma("gluon")
    qkv_ = _rand(2, 1000, hq + 2 * hkv, head_dim, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(2, 1000, hq, head_dim, device="cuda")
    with ops.use("triton"):
        got, _ = _grads(lambda t: flash_attention_qkv(t, hkv, causal=True), (qkv_,), dout)
        want, _ = _grads(lambda t: flash_attention(*t.split([hq, hkv, hkv], dim=-2), causal=True), (qkv_,), dout)
    ref, _ = _grads(lambda t: _dense_attention(*t.split([hq, hkv, hkv], dim=-2), True, head_dim ** -0.5, None),
                    (qkv_.double(),), dout)
    for a, b, r in zip(got, want, ref):
        assert torch.equal(a, b)
        assert _rel(a, r) < 0.02, _rel(a, r)


@pytest.mark.gpu
def test_gpu_seqlens_differ_and_window(tma):
    tma("tma")
    check(*qkv(2, 700, 1500, 8, 8, 128, device="cuda"), causal=True)
    check(*qkv(1, 2048, 2048, 8, 4, 128, device="cuda"), window=(256, 0))
    check(*qkv(1, 2048, 2048, 8, 4, 128, device="cuda"), window=(100, 37))


@pytest.mark.gpu
def test_gpu_varlen_fused_qkv(tma):
    tma("tma")
    lengths = [1, 777, 2048, 1000, 3, 270]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    fused = _rand(sum(lengths), 16 + 4 + 4, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v = fused.split([16, 4, 4], dim=1)
    check(q, k, v, causal=True, cu_seqlens=cu)


@pytest.mark.gpu
def test_gpu_qkv_entry_point_matches_split_views(tma):
    """At the 1.3B preset's shape (16 heads, head_dim 128, N 2048): bitwise the split views' results (the
    Gluon forward tiles the views in place)."""
    tma("gluon")
    qkv = _rand(2, 2048, 48, 128, dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(2, 2048, 16, 128, device="cuda")
    got, _ = _grads(lambda t: flash_attention_qkv(t, 16, causal=True), (qkv,), dout)
    want, _ = _grads(lambda t: flash_attention(*t.split([16, 16, 16], dim=-2), causal=True), (qkv,), dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_tma_matches_pointer_path(tma):
    """The Hopper descriptor path against the pointer path: the same function up to accumulation order."""
    q, k, v = qkv(2, 2048, 2048, 16, 8, 128, device="cuda")
    dout = torch.randn_like(q)
    results = []
    for path in ("ptr", "tma"):
        tma(path)
        got, lse = _grads(lambda *t: flash_attention(*t, causal=True, return_lse=True), (q, k, v), dout)
        results.append(got + [lse])
    for a, b in zip(*results):
        assert _rel(a, b) < 1e-2
    assert (results[0][-1] - results[1][-1]).abs().max().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "ptr"])
def test_gpu_fast_launch_matches_normal_launch_bitwise(path, tma):
    """Attention's launches through ops.launch.FastLauncher (descriptor arguments included) give bitwise the
    results of Triton's normal launch, and the fast path is really taken after the first calls."""
    from tilewise.ops import launch
    tma(path)
    q, k, v = qkv(2, 1500, 1500, 16, 4, 128, device="cuda")
    dout = torch.randn_like(q)
    run = lambda: _grads(lambda *t: flash_attention(*t, causal=True, return_lse=True), (q, k, v), dout)  # noqa: E731
    with launch.normal_launches():
        normal = run()
    before = attn._FWD.launcher.fast_launches
    fast = run()
    fast = run()   # the first call of each key took the normal path
    for a, b in zip(normal[0] + [normal[1]], fast[0] + [fast[1]]):
        assert torch.equal(a, b)
    assert attn._FWD.launcher.fast_launches > before


def keyed_and_planned(plans, before, call):
    """The one plan made since `before` (the plans' keys then), and call()'s results on the keyed path and
    through that plan (each a list of clones), checking that the plan ran; the plan is restored."""
    (sig,) = [s for s, plan in plans.items() if plan and s not in before]
    plan, used = plans[sig], []
    try:
        plans[sig] = False                                  # the keyed path
        want = [t.clone() for t in call()]
        plans[sig] = lambda *a: used.append(1) or plan(*a)
        got = [t.clone() for t in call()]
    finally:
        plans[sig] = plan
    assert used == [1]
    return want, got


@pytest.mark.parametrize("path", ["tma", "ptr"])
def test_forward_plan_passes_the_keyed_paths_arguments(path, tma, monkeypatch):
    """The forward plan (_forward_plan) rebuilds each launch's arguments from the call signature's constants
    and the new tensors. Here its direct launch hands them to the interpreter (the GPU's direct launch is
    tests/ops/test_launch.py's): the output and LSE are bitwise the keyed path's, with the new values."""
    from tilewise.ops import launch
    tma(path)
    monkeypatch.setattr(launch.BoundLauncher, "direct",
                        lambda self, args: lambda grid, *a: self.launcher.kernel[grid](*a, **self.meta))
    monkeypatch.setattr(attn._FWD, "plans", {})

    def call(*t):
        with ops.use("triton"):
            return flash_attention(*t, causal=True, return_lse=True)
    q, k, v = qkv(2, 45, 38, 4, 2, 32)
    for _ in range(2):   # the interpreter's one config is bound on the key's second call
        call(q, k, v)
    q2, k2, v2 = qkv(2, 45, 38, 4, 2, 32)
    want, got = keyed_and_planned(attn._FWD.plans, (), lambda: call(q2, k2, v2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert _rel(got[0], attention_reference(q2, k2, v2, causal=True)) < 2e-2


@pytest.mark.parametrize("case", ["plain", "dlse", "strided dout", "padded dout", "gradient views"])
@pytest.mark.parametrize("path", ["tma", "ptr"])
def test_backward_plan_passes_the_keyed_paths_arguments(path, case, tma, monkeypatch):
    """The backward plan (_backward_plan) against the keyed path, as the forward's test does: dQ, dK, dV
    bitwise equal, with a dLSE, with a dO the keyed path copies (a last stride of 2; rows padded beyond the
    heads, which TMA cannot tile) and with gradients written into views of one tensor (flash_attention_qkv)."""
    from tilewise.ops import launch
    tma(path)
    monkeypatch.setattr(launch.BoundLauncher, "direct",
                        lambda self, args: lambda grid, *a: self.launcher.kernel[grid](*a, **self.meta))
    monkeypatch.setattr(attn._DQ, "plans", {})
    b, n, hq, hkv, d = 2, 40, 4, 2, 32
    scale = d ** -0.5

    def inputs():
        q, k, v = qkv(b, n, n, hq, hkv, d)
        out, lse = attn._attn_forward(q, k, v, None, 0, scale, -1, 0)
        if case == "strided dout":
            dout = torch.randn(b, n, hq, 2 * d, dtype=q.dtype)[..., ::2]
        elif case == "padded dout":
            dout = torch.randn(b, n, hq, d + 8, dtype=q.dtype)[..., :d]
        else:
            dout = torch.randn_like(q)
        dlse = torch.randn_like(lse) if case == "dlse" else None
        grads = None
        if case == "gradient views":
            grads = torch.full((b, n, hq + 2 * hkv, d), float("nan"), dtype=q.dtype).split([hq, hkv, hkv], dim=-2)
        return (dout, q, k, v, out, lse, dlse), grads

    def backward(args, grads):
        with ops.use("triton"):
            return attn._attn_backward(*args, None, 0, scale, -1, 0, grads=grads)
    for _ in range(2):     # the interpreter's one config is bound on each kernel's second call
        backward(*inputs())
    args, grads = inputs()

    def call():
        for g in grads or ():
            g.fill_(float("nan"))      # each path writes every element of the views
        return backward(args, grads)
    want, got = keyed_and_planned(attn._DQ.plans, (), call)
    for a, w in zip(got, want):
        assert torch.equal(a, w)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "ptr"])
def test_gpu_forward_plan_matches_the_keyed_path(path, tma):
    """A padded-batch forward called again with one call signature launches through its plan (_forward_plan):
    bitwise the keyed path's output and LSE, with the new tensors' values; a q of another alignment is
    another signature, and right too."""
    tma(path)
    q, k, v = qkv(2, 1200, 1200, 16, 4, 128, device="cuda")
    call = lambda *t: flash_attention(*t, causal=True, return_lse=True)  # noqa: E731
    before = set(attn._FWD.plans)
    for _ in range(3):
        call(q, k, v)
    q2, k2, v2 = qkv(2, 1200, 1200, 16, 4, 128, device="cuda")
    want, got = keyed_and_planned(attn._FWD.plans, before, lambda: call(q2, k2, v2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    shifted = torch.empty(q2.numel() + 4, dtype=q2.dtype, device="cuda")[4:].view(q2.shape)   # 8-byte aligned
    shifted.copy_(q2)
    other = call(shifted, k2, v2)
    assert _rel(other[0], want[0]) < 1e-2 and (other[1] - want[1]).abs().max().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["tma", "ptr"])
def test_gpu_backward_plan_matches_the_keyed_path(path, tma):
    """The backward's plan on the GPU (its direct launches the compiled kernels'): dQ, dK, dV bitwise the
    keyed path's, for a dO the keyed path copies too."""
    tma(path)
    scale = 128 ** -0.5

    def inputs():
        q, k, v = qkv(2, 1200, 1200, 16, 4, 128, device="cuda")
        out, lse = attn._attn_forward(q, k, v, None, 0, scale, -1, 0)
        dout = torch.randn(2, 1200, 16, 136, dtype=q.dtype, device="cuda")[..., :128]   # rows padded: copied
        return dout, q, k, v, out, lse, None

    def backward(args):
        return attn._attn_backward(*args, None, 0, scale, -1, 0)
    before = set(attn._DQ.plans)
    for _ in range(3):
        backward(inputs())
    args = inputs()
    want, got = keyed_and_planned(attn._DQ.plans, before, lambda: backward(args))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
def test_gpu_config_that_cannot_launch_is_skipped(tma, monkeypatch):
    """A candidate far beyond the shared-memory limit (8 stages of 128 x 128 K/V tiles at head_dim 128)
    fails to launch; the next candidate runs, and the failure is on record."""
    tma("tma")
    monkeypatch.setenv("TILEWISE_ATTN_CONFIGS", "fwd=128,128,8,8/128,64,8,3")
    attn.reset_tuning()
    try:
        check(*qkv(1, 512, 512, 4, 4, 128, device="cuda"), causal=True)
        (entry,) = attn.tuning_report()["fwd"]
        assert entry["chosen"] == (128, 64, 8, 3) and isinstance(entry["ms"]["128,128,8,8"], str)
    finally:
        attn.reset_tuning()


@pytest.mark.gpu
def test_gpu_deterministic(tma):
    tma("tma")
    q, k, v = qkv(2, 2048, 2048, 16, 4, 128, device="cuda")
    dout = torch.randn_like(q)
    runs = [_grads(lambda *t: flash_attention(*t, causal=True, deterministic=True), (q, k, v), dout)[0]
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_torch_compile_inductor(tma):
    tma("tma")
    q, k, v = qkv(2, 1024, 1024, 16, 16, 128, device="cuda")
    dout = torch.randn_like(q)
    fn = lambda *t: flash_attention(*t, causal=True)  # noqa: E731
    got, _ = _grads(torch.compile(fn, fullgraph=True), (q, k, v), dout)
    want, _ = _grads(fn, (q, k, v), dout)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_memory_128k(tma):
    """Forward + backward at seqlen 131072, 16 heads, head_dim 128: under 1 GB beyond the tensors the
    caller holds (q, k, v, dout) and the ones it gets back (out, lse, dq, dk, dv)."""
    tma("tma")
    small = qkv(1, 4096, 4096, 16, 16, 128, device="cuda")  # tune at a small size first (same key)
    _grads(lambda *t: flash_attention(*t, causal=True), small, torch.randn_like(small[0]))
    del small
    q, k, v = (t.requires_grad_() for t in qkv(1, 131072, 131072, 16, 16, 128, device="cuda"))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    out.backward(dout)
    torch.cuda.synchronize()
    held = sum(t.numel() * t.element_size() for t in (out, lse, q.grad, k.grad, v.grad))
    extra = torch.cuda.max_memory_allocated() - base - held
    assert extra < 1 << 30, f"{extra / 2**30:.2f} GiB beyond inputs, outputs and gradients"
    assert not torch.isnan(out).any() and not torch.isnan(q.grad).any()


# ------------------------------------------------------------------------------------------ grid order

@triton.jit
def _grid_tile_probe(OUT, UNEVEN: tl.constexpr):
    """Writes attention._grid_tile's (tile, head, batch) at this program's launch position."""
    tile, h, b = attn._grid_tile(UNEVEN)
    t = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    tl.store(OUT + 3 * t, tile)
    tl.store(OUT + 3 * t + 1, h)
    tl.store(OUT + 3 * t + 2, b)


def grid_tile_order(grid, uneven, device="cpu"):
    """attention._grid_tile's (tile, head, batch) of each program of `grid`, in launch order, as a list."""
    out = torch.full((grid[0] * grid[1] * grid[2], 3), -1, dtype=torch.int32, device=device)
    _grid_tile_probe[grid](out, UNEVEN=uneven)
    return [tuple(row) for row in out.tolist()]


@pytest.mark.parametrize("grid", [(5, 3, 7), (4, 1, 1), (3, 17, 2), (1, 4, 5)])
def test_uneven_grids_run_every_tile_once_heaviest_first_within_sections(grid):
    """Causal grids: every (tile, head, batch) exactly once; units (batch, head) come GRID_SECTION at a time
    (the last section smaller), and in a section tile 0 of every unit before any tile 1, and so on, so the
    grid ends on its light tiles. Even grids keep the launch order."""
    n, heads, batch = grid
    even = grid_tile_order(grid, False)
    assert even == [(t, h, b) for b in range(batch) for h in range(heads) for t in range(n)]
    order = grid_tile_order(grid, True)
    assert sorted(order) == sorted(even)
    section = attn._GRID_SECTION.value
    units = heads * batch
    pos = 0
    for first in range(0, units, section):
        size = min(section, units - first)
        chunk = order[pos:pos + n * size]
        pos += n * size
        assert {h + heads * b for _, h, b in chunk} == set(range(first, first + size))
        assert [t for t, _, _ in chunk] == sorted(t for t, _, _ in chunk)
