"""End to end: the tilewise training step against a torch.compile'd plain PyTorch GPT of the same shape.

The baseline is what a strong PyTorch user writes: nn.LayerNorm, nn.Linear, SDPA with its default backend,
tied embeddings, fused AdamW, bf16 autocast, torch.compile on the model. tilewise runs the trainer's own
step (tilewise.train.make_step) eagerly and captured as one CUDA graph (tilewise.graphs.StepGraph, as
train.cuda_graphs does), in bf16 and, for the configs named by --fp8, with FP8 delayed scaling; and, as a
yardstick, the captured bf16 step with model.attention='sdpa' (torch's SDPA, cuDNN here, as the baseline's).
Every variant starts from the same weights, sees the same random batches and runs the same number of steps
at a constant learning rate; their losses after the last step must agree within bf16 tolerance.

After timing, --profile-steps more steps run under torch.profiler (CUDA activity only). Each row's
breakdown_ms is the GPU time per step by kind of kernel (gemm, attention, memory_bound, optimizer: AdamW
and gradient clipping) and idle = wall - busy, the time the GPU waited on the host; top_kernels lists the
largest kernels with the kind given to each and their launches per step, so the classification can be
checked. The profiler adds a little host time per launch, so an eager variant's idle is an upper bound.

    PYTHONPATH=src python3 bench/e2e.py --out DIR [--quick] [--configs gpt2-124m,gpt-1.3b] [--fp8 gpt-1.3b]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from common import RESULTS, GpuClocks, PlainGPT, environment, write_result  # noqa: E402
from tilewise.config import load_config  # noqa: E402
from tilewise.graphs import WARMUP_STEPS, StepGraph, uncaptured_optimizer_steps  # noqa: E402
from tilewise.model import GPT, branch_bias_names  # noqa: E402
from tilewise.profile import summarize_trace, trace_events  # noqa: E402
from tilewise.train import decay_groups, make_optimizer, make_step  # noqa: E402

PEAK = 989e12
SHAPES = {"gpt2-124m": (32, 1024), "gpt-1.3b": (8, 2048)}
VOCAB, REAL_VOCAB = 50304, 50257
LOSS_TOLERANCE = {"bf16": 1e-2, "fp8": 3e-2}   # relative difference of the final loss from the baseline's
DEFAULTS = {"configs": "gpt2-124m,gpt-1.3b", "fp8": "gpt-1.3b"}   # --configs, --fp8

# Kernel kinds, tried in order; anything else is memory-bound (norms, activations, casts, cross-entropy,
# embeddings, copies). Attention first: flash kernels' template names mention cutlass.
AUTOCAST = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731


@torch.no_grad()
def copy_weights(src: GPT, dst: PlainGPT) -> None:
    """The baseline starts from tilewise's initialization (same layout: fused qkv, tied head)."""
    dst.wte.weight.copy_(src.wte.weight)
    dst.wpe.weight.copy_(src.wpe.weight)
    params = dict(src.named_parameters())
    for s, d, (attn_bias, mlp_bias) in zip(src.blocks, dst.blocks, branch_bias_names(len(src.blocks))):
        for sn, dn in ((s.norm1, d.ln1), (s.norm2, d.ln2)):
            dn.weight.copy_(sn.weight)
            dn.bias.copy_(sn.bias)
        d.qkv.weight.copy_(s.attn.qkv.weight)
        d.qkv.bias.copy_(s.attn.qkv.bias)
        d.proj.weight.copy_(s.attn.proj.weight)
        d.proj.bias.copy_(params[attn_bias])
        d.fc.weight.copy_(s.mlp.up.weight)
        d.fc.bias.copy_(s.mlp.up_bias)
        d.out.weight.copy_(s.mlp.down.weight)
        d.out.bias.copy_(params[mlp_bias])
    dst.ln_f.weight.copy_(src.norm_f.weight)
    dst.ln_f.bias.copy_(src.norm_f.bias)


# ------------------------------------------------------------------------------------------------
# The variants: each is a step(x, y) -> loss (a device tensor), built from the shared initial weights
# ------------------------------------------------------------------------------------------------

