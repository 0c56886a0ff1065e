"""Where the atomic-dQ Gluon backward's time goes: each variant removes one piece of
ops/attention_sm90_bwd.py's dK/dV + dQ kernel (its dQ is wrong: timing only) and times the kernel alone against
the unchanged one and against the split mode's two kernels, at the GPT-1.3B and GPT-2 124M attention shapes and
d128 4 x 4096 x 16.

Variants (a source line replaced, the module loaded from a temporary file as tilewise.ops._ablate_<name>):
- no_atomics: the consumers' atomics (configs without a writer warp) skipped;
- writer_no_atomics: the writer warp reads the partials but adds nothing;
- writer_no_store: the consumers hand the writer nothing (no shared-memory store of the partial; the
  handshake stays);
- no_handshake: SPLIT's per-stage ds_ready wait skipped (dQ reads a half that may not be written yet).

    PYTHONPATH=src python3 bench/attention_sm90_bwd_ablate.py --out DIR
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

SOURCE = os.path.join(HERE, "..", "src", "tilewise", "ops", "attention_sm90_bwd.py")
CONSUMER_ATOMIC = """gl.atomic_add(dqa + qoffs, dq * softmax_scale, mask=gl.expand_dims(start_m + qrows < seqlen, 1),
                                  sem="relaxed")"""
WRITER_ATOMIC_SPLIT = """gl.atomic_add(base + (c * CHUNK * HEAD_DIM + half * DQ_N) + offs, part, mask=mask,
                                          sem="relaxed")"""
WRITER_ATOMIC_SUM = "gl.atomic_add(base + c * CHUNK * HEAD_DIM + offs, part, mask=mask, sem=\"relaxed\")"
CONSUMER_STORE = "dq_bufs.index(2 * dslot + WG).store(dq * softmax_scale)"
HANDSHAKE = "mbarrier.wait(ds_ready.index(stage), phase)"
VARIANTS = {
    "unchanged": [],
    "no_atomics": [(CONSUMER_ATOMIC, "dqa = dqa")],
    "writer_no_atomics": [(WRITER_ATOMIC_SPLIT, "part = part"), (WRITER_ATOMIC_SUM, "part = part")],
    "writer_no_store": [(CONSUMER_STORE, "dq = dq")],
    "no_handshake": [(HANDSHAKE, "phase = phase")],
}
# (shape (batch, seqlen, heads, head_dim), causal, dkdv_dq configs)
CELLS = [((8, 2048, 16, 128), True, [(64, 64, 2, 1), (64, 64, 2, 1, 1), (64, 64, 2, 1, 2)]),
         ((4, 4096, 16, 128), False, [(64, 64, 2, 1), (64, 64, 2, 1, 1), (64, 64, 2, 1, 2)]),
         ((32, 1024, 12, 64), True, [(64, 64, 3, 0), (64, 64, 3, 1), (64, 64, 3, 1, 1), (64, 64, 3, 1, 2)])]


def applicable(cfg) -> list[str]:
    """The variants that change something in a config's build."""
    writer = len(cfg) > 4 and cfg[4] > 0
    names = ["unchanged"] + (["writer_no_atomics", "writer_no_store"] if writer else ["no_atomics"])
    return names + (["no_handshake"] if cfg[3] else [])


def load_variant(name: str, subs, folder: str):
    """attention_sm90_bwd.py with subs applied (each must occur once), as tilewise.ops._ablate_<name>."""
    src = open(SOURCE).read()
    for old, new in subs:
        if src.count(old) != 1:
            raise RuntimeError(f"variant {name}: {old!r} occurs {src.count(old)} times, not once")
        src = src.replace(old, new)
    path = os.path.join(folder, f"_ablate_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    importlib.import_module("tilewise.ops")
    spec = importlib.util.spec_from_file_location(f"tilewise.ops._ablate_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="accepted as bench/h200.sh passes it")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/attention_sm90_bwd_ablate.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from tilewise.ops import attention as att
    from tilewise.ops import attention_sm90_bwd as b9
    result = {"area": "attention_sm90_bwd_ablate", **environment(), "unit": "ms, kernel alone (do_bench median)",
              "command": "PYTHONPATH=src python3 bench/attention_sm90_bwd_ablate.py --out DIR", "rows": []}

    def ms(fn):
        return round(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), 4)

    with tempfile.TemporaryDirectory() as folder:
        mods = {}
        for name, subs in VARIANTS.items():
            try:
                mods[name] = load_variant(name, subs, folder)
            except Exception as e:  # noqa: BLE001 - recorded
                result.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
        for (batch, seqlen, heads, d), causal, configs in CELLS:
            torch.manual_seed(0)
            q, k, v, dout = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
            scale = d ** -0.5
            o, lse = att.flash_attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
            lse2, delta = att._backward_prep(dout, o, lse, None, None, batch, seqlen, seqlen, heads, 0)
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            dq_acc = torch.zeros(batch, heads, seqlen, d, device="cuda", dtype=torch.float32)
            row = {"shape": [batch, seqlen, heads, d], "causal": causal,
                   "split_dkdv": ms(lambda: b9.launch_dkdv(q, k, v, dout, dk, dv, lse2, delta, causal, scale)),
                   "split_dq": ms(lambda: b9.launch_dq(q, k, v, dout, dq, lse2, delta, causal, scale))}
            for cfg in configs:
                for name in applicable(cfg):
                    if name not in mods:
                        continue
                    key = f"{name}_{'_'.join(map(str, cfg))}"
                    try:
                        row[key] = ms(lambda m=mods[name], c=cfg: m.launch_dkdv_dq(q, k, v, dout, dk, dv, dq_acc,
                                                                                 lse2, delta, causal, scale, c))
                    except Exception as e:  # noqa: BLE001 - recorded
                        row[key] = f"{type(e).__name__}: {str(e)[:200]}"
            print(row, flush=True)
            result["rows"].append(row)
            write_result(result, "attention_sm90_bwd_ablate.json", [args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
