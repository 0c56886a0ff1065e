"""ops.attention_sm90: the Gluon Hopper forward against a float64 reference and attention.py's Triton forward.

The kernel runs only on a CUDA sm_90 GPU (the interpreter cannot run Gluon): those tests are gpu-marked and
skip elsewhere, or where available() says no. Outputs start as NaN (_NAN_FILL), so an element no program
writes fails. The error bound: 2x the Triton forward's error against the same float64 reference (plus a
floor), for o and for lse. The persistent schedule's configs (a fifth element 1) are also held to the grid
schedule's (o, lse) of the same tiles, bit for bit, on shapes of many more and of fewer tiles than SMs.
"""
import math

import pytest
import torch

from tilewise.ops import attention as attn
from tilewise.ops import attention_sm90 as a9
from tilewise.ops.attention import flash_attention

ABS_FLOOR = 1e-6


@pytest.fixture(autouse=True)
def _seed_and_nan_fill(monkeypatch):
    torch.manual_seed(1234)
    monkeypatch.setattr(a9, "_NAN_FILL", True)
    monkeypatch.setenv("TILEWISE_ATTN_AUTOTUNE", "0")
    with attn.triton_kernels_only():   # flash_attention: the Triton kernel to compare with
        yield


def test_imports_and_is_unavailable_on_cpu():
    assert a9.available(torch.device("cpu")) is False
    assert a9.available("cpu") is False
    q = torch.randn(1, 16, 2, 64)
    with pytest.raises(ValueError):
        a9.forward(q, q, q, causal=False, softmax_scale=0.125)


def _reference(q, k, v, causal, scale):
    """float64 o (q's layout) and natural-log lse (batch, heads_q, seqlen)."""
    group = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))   # (batch, heads, seqlen, d)
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vd
    return o.transpose(1, 2), lse


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


