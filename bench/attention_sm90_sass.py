"""The Gluon sm_90 attention forward (ops/attention_sm90.py) compiled ahead of time for sm_90a, no GPU needed
(Triton's own ptxas and cuobjdump), and what its build says: registers, spills, wgmma count, setmaxnreg,
the wgmma waits in the main loop, shared memory.

    python bench/attention_sm90_sass.py                    # every (head_dim, causal, dtype) at the default config
    python bench/attention_sm90_sass.py --all-configs --json     # the persistent configs (fifth element 1) too

Needs a Triton with Gluon's Hopper API as 3.6 has it (the module's available() need not hold: no GPU is
touched). Exit status 1 when a build fails, spills or has no wgmma.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # the interpreter cannot compile
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def compile_kernel(d: int, causal: bool, dtype: str, cfg):
    from tilewise.ops import attention_sm90 as a9
    return a9.compile_sm90(d, causal, dtype, cfg)


def cuobjdump(kernel, flag: str) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loops_with_wgmma(sass: str) -> list[list[str]]:
    """The innermost loops (backward branches) whose body holds a wgmma (SASS HGMMA, or QGMMA for FP8): the
    consumer warpgroups' loops, one per consumer partition. A loop that holds another such loop is left out;
    predicates are dropped."""
    ins = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans = []
    for addr, text in ins:
        target = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            if any("GMMA" in t for a, t in ins if lo <= a <= addr):
                spans.append((lo, addr))
    inner = [(lo, hi) for lo, hi in spans
             if not any((lo2, hi2) != (lo, hi) and lo <= lo2 and hi2 <= hi for lo2, hi2 in spans)]
    return [[re.sub(r"^@!?U?P\w+\s+", "", t).strip() for a, t in ins if lo <= a <= hi] for lo, hi in inner]


def build_report(r: dict, build) -> dict:
    """r updated with what the kernel build() returns says: registers, stack, shared memory, spill
    instructions, wgmma counts (16-bit HGMMA; E4M3 QGMMA; those with A from registers), setmaxnreg, and per
    consumer loop its instructions, wgmmas, wgmma waits, exp2s, barriers, shuffles and top opcodes; or the
    build's error. r["ok"]: it built, spills nothing and has a wgmma."""
    try:
        k = build()
    except Exception as e:  # noqa: BLE001 - report and go on
        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        return r
    sass = cuobjdump(k, "-sass")
    usage = cuobjdump(k, "-res-usage")
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    r.update({
        "registers": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
        "shared_bytes": k.metadata.shared,
        "spill_instructions": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        "wgmma": len(re.findall(r"\bHGMMA\.", sass)),
        "fp8_wgmma": len(re.findall(r"\bQGMMA\.\S+E4M3\.E4M3", sass)),
        "wgmma_reg_a": len(re.findall(r"\b[HQ]GMMA\.\S+\s+R\d+,\s*R\d+", sass)),
        "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])),
                             key=int),
        "loops": [{"instructions": len(b),
                   "wgmma": sum("GMMA" in t.split()[0] for t in b),
                   "wgmma_waits": sum(t.startswith("WARPGROUP.DEPBAR") for t in b),
                   "mufu_ex2": sum(t.startswith("MUFU.EX2") for t in b),
                   "bar_sync": sum(t.startswith("BAR.SYNC") for t in b),
                   "shfl": sum(t.startswith("SHFL") for t in b),
                   "top": dict(collections.Counter(t.split()[0].split(".")[0] for t in b).most_common(8))}
                  for b in loops_with_wgmma(sass)],
    })
    r["ok"] = r["spill_instructions"] == 0 and (r["wgmma"] + r["fp8_wgmma"]) > 0
    return r


def report(d: int, causal: bool, dtype: str, cfg) -> dict:
    return build_report({"head_dim": d, "causal": causal, "dtype": dtype, "config": list(cfg)},
                        lambda: compile_kernel(d, causal, dtype, cfg))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all-configs", action="store_true", help="every config of CONFIGS, not only the first")
    p.add_argument("--head-dims", default="128,64")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--json", action="store_true", help="one JSON list on the last line")
    p.add_argument("--configs", default=None, metavar="BM,BN,STAGES[,PINGPONG[,PERSISTENT]];...",
                   help="these configs instead of CONFIGS' (for every head_dim)")
    args = p.parse_args(argv)
    from tilewise.ops import attention_sm90 as a9
    out, bad = [], 0
    for d in map(int, args.head_dims.split(",")):
        cfgs = a9.CONFIGS[d] if args.all_configs else a9.CONFIGS[d][:1]
        if args.configs:
            cfgs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
        for cfg in cfgs:
            for causal in (False, True):
                for dtype in args.dtypes.split(","):
                    r = report(d, causal, dtype, tuple(cfg))
                    out.append(r)
                    bad += not r.get("ok", False)
                    if args.json:
                        continue
                    head = f"d{d} {str(tuple(cfg)):19} causal={causal!s:5} {dtype}"
                    if "error" in r:
                        print(f"{head}  FAILED {r['error']}")
                        continue
                    # the first two innermost wgmma loops are the two consumer warpgroups' key-block loops (with
                    # PERSISTENT too: the tile loops hold them)
                    loops = "; ".join(f"{l['instructions']} ins, {l['wgmma']} wgmma, {l['wgmma_waits']} waits, "
                                      f"{l['mufu_ex2']} ex2" for l in r["loops"][:2])
                    print(f"{head}  regs {r['registers']:3} spills {r['spill_instructions']} "
                          f"stack {r['stack']} smem {r['shared_bytes']} wgmma {r['wgmma']} (A in regs {r['wgmma_reg_a']}) "
                          f"setmaxnreg {r['setmaxnreg']}  consumer loops: {loops}")
    if args.json:
        print(json.dumps(out))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
