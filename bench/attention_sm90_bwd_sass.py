"""The Gluon sm_90 attention backward kernels (ops/attention_sm90_bwd.py: dK/dV, dQ, and dkdv_dq, the dK/dV
kernel with atomic dQ of dq_mode="atomic") compiled ahead of time for sm_90a, no GPU needed (Triton's own ptxas
and cuobjdump), and what each build says: registers, spills, wgmma count, setmaxnreg, the wgmmas and waits of
the consumer loops, shared memory.

    python bench/attention_sm90_bwd_sass.py                  # every kernel x head_dim x causal x dtype, default configs
    python bench/attention_sm90_bwd_sass.py --all-configs --json

Needs a Triton with Gluon's Hopper API as 3.6 has it (the module's available() need not hold: no GPU is
touched). Exit status 1 when a build fails, spills or has no wgmma. The SASS helpers are
bench/attention_sm90_sass.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)   # the interpreter cannot compile
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(0, HERE)

from attention_sm90_sass import build_report  # noqa: E402


def report(kind: str, d: int, causal: bool, dtype: str, cfg) -> dict:
    from tilewise.ops import attention_sm90_bwd as b9
    return build_report({"kernel": kind, "head_dim": d, "causal": causal, "dtype": dtype, "config": list(cfg)},
                        lambda: b9.compile_sm90(kind, d, causal, dtype, cfg))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all-configs", action="store_true", help="every config of CONFIGS, not only the first")
    p.add_argument("--kernels", default="dkdv,dq,dkdv_dq")
    p.add_argument("--head-dims", default="128,64")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--json", action="store_true", help="one JSON list on the last line")
    args = p.parse_args(argv)
    from tilewise.ops import attention_sm90_bwd as b9
    if b9._GLUON_ERROR:
        print(f"no Gluon Hopper API in this Triton: {b9._GLUON_ERROR}")
        return 1
    out, bad = [], 0
    for kind in args.kernels.split(","):
        for d in map(int, args.head_dims.split(",")):
            cfgs = b9.CONFIGS[kind][d] if args.all_configs else b9.CONFIGS[kind][d][:1]
            for cfg in cfgs:
                for causal in (False, True):
                    for dtype in args.dtypes.split(","):
                        r = report(kind, d, causal, dtype, tuple(cfg))
                        out.append(r)
                        bad += not r.get("ok", False)
                        if args.json:
                            continue
                        head = f"{kind:7} d{d} {str(tuple(cfg)):16} causal={causal!s:5} {dtype}"
                        if "error" in r:
                            print(f"{head}  FAILED {r['error']}")
                            continue
                        loops = "; ".join(f"{l['instructions']} ins, {l['wgmma']} wgmma, {l['wgmma_waits']} waits, "
                                          f"{l['mufu_ex2']} ex2" for l in r["loops"][:2])
                        print(f"{head}  regs {r['registers']:3} spills {r['spill_instructions']} "
                              f"stack {r['stack']} smem {r['shared_bytes']} wgmma {r['wgmma']} "
                              f"(A in regs {r['wgmma_reg_a']}) setmaxnreg {r['setmaxnreg']}"
                              f"  consumer loops: {loops}", flush=True)
    if args.json:
        print(json.dumps(out))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
