"""What bounds the FP8 attention kernels: each variant removes one piece of their CUDA-core work (its
results are wrong: timing only) and times the forward and the backward against the unchanged kernels and
the bf16 kernel, at head_dim 128, seqlen 4096, batch 4, 16 heads, causal and not.

A variant is fp8_attention.py with one expression replaced, loaded from a temporary file as a module of
tilewise.ops (its relative imports resolve there). Variants: fwd_noexp (P = the exponent, no exp2),
fwd_nocvt (PV on the Q tile instead of P cast to E4M3), fwd_norescale (the accumulator never rescaled),
bwd_noexp (P^T and P without exp2 in dK/dV and dQ), bwd_norescale (dK, dQ accumulators never rescaled when
their row scale grows), bwd_noamax (no row maximum of |dS|), and pairs of them. Each kernel runs one
fixed config (CONFIGS: the tuner's choices at this shape), so the variants differ in that one piece only.

    PYTHONPATH=src python3 bench/fp8_attention_ablate.py --out DIR
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import environment, write_result  # noqa: E402

SOURCE = os.path.join(HERE, "..", "src", "tilewise", "ops", "fp8_attention.py")
FWD_EXP = "p = tl.math.exp2(s * c[:, None] - (m_use - P_LOG2)[:, None])"
FWD_DOT = "acc = tl.dot(_e4m3(p, EMU), tl.trans(vt8), acc)"
FWD_RESCALE = "acc = acc * (alpha * (vs_i / vs))[:, None]"
BWD_EXP_T = "p_t = tl.math.exp2(s_t * (qs * kc)[None, :] - (lse2 - P_LOG2)[None, :])"
BWD_EXP = "p = tl.math.exp2(s * (qc * ks)[:, None] - lse2[:, None])"
BWD_RESCALE = "acc = acc * tl.where(inv_old > 0, inv / tl.where(inv_old > 0, inv_old, 1.0), 1.0)[:, None]"
BWD_AMAX_K = "tl.max(tl.abs(g), 1)"
BWD_AMAX_Q = "tl.max(tl.abs(ds), 1) * ks"
NO_EXP = lambda line: (line, line.replace("tl.math.exp2(", "("))  # noqa: E731
NO_CVT = (FWD_DOT, "acc = tl.dot(q8, tl.trans(vt8), acc)")   # q8 has P's shape at BLOCK_N = head_dim = 128
NO_RESCALE_F = (FWD_RESCALE, "acc = acc")
NO_RESCALE_B = (BWD_RESCALE, "acc = acc")
NO_AMAX = [(BWD_AMAX_K, "(ck * 0.0 + 1.0)"), (BWD_AMAX_Q, "(cq * 0.0 + 1.0)")]
VARIANTS = {
    "fp8": [],
    "fwd_noexp": [NO_EXP(FWD_EXP)],
    "fwd_nocvt": [NO_CVT],
    "fwd_norescale": [NO_RESCALE_F],
    "fwd_noexp_nocvt": [NO_EXP(FWD_EXP), NO_CVT],
    "fwd_nocvt_norescale": [NO_CVT, NO_RESCALE_F],
    "bwd_noexp": [NO_EXP(BWD_EXP_T), NO_EXP(BWD_EXP)],
    "bwd_norescale": [NO_RESCALE_B],
    "bwd_noamax": NO_AMAX,
    "bwd_norescale_noamax": [NO_RESCALE_B] + NO_AMAX,
}
CONFIGS = {"fp8_fwd": [(64, 128, 4, 3, "tma")], "fp8_dkdv": [(64, 64, 4, 2)], "fp8_dq": [(64, 64, 4, 3)]}
SHAPE = (4, 4096, 16, 128)   # batch, seqlen, heads, head_dim


def load_variant(name: str, subs, folder: str):
    """fp8_attention.py with subs applied, as the module tilewise.ops._ablate_<name>."""
    src = open(SOURCE).read()
    for old, new in subs:
        if src.count(old) != 1:
            raise RuntimeError(f"variant {name}: {old!r} occurs {src.count(old)} times in fp8_attention.py, not once")
        src = src.replace(old, new)
    path = os.path.join(folder, f"_ablate_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    importlib.import_module("tilewise.ops")   # the variant's parent package
    spec = importlib.util.spec_from_file_location(f"tilewise.ops._ablate_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    for kernel, configs in CONFIGS.items():
        mod.set_candidates(kernel, configs, 128)
    return mod


def time_fwd_bwd(fn, q, k, v, dout, causal, flops):
    """bench/attention.py's timing (do_bench medians, the backward over one retained graph), as TFLOP/s too."""
    import triton
    from attention import time_fwd_bwd as attention_timing
    fwd, bwd, _, _ = attention_timing(triton, fn, q, k, v, causal, dout, 100)
    return {"fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": flops / fwd / 1e9, "bwd_tflops": 2.5 * flops / bwd / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="accepted as bench/h200.sh passes it; one shape already")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/fp8_attention_ablate.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tilewise.ops import flash_attention
    B, N, H, D = SHAPE
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    result = {"area": "fp8_attention_ablate", **environment(), "shape": dict(zip("BNHD", SHAPE)), "configs": CONFIGS,
              "command": "TILEWISE_COMMIT=<sha> bash bench/h200.sh fp8_attention_ablate", "rows": []}
    with tempfile.TemporaryDirectory() as folder:
        for causal in (False, True):
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            row = {"causal": causal,
                   "bf16": time_fwd_bwd(lambda q, k, v, c: flash_attention(q, k, v, causal=c), q, k, v, dout,
                                        causal, flops)}
            for name, subs in VARIANTS.items():
                try:
                    mod = load_variant(name, subs, folder)
                    row[name] = time_fwd_bwd(lambda q, k, v, c, m=mod: m.fp8_flash_attention(q, k, v, causal=c),
                                             q, k, v, dout, causal, flops)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is recorded
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"causal={causal!s:5} {name:22s} " + "  ".join(
                    f"{key} {val:.3f}" for key, val in row[name].items() if isinstance(val, float)), flush=True)
            result["rows"].append(row)
            write_result(result, "fp8_attention_ablate.json", [args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
