"""The command line: `tilewise prepare | train | sample | export | ckpt`. Parsing only; the work is in the modules.

User mistakes (a bad option value, a missing file, an unusable corpus) end with one line on stderr and
exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .config import PRESETS, ConfigError, load_config

EPILOG_SET = ("--set takes section.field=value pairs, e.g. --set train.lr=3e-4 --set model.n_layer=6; "
              "sections: model, data, train, fp8, checkpoint, distributed (see tilewise/config.py).")


def _add_config_args(p: argparse.ArgumentParser, default_preset: str | None) -> None:
    p.add_argument("--preset", default=default_preset, choices=sorted(PRESETS),
                   help=f"named configuration to start from (default: {default_preset})")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with [model], [data], [train], ... tables")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field, e.g. train.max_steps=200 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tilewise",
        description="Train transformer language models: Triton kernels on NVIDIA GPUs, PyTorch reference ops on CPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("prepare", help="tokenize a corpus into token shards (cached)",
                       description="Train (or load) a byte-level BPE tokenizer and write uint16/uint32 token shards "
                                   "plus meta.json. With no inputs the corpus is the Python standard library's source. "
                                   "A second run on the same input returns at once.")
    p.add_argument("inputs", nargs="*", help="files, folders, globs or JSONL files with a 'text' field (default: "
                                              "the Python standard library source)")
    p.add_argument("--out", help="output directory (default: data/stdlib-<vocab-size> for the default corpus)")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (default: 2048)")
    p.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out (default: 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (default: 0)")

    p = sub.add_parser("train", help="train a model", epilog=EPILOG_SET,
                       description="Train a model. Prepares the data if needed, then writes metrics.jsonl, "
                                   "summary.json, loss.png and checkpoints into train.out_dir (runs/<preset>).")
    _add_config_args(p, "tiny")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")

    p = sub.add_parser("sample", help="generate text from a trained run",
                       description="Load a run's latest checkpoint and continue a prompt, with a KV cache.")
    p.add_argument("--run", required=True, metavar="DIR", help="run directory (holds config.json and checkpoints/)")
    p.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0 = all (default: 50)")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")

    p = sub.add_parser("export", help="write a run as a HuggingFace transformers model directory",
                       description="Write the run's latest checkpoint as config.json + model.safetensors "
                                   "(GPT2LMHeadModel or LlamaForCausalLM) and copy its tokenizer.json.")
    p.add_argument("--run", required=True, metavar="DIR", help="run directory (holds config.json and checkpoints/)")
    p.add_argument("--format", default="hf", choices=["hf"], help="output format (default: hf)")
    p.add_argument("--vocab", default="padded", choices=["padded", "tokenizer"],
                   help="padded: every embedding row, logits equal tilewise's; tokenizer: the tokenizer's rows only "
                        "(default: padded)")
    p.add_argument("out", metavar="OUT", help="output directory")

    p = sub.add_parser("ckpt", help="look into checkpoints", description="Checkpoint tools.")
    ckpt_sub = p.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", required=True)
    q = ckpt_sub.add_parser("inspect", help="print a checkpoint's manifest as a table",
                            description="Print a checkpoint's manifest: step, ranks, and per tensor its dtype, "
                                        "global shape, kind, shards, bytes and the ranks whose files hold it.")
    q.add_argument("path", metavar="DIR", help="a checkpoint directory, a checkpoint root or a run directory")
    return parser


def cmd_prepare(args) -> int:
    from .data import prepare
    out = args.out
    if out is None:
        if args.inputs:
            raise ConfigError("prepare: --out is required when inputs are given")
        out = os.path.join("data", f"stdlib-{args.vocab_size}")
    meta = prepare(out, args.inputs or None, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                   val_fraction=args.val_fraction, seed=args.seed)
    print(f"{out}: {meta['train']['tokens']:,} train / {meta['val']['tokens']:,} val tokens, "
          f"vocab {meta['vocab_size']}")
    return 0


def cmd_train(args) -> int:
    from .train import train
    cfg = load_config(args.preset, args.config, args.overrides)
    summary = train(cfg, resume=args.resume)
    if summary.get("rank", 0) != 0:  # one console voice: rank 0 reports
        return 0
    print(f"final_val_loss {summary['final_val_loss']:.4f}  unigram_val_loss {summary['unigram_val_loss']:.4f}  "
          f"ratio {summary['val_over_unigram']:.3f}  ({summary['wall_s']:.0f} s, "
          f"{summary['tokens_per_s'] or 0:,.0f} tokens/s)")
    print(f"run directory: {cfg.train.out_dir}  (summary.json, metrics.jsonl, loss.png)")
    return 0


def cmd_sample(args) -> int:
    import torch
    from tokenizers import Tokenizer

    from .checkpoint import Checkpointer
    from .config import from_dict
    from .model import GPT
    from .train import resolve_device

    config_path = os.path.join(args.run, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"sample: {args.run!r} is not a run directory (no config.json)")
    with open(config_path) as f:
        cfg = from_dict(json.load(f))
    device = resolve_device(args.device)
    tensors, _ = Checkpointer(os.path.join(args.run, "checkpoints")).load()
    model = GPT(cfg.model)
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    model.to(device).eval()
    tokenizer = Tokenizer.from_file(os.path.join(cfg.data.dir, "tokenizer.json"))
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise ConfigError("sample: the prompt is empty")
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         vocab_limit=tokenizer.get_vocab_size(), generator=gen)
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(tokenizer.decode(row))
    return 0


def cmd_export(args) -> int:
    from .checkpoint.export import export_hf
    info = export_hf(args.run, args.out, vocab=args.vocab)
    print(f"{info['out_dir']}: {info['architecture']}, step {info['step']}, vocab {info['vocab_size']}, "
          f"{info['params']:,} parameters")
    return 0


def cmd_ckpt(args) -> int:
    from .checkpoint.manifest import table
    print(table(args.path))
    return 0


COMMANDS = {"prepare": cmd_prepare, "train": cmd_train, "sample": cmd_sample, "export": cmd_export,
            "ckpt": cmd_ckpt}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from .checkpoint.save import CheckpointError
    from .data import DataError
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError, PermissionError) as e:
        print(f"tilewise {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tilewise {args.command}: interrupted", file=sys.stderr)
        return 130