def baseline_variant(init: GPT, cfg):
    c = cfg.model
    with torch.device("cuda"):
        plain = PlainGPT(VOCAB, c.seq_len, c.d_model, c.n_layer, c.n_head)
    copy_weights(init, plain)
    compiled = torch.compile(plain)
    optimizer = torch.optim.AdamW(decay_groups(plain, cfg.train.weight_decay), lr=cfg.train.lr,
                                  betas=(cfg.train.beta1, cfg.train.beta2), fused=True)   # decay as tilewise

    def step(x, y):
        with AUTOCAST():
            loss = compiled(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step, {}


def tilewise_variant(init: GPT, cfg, shape: tuple[int, int], *, graphs: bool, fp8: bool, compiled: bool = False,
                     attention: str = "flash"):
    with torch.device("cuda"):
        model = GPT(dataclasses.replace(cfg.model, attention=attention))
    model.load_state_dict(init.state_dict())
    fp8_state = None
    if fp8:
        from tilewise.fp8 import convert_to_fp8, recipe_from_config
        recipe = recipe_from_config(dataclasses.replace(cfg.fp8, recipe="delayed"))
        fp8_state = convert_to_fp8(model, recipe, skip=lambda n: n.endswith("lm_head"))
    runner = torch.compile(model) if compiled else model
    lr = torch.full((), cfg.train.lr, dtype=torch.float32, device="cuda") if graphs else None
    optimizer = make_optimizer(model, cfg, torch.device("cuda"), lr=lr)
    step_fn = make_step(runner, model, optimizer, fp8_state, AUTOCAST, 1, cfg.train.grad_clip)
    if not graphs:
        return (lambda x, y: step_fn(lambda k: (x, y))[0]), {}

    graph = StepGraph(step_fn, 1, *shape, torch.device("cuda"), model=model)
    info = {"eager_steps": 0}

    def step(x, y):
        if info["eager_steps"] < WARMUP_STEPS:
            info["eager_steps"] += 1
            with uncaptured_optimizer_steps():
                return step_fn(lambda k: (x, y))[0]
        graph.load(0, x, y)
        if not graph.captured:
            start = time.time()
            graph.capture()
            info["capture_s"] = round(time.time() - start, 2)
        return graph.replay()[0]
    return step, info


# ------------------------------------------------------------------------------------------------
# Timing and the profile
# ------------------------------------------------------------------------------------------------

def time_steps(step, batches, warmup: int, steps: int):
    """Mean step ms over `steps` after `warmup`, with CUDA events; returns (ms, loss after the last step,
    the SM clock and power while the timed steps ran: GpuClocks.summary)."""
    for i in range(warmup):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with GpuClocks() as clocks:
        start.record()
        for i in range(steps):
            loss = step(*batches[(warmup + i) % len(batches)])
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, loss.item(), clocks.summary()


def profile_breakdown(step, batches, offset: int, steps: int) -> dict:
    """GPU ms per step by kernel kind, busy (the union of kernel intervals), wall and idle = wall - busy."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(*batches[(offset + i) % len(batches)])
        torch.cuda.synchronize()
    return summarize_trace(trace_events(prof), steps)


def release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_config(name: str, args) -> list[dict]:
    batch, seq = SHAPES[name]
    cfg = load_config(name, overrides=[f"model.seq_len={seq}"])
    cfg.model.vocab_size = VOCAB
    torch.manual_seed(0)
    with torch.device("cuda"):
        init = GPT(cfg.model)
    init = init.cpu()   # the weights every variant starts from, off the GPU so peak memory is each variant's own
    flops_per_token = init.flops_per_token()
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randint(0, REAL_VOCAB, (batch, seq), device="cuda", generator=gen),
                torch.randint(0, REAL_VOCAB, (batch, seq), device="cuda", generator=gen)) for _ in range(4)]
    tokens = batch * seq

    def tw(**kw):
        return lambda: tilewise_variant(init, cfg, (batch, seq), **kw)
    variants = [("compiled_baseline", "bf16", lambda: baseline_variant(init, cfg)),
                ("tilewise", "bf16", tw(graphs=False, fp8=False)),
                ("tilewise_graphs", "bf16", tw(graphs=True, fp8=False)),
                # the same step with torch's SDPA (cuDNN here) in place of the Triton attention: what the
                # attention kernel alone costs against the baseline's
                ("tilewise_sdpa_graphs", "bf16", tw(graphs=True, fp8=False, attention="sdpa"))]
    if args.compile_tilewise:
        variants.append(("tilewise_compiled", "bf16", tw(graphs=False, fp8=False, compiled=True)))
    if name in args.fp8:
        variants += [("tilewise_fp8", "fp8", tw(graphs=False, fp8=True)),
                     ("tilewise_fp8_graphs", "fp8", tw(graphs=True, fp8=True))]

    rows = []
    for label, precision, build in variants:
        t0 = time.time()
        try:
            step, info = build()
            torch.cuda.reset_peak_memory_stats()
            ms, loss, clocks = time_steps(step, batches, args.warmup, args.steps)
        except Exception as e:  # noqa: BLE001 - a comparison variant may fail; the run keeps the rest
            if label != "tilewise_sdpa_graphs":   # the comparison
                raise
            print(f"  {name} {label}: failed ({type(e).__name__}: {str(e)[:200]}); no row", flush=True)
            release()
            continue
        peak_gb = torch.cuda.max_memory_allocated() / 1e9
        tps = tokens / (ms / 1e3)
        row = {"shape": {"config": name, "batch": batch, "seqlen": seq}, "variant": label,
               "tokens_per_s": round(tps), "mfu": round(flops_per_token * tps / PEAK, 4), "step_ms": round(ms, 2),
               "peak_mem_gb": round(peak_gb, 2), "loss_after": round(loss, 4), "precision": precision,
               "clocks": clocks}
        if args.profile_steps:
            prof = profile_breakdown(step, batches, args.warmup + args.steps, args.profile_steps)
            row["idle_ms"] = prof.get("breakdown_ms", {}).get("idle")
            row.update(prof)
        row["capture_s"] = info.get("capture_s")
        if label.startswith("tilewise") and "sdpa" not in label:
            # which attention kernels ran: the Gluon-against-Triton races of this process so far (attention.py)
            from tilewise.ops.attention import tuning_report
            row["attention_races"] = tuning_report()["gluon_vs_triton"]
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        split = row.get("breakdown_ms", {})
        print(f"  {name} {label}: {tps:,.0f} tokens/s, {ms:.1f} ms/step, {peak_gb:.1f} GB, loss {loss:.4f}"
              + (f"; per step gemm {split['gemm']}, attention {split['attention']}, memory-bound "
                 f"{split['memory_bound']}, optimizer {split['optimizer']}, idle {split['idle']} ms" if split else ""),
              flush=True)
        del step, info, build
        if "compiled" in label:
            torch._dynamo.reset()
        release()
    base = next(r for r in rows if r["variant"] == "compiled_baseline")
    for r in rows:
        r["x_baseline"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        r["loss_rel_diff"] = round(abs(r["loss_after"] - base["loss_after"]) / base["loss_after"], 4)
        r["loss_agrees"] = r["loss_rel_diff"] <= LOSS_TOLERANCE[r["precision"]]
    return rows


def write(rows: list[dict], args) -> None:
    given = {"configs": args.configs, "fp8": ",".join(args.fp8)}     # main() split --fp8 into a list
    extra = " ".join(f"--{k} {v}" for k, v in given.items() if v != DEFAULTS[k])
    command = ("TILEWISE_COMMIT=<sha> " + ("QUICK=1 " if args.quick else "BENCH_TIMEOUT=480 ")
               + (f'BENCH_ARGS="{extra}" ' if extra else "") + "bash bench/h200.sh e2e")
    from tilewise.ops.linear import fp32_out_mm_ok
    # whether the fused head accumulates grad_W with fp32-output GEMMs here (else a bf16 product + add a chunk)
    fp32_out_mm = fp32_out_mm_ok(torch.device("cuda"), torch.bfloat16)
    result = {"area": "e2e", **environment(), "command": command, "fp32_out_mm": fp32_out_mm, "rows": rows}
    write_result(result, "e2e.json", [RESULTS, args.out])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write e2e.json into this directory")
    p.add_argument("--configs", default=DEFAULTS["configs"])
    p.add_argument("--fp8", default=DEFAULTS["fp8"],
                   help="configs also timed with FP8 linears (comma list, '' for none)")
    p.add_argument("--warmup", type=int, default=WARMUP_STEPS + 1,
                   help=f"untimed steps (more than the {WARMUP_STEPS} eager steps before a graph's capture)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=5, help="steps under torch.profiler after timing (0: none)")
    p.add_argument("--compile-tilewise", action="store_true", help="also time tilewise under torch.compile")
    p.add_argument("--quick", action="store_true", help="GPT-2 124M only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/e2e.py needs a CUDA GPU", file=sys.stderr)
        return 2
    configs = ["gpt2-124m"] if args.quick else [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs + [c for c in args.fp8.split(",") if c] if c not in SHAPES]
    if unknown:
        print(f"bench/e2e.py: unknown config {unknown[0]!r}; expected one of {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    if args.warmup <= WARMUP_STEPS or args.steps < 1 or args.profile_steps < 0:
        print(f"bench/e2e.py: --warmup={args.warmup} must exceed {WARMUP_STEPS} (the graphs capture in warm-up), "
              f"--steps >= 1, --profile-steps >= 0", file=sys.stderr)
        return 2
    args.fp8 = [c for c in args.fp8.split(",") if c]
    torch._dynamo.config.recompile_limit = 64
    rows = []
    for name in configs:
        rows += run_config(name, args)
        write(rows, args)   # after every config, so a timeout keeps what ran
    print(f"\n{'config':<11} {'variant':<20} {'tokens/s':>10} {'MFU':>6} {'ms':>8} {'idle':>6} {'GB':>6} "
          f"{'x base':>7} {'loss':>8}")
    for r in rows:
        idle = f"{r['idle_ms']:>6.1f}" if r.get("idle_ms") is not None else f"{'-':>6}"
        print(f"{r['shape']['config']:<11} {r['variant']:<20} {r['tokens_per_s']:>10,} {r['mfu']:>6.1%} "
              f"{r['step_ms']:>8.1f} {idle} {r['peak_mem_gb']:>6.1f} {r['x_baseline']:>7.2f} "
              f"{r['loss_after']:>8.4f}{'' if r['loss_agrees'] else '  LOSS DISAGREES'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