def check(batch, seqlen, hq, hkv, d, causal, dtype=torch.bfloat16, config=None):
    if not a9.available("cuda"):
        pytest.skip(f"no sm_90 GPU with Gluon: {a9._GLUON_ERROR}")
    q = torch.randn(batch, seqlen, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(batch, seqlen, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(batch, seqlen, hkv, d, dtype=dtype, device="cuda")
    scale = 1.0 / math.sqrt(d)
    o, lse = a9.forward(q, k, v, causal=causal, softmax_scale=scale, config=config)
    torch.cuda.synchronize()
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert lse.shape == (batch, hq, seqlen) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert not o.isnan().any(), "unwritten or NaN output elements"
    assert not lse.isnan().any(), "unwritten or NaN lse elements"
    ref_o, ref_lse = _reference(q, k, v, causal, scale)
    with torch.no_grad():
        t_o, t_lse = flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    for name, got, tri, ref in (("o", o, t_o, ref_o), ("lse", lse, t_lse, ref_lse)):
        e, e_tri = _err(got, ref), _err(tri, ref)
        assert e <= 2 * e_tri + ABS_FLOOR + (1e-5 if name == "lse" else 0.0), (name, e, e_tri)
    return o, lse


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_matches_reference(head_dim, causal):
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
    """Lengths that are no multiple of any tile: the last key block is masked, the last query rows unstored
    (and the next sequence's rows, which the tiles read, must not leak in: batch 3)."""
    check(3, seqlen, 4, 2, head_dim, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, (64, 128, 2), (64, 64, 3)])
@pytest.mark.parametrize("seqlen", [130, 1100])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_tree_rows(head_dim, causal, seqlen, config, monkeypatch):
    """TREE_ROWS (gluon_sm90.row_max / row_sum's trees): the chains' bounds, masked blocks included, at
    BLOCK_N 128 and 64, the persistent default (None) and the grid schedule."""
    monkeypatch.setattr(a9, "TREE_ROWS", True)
    check(3, seqlen, 4, 2, head_dim, causal, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_every_config(head_dim):
    for cfg in a9.CONFIGS[head_dim]:
        for causal in (False, True):
            check(2, 1000, 4, 2, head_dim, causal, config=cfg)


@pytest.mark.gpu
def test_gpu_real_size():
    check(2, 4096, 16, 16, 128, True)
    check(1, 4096, 16, 4, 128, False)


@pytest.mark.gpu
def test_gpu_unsupported_raises_value_error():
    if not a9.available("cuda"):
        pytest.skip("no sm_90 GPU with Gluon")
    q = torch.randn(1, 128, 2, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="seqlen"):
        a9.forward(q, k, k, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(1, 128, 2, 96, dtype=torch.bfloat16, device="cuda")
        a9.forward(x, x, x, causal=False, softmax_scale=0.1)
    with pytest.raises(ValueError, match="bf16"):
        x = torch.randn(1, 128, 2, 128, device="cuda")
        a9.forward(x, x, x, causal=False, softmax_scale=0.1)


# The persistent schedule (a config's fifth element): CONFIGS' persistent entries per head_dim.
PERSISTENT = {d: [c for c in a9.CONFIGS[d] if len(c) > 4 and c[4]] for d in a9.CONFIGS}


def test_persistent_configs_parse():
    assert all(PERSISTENT[d] for d in (64, 128)), "CONFIGS has no persistent entry"
    assert all(len(a9.CONFIGS[d][0]) < 5 for d in (64, 128)), "the grid schedule's default is persistent"
    assert a9._config((64, 128, 2), 128) == (64, 128, 2, False, False)
    assert a9._config((64, 128, 2, 1), 128) == (64, 128, 2, True, False)
    assert a9._config((64, 128, 2, 0, 1), 128) == (64, 128, 2, False, True)
    for d in (64, 128):
        assert a9.default_config(d, a9.PERSISTENT_UP_TO) == PERSISTENT[d][0]
        assert a9.default_config(d, a9.PERSISTENT_UP_TO + 1) == a9.CONFIGS[d][0]
    with pytest.raises(ValueError, match="PINGPONG"):
        a9._config((64, 128, 2, 1, 1), 128)
    with pytest.raises(ValueError, match="not"):
        a9._config((64, 128, 2, 0, 1, 0), 128)


def test_causal_section_fits_l2_share():
    l2 = 50 << 20
    units = a9._causal_section(1024, 64, 1, 2, l2)     # 256 KiB of K/V a head
    assert units * 2 * 1024 * 64 * 2 <= l2 * a9._L2_SHARE < (units + 1) * 2 * 1024 * 64 * 2
    assert a9._causal_section(1024, 64, 4, 2, l2) == 4 * units   # GQA: 4 query heads share one KV head's
    assert a9._causal_section(1 << 20, 128, 1, 2, l2) == 1


def _persistent_matches_grid(batch, seqlen, hq, hkv, d, causal, cfg):
    """check() of persistent config cfg, then its (o, lse) against the grid schedule's of the same tiles:
    the same arithmetic row by row, so equal bit for bit."""
    o, lse = check(batch, seqlen, hq, hkv, d, causal, config=cfg)
    torch.manual_seed(1234)
    q = torch.randn(batch, seqlen, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, seqlen, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(batch, seqlen, hkv, d, dtype=torch.bfloat16, device="cuda")
    scale = 1.0 / math.sqrt(d)
    o_p, lse_p = a9.forward(q, k, v, causal=causal, softmax_scale=scale, config=cfg)
    o_g, lse_g = a9.forward(q, k, v, causal=causal, softmax_scale=scale, config=cfg[:3])
    torch.cuda.synchronize()
    assert torch.equal(o_p, o_g) and torch.equal(lse_p, lse_g), (cfg, (o_p.float() - o_g.float()).abs().max())
    return o, lse


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [77, 1000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_persistent_ragged_gqa(seqlen, head_dim, causal):
    """Ragged lengths (the last key block masked, the last rows unstored) with GQA, every persistent config,
    each against the Triton kernel and the grid schedule."""
    for cfg in PERSISTENT[head_dim]:
        _persistent_matches_grid(3, seqlen, 4, 2, head_dim, causal, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_persistent_many_tiles(head_dim, causal):
    """Many more tiles than SMs (each program runs several; the ring's slots and Q's phase carried over):
    4 x 1030 x 16 heads is 576 tiles at BLOCK_M 64, ragged, GQA 4."""
    for cfg in PERSISTENT[head_dim]:
        _persistent_matches_grid(4, 1030, 16, 4, head_dim, causal, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 128, 1, 1), (1, 1, 1, 1), (1, 77, 2, 1), (2, 300, 3, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_persistent_fewer_tiles_than_sms(shape, head_dim, causal):
    """Fewer tiles than SMs: a grid of one program per tile (1 x 128 x 1 head: one tile)."""
    for cfg in PERSISTENT[head_dim]:
        _persistent_matches_grid(*shape, head_dim, causal, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("section", [1, 3, 1000])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_persistent_causal_sections(section, head_dim, monkeypatch):
    """Causal sections of 1, 3 (5 x 2 = 10 units: a last section of 1) and all units."""
    monkeypatch.setattr(a9, "_causal_section", lambda *args: section)
    _persistent_matches_grid(5, 700, 2, 1, head_dim, True, PERSISTENT[head_dim][0])


@pytest.mark.gpu
def test_gpu_persistent_fp16_real_size():
    for cfg in PERSISTENT[128]:
        check(2, 2048, 16, 16, 128, True, dtype=torch.float16, config=cfg)
        check(1, 4096, 16, 4, 128, False, dtype=torch.float16, config=cfg)
