"""Data loading under GPT-2 124M training steps: the tilewise Prefetcher against torch DataLoader and a synchronous loader.

Two sources feed the same model, in the same global batch order:
- memmap: a token folder (random ids, written by tilewise.data.write_token_shards) read by TokenDataset.rows;
- slow: on-the-fly tokenization: each row is a slice of standard-library text encoded by a byte-level BPE when the
  batch is asked for (about 8 characters of text a token, so tokenizing costs about as much as a step).
Loaders: the Prefetcher (a thread, pinned buffers, copy stream), DataLoader(pin_memory=True, num_workers 0/2/4,
one whole batch an item, so the order is the same), a synchronous loader (read, copy, compute in turn), and
"ideal": one device batch reused (no loading at all), the floor the others are compared with.

Each step is forward + backward + fused AdamW in bf16 autocast, then loss.item(): a trainer that logs every step,
so a loader's host time cannot hide behind queued GPU work. Step time: CUDA events around the timed steps after
3 warm-up steps. Data wait: host time blocked getting the batch (for the Prefetcher its data_wait_ms).
Before timing, every loader's first batch is checked against the source's own batch 0.

    PYTHONPATH=src python3 bench/dataloader.py --out DIR [--quick]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from common import RESULTS, PlainGPT, environment, write_result
from tilewise.data import Prefetcher, TokenDataset, default_corpus_files, write_token_shards

VOCAB = 50304
HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the model the loaders feed: a plain GPT-2 124M (bench/common.py); its speed is not what is measured


# ---- the slow source: rows tokenized when asked for


class SlowSource:
    """Row p of the stream: the text at a seeded offset of the corpus, encoded, its first seq_len + 1 tokens.
    rows() encodes a whole batch with encode_batch (the library's own threads); __getitem__ serves DataLoader."""

    def __init__(self, text: str, tokenizer_json: str, seq_len: int, batch_size: int, chars_per_token: int, seed=0):
        from tokenizers import Tokenizer
        self.text, self.tokenizer_json = text, tokenizer_json
        self.tok = Tokenizer.from_str(tokenizer_json)
        self.seq_len, self.batch_size, self.chars = seq_len, batch_size, (seq_len + 1) * chars_per_token
        self.seed, self.world_size, self.eot_id = seed, 1, 0

    def __getstate__(self):  # DataLoader workers rebuild the tokenizer from its JSON
        return {k: v for k, v in self.__dict__.items() if k != "tok"}

    def __setstate__(self, state):
        from tokenizers import Tokenizer
        self.__dict__.update(state)
        self.tok = Tokenizer.from_str(self.tokenizer_json)

    def rows(self, index, batch_size, out=None):
        width = self.seq_len + 1
        rng = np.random.default_rng((self.seed, index))
        starts = rng.integers(0, len(self.text) - self.chars, size=batch_size)
        encodings = self.tok.encode_batch([self.text[s:s + self.chars] for s in starts.tolist()], add_special_tokens=False)
        if out is None:
            out = np.empty((batch_size, width), dtype=np.int64)
        for i, enc in enumerate(encodings):
            ids = np.asarray(enc.ids, dtype=np.int64)
            out[i] = np.resize(ids, width)  # repeats cyclically if the slice was short; it rarely is
        return out

    def batch(self, index, batch_size):
        r = self.rows(index, batch_size)
        return torch.from_numpy(r[:, :-1].copy()), torch.from_numpy(r[:, 1:].copy())

    def __len__(self):
        return 1 << 30

    def __getitem__(self, index):
        return self.batch(index, self.batch_size)


class BatchItems(torch.utils.data.Dataset):
    """A TokenDataset as a map-style dataset whose item k is global batch k (inputs, targets)."""

    def __init__(self, ds, batch_size):
        self.ds, self.batch_size = ds, batch_size

    def __len__(self):
        return 1 << 30

    def __getitem__(self, index):
        return self.ds.batch(index, self.batch_size)


# ---- loaders: each is a callable returning (x, y) on the device, plus its host wait


class SyncLoader:
    def __init__(self, source, batch_size, device):
        self.source, self.batch_size, self.device, self.k = source, batch_size, device, 0

    def __call__(self):
        t0 = time.perf_counter()
        x, y = self.source.batch(self.k, self.batch_size)
        x, y = x.to(self.device), y.to(self.device)
        self.k += 1
        return x, y, (time.perf_counter() - t0) * 1e3

    def close(self):
        pass


class TorchLoader:
    def __init__(self, items, device, workers):
        self.device = device
        # fork: the workers inherit the memory maps and the tokenizer instead of pickling them
        context = "fork" if workers else None
        self.loader = torch.utils.data.DataLoader(items, batch_size=None, shuffle=False, num_workers=workers,
                                                  pin_memory=True, multiprocessing_context=context)
        self.it = iter(self.loader)

    def __call__(self):
        t0 = time.perf_counter()
        x, y = next(self.it)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y, (time.perf_counter() - t0) * 1e3

    def close(self):
        del self.it


class PrefetchLoader:
    def __init__(self, source, batch_size, device):
        self.p = Prefetcher(source, batch_size, device, depth=2)

    def __call__(self):
        x, y = self.p.next()
        return x, y, self.p.data_wait_ms

    def close(self):
        self.p.close()


class IdealLoader:
    def __init__(self, source, batch_size, device):
        x, y = source.batch(0, batch_size)
        self.x, self.y = x.to(device), y.to(device)

    def __call__(self):
        return self.x, self.y, 0.0

    def close(self):
        pass


def measure(name, make, reference, model, opt, steps, warmup=3):
    loader = make()
    cuda = next(model.parameters()).is_cuda
    try:
        x, y, _ = loader()
        if not (torch.equal(x.cpu(), reference[0]) and torch.equal(y.cpu(), reference[1])):
            raise SystemExit(f"{name}: its first batch differs from the source's batch 0")
        for _ in range(warmup):
            step(model, opt, *loader()[:2])
        wait = 0.0
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y, w = loader()
            wait += w
            step(model, opt, x, y)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            step_ms = start.elapsed_time(end) / steps
        else:  # the CPU smoke run: loss.item() has already waited for the step
            step_ms = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        loader.close()
    return {"loader": name, "step_ms": step_ms, "data_wait_ms": wait / steps, "wait_frac": wait / steps / step_ms}


def step(model, opt, x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()  # a trainer that logs every step: the host meets the GPU here


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write dataloader.json into this folder")
    ap.add_argument("--quick", action="store_true", help="fewer steps and loaders (a smoke run)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per loader (default 20, quick 8)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run of the script, tiny model)")
    ap.add_argument("--chars-per-token", type=int, default=8, help="text per row of the slow source, in characters a token")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/dataloader.py needs a CUDA GPU (or --device cpu for a smoke run)")
    steps = args.steps or (8 if args.quick else 20)
    workers = (0, 4) if args.quick else (0, 2, 4)
    torch.manual_seed(0)
    B, T = args.batch, args.seq_len

    tmp = tempfile.mkdtemp(prefix="tilewise-bench-data-")
    t0 = time.time()
    rng = np.random.default_rng(0)
    write_token_shards(tmp, {"train": rng.integers(0, VOCAB, size=16 << 20), "val": rng.integers(0, VOCAB, size=1 << 16)},
                       vocab_size=VOCAB, eot_id=0)
    memmap = TokenDataset(tmp, "train", T, seed=0)
    # The slow source's tokenizer: a byte-level BPE trained on 8 MB of the standard library.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    text = []
    for path in default_corpus_files():
        try:
            with open(path, encoding="utf-8") as f:
                text.append(f.read())
        except (UnicodeDecodeError, OSError):
            continue
    text = "\n".join(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text[:8 << 20]], trainer=trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    slow = SlowSource(text, tok.to_str(), T, B, args.chars_per_token)
    print(f"data ready in {time.time() - t0:.1f} s", file=sys.stderr)

    if device.type == "cuda":
        model = PlainGPT(seq_len=T).to(device)
    else:
        model = PlainGPT(seq_len=T, d=64, layers=1, heads=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    results = {}
    for source_name, source, items in (("memmap", memmap, BatchItems(memmap, B)), ("slow", slow, slow)):
        reference = source.batch(0, B)
        makers = [("prefetcher", lambda s=source: PrefetchLoader(s, B, device)),
                  ("synchronous", lambda s=source: SyncLoader(s, B, device))]
        makers += [(f"dataloader_w{w}", lambda w=w, it=items: TorchLoader(it, device, w)) for w in workers]
        makers.append(("ideal", lambda s=source: IdealLoader(s, B, device)))
        rows = []
        for name, make in makers:
            r = measure(name, make, reference, model, opt, steps)
            rows.append(r)
            print(f"{source_name:7s} {name:15s} step {r['step_ms']:8.2f} ms  wait {r['data_wait_ms']:8.3f} ms", file=sys.stderr)
        results[source_name] = rows

    out = {"area": "dataloader", **environment(),
           "setup": {"model": "gpt2-124m (plain torch, bf16 autocast, fused AdamW, loss.item() every step)",
                     "batch": B, "seq_len": T, "timed_steps": steps, "prefetch_depth": 2,
                     "slow_source": f"BPE-8192 encode of {args.chars_per_token} chars/token per row, at request time",
                     "ratio_best_peer": "best peer step time / tilewise step time (> 1: tilewise faster)",
                     "peers": "dataloader_w* = torch DataLoader(pin_memory=True, num_workers=*); synchronous; "
                              "ideal = no loading (one batch reused), not a peer"},
           "rows": [], "measurements": results}
    for source_name, rows in results.items():
        by = {r["loader"]: r for r in rows}
        peers = [n for n in by if n not in ("prefetcher", "ideal")]
        best = min(peers, key=lambda n: by[n]["step_ms"])
        shape = {"source": source_name, "batch": B, "seq_len": T, "model": "gpt2-124m"}
        row = {"shape": shape, "unit": "ms/step", "tilewise": by["prefetcher"]["step_ms"]}
        row.update({n: by[n]["step_ms"] for n in peers})
        row["ideal"] = by["ideal"]["step_ms"]
        row["ratio_best_peer"] = by[best]["step_ms"] / by["prefetcher"]["step_ms"]
        out["rows"].append(row)
        wait = {"shape": dict(shape), "unit": "data_wait ms/step", "tilewise": by["prefetcher"]["data_wait_ms"]}
        wait.update({n: by[n]["data_wait_ms"] for n in peers})
        wait["tilewise_wait_frac"] = by["prefetcher"]["wait_frac"]
        best_wait = min(by[n]["data_wait_ms"] for n in peers)
        mine = by["prefetcher"]["data_wait_ms"]
        wait["ratio_best_peer"] = best_wait / mine if mine > 0 else None
        out["rows"].append(wait)
    shutil.rmtree(tmp, ignore_errors=True)

    write_result(out, "dataloader.json", [RESULTS if device.type == "cuda" else None, args.out])

    cols = ["prefetcher", "synchronous"] + [f"dataloader_w{w}" for w in workers] + ["ideal"]
    print(f"\n{'source':8s} {'metric':16s} " + " ".join(f"{c:>14s}" for c in cols))
    for source_name, rows in results.items():
        by = {r["loader"]: r for r in rows}
        print(f"{source_name:8s} {'step ms':16s} " + " ".join(f"{by[c]['step_ms']:14.2f}" for c in cols))
        print(f"{source_name:8s} {'data wait ms':16s} " + " ".join(f"{by[c]['data_wait_ms']:14.3f}" for c in cols))
        print(f"{source_name:8s} {'wait / step':16s} " + " ".join(f"{by[c]['wait_frac']:14.2%}" for c in cols))


if __name__ == "__main__":
    main()
