"""End to end: the tilewise training step against a torch.compile'd plain PyTorch GPT of the same shape.

The baseline is what a strong PyTorch user writes: nn.LayerNorm, nn.Linear, SDPA with its default backend,
tied embeddings, fused AdamW, bf16 autocast, torch.compile on the model. Both start from the same weights
and see the same random batches; after the timed steps their losses must agree within bf16 tolerance.

    PYTHONPATH=src python3 bench/e2e.py --out DIR [--configs gpt2-124m,gpt-1.3b] [--fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import PlainGPT, environment  # noqa: E402
from tilewise.config import load_config  # noqa: E402
from tilewise.model import GPT  # noqa: E402
from tilewise.train import make_optimizer  # noqa: E402

PEAK = 989e12
SHAPES = {"gpt2-124m": (32, 1024), "gpt-1.3b": (8, 2048)}


@torch.no_grad()
def copy_weights(src: GPT, dst: PlainGPT) -> None:
    """The baseline starts from tilewise's initialization (same layout: fused qkv, tied head)."""
    dst.wte.weight.copy_(src.wte.weight)
    dst.wpe.weight.copy_(src.wpe.weight)
    for s, d in zip(src.blocks, dst.blocks):
        for sn, dn in ((s.norm1, d.ln1), (s.norm2, d.ln2)):
            dn.weight.copy_(sn.weight)
            dn.bias.copy_(sn.bias)
        d.qkv.weight.copy_(s.attn.qkv.weight)
        d.qkv.bias.copy_(s.attn.qkv.bias)
        d.proj.weight.copy_(s.attn.proj.weight)
        d.proj.bias.copy_(s.attn.proj.bias)
        d.fc.weight.copy_(s.mlp.up.weight)
        d.fc.bias.copy_(s.mlp.up_bias)
        d.out.weight.copy_(s.mlp.down.weight)
        d.out.bias.copy_(s.mlp.down.bias)
    dst.ln_f.weight.copy_(src.norm_f.weight)
    dst.ln_f.bias.copy_(src.norm_f.bias)


def time_steps(model, optimizer, batches, warmup, steps, after_step=None):
    """(median-free) mean step ms over `steps` after `warmup`, with CUDA events; returns (ms, last loss)."""
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        return loss.detach()

    for i in range(warmup):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        loss = step(*batches[(warmup + i) % len(batches)])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, loss.item()


def run_config(name: str, args) -> list[dict]:
    batch, seq = SHAPES[name]
    cfg = load_config(name, overrides=[f"model.seq_len={seq}"])
    cfg.model.vocab_size = 50304
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randint(0, 50257, (batch, seq), device="cuda", generator=gen),
                torch.randint(0, 50257, (batch, seq), device="cuda", generator=gen)) for _ in range(4)]
    tokens = batch * seq
    rows = []

    tw = GPT(cfg.model).cuda()
    flops_per_token = tw.flops_per_token()
    plain = PlainGPT(50304, seq, cfg.model.d_model, cfg.model.n_layer, cfg.model.n_head).cuda()
    copy_weights(tw, plain)

    variants = [("compiled_baseline", lambda: torch.compile(plain), plain, None)]
    variants.append(("tilewise", lambda: tw, tw, None))
    if args.compile_tilewise:
        variants.append(("tilewise_compiled", lambda: torch.compile(tw), tw, None))
    if args.fp8:
        from tilewise.fp8 import convert_to_fp8, recipe_from_config
        cfg.fp8.recipe = "delayed"
        variants.append(("tilewise_fp8", None, None, cfg))

    state0 = {k: v.clone() for k, v in tw.state_dict().items()}
    for label, build, module, fp8_cfg in variants:
        if fp8_cfg is not None:
            module = GPT(cfg.model).cuda()
            module.load_state_dict(state0)
            fp8_state = convert_to_fp8(module, recipe_from_config(cfg.fp8),
                                       skip=lambda n: n.endswith("lm_head"))
            runner, after = module, fp8_state.step
        else:
            if module is tw:
                tw.load_state_dict(state0)
            runner, after = build(), None
        optimizer = make_optimizer(module, cfg, torch.device("cuda"))
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        ms, loss = time_steps(runner, optimizer, batches, args.warmup, args.steps, after)
        tps = tokens / (ms / 1e3)
        rows.append({"shape": {"config": name, "batch": batch, "seqlen": seq}, "variant": label,
                     "tokens_per_s": round(tps), "mfu": round(flops_per_token * tps / PEAK, 4),
                     "step_ms": round(ms, 2), "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                     "loss_after": round(loss, 4), "wall_s": round(time.time() - t0, 1)})
        print(f"  {name} {label}: {tps:,.0f} tokens/s, {ms:.1f} ms/step, loss {loss:.4f}", flush=True)
        del optimizer
        torch.cuda.empty_cache()
    base = next(r for r in rows if r["variant"] == "compiled_baseline")
    for r in rows:
        r["x_baseline"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        r["loss_rel_diff"] = round(abs(r["loss_after"] - base["loss_after"]) / base["loss_after"], 4)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write e2e.json into this directory")
    p.add_argument("--configs", default="gpt2-124m,gpt-1.3b")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fp8", action="store_true", help="also time the tilewise trainer with FP8 linears")
    p.add_argument("--compile-tilewise", action="store_true", help="also time tilewise under torch.compile")
    p.add_argument("--quick", action="store_true", help="GPT-2 124M only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/e2e.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch._dynamo.config.recompile_limit = 64
    configs = ["gpt2-124m"] if args.quick else args.configs.split(",")
    rows = []
    for name in configs:
        rows += run_config(name, args)
    result = {"area": "e2e", **environment(), "command": "PYTHONPATH=src python3 bench/e2e.py", "rows": rows}
    for d in filter(None, [os.path.join(HERE, "results"), args.out]):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "e2e.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'config':<11} {'variant':<20} {'tokens/s':>10} {'MFU':>6} {'ms':>8} {'GB':>6} {'x base':>7} {'loss':>8}")
    for r in rows:
        print(f"{r['shape']['config']:<11} {r['variant']:<20} {r['tokens_per_s']:>10,} {r['mfu']:>6.1%} "
              f"{r['step_ms']:>8.1f} {r['peak_mem_gb']:>6.1f} {r['x_baseline']:>7.2f} {r['loss_after']:>8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
