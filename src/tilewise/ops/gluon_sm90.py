"""What the Hopper Gluon kernels (attention_sm90, attention_sm90_bwd, fp8_attention_sm90) share on the host.

Gluon's Hopper API, imported under a guard: it is Triton 3.6's here, and on another Triton (CI's 3.9
interpreter) a module or a name may differ, so `gl` is None, GLUON_ERROR says why and each kernel module's
available() says False. Beside it: the warp roles' register split, the ahead-of-time build for sm_90a (what
available() tries once and the SASS scripts inspect), the device check, the token-row matrix TMA tiles, and
the argument checks every dense attention call shares.
"""
from __future__ import annotations

import functools
import math

import torch

try:  # Gluon's Hopper API as Triton 3.6 spells it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    for _name in ("async_copy_global_to_shared", "make_tensor_descriptor"):
        if not hasattr(tma, _name):
            raise ImportError(_name)
    if not hasattr(gl, "warp_specialize") or not hasattr(gl, "NVMMADistributedLayout"):
        raise ImportError("warp_specialize")
    GLUON_ERROR = None
except Exception as _e:  # noqa: BLE001 - ImportError, or an API that differs (AttributeError, TypeError)
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = None
    GLUON_ERROR = f"{type(_e).__name__}: {_e}"

# The warp roles: one producer warp with few registers (it only issues TMA copies and waits on barriers),
# two 4-warp consumer warpgroups with most of them.
PRODUCER_WARPS = 1
PRODUCER_REGS = 24
CONSUMER_REGS = 240
ROLE_CONSTS = dict(PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS)


def aot_compile(fn, consts: dict, types: dict, num_warps: int = 4):
    """fn built for sm_90a without touching a GPU: consts the constexprs, types the Triton type of each other
    argument by name (default i32); pointers specialized to 16-byte alignment, as torch's allocations are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
            if sig[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def builds_ahead(*builds) -> bool:
    """Whether every build (a callable compiling a kernel ahead of time) succeeds: a Triton whose Gluon API
    differs from 3.6's fails here, once, and the caller keeps its Triton kernels."""
    try:
        for build in builds:
            build()
        return True
    except Exception:  # noqa: BLE001 - any failure means: not available
        return False


def tensordesc_type(dtype: str, block, layout) -> str:
    """The signature type of a host TensorDescriptor argument, as aot_compile's types take it."""
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


@functools.lru_cache(maxsize=None)
def _capability(index):
    return torch.cuda.get_device_capability(index)


def on_sm90(device) -> bool:
    """Whether device is a CUDA device of compute capability 9.0 (Hopper)."""
    device = torch.device(device)
    if gl is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        return _capability(device.index if device.index is not None else torch.cuda.current_device()) == (9, 0)
    except Exception:  # noqa: BLE001 - no driver, a bad index
        return False


def token_rows(t):
    """t (batch, seqlen, heads, head_dim) as the (batch * seqlen, heads * head_dim) matrix TMA tiles, without
    a copy: the heads of a token side by side, tokens at one stride (a fused QKV projection's views too),
    16-byte aligned. None when the layout does not allow it."""
    b, n, h, d = t.shape
    s0, s1, s2, s3 = t.stride()
    if s3 != 1 or (s2 != d and h > 1) or (s0 != n * s1 and b > 1) or (s1 * t.element_size()) % 16 \
            or t.data_ptr() % 16:
        return None
    return t.as_strided((b * n, h * d), (s1, 1))


def as_rows(t):
    """t and its token_rows matrix, copied to a contiguous tensor first where its layout does not allow one."""
    rows = token_rows(t)
    if rows is None:
        t = t.contiguous() if not t.is_contiguous() else t.clone()
        rows = token_rows(t)
    return t, rows


