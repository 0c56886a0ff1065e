"""The corpus: text files in, a byte-level BPE tokenizer and raw token shards out (`tilewise prepare`).

prepare(out_dir, inputs) writes into out_dir:
- tokenizer.json: a byte-level BPE (the `tokenizers` library) trained on the corpus, or a copy of a given one;
  "<|endoftext|>" is its end-of-document id (eot).
- train_000.bin, val_000.bin, ...: every document's tokens followed by eot, concatenated, as raw uint16
  (uint32 when the vocabulary needs it), at most `shard_tokens` tokens a file; read later with numpy memmap.
- meta.json: what the shards hold (layout in `prepare`'s docstring), with a fingerprint of the inputs. A second
  prepare of the same inputs and settings finds the fingerprint and returns without reading the corpus.

Documents: each file is one document, except JSONL (*.jsonl, *.ndjson), where each line is a JSON object whose
"text" string is one document. A file with a NUL byte in its first 8 KiB is binary; binary and non-UTF-8 files
are skipped and counted, as are empty documents and JSONL objects without a "text" string. A JSONL line that
is not JSON at all is an error (the file is probably not JSONL). Folders are searched recursively for
text-like files (TEXT_SUFFIXES, hidden folders and __pycache__ left out); a file named directly is read
whatever its suffix. A literal "<|endoftext|>" inside a document is read as the eot token.

Split: a document goes to val when a stable hash of (seed, its name) falls below val_fraction; at least one
document is in val (and one in train) whenever there are two or more. The hash is blake2b, not Python's
randomized hash(), so the split is the same in every process and on every machine.

Cost: the corpus is read twice (a tokenizer-training sample of at most 64 MiB, then all of it, encoded in
chunks of ~8 MiB of text), shards are written once, 2 or 4 bytes a token. Memory stays at a chunk, not the corpus.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time

import numpy as np

FORMAT = 1
EOT = "<|endoftext|>"
SPECIAL_TOKENS = (EOT,)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # every byte, the specials, and at least one merge
SHARD_TOKENS = 1 << 28  # 256M tokens: 512 MiB a uint16 shard
TOKENIZER_SAMPLE_BYTES = 64 << 20
ENCODE_CHUNK_BYTES = 8 << 20
BINARY_PROBE_BYTES = 8192
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (
    ".py", ".pyi", ".pyx", ".txt", ".md", ".rst", ".tex", ".json", ".jsonl", ".ndjson", ".csv", ".tsv",
    ".html", ".htm", ".xml", ".css", ".js", ".ts", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".rs", ".go",
    ".java", ".kt", ".scala", ".rb", ".pl", ".lua", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".sql",
)


class DataError(ValueError):
    """Bad corpus input: the message is one line and says what and where."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The shard dtype for a vocabulary: uint16 holds ids below 65536, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def default_corpus_files() -> list[str]:
    """The running interpreter's standard library *.py files (no site-packages/dist-packages), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


# ----------------------------------------------------------------------------------------------------------
# Finding the documents


def _is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def _text_like(path: str) -> bool:
    return path.lower().endswith(TEXT_SUFFIXES)


def _walk_folder(folder: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            if not name.startswith(".") and _text_like(name):
                found.append(os.path.join(dirpath, name))
    return found


def resolve_inputs(inputs: list[str] | None) -> list[tuple[str, str]]:
    """The input files as (name, path): name is stable across machines and keys the split hash."""
    if inputs is None:
        root = sysconfig.get_paths()["stdlib"]
        files = [(os.path.relpath(p, root), p) for p in default_corpus_files()]
        if not files:
            raise DataError(f"empty corpus: no *.py files in the standard library folder {root}")
        return files
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise DataError(f"inputs must be a non-empty list of files, folders or globs, got {inputs!r}")
    files, seen = [], set()

    def add(name, path):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            files.append((os.path.normpath(name), path))

    for spec in inputs:
        spec = os.fspath(spec)
        if os.path.isdir(spec):
            found = _walk_folder(spec)
            if not found:
                raise DataError(f"empty corpus: folder {spec} holds no text-like files ({', '.join(TEXT_SUFFIXES[:6])}, ...)")
            for p in found:
                add(os.path.join(spec, os.path.relpath(p, spec)), p)
        elif os.path.isfile(spec):
            add(spec, spec)
        elif _is_glob(spec):
            matched = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matched:
                raise DataError(f"empty corpus: the pattern {spec} matched no files")
            for p in matched:
                add(p, p)
        else:
            raise DataError(f"input path {spec} does not exist")
    return files


def _read_text(path: str) -> str | None:
    """The file's text, or None when it is binary (NUL in the first 8 KiB) or not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"cannot read input file {path}: {e.strerror or e}") from None
    if b"\0" in data[:BINARY_PROBE_BYTES]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _documents(name: str, path: str, skipped: dict | None = None):
    """Yield (doc_name, text) for one input file, counting what is skipped into `skipped`."""
    def count(key):
        if skipped is not None:
            skipped[key] = skipped.get(key, 0) + 1

    text = _read_text(path)
    if text is None:
        count("binary_or_non_utf8")
        return
    if not path.lower().endswith(JSONL_SUFFIXES):
        if text.strip():
            yield name, text
        else:
            count("empty")
        return
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside a JSON string
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise DataError(f"{path}:{lineno}: not a JSON object (a JSONL file needs one object with a \"text\" string per line)") from None
        doc = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(doc, str):
            count("jsonl_no_text")
        elif not doc.strip():
            count("empty")
        else:
            yield f"{name}#{lineno}", doc


