"""ops.gluon_sm90: the host-side pieces the Gluon kernels share (they run on any machine)."""
import pytest
import torch

from tilewise.ops import gluon_sm90 as g


def test_token_rows_tiles_views_in_place_or_says_no():
    """The (tokens, heads * head_dim) matrix of a contiguous tensor and of a fused-QKV view shares their
    storage; a layout TMA cannot tile that way (heads not side by side, unaligned rows) gives None."""
    x = torch.randn(2, 5, 3, 64)
    rows = g.token_rows(x)
    assert rows.data_ptr() == x.data_ptr() and torch.equal(rows, x.reshape(10, 192))
    fused = torch.randn(2, 5, 7, 64, dtype=torch.bfloat16)
    q, k, v = fused.split([3, 2, 2], dim=2)
    for t in (q, k, v):
        rows = g.token_rows(t)
        assert rows.data_ptr() == t.data_ptr() and torch.equal(rows, t.reshape(10, -1))
    assert g.token_rows(x.transpose(1, 2).contiguous().transpose(1, 2)) is None   # heads apart
    odd = torch.randn(2, 5, 3, 5)     # a token row of 15 fp32 elements: 60 bytes, no 16-byte multiple
    assert g.token_rows(odd) is None



def _qkv(b=2, n=16, hq=4, hkv=2, d=64):
    return torch.randn(b, n, hq, d), torch.randn(b, n, hkv, d), torch.randn(b, n, hkv, d)


def test_check_dense_accepts_a_dense_call_and_names_what_it_cannot_take():
    q, k, v = _qkv()
    g.check_dense("op", q, k, v, True, 0.125, (64, 128))
    bad = [
        ((q[0], k[0], v[0], True, 0.125), "dense"),                        # packed (varlen) layout
        ((q, k[:, :8], v[:, :8], True, 0.125), "seqlen"),
        ((q, k, v[..., :32], True, 0.125), "do not match"),
        ((torch.randn(2, 16, 4, 96), torch.randn(2, 16, 2, 96), torch.randn(2, 16, 2, 96), True, 0.1), "head_dim"),
        ((q, *_qkv(hkv=3)[1:], True, 0.125), "multiple"),
        ((q, k, v, True, 0.0), "softmax_scale"),
        ((q, k, v, True, float("inf")), "softmax_scale"),
        ((q, k, v, (64, 0), 0.125), "causal"),                              # a window
        ((*_qkv(b=0), False, 0.125), "empty"),
        ((q, k, v.double().numpy(), False, 0.125), "tensors"),
    ]
    for args, words in bad:
        with pytest.raises(ValueError, match=words):
            g.check_dense("op", *args, (64, 128))


def test_no_sm90_without_cuda_and_nan_filled_outputs():
    assert g.on_sm90("cpu") is False
    assert torch.isnan(g.new_output((3, 4), torch.float32, "cpu", True)).all()
    assert g.new_output((3, 4), torch.bfloat16, "cpu", False).shape == (3, 4)


@pytest.mark.gpu
def test_gpu_gluon_kernels_launch_directly_with_their_normal_launchs_results():
    """The Gluon attention kernels launch through ops.launch.FastLauncher: after the normal launch of each
    key, the direct launches (Gluon descriptors among their arguments) give bitwise the same outputs."""
    from tilewise.ops import attention_sm90 as a9, attention_sm90_bwd as b9, launch
    from tilewise.ops import fp8_attention_sm90 as f9, fp8_attention_sm90_bwd as fb
    if not all(m.available("cuda") for m in (a9, b9, f9, fb)):
        pytest.skip("no Gluon kernels here")
    torch.manual_seed(0)
    q = torch.randn(2, 700, 8, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 700, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    dout = torch.randn_like(q)
    scale = 128 ** -0.5

    def run():
        o, lse = a9.forward(q, k, v, True, scale)
        o8, lse8 = f9.forward(q, *f9.quantize_kv(k, v), True, scale)
        return [o, lse, *b9.backward(dout, q, k, v, o, lse, True, scale), o8, lse8,
                *fb.backward(dout, q, k, v, o8, lse8, True, scale)]
    used = [a9._FWD_LAUNCH, b9.LAUNCHERS["dkdv"], b9.LAUNCHERS["dq"], f9._FWD_LAUNCH, *fb.LAUNCHERS.values()]
    with launch.normal_launches():
        want = run()
    run()   # each key's first launch: the normal one, whose compiled kernel is kept
    before = [lc.fast_launches for lc in used]
    got = run()
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert all(lc.fast_launches > n for lc, n in zip(used, before))


if g.gl is not None:
    gl = g.gl

    @g.gluon.jit
    def _grid_tile_probe(OUT, CAUSAL: gl.constexpr):
        """Writes grid_tile's (tile, head, batch) at this program's launch position."""
        tile, h, b = g.grid_tile(CAUSAL)
        t = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
        gl.store(OUT + 3 * t, tile)
        gl.store(OUT + 3 * t + 1, h)
        gl.store(OUT + 3 * t + 2, b)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", [(5, 3, 7), (16, 16, 8), (3, 17, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_grid_tile_is_attention_triton_grid_order(grid, causal):
    """grid_tile (the Gluon kernels' program order) is attention._grid_tile's (the Triton kernels'), which
    tests/ops/test_attention.py holds to its contract: the same (tile, head, batch) at every launch position."""
    if not g.on_sm90("cuda"):
        pytest.skip("no sm_90 GPU")
    from test_attention import grid_tile_order
    out = torch.full((grid[0] * grid[1] * grid[2], 3), -1, dtype=torch.int32, device="cuda")
    _grid_tile_probe[grid](out, CAUSAL=causal, num_warps=1)
    assert [tuple(r) for r in out.tolist()] == grid_tile_order(grid, causal, "cuda")
