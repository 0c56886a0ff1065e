"""The step's plain GEMMs, one by one: torch's (cuBLAS, the heuristic's first algorithm) against ops.cublaslt's
matmul with its heuristic's first and with TUNE (the fastest of its first TUNE_ALGOS, timed once).

At the e2e configs' shapes (rows = batch x sequence): each block linear's forward (x @ W^T), data gradient
(dy @ W) and weight gradient (dy^T @ x into fp32), and the fused head's chunk GEMMs (logits, grad_hidden;
its grad_W accumulation runs with beta = 1, which TUNE leaves to the heuristic). CUDA-graph replay median ms
of each, and per config the sum over a step's calls (layers x each block GEMM, chunks x each head GEMM): what
TUNE would save the step if the GEMMs ran as they do alone (bench/e2e_ab.py --cublaslt tuned is the step).

    PYTHONPATH=src python3 bench/gemm_tune.py --out DIR
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)
from common import RESULTS, environment, write_result  # noqa: E402

cublaslt = importlib.import_module("tilewise.ops.cublaslt")
cross_entropy = importlib.import_module("tilewise.ops.cross_entropy")

# (config, tokens, d_model, layers, vocab)
CONFIGS = [("gpt2-124m", 32768, 768, 12, 50304), ("gpt-1.3b", 16384, 2048, 24, 50304)]


def graph_ms(fn):
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def gemms(tokens, d, layers, vocab):
    """(name, calls a step, M, K, N, a's layout, b's layout, out dtype): a (M, K) @ b (K, N); a layout "t" is
    the transpose of a contiguous matrix (as dy^T, W^T are)."""
    out = []
    for layer, n_in, n_out in (("qkv", d, 3 * d), ("proj", d, d), ("fc1", d, 4 * d), ("fc2", 4 * d, d)):
        out += [(f"{layer} fwd", layers, tokens, n_in, n_out, "n", "t", torch.bfloat16),
                (f"{layer} dgrad", layers, tokens, n_out, n_in, "n", "n", torch.bfloat16),
                (f"{layer} wgrad", layers, n_out, tokens, n_in, "t", "n", torch.float32)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = cross_entropy.default_chunk_rows(tokens, vocab, 2, d, sms)
    chunks = -(-tokens // rows)
    out += [("head logits", chunks, rows, d, vocab, "n", "t", torch.bfloat16),
            ("head grad_hidden", chunks, rows, vocab, d, "n", "n", torch.bfloat16)]
    return out


def operand(rows, cols, layout, g):
    t = torch.randn(*((cols, rows) if layout == "t" else (rows, cols)), device="cuda", generator=g)
    t = t.to(torch.bfloat16)
    return t.t() if layout == "t" else t


def bench(config, name, calls, M, K, N, a_layout, b_layout, out_dtype):
    g = torch.Generator(device="cuda").manual_seed(M + K + N)
    a, b = operand(M, K, a_layout, g), operand(K, N, b_layout, g)
    out = torch.empty(M, N, device="cuda", dtype=out_dtype)
    ref = a.double() @ b.double()

    def torch_mm():
        return torch.mm(a, b, out=out) if out_dtype == a.dtype else torch.mm(a, b, out_dtype=out_dtype, out=out)

    row = {"shape": {"config": config, "gemm": name, "M": M, "K": K, "N": N, "out": str(out_dtype)},
           "unit": "ms", "calls": calls, "rel_err": {}}
    for label, fn, tune in (("torch", torch_mm, False), ("cublaslt", lambda: cublaslt.matmul(a, b, out), False),
                            ("cublaslt_tuned", lambda: cublaslt.matmul(a, b, out), True)):
        cublaslt.TUNE = tune
        fn()   # plans (and with TUNE times the candidates) before the graph captures it
        row["rel_err"][label] = ((out.double() - ref).norm() / ref.norm()).item()
        row[label] = graph_ms(fn)
    cublaslt.TUNE = False
    row["tuned_vs_torch"] = row["torch"] / row["cublaslt_tuned"]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write gemm_tune.json into this directory")
    p.add_argument("--quick", action="store_true", help="GPT-2 124M only")
    args = p.parse_args()
    if not torch.cuda.is_available() or not cublaslt.available("cuda"):
        print("bench/gemm_tune.py needs a CUDA GPU and cuBLASLt", file=sys.stderr)
        return 2
    rows = []
    for config, tokens, d, layers, vocab in CONFIGS[:1] if args.quick else CONFIGS:
        step = {"torch": 0.0, "cublaslt": 0.0, "cublaslt_tuned": 0.0}
        for spec in gemms(tokens, d, layers, vocab):
            r = bench(config, *spec)
            rows.append(r)
            for k in step:
                step[k] += r["calls"] * r[k]
            print(f"{config:>9} {spec[0]:>16} {spec[2]}x{spec[3]}x{spec[4]}: torch {r['torch']:.3f} cublaslt "
                  f"{r['cublaslt']:.3f} tuned {r['cublaslt_tuned']:.3f} ms ({r['tuned_vs_torch']:.3f}x)", flush=True)
        rows.append({"shape": {"config": config, "gemm": "step total (calls x ms)"}, "unit": "ms", **step,
                     "tuned_vs_torch": step["torch"] / step["cublaslt_tuned"]})
        print(f"{config:>9} step total: torch {step['torch']:.2f} cublaslt {step['cublaslt']:.2f} tuned "
              f"{step['cublaslt_tuned']:.2f} ms")
    result = {"area": "gemm_tune", **environment(), "tune_algos": cublaslt.TUNE_ALGOS,
              "command": "TILEWISE_COMMIT=<sha> bash bench/h200.sh gemm_tune", "rows": rows}
    write_result(result, "gemm_tune.json", [RESULTS, args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
