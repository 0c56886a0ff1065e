"""Which shapes crash the Gluon FP8 backward's kernels (ops/fp8_attention_sm90_bwd.py): each (kernel, shape) runs
in its own process (a crash such as "illegal instruction" poisons the CUDA context of the process that saw it),
prepare() and then launch_dkdv or launch_dq alone, synchronized. Prints and writes one row per case: the exit
status and the last line of its error output.

    PYTHONPATH=src python3 bench/fp8_attention_sm90_bwd_probe.py --out DIR
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# (batch, seqlen, heads_q, heads_kv, head_dim, causal): the gpu tests' first ragged case first, then one change
# at a time
CASES = [(3, 1, 4, 2, 64, False), (1, 1, 4, 2, 64, False), (3, 1, 4, 4, 64, False), (3, 16, 4, 2, 64, False),
         (3, 37, 4, 2, 64, False), (3, 64, 4, 2, 64, False), (3, 130, 4, 2, 64, False), (1, 256, 2, 2, 64, False),
         (3, 1, 4, 2, 128, False), (3, 37, 4, 2, 128, False), (3, 130, 4, 2, 128, True), (1, 256, 2, 2, 128, False)]

CHILD = r"""
import sys, math, torch
from tilewise.ops import fp8_attention as f8, fp8_attention_sm90_bwd as fb
kernel = sys.argv[1]
b, n, hq, hkv, d, causal = (int(x) for x in sys.argv[2:8])
torch.manual_seed(0)
q, k, v, dout = (torch.randn(b, n, h, d, dtype=torch.bfloat16, device="cuda") for h in (hq, hkv, hkv, hq))
scale = 1.0 / math.sqrt(d)
with torch.no_grad():
    o, lse = f8._fp8_forward(q, k, v, None, 0, scale, -1, 0 if causal else -1, False)
    prep = fb.prepare(dout, q, k, v, o, lse)
    torch.cuda.synchronize()
    if kernel == "dkdv":
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        fb.launch_dkdv(prep, q, k, dk, dv, bool(causal), scale)
    else:
        dq = torch.empty_like(q)
        fb.launch_dq(prep, q, k, dq, bool(causal), scale)
    torch.cuda.synchronize()
print("ok")
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="accepted as bench/h200.sh passes it")
    args = p.parse_args()
    from common import environment, write_result
    result = {"area": "fp8_attention_sm90_bwd_probe", **environment(),
              "command": "PYTHONPATH=src python3 bench/fp8_attention_sm90_bwd_probe.py --out DIR", "rows": []}
    for case, kernel in itertools.product(CASES, ("dkdv", "dq")):
        try:
            r = subprocess.run([sys.executable, "-c", CHILD, kernel, *(str(int(x)) for x in case)],
                               capture_output=True, text=True, timeout=120)
            rc, tail = r.returncode, (r.stderr.strip().splitlines() or [r.stdout.strip()])[-1][:300]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", ""
        row = {"case": dict(zip(("batch", "seqlen", "heads_q", "heads_kv", "head_dim", "causal"), case)),
               "kernel": kernel, "rc": rc, "tail": tail}
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        write_result(result, "fp8_attention_sm90_bwd_probe.json", [args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