def new_output(shape, dtype, device, nan_fill: bool):
    """An output buffer; NaN-filled with nan_fill, so that an element no program writes shows in a test."""
    if nan_fill:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def check_dense(who: str, q, k, v, causal, softmax_scale, head_dims) -> None:
    """ValueError naming what a Gluon attention kernel cannot take of a dense call: q, k, v tensors of the
    (batch, seqlen, heads, head_dim) layout on q's device, k and v of one shape and batch, equal sequence
    lengths, head_dim in head_dims, heads_q a multiple of heads_kv, a positive finite scale, a bool causal (no
    windows), no empty input, batch and heads within the grid's 65535. Dtypes are the caller's to check."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError(f"{who}: q, k, v must be tensors")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{who}: only the dense (batch, seqlen, heads, head_dim) layout is supported "
                         "(no varlen / cu_seqlens)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{who}: q, k, v on different devices ({q.device}, {k.device}, {v.device})")
    batch, seqlen, heads, d = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != d:
        raise ValueError(f"{who}: k, v shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if k.shape[1] != seqlen:
        raise ValueError(f"{who}: seqlen_q != seqlen_k ({seqlen} != {k.shape[1]}) is not supported")
    if d not in head_dims:
        raise ValueError(f"{who}: head_dim {d} is not supported (only {sorted(head_dims)})")
    if heads % k.shape[2]:
        raise ValueError(f"{who}: heads_q {heads} is not a multiple of heads_kv {k.shape[2]}")
    if not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"{who}: softmax_scale must be a positive finite number, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise ValueError(f"{who}: causal must be a bool (no sliding windows)")
    if batch * seqlen * heads == 0:
        raise ValueError(f"{who}: empty inputs are not supported")
    if batch > 65535 or heads > 65535:
        raise ValueError(f"{who}: batch {batch} or heads {heads} exceeds the grid's 65535")


query_pair_work = stream_kv = kv_ring_barriers = invalidate_kv_ring = heavy_first = grid_tile = None
query_pair_tile = stream_kv_from = produce_tiles = row_max = row_sum = None
GRID_SECTION = None
if gluon is not None:
    try:
        # The (batch, head) units a causal one-program-per-tile grid launches together (grid_tile): enough that
        # a section is about one wave of 132 SMs at the short sequences, few enough that its operands stay in L2.
        # Against the (batch, head)-major order on the H200 (bench/results/sm90/grid_order_3c1a97d.json, causal,
        # kernels alone): FP8 dK/dV and dQ 1.04-1.06x at 8 x 2048 and 4 x 4096 x 16 heads (d128); bf16 dQ
        # 1.02-1.04x, bf16 dK/dV 1.01x at 8 x 2048 and 32 x 1024 (d64) but 0.98x at 4 x 4096 (its default config).
        GRID_SECTION = gl.constexpr(16)

        @gluon.jit
        def heavy_first(t, n_ranks, units, section):
            """(rank, unit) of position t of an order over n_ranks * units tiles that takes `section` units at a
            time (the last section may be smaller) and, in a section, every unit's rank-0 tile, then every
            unit's rank 1, ...: with rank 0 a unit's heaviest tile, the order ends on the lightest ones."""
            first_unit = (t // (section * n_ranks)) * section
            in_section = t - first_unit * n_ranks
            size = gl.minimum(section, units - first_unit)
            return in_section // size, first_unit + in_section % size

        @gluon.jit
        def grid_tile(CAUSAL: gl.constexpr):
            """(tile, head, batch) of this program of a grid (tiles, heads, batch). Causal, where a unit's tiles
            differ in work: the programs in launch order go through heavy_first (tile = rank, GRID_SECTION
            units a section), so the caller's tile 0 should be its heaviest. The last programs launched are then
            light ones and the SMs run out of work together; the grid's own order (a unit's tiles heaviest first,
            unit after unit) ends on whole units, heavy tiles among them. Non-causal: the grid's order (a unit's
            tiles run side by side and share its operands in L2)."""
            tile = gl.program_id(0)
            h = gl.program_id(1)
            b = gl.program_id(2)
            if CAUSAL:
                n_tiles = gl.num_programs(0)
                heads = gl.num_programs(1)
                tile, unit = heavy_first(tile + n_tiles * (h + heads * b), n_tiles, heads * gl.num_programs(2),
                                         GRID_SECTION)
                h = unit % heads
                b = unit // heads
            return tile, h, b

        @gluon.jit
        def row_max(x, M: gl.constexpr, N: gl.constexpr, ROW: gl.constexpr, TREE: gl.constexpr):
            """gl.max(x, 1) of an (M, N) wgmma accumulator; with TREE as a tree: the column halves are folded
            in registers (a reshape to (M, 2, N / 2) moves no data: the top column bit is a register bit of the
            layout) down to 8 columns, then gl.max (its in-thread pair and quad shuffles). gl.max alone folds a
            thread's N / 4 values of a row in one dependent chain; ncu on the FP8 forward found its FMNMXs
            the most stalled instructions (fixed-latency waits). ROW: the layout of gl.max(x, 1) (the tree's
            result is the same distribution under another name: the conversion moves nothing)."""
            if TREE:
                for i in gl.static_range(0, 8):
                    if (N >> i) > 8:
                        x = gl.max(gl.reshape(x, [M, 2, (N >> i) // 2]), 1)
            return gl.convert_layout(gl.max(x, 1), ROW)

        @gluon.jit
        def row_sum(x, M: gl.constexpr, N: gl.constexpr, ROW: gl.constexpr, TREE: gl.constexpr):
            """gl.sum(x, 1); with TREE as row_max's tree (a different float32 summation order)."""
            if TREE:
                for i in gl.static_range(0, 8):
                    if (N >> i) > 8:
                        x = gl.sum(gl.reshape(x, [M, 2, (N >> i) // 2]), 1)
            return gl.convert_layout(gl.sum(x, 1), ROW)

        @gluon.jit
        def query_pair_work(seqlen, group, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
            """A program of a grid (query tile pairs, heads_q, batch) over key blocks: its query head h, batch
            b, key/value head hk (GQA groups of `group`), first query row m0 (two BLOCK_M-row tiles from
            there) and key-block count; causal: the latest (heaviest) pairs first, in grid_tile's order."""
            pid, h, b = grid_tile(CAUSAL)
            if CAUSAL:
                pid = gl.num_programs(0) - 1 - pid
            m0 = pid * (2 * BLOCK_M)
            if CAUSAL:
                n_blocks = gl.cdiv(gl.minimum(m0 + 2 * BLOCK_M, seqlen), BLOCK_N)
            else:
                n_blocks = gl.cdiv(seqlen, BLOCK_N)
            return h, b, h // group, m0, n_blocks

        @gluon.jit
        def kv_ring_barriers(STAGES: gl.constexpr):
            """The mbarriers of a STAGES-deep K/V ring, initialized: k_full, v_full (one arrive: the producer's
            expect, then the TMA transaction count) and k_free, v_free (one arrive per consumer warpgroup)."""
            k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(k_full.index(i), count=1)
                mbarrier.init(v_full.index(i), count=1)
                mbarrier.init(k_free.index(i), count=2)
                mbarrier.init(v_free.index(i), count=2)
            return k_full, v_full, k_free, v_free

        @gluon.jit
        def invalidate_kv_ring(k_full, v_full, k_free, v_free, STAGES: gl.constexpr):
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(k_full.index(i))
                mbarrier.invalidate(v_full.index(i))
                mbarrier.invalidate(k_free.index(i))
                mbarrier.invalidate(v_free.index(i))

        @gluon.jit
        def stream_kv(k_desc, v_desc, k_ring, v_ring, k_full, v_full, k_free, v_free, k_row, k_col, v_row, v_col,
                      n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_TRANSPOSED: gl.constexpr):
            """A producer's key blocks: K_j (the tile at row k_row + j BLOCK_N, column k_col) and V_j (at v_row +
            j BLOCK_N, v_col; with V_TRANSPOSED the V^T tile at v_row, v_col + j BLOCK_N) into stage j % STAGES
            of their rings, each once both consumers freed the stage (k_free / v_free, waited with the opposite
            parity of the round, so the first round finds every stage free), signalled on k_full / v_full."""
            for j in range(n_blocks):
                stage = j % STAGES
                free_phase = ((j // STAGES) & 1) ^ 1
                mbarrier.wait(k_free.index(stage), free_phase)
                mbarrier.expect(k_full.index(stage), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], k_full.index(stage),
                                                k_ring.index(stage))
                mbarrier.wait(v_free.index(stage), free_phase)
                mbarrier.expect(v_full.index(stage), v_desc.block_type.nbytes)
                if V_TRANSPOSED:
                    tma.async_copy_global_to_shared(v_desc, [v_row, v_col + j * BLOCK_N], v_full.index(stage),
                                                    v_ring.index(stage))
                else:
                    tma.async_copy_global_to_shared(v_desc, [v_row + j * BLOCK_N, v_col], v_full.index(stage),
                                                    v_ring.index(stage))

        @gluon.jit
        def query_pair_tile(t, n_pairs, heads, units, section, seqlen, group, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
            """query_pair_work's (h, b, hk, m0, n_blocks) for tile t of a persistent schedule over the n_pairs *
            units tiles (units = heads * batch, unit u = head u % heads of sequence u // heads). Non-causal:
            a unit's pairs side by side, the order of the one-program-per-pair grid (the tiles running at
            once share K/V in L2). Causal: `section` units at a time (as many as have their K/V in L2; the
            last section may be smaller), a section's tiles heaviest first (every unit's latest pair, then the
            pair before, ...), so the round robin of the programs over the tiles ends on light ones. (A snake,
            every other round reversed so that program 0 does not take every round's heaviest tile, measured
            worse where the schedule is the default: see attention_sm90.PERSISTENT_UP_TO.)"""
            if CAUSAL:
                rank, unit = heavy_first(t, n_pairs, units, section)
                pair = n_pairs - 1 - rank
            else:
                pair = t % n_pairs
                unit = t // n_pairs
            h = unit % heads
            m0 = pair * (2 * BLOCK_M)
            if CAUSAL:
                n_blocks = gl.cdiv(gl.minimum(m0 + 2 * BLOCK_M, seqlen), BLOCK_N)
            else:
                n_blocks = gl.cdiv(seqlen, BLOCK_N)
            return h, unit // heads, h // group, m0, n_blocks

        @gluon.jit
        def stream_kv_from(k_desc, v_desc, k_ring, v_ring, k_full, v_full, k_free, v_free, k_row, k_col, v_row,
                           v_col, n_blocks, filled, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           V_TRANSPOSED: gl.constexpr):
            """stream_kv for a ring that `filled` earlier blocks went through (a persistent producer's earlier
            tiles): key block j takes the ring's slot filled + j, so one tile's blocks follow the last's
            without draining the ring. Returns filled + n_blocks, the next tile's `filled`."""
            for j in range(n_blocks):
                slot = filled + j
                stage = slot % STAGES
                free_phase = ((slot // STAGES) & 1) ^ 1
                mbarrier.wait(k_free.index(stage), free_phase)
                mbarrier.expect(k_full.index(stage), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, k_col], k_full.index(stage),
                                                k_ring.index(stage))
                mbarrier.wait(v_free.index(stage), free_phase)
                mbarrier.expect(v_full.index(stage), v_desc.block_type.nbytes)
                if V_TRANSPOSED:
                    tma.async_copy_global_to_shared(v_desc, [v_row, v_col + j * BLOCK_N], v_full.index(stage),
                                                    v_ring.index(stage))
                else:
                    tma.async_copy_global_to_shared(v_desc, [v_row + j * BLOCK_N, v_col], v_full.index(stage),
                                                    v_ring.index(stage))
            return filled + n_blocks

        @gluon.jit
        def produce_tiles(q_desc, k_desc, v_desc, q_tile0, q_tile1, k_ring, v_ring, q_bar, q_free, k_full, v_full,
                          k_free, v_free, seqlen, heads, group, n_pairs, units, section, n_tiles,
                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, CAUSAL: gl.constexpr, V_TRANSPOSED: gl.constexpr):
            """A persistent forward's producer, tiles pid, pid + nprog, ... in query_pair_tile's order: a tile's Q
            pair once both consumers released the last one (q_free, waited with the opposite parity of the
            tile's, so the first tile does not wait), then its K/V blocks into the ring after the last tile's
            (stream_kv_from), so they load while the consumers finish that tile. V_TRANSPOSED: V^T tiles of the
            (batch * heads_kv * head_dim, tokens) view, as the FP8 kernels read them."""
            filled = 0
            q_phase = 0
            for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
                h, b, hk, m0, n_blocks = query_pair_tile(t, n_pairs, heads, units, section, seqlen, group, BLOCK_M,
                                                         BLOCK_N, CAUSAL)
                mbarrier.wait(q_free, q_phase ^ 1)
                mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
                q_row = b * seqlen + m0
                tma.async_copy_global_to_shared(q_desc, [q_row, h * HEAD_DIM], q_bar, q_tile0)
                tma.async_copy_global_to_shared(q_desc, [q_row + BLOCK_M, h * HEAD_DIM], q_bar, q_tile1)
                if V_TRANSPOSED:
                    v_row = (b * (heads // group) + hk) * HEAD_DIM
                    v_col = 0
                else:
                    v_row = b * seqlen
                    v_col = hk * HEAD_DIM
                filled = stream_kv_from(k_desc, v_desc, k_ring, v_ring, k_full, v_full, k_free, v_free, b * seqlen,
                                        hk * HEAD_DIM, v_row, v_col, n_blocks, filled, BLOCK_N, STAGES,
                                        V_TRANSPOSED)
                q_phase ^= 1
    except Exception as _e:  # noqa: BLE001 - a Gluon whose decorators differ: the kernel modules see gl None
        GLUON_ERROR = f"{type(_e).__name__}: {_e}"
        gluon = gl = None
