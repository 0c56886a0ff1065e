"""The FP8 attention kernels compiled for sm_90 ahead of time (no GPU: Triton's own ptxas and cuobjdump), and
what their SASS says: register spills, E4M3 wgmma count, and the instruction mix of the main inner loop.

The inner loop's instruction count is what a change to the kernels' arithmetic moves, though on the H200
that arithmetic is not what bounds them (bench/fp8_attention_ablate.py: without exp2 and the E4M3 cast the
forward is 11% faster); timing them needs the GPU (bench/attention.py --fp8-only). The "inner loop"
is the first backward branch whose body holds a wgmma: the backward's interior (unmasked) query or key
blocks, and the forward's one loop over all its key blocks, the boundary blocks' mask branch included.

    python bench/fp8_attention_sass.py                     # each kernel's default config, causal, head_dim 128
    python bench/fp8_attention_sass.py --config fp8_dkdv=64,64,4,2 --both-masks --json
tests/ops/test_fp8_attention.py runs it to check that every build uses E4M3 wgmma and does not spill.
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

FP8, BF16, F32 = "*fp8e4nv", "*bf16", "*fp32"
POINTERS = {**dict.fromkeys(["Q8", "Q8T", "K8", "K8T", "V8", "V8T", "DO8", "DO8T"], FP8),
            **dict.fromkeys(["Q", "O", "DQ", "DK", "DV", "ROT"], BF16), "CU": "*i32", "CU_T": "*i32",
            **dict.fromkeys(["QS", "KS", "VS", "DOS", "LSE", "LSE2", "DELTA", "DOA"], F32),
            "qk_scale": "fp32", "grad_scale": "fp32"}


def variants(d: int):
    """name -> (kernel, extra constexprs, descriptor blocks (as functions of bm, bn))."""
    from tilewise.ops import fp8_attention as f8
    return {
        "fp8_fwd": (f8._fp8_fwd, {"ROTATE": False},
                    lambda bm, bn: {"desc_k": (bn, d), "desc_v": (d, bn)}),
        "fp8_dkdv": (f8._fp8_bwd_dkdv, {"GQA": False, "ROTATE": False},
                     lambda bm, bn: {"desc_q": (bm, d), "desc_do": (bm, d), "desc_qt": (d, bm), "desc_dot": (d, bm)}),
        "fp8_dq": (f8._fp8_bwd_dq, {"ROTATE": False},
                   lambda bm, bn: {"desc_k": (bn, d), "desc_v": (bn, d), "desc_kt": (d, bn)}),
    }


def compile_sass(fn, descs: dict, constexprs: dict, cfg) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    bm, bn, warps, stages = cfg
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = "tensordesc<fp8e4nv[%d, %d]>" % descs[name]
        else:
            sig[name] = POINTERS.get(name, "i32")
            if sig[name].startswith("*") or (sig[name] == "i32" and name not in ("left", "right", "b0")):
                attrs[(i,)] = [["tt.divisibility", 16]]   # what the launcher's arguments specialize to
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def inner_loop(sass: str) -> list[str]:
    """The instructions of the first backward branch's body that holds a wgmma, predicates dropped."""
    ins = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for addr, text in ins:
        target = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            if any("GMMA" in t for t in body):
                return [re.sub(r"^@!?U?P\w+\s+", "", t).strip() for t in body]
    return []


def report(name: str, cfg, causal: bool, d: int = 128) -> dict:
    from tilewise.ops import fp8_attention as f8
    fn, extra, descs = variants(d)[name]
    bm, bn = cfg[:2]
    consts = dict(HEAD_DIM=d, BLOCK_D=d, HAS_LEFT=False, HAS_RIGHT=causal, VARLEN=False, USE_TMA=True,
                  KV_BLOCK=f8.KV_BLOCK, EMU=False, EMU_BF16=False, BLOCK_M=bm, BLOCK_N=bn, **extra)
    sass = compile_sass(fn, descs(bm, bn), {k: v for k, v in consts.items() if k in fn.arg_names}, cfg)
    loop = inner_loop(sass)
    ops = [t.split()[0].split(".")[0] for t in loop]
    return {"kernel": name, "config": list(cfg), "causal": causal,
            "spills": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
            "fp8_mma": len(re.findall(r"QGMMA\.\S+E4M3\.E4M3", sass)),
            # waits on the tensor cores in the loop: a wgmma whose A operand sits in registers waits after
            # each of its k-steps; from shared memory the k-steps issue back to back, one wait for them all
            "inner_loop_wgmma_waits": sum(t.startswith("WARPGROUP.DEPBAR") for t in loop),
            "inner_loop": len(loop), "inner_loop_ops": dict(collections.Counter(ops).most_common())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default="fp8_fwd,fp8_dkdv,fp8_dq")
    p.add_argument("--config", action="append", default=[], metavar="KERNEL=BM,BN,WARPS,STAGES",
                   help="a config instead of the kernel's default (repeatable)")
    p.add_argument("--both-masks", action="store_true", help="non-causal builds too")
    p.add_argument("--json", action="store_true", help="one JSON list on the last line")
    args = p.parse_args(argv)
    from tilewise.ops import fp8_attention as f8
    configs = {}
    for c in args.config:
        kern, _, values = c.partition("=")
        try:
            configs[kern] = tuple(int(x) for x in values.split(","))
            assert len(configs[kern]) == 4
        except (ValueError, AssertionError):
            p.error(f"--config {c!r}: expected KERNEL=BM,BN,WARPS,STAGES, e.g. fp8_dkdv=64,64,4,2")
    out = []
    for name in args.kernels.split(","):
        cfg = configs.get(name) or tuple(f8.FP8_CONFIGS[name][128][0][:4])
        for causal in ((False, True) if args.both_masks else (True,)):
            r = report(name, cfg, causal)
            out.append(r)
            if not args.json:
                top = ", ".join(f"{k} {v}" for k, v in list(r["inner_loop_ops"].items())[:12])
                print(f"{name:14} {str(tuple(cfg)):16} causal={causal!s:5} spills {r['spills']:3}  "
                      f"E4M3 wgmma {r['fp8_mma']:3}  inner loop {r['inner_loop']:4} instructions, "
                      f"{r['inner_loop_wgmma_waits']} wgmma waits: {top}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
