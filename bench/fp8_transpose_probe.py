"""Does this GPU's Triton/ptxas compile a kernel that stores an FP8 tile and its transpose correctly?

The ptxas that Triton 3.6 bundles (CUDA 12.8) does not, on sm_90: with both stores in one kernel and float32
input, a quarter of the transposed copy's bytes are foreign (NaN patterns among them), on every tile; CUDA
13.0's ptxas (TRITON_PTXAS_PATH) and a kernel with only the transposed store are correct. tilewise.ops.fp8_cast
therefore writes the two copies of a float32 tensor in separate launches (and FP8 attention's passes always
do). This script tells whether that is still needed: each way of writing the transposed copy, float32 and bf16
input, a few shapes and tiles, bytes compared with torch's cast; `clean` per (input dtype, variant).

    PYTHONPATH=src python3 bench/fp8_transpose_probe.py [--out DIR]     # writes fp8_transpose_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

SCALE = 37.5
VARIANTS = {  # how the transposed copy is written, beside the row-major one (9: alone)
    0: "tl.trans of the FP8 tile",
    1: "tl.trans of its uint8 bits",
    2: "the FP8 tile stored at transposed addresses",
    3: "tl.trans of the float32 values, cast after",
    9: "the transposed copy alone (no row-major store)",
}


@triton.jit
def _cast_kernel(x_ptr, y_ptr, yt_ptr, M, N, scale, VARIANT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32) * scale
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    y = x.to(tl.float8e4nv)
    if VARIANT != 9:
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], y, mask=mask)
    t_ptrs = yt_ptr + offs_n[:, None] * M + offs_m[None, :]
    t_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if VARIANT == 0 or VARIANT == 9:
        tl.store(t_ptrs, tl.trans(y), mask=t_mask)
    elif VARIANT == 1:
        tl.store(t_ptrs, tl.trans(y.to(tl.uint8, bitcast=True)), mask=t_mask)
    elif VARIANT == 2:
        tl.store(yt_ptr + offs_n[None, :] * M + offs_m[:, None], y, mask=mask)
    elif VARIANT == 3:
        tl.store(t_ptrs, tl.trans(x).to(tl.float8e4nv), mask=t_mask)


def wrong_bytes(x: torch.Tensor, variant: int, tile: tuple) -> tuple[int, int]:
    """(wrong bytes in the row-major copy, in the transposed copy) against torch's cast."""
    M, N = x.shape
    fill = lambda shape: torch.full(shape, 0x7F, dtype=torch.uint8, device=x.device)  # noqa: E731 - NaN
    y, yt = fill((M, N)).view(torch.float8_e4m3fn), fill((N, M)).view(torch.float8_e4m3fn)
    bm, bn, warps = tile
    _cast_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, y, yt.view(torch.uint8) if variant == 1 else yt, M, N, SCALE, VARIANT=variant, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps)
    want = (x.float() * SCALE).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad_y = 0 if variant == 9 else int((y.view(torch.uint8) != want).sum())
    return bad_y, int((yt.view(torch.uint8) != want.t()).sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write fp8_transpose_probe.json into this folder")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/fp8_transpose_probe.py: needs a CUDA GPU (it probes the GPU compiler)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows, clean = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((16384, 768), (1000, 2048), (4096, 4096)):
            x = torch.randn(shape, device="cuda", dtype=dtype)
            for variant in VARIANTS:
                for tile in ((64, 128, 8), (64, 64, 4), (128, 64, 8), (32, 128, 4)):
                    bad_y, bad_t = wrong_bytes(x, variant, tile)
                    rows.append({"dtype": str(dtype), "shape": list(shape), "variant": variant, "tile": list(tile),
                                 "wrong_bytes": bad_y, "wrong_bytes_t": bad_t})
                    key = f"{str(dtype).replace('torch.', '')} / {VARIANTS[variant]}"
                    clean[key] = clean.get(key, True) and bad_y == 0 and bad_t == 0
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "ptxas": os.environ.get("TRITON_PTXAS_PATH", "bundled"), "clean": clean, "rows": rows}
    for key, ok in clean.items():
        print(f"{'clean' if ok else 'WRONG'}  {key}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_transpose_probe.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
