"""bench/e2e.py with one tilewise setting changed: an A/B of a candidate against the defaults in the step.

Isolated kernel timings do not predict the step: at 1.3B every variant runs at the H200's 700 W board
limit (e2e.json's `clocks`: SM clock median ~1600 MHz), and the attention kernels took 1.15-1.22x their
own benches' times there (results/sm90/e2e_clocks_6e3a2a8.json). So a candidate that loses or wins in its
own bench is settled here, in the step, beside the baseline and the default variants of the same process
(they run unchanged apart from the setting):
- --attn-bwd atomic: every Gluon-covered bf16 attention backward runs attention_sm90_bwd with
  dq_mode="atomic" (dK/dV and dQ in one kernel, dQ by atomics into a zeroed float32 buffer, then a cast),
  ATOMIC_CONFIGS' writer configs, instead of racing the split kernels against the Triton ones.
- --head-chunk-mb N: cross_entropy.CHUNK_BYTES = N MiB, the logits chunk of the fused head (fewer, larger
  GEMMs; more memory).
- --head-chunk-rows N: the fused head's chunks of N token rows each (the last one the rest), whatever their
  bytes: e.g. rows whose grad_hidden GEMM fills whole waves of output tiles (at 124M a 4736-row chunk's
  4736 x 768 output is 114 tiles of 256 x 128 for 132 SMs, and the chunks' grad_hidden GEMMs took 3.54 ms a
  step against the unchunked baseline's ~2.85; results/sm90/e2e_gemm_launches_f0cb7f6.json). 11008 rows won
  (results/e2e_ab_head_rows_dfdafa8.json) and is what cross_entropy.default_chunk_rows now picks there.
- --cublaslt mlp|linear|all|tuned: cuBLASLt through ops/cublaslt.py, off by default until this settles it:
  mlp turns on ops.mlp.CUBLASLT_MLP (the GELU MLP's bias + GELU inside its first GEMM, GELU's backward inside
  its data-gradient GEMM, its bias gradient inside its weight-gradient GEMM); linear turns on cublaslt.GEMMS
  (ops.linear's GEMMs and the fused head's there, a biased linear's bias gradient from its weight-gradient
  GEMM instead of column_sums' pass: at the e2e shapes the QKV projection's); all both; tuned both and
  cublaslt.TUNE (each GEMM's algorithm the fastest of the heuristic's first eight on its first call).
- --embedding triton: ops.embedding.TRITON_EMBEDDING on (the token + position rows in one pass, the table's
  gradient as a sorted segment sum) instead of F.embedding, its add and torch's embedding backward.
Writes e2e_ab.json into --out only (never e2e.json, the README's main table).

    PYTHONPATH=src python3 bench/e2e_ab.py --out DIR --attn-bwd atomic [e2e.py's options]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

import e2e  # noqa: E402
from common import environment, write_result  # noqa: E402

# The fastest dkdv_dq configs per head_dim in bench/attention_sm90_bwd.py at the e2e shapes (6e3a2a8): the
# writer-warp ones.
ATOMIC_CONFIGS = {128: (64, 64, 2, 1, 1), 64: (64, 64, 2, 1, 2)}


def atomic_backward() -> None:
    """Route every covered bf16 backward to dq_mode='atomic' (no Gluon-against-Triton race for it)."""
    attention = importlib.import_module("tilewise.ops.attention")
    sm90_bwd = importlib.import_module("tilewise.ops.attention_sm90_bwd")
    split = sm90_bwd.backward

    def backward(dout, q, k, v, o, lse, causal, softmax_scale, **kw):
        return split(dout, q, k, v, o, lse, causal, softmax_scale, dq_mode="atomic",
                     dkdv_dq_config=ATOMIC_CONFIGS[q.shape[-1]], **kw)
    sm90_bwd.backward = backward
    races = attention._gluon_wins
    attention._gluon_wins = lambda kind, *args: kind == "bwd" or races(kind, *args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn-bwd", choices=("atomic",), help="the bf16 attention backward's dQ mode")
    p.add_argument("--head-chunk-mb", type=int, help="the fused head's logits chunk in MiB")
    p.add_argument("--head-chunk-rows", type=int, help="the fused head's chunk in token rows")
    p.add_argument("--cublaslt", choices=("mlp", "linear", "all", "tuned"), help="GEMMs through ops.cublaslt")
    p.add_argument("--embedding", choices=("triton",), help="the Triton token + position embedding on")
    args, rest = p.parse_known_args()
    names = ("attn_bwd", "head_chunk_mb", "head_chunk_rows", "cublaslt", "embedding")
    given = [name for name in names if getattr(args, name) is not None]
    if len(given) != 1:
        print("bench/e2e_ab.py: give exactly one of --attn-bwd, --head-chunk-mb, --head-chunk-rows, "
              "--cublaslt, --embedding", file=sys.stderr)
        return 2
    name = given[0]
    value = getattr(args, name)
    flag = f"--{name.replace('_', '-')} {value}"
    if name in ("head_chunk_mb", "head_chunk_rows") and value < 1:
        print(f"bench/e2e_ab.py: {flag.replace(' ', '=')}; expected >= 1", file=sys.stderr)
        return 2
    setting = {name: value}
    cross_entropy = importlib.import_module("tilewise.ops.cross_entropy")
    if name == "attn_bwd":
        atomic_backward()
        setting["configs"] = {str(d): list(c) for d, c in ATOMIC_CONFIGS.items()}
    elif name == "cublaslt":
        cublaslt = importlib.import_module("tilewise.ops.cublaslt")
        importlib.import_module("tilewise.ops.mlp").CUBLASLT_MLP = value in ("mlp", "all", "tuned")
        cublaslt.GEMMS = value in ("linear", "all", "tuned")
        cublaslt.TUNE = value == "tuned"
    elif name == "embedding":
        importlib.import_module("tilewise.ops.embedding").TRITON_EMBEDDING = True
    elif name == "head_chunk_mb":
        cross_entropy.CHUNK_BYTES = value << 20
    else:
        cross_entropy.default_chunk_rows = lambda n_rows, *_: max(1, min(value, n_rows))

    def write(rows, e2e_args):   # e2e.main calls this after every config
        which = "--quick" if e2e_args.quick else f"--configs {e2e_args.configs} --fp8 '{','.join(e2e_args.fp8)}'"
        result = {"area": f"e2e_ab ({flag})", **environment(), "setting": setting,
                  "command": f"PYTHONPATH=src python3 bench/e2e_ab.py {flag} {which} --out DIR", "rows": rows}
        write_result(result, "e2e_ab.json", [e2e_args.out])
    e2e.write = write
    sys.argv = [sys.argv[0]] + rest
    return e2e.main()


if __name__ == "__main__":
    sys.exit(main())