def _split_hash(seed: int, name: str) -> float:
    """A number in [0, 1) from (seed, name), the same on every machine and in every process."""
    digest = hashlib.blake2b(f"{seed}\0{name}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


# ----------------------------------------------------------------------------------------------------------
# The tokenizer


def _train_tokenizer(files, vocab_size: int, seed: int, progress: bool):
    """Train a byte-level BPE on the first 64 MiB of documents, files taken in seeded-hash order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample, size = [], 0
    for name, path in sorted(files, key=lambda f: _split_hash(seed, f[0])):
        for _, text in _documents(name, path):
            sample.append(text)
            size += len(text)
            if size >= TOKENIZER_SAMPLE_BYTES:
                break
        if size >= TOKENIZER_SAMPLE_BYTES:
            break
    if not sample:
        return None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress,
    )
    if progress:
        print(f"training a {vocab_size}-token byte-level BPE on {size / 2**20:.1f} MiB of text", file=sys.stderr)
    tok.train_from_iterator(sample, trainer=trainer)
    return tok


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own Exception type on a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"tokenizer file {path} does not parse as a tokenizers JSON file: {first}") from None
    if tok.token_to_id(EOT) is None:
        raise DataError(f"tokenizer file {path} has no {EOT} token; it is needed as the end-of-document id")
    return tok


def _encode(tok, texts: list[str]) -> list[list[int]]:
    # encode_batch_fast skips the offsets (about 2x faster); older tokenizers versions lack it.
    fn = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in fn(texts, add_special_tokens=False)]


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Shards


class _ShardWriter:
    """Appends tokens to <split>_000.bin, <split>_001.bin, ... in a temporary folder."""

    def __init__(self, folder: str, split: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.files, self.file_tokens, self.documents = [], [], 0
        self._f = None

    def _open(self):
        name = f"{self.split}_{len(self.files):03d}.bin"
        self.files.append(name)
        self.file_tokens.append(0)
        self._f = open(os.path.join(self.folder, name), "wb")

    def write(self, tokens: np.ndarray):
        while tokens.size:
            if self._f is None or self.file_tokens[-1] >= self.shard_tokens:
                if self._f is not None:
                    self._f.close()
                self._open()
            room = self.shard_tokens - self.file_tokens[-1]
            part, tokens = tokens[:room], tokens[room:]
            self._f.write(part.astype(self.dtype, copy=False).tobytes())
            self.file_tokens[-1] += int(part.size)

    def close(self):
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None

    def summary(self) -> dict:
        return {"files": self.files, "file_tokens": self.file_tokens,
                "tokens": int(sum(self.file_tokens)), "documents": self.documents}


def _cached_meta(out_dir: str, fingerprint: str) -> dict | None:
    """meta.json when it matches the fingerprint and every shard it names has its recorded size."""
    try:
        with open(os.path.join(out_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint or meta.get("format") != FORMAT:
        return None
    try:
        itemsize = np.dtype(meta["dtype"]).itemsize
        if not os.path.isfile(os.path.join(out_dir, meta["tokenizer"])):
            return None
        for split in ("train", "val"):
            for name, n in zip(meta[split]["files"], meta[split]["file_tokens"]):
                if os.path.getsize(os.path.join(out_dir, name)) != n * itemsize:
                    return None
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return meta


def _check_args(out_dir, vocab_size, tokenizer, val_fraction, seed, shard_tokens):
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"prepare: out_dir must be a path, got {type(out_dir).__name__}")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"output dir {os.fspath(out_dir)} exists and is a file, not a folder")
    if vocab_size is not None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
            raise TypeError(f"prepare: vocab_size must be an int, got {type(vocab_size).__name__}")
        if vocab_size < MIN_VOCAB:
            raise DataError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB} "
                            f"(256 bytes + {len(SPECIAL_TOKENS)} special token + 1 merge)")
        if vocab_size > 1 << 32:
            raise DataError(f"vocab_size {vocab_size} is too large: token ids are stored as uint32 (at most 2**32)")
    elif tokenizer is None:
        raise DataError("vocab_size=None needs a tokenizer file to take the vocabulary size from")
    if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction {val_fraction!r} must be a number in [0, 1)")
    if not isinstance(seed, int):
        raise TypeError(f"prepare: seed must be an int, got {type(seed).__name__}")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DataError(f"shard_tokens {shard_tokens!r} must be a positive int")


def prepare(out_dir: str, inputs: list[str] | None = None, *, vocab_size: int | None = 2048,
            tokenizer: str | None = None, val_fraction: float = 0.01, seed: int = 0, progress: bool = True,
            shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenize `inputs` (None: the standard library) into out_dir; return the meta dict (also out_dir/meta.json).

    vocab_size: the BPE to train; with `tokenizer` (a tokenizer.json to use instead of training), the vocabulary
    size recorded in meta, which must be at least the tokenizer's (None: the tokenizer's own size).
    meta.json: {"format", "vocab_size", "tokenizer_vocab_size", "eot_id", "dtype", "tokenizer",
    "train"/"val": {"files", "file_tokens", "tokens", "documents"}, "skipped": {"binary_or_non_utf8", "empty",
    "jsonl_no_text"}, "fingerprint", "inputs": {"specs", "files", "bytes"}, "seed", "val_fraction"}.
    Cached: a meta.json with the same fingerprint (input paths, sizes, mtimes; vocab_size; the tokenizer file's
    hash; val_fraction; seed; shard_tokens; FORMAT) is returned at once. Raises DataError on bad input.
    """
    _check_args(out_dir, vocab_size, tokenizer, val_fraction, seed, shard_tokens)
    out_dir = os.fspath(out_dir)
    files = resolve_inputs(inputs)
    stats = []
    for name, path in files:
        st = os.stat(path)
        stats.append([name, os.path.abspath(path), st.st_size, st.st_mtime_ns])
    tok_hash = None
    if tokenizer is not None:
        tokenizer = os.fspath(tokenizer)
        if not os.path.isfile(tokenizer):
            raise DataError(f"tokenizer file {tokenizer} does not exist")
        tok_hash = _file_sha256(tokenizer)
    fingerprint = hashlib.sha256(json.dumps({
        "format": FORMAT, "files": stats, "vocab_size": vocab_size, "tokenizer": tok_hash,
        "val_fraction": float(val_fraction), "seed": seed, "shard_tokens": shard_tokens,
    }, sort_keys=True).encode()).hexdigest()
    meta = _cached_meta(out_dir, fingerprint)
    if meta is not None:
        if progress:
            print(f"prepare: {out_dir} is up to date ({meta['train']['tokens']:,} train tokens)", file=sys.stderr)
        return meta

    if tokenizer is not None:
        tok = _load_tokenizer(tokenizer)
        if vocab_size is not None and vocab_size < tok.get_vocab_size():
            raise DataError(f"vocab_size {vocab_size} is smaller than the {tok.get_vocab_size()} tokens of {tokenizer}")
    else:
        tok = _train_tokenizer(files, vocab_size, seed, progress)
        if tok is None:
            _raise_no_text(files)
    meta_vocab = vocab_size if vocab_size is not None else tok.get_vocab_size()
    eot_id = tok.token_to_id(EOT)
    dtype = token_dtype(meta_vocab)

    if inputs is None:
        specs = None
    else:
        specs = [os.fspath(x) for x in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".prepare-{os.getpid()}-{time.monotonic_ns()}")
    os.makedirs(tmp)
    try:
        meta = _write_shards(tmp, files, tok, eot_id, dtype, val_fraction, seed, shard_tokens, progress)
        meta.update({
            "format": FORMAT, "vocab_size": int(meta_vocab), "tokenizer_vocab_size": int(tok.get_vocab_size()),
            "eot_id": int(eot_id), "dtype": dtype.name, "tokenizer": "tokenizer.json", "fingerprint": fingerprint,
            "inputs": {"specs": specs, "files": len(files), "bytes": int(sum(s[2] for s in stats))},
            "seed": seed, "val_fraction": float(val_fraction),
        })
        tok.save(os.path.join(tmp, "tokenizer.json"))
        _commit(tmp, out_dir, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        print(f"prepare: {meta['train']['tokens']:,} train / {meta['val']['tokens']:,} val tokens from "
              f"{meta['train']['documents'] + meta['val']['documents']} documents in {out_dir}", file=sys.stderr)
    return meta


def _raise_no_text(files, skipped: dict | None = None):
    if skipped is None:
        skipped = {}
        for name, path in files:
            for _ in _documents(name, path, skipped):
                pass
    binary, empty, no_text = (skipped.get(k, 0) for k in ("binary_or_non_utf8", "empty", "jsonl_no_text"))
    n = len(files)
    if binary == 0 and no_text == 0:
        raise DataError(f"empty corpus: all {n} input files (or their documents) are empty")
    raise DataError(f"no readable text in {n} input files: {binary} binary or non-UTF-8, {empty} empty, "
                    f"{no_text} JSONL lines without a \"text\" string")


def _write_shards(tmp, files, tok, eot_id, dtype, val_fraction, seed, shard_tokens, progress) -> dict:
    """Encode every document in chunks and append it, eot-terminated, to its split's shards."""
    from tqdm.auto import tqdm

    skipped = {"binary_or_non_utf8": 0, "empty": 0, "jsonl_no_text": 0}
    writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
    # The at-least-one-document-per-split rule can only be settled at the end, so two documents stay out of
    # the shards until then: the train document with the smallest hash (the one to move if val ends up empty)
    # and the val document with the largest hash (the one to move if train ends up empty).
    held = {"train": None, "val": None}

    def put(split, tokens):
        writers[split].write(tokens)
        writers[split].documents += 1

    chunk, texts, size = [], [], 0

    def flush():
        nonlocal chunk, texts, size
        for (h, split), ids in zip(chunk, _encode(tok, texts)):
            tokens = np.empty(len(ids) + 1, dtype=np.int64)
            tokens[:-1] = ids
            tokens[-1] = eot_id
            item = (h, tokens)
            old = held[split]
            keep = old is None or (h < old[0] if split == "train" else h > old[0])
            if keep:
                held[split], item = item, old
            if item is not None:
                put(split, item[1])
        chunk, texts, size = [], [], 0

    total = sum(os.path.getsize(p) for _, p in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        for name, path in files:
            for doc_name, text in _documents(name, path, skipped):
                h = _split_hash(seed, doc_name)
                chunk.append((h, "val" if h < val_fraction else "train"))
                texts.append(text)
                size += len(text)
                if size >= ENCODE_CHUNK_BYTES:
                    flush()
            bar.update(os.path.getsize(path))
        flush()
    n = {s: writers[s].documents + (held[s] is not None) for s in writers}
    if n["train"] + n["val"] == 0:
        for w in writers.values():
            w.close()
        _raise_no_text(files, skipped)
    if n["val"] == 0 and n["train"] >= 2:
        held["val"], held["train"] = held["train"], None
    elif n["train"] == 0:  # a lone document trains; with two or more, val keeps the rest
        held["train"], held["val"] = held["val"], None
    for split, item in held.items():
        if item is not None:
            put(split, item[1])
    for w in writers.values():
        w.close()
    return {"train": writers["train"].summary(), "val": writers["val"].summary(), "skipped": skipped}


def _commit(tmp: str, out_dir: str, meta: dict):
    """Move the new files into out_dir so that meta.json, written last, never describes files it does not match."""
    meta_path = os.path.join(out_dir, "meta.json")
    # From here until the new meta lands, out_dir has no meta.json: nothing can read half a state.
    with contextlib.suppress(FileNotFoundError):
        os.remove(meta_path)
    new = set(os.listdir(tmp))
    for name in os.listdir(out_dir):
        if name.startswith(("train_", "val_")) and name.endswith(".bin") and name not in new:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, name))
    for name in sorted(new):
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    with open(os.path.join(tmp, "meta.json.tmp"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(tmp, "meta.json.tmp"), meta_path)


def write_token_shards(out_dir: str, splits: dict, *, vocab_size: int, eot_id: int,
                       shard_tokens: int = SHARD_TOKENS, documents: dict | None = None) -> dict:
    """Write given token arrays as a prepared data folder (shards + meta.json, no tokenizer): for tests,
    benchmarks and token streams made elsewhere. splits: {"train": 1-d ints, "val": 1-d ints}."""
    dtype = token_dtype(vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".prepare-{os.getpid()}-{time.monotonic_ns()}")
    os.makedirs(tmp)
    try:
        meta = {"format": FORMAT, "vocab_size": int(vocab_size), "eot_id": int(eot_id), "dtype": dtype.name,
                "tokenizer": None, "fingerprint": None, "skipped": {}, "inputs": None}
        for split in ("train", "val"):
            tokens = np.asarray(splits.get(split, np.zeros(0, np.int64)))
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= np.iinfo(dtype).max + 1):
                raise DataError(f"write_token_shards: {split} tokens do not fit {dtype.name}")
            w = _ShardWriter(tmp, split, dtype, shard_tokens)
            w.write(tokens)
            w.close()
            w.documents = int((documents or {}).get(split, int((tokens == eot_id).sum())))
            meta[split] = w.summary()
        _commit(tmp, out_dir, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta
