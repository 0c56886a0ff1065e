"""prepare: documents in, tokenizer and shards out; the cache; the split; every bad input's one-line error."""
import json
import os
import time

import numpy as np
import pytest

from tilewise.data import DataError, TokenDataset, default_corpus_files, prepare, token_dtype
from tilewise.data import corpus as corpus_mod

WORDS = "alpha beta gamma delta tensor kernel warp tile stream shard token batch loss step grad".split()


def words(rng, n):
    return " ".join(rng.choice(WORDS, size=n)) + "\n"


def write_corpus(root, seed=0):
    """A folder of documents plus every kind of file prepare must skip; returns the expected document texts."""
    rng = np.random.default_rng(seed)
    src = root / "src"
    (src / "pkg").mkdir(parents=True)
    docs = {
        "a.py": "def f(x):\n    return x * 2  # twice\n" + words(rng, 40),
        "pkg/b.txt": "Ünïcode text, ümlauts and emoji \U0001f600\n" + words(rng, 60),
        "pkg/notes.md": "# Notes\n\n" + words(rng, 50),
    }
    for name, text in docs.items():
        (src / name).write_text(text, encoding="utf-8")
    jsonl = [{"text": "first json document " + words(rng, 20)}, {"meta": "no text here"},
             {"text": ""}, {"text": "second json document " + words(rng, 25)}, {"text": 7}]
    (src / "data.jsonl").write_text("\n".join(json.dumps(o) for o in jsonl) + "\n\n", encoding="utf-8")
    (src / "blob.txt").write_bytes(b"abc\x00def" * 10)            # binary: NUL in the first 8 KiB
    (src / "latin.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))  # not UTF-8
    (src / "empty.py").write_text("")
    (src / "image.png").write_bytes(b"\x89PNG not text-like, never looked at")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "a.py").write_text("ignored")
    expected = list(docs.values()) + [jsonl[0]["text"], jsonl[3]["text"]]
    return src, expected


def read_split(out, meta, split):
    dtype = np.dtype(meta["dtype"])
    parts = [np.fromfile(os.path.join(out, f), dtype=dtype) for f in meta[split]["files"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def split_docs(tokens, eot):
    """Token stream -> list of documents (token lists), each of which ended with eot."""
    assert tokens.size == 0 or tokens[-1] == eot, "the stream must end with eot"
    cuts = np.flatnonzero(tokens == eot)
    return [tokens[a + 1:b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def decode_all(out, meta):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    docs = {}
    for split in ("train", "val"):
        docs[split] = [tok.decode(d.tolist()) for d in split_docs(read_split(out, meta, split), meta["eot_id"])]
    return docs


def test_prepare_small_corpus(tmp_path, capsys):
    src, expected = write_corpus(tmp_path)
    out = tmp_path / "out"
    meta = prepare(str(out), [str(src)], vocab_size=300, val_fraction=0.3, progress=False)
    assert capsys.readouterr().err == ""  # progress=False is silent
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk == meta
    assert meta["format"] == 1 and meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
    assert meta["skipped"] == {"binary_or_non_utf8": 2, "empty": 2, "jsonl_no_text": 2}
    assert meta["train"]["documents"] + meta["val"]["documents"] == len(expected)
    assert meta["val"]["documents"] >= 1 and meta["train"]["documents"] >= 1
    assert meta["inputs"]["files"] == 7  # the png and __pycache__ are not text-like inputs
    docs = decode_all(str(out), meta)
    # Byte-level BPE round-trips exactly, and every document is in exactly one split, once.
    assert sorted(docs["train"] + docs["val"]) == sorted(expected)
    for split in ("train", "val"):
        tokens = read_split(str(out), meta, split)
        assert tokens.size == meta[split]["tokens"] == sum(meta[split]["file_tokens"])
        assert int((tokens == meta["eot_id"]).sum()) == meta[split]["documents"]
        assert int(tokens.max()) < meta["tokenizer_vocab_size"] <= 300
    # The shards open as a dataset.
    ds = TokenDataset(str(out), "train", 8)
    x, y = ds.batch(0, 2)
    assert x.shape == (2, 8)


def test_progress_goes_to_stderr(tmp_path, capsys):
    src, _ = write_corpus(tmp_path)
    prepare(str(tmp_path / "out"), [str(src)], vocab_size=300, progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "prepare:" in captured.err


def test_cache_hit_does_not_rewrite(tmp_path):
    src, _ = write_corpus(tmp_path)
    out = tmp_path / "out"
    meta = prepare(str(out), [str(src)], vocab_size=300, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    time.sleep(0.01)
    start = time.perf_counter()
    again = prepare(str(out), [str(src)], vocab_size=300, progress=False)
    assert time.perf_counter() - start < 0.5
    assert again == meta
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    # A changed input, or a changed setting, prepares again.
    (src / "a.py").write_text("def g():\n    pass\n" * 30)
    changed = prepare(str(out), [str(src)], vocab_size=300, progress=False)
    assert changed["fingerprint"] != meta["fingerprint"]
    reseeded = prepare(str(out), [str(src)], vocab_size=300, seed=1, progress=False)
    assert reseeded["fingerprint"] != changed["fingerprint"]
    # A shard damaged after prepare is not trusted by the cache.
    shard = out / reseeded["train"]["files"][0]
    shard.write_bytes(shard.read_bytes()[:-2])
    repaired = prepare(str(out), [str(src)], vocab_size=300, seed=1, progress=False)
    assert repaired == reseeded and shard.stat().st_size == 2 * reseeded["train"]["file_tokens"][0]


def many_docs(root, n):
    root.mkdir()
    rng = np.random.default_rng(1)
    texts = {}
    for i in range(n):
        texts[f"doc{i:02d}.txt"] = f"document {i} " + words(rng, 8)
        (root / f"doc{i:02d}.txt").write_text(texts[f"doc{i:02d}.txt"])
    return texts


def test_split_is_deterministic_and_follows_the_hash(tmp_path):
    src = tmp_path / "src"
    texts = many_docs(src, 40)
    a = prepare(str(tmp_path / "a"), [str(src)], vocab_size=300, val_fraction=0.25, seed=3, progress=False)
    b = prepare(str(tmp_path / "b"), [str(src)], vocab_size=300, val_fraction=0.25, seed=3, progress=False)
    for split in ("train", "val"):
        assert np.array_equal(read_split(str(tmp_path / "a"), a, split), read_split(str(tmp_path / "b"), b, split))
    # The val documents are exactly those whose stable hash falls below val_fraction.
    want_val = sorted(t for name, t in texts.items()
                      if corpus_mod._split_hash(3, os.path.join(str(src), name)) < 0.25)
    assert 3 <= len(want_val) <= 20
    assert sorted(decode_all(str(tmp_path / "a"), a)["val"]) == want_val
    c = prepare(str(tmp_path / "c"), [str(src)], vocab_size=300, val_fraction=0.25, seed=4, progress=False)
    assert sorted(decode_all(str(tmp_path / "c"), c)["val"]) != want_val


def test_split_keeps_one_document_on_each_side(tmp_path):
    src = tmp_path / "src"
    many_docs(src, 2)
    m = prepare(str(tmp_path / "two"), [str(src)], vocab_size=300, val_fraction=0.0, progress=False)
    assert (m["train"]["documents"], m["val"]["documents"]) == (1, 1)
    m = prepare(str(tmp_path / "two_all_val"), [str(src)], vocab_size=300, val_fraction=0.999999, progress=False)
    assert (m["train"]["documents"], m["val"]["documents"]) == (1, 1)
    one = tmp_path / "one.txt"
    one.write_text("a single document " * 20)
    m = prepare(str(tmp_path / "one"), [str(one)], vocab_size=300, val_fraction=0.999999, progress=False)
    assert (m["train"]["documents"], m["val"]["documents"]) == (1, 0) and m["val"]["files"] == []


def test_globs_files_and_jsonl_inputs(tmp_path):
    src, _ = write_corpus(tmp_path)
    m = prepare(str(tmp_path / "g"), [str(src / "**" / "*.txt"), str(src / "data.jsonl"), str(src / "a.py")],
                vocab_size=300, progress=False)
    # b.txt, blob.txt, latin.txt by the glob (two skipped), two JSONL documents, a.py.
    assert m["inputs"]["files"] == 5
    assert m["train"]["documents"] + m["val"]["documents"] == 4
    assert m["skipped"]["binary_or_non_utf8"] == 2 and m["skipped"]["jsonl_no_text"] == 2


def test_shards_split_at_shard_tokens(tmp_path):
    src, _ = write_corpus(tmp_path)
    one = prepare(str(tmp_path / "one"), [str(src)], vocab_size=300, progress=False)
    many = prepare(str(tmp_path / "many"), [str(src)], vocab_size=300, shard_tokens=50, progress=False)
    assert len(many["train"]["files"]) == -(-many["train"]["tokens"] // 50) >= 3
    assert all(n <= 50 for n in many["train"]["file_tokens"])
    for split in ("train", "val"):
        assert np.array_equal(read_split(str(tmp_path / "one"), one, split), read_split(str(tmp_path / "many"), many, split))
    # A re-prepare with bigger shards removes the stale ones.
    again = prepare(str(tmp_path / "many"), [str(src)], vocab_size=300, progress=False)
    assert sorted(p.name for p in (tmp_path / "many").glob("*.bin")) == sorted(again["train"]["files"] + again["val"]["files"])


def test_given_tokenizer_is_used(tmp_path):
    src, _ = write_corpus(tmp_path)
    trained = prepare(str(tmp_path / "t"), [str(src)], vocab_size=300, progress=False)
    tok = str(tmp_path / "t" / "tokenizer.json")
    loaded = prepare(str(tmp_path / "l"), [str(src)], vocab_size=None, tokenizer=tok, progress=False)
    assert loaded["vocab_size"] == trained["tokenizer_vocab_size"]
    assert np.array_equal(read_split(str(tmp_path / "t"), trained, "train"), read_split(str(tmp_path / "l"), loaded, "train"))
    padded = prepare(str(tmp_path / "p"), [str(src)], vocab_size=512, tokenizer=tok, progress=False)
    assert padded["vocab_size"] == 512


def test_interrupted_prepare_leaves_the_old_state(tmp_path, monkeypatch):
    src, _ = write_corpus(tmp_path)
    out = tmp_path / "out"
    old = prepare(str(out), [str(src)], vocab_size=300, progress=False)

    def broken(tok, texts):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus_mod, "_encode", broken)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(out), [str(src)], vocab_size=300, seed=9, progress=False)
    assert json.loads((out / "meta.json").read_text()) == old
    assert not [p for p in out.iterdir() if p.name.startswith(".prepare")]
    TokenDataset(str(out), "train", 8).batch(0, 1)  # the old meta still describes the old shards


def test_token_dtype_rule():
    assert token_dtype(2048) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535
    assert token_dtype(65537) == np.uint32
    assert token_dtype(200_000) == np.uint32


def bad_case(tmp_path, case):
    """Build the inputs of one bad case; return (args, kwargs) for prepare."""
    out = str(tmp_path / "out")
    if case == "no_text_like_files":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "x.bin").write_bytes(b"1")
        return [out, [str(tmp_path / "d")]], {}
    if case == "glob_matches_nothing":
        return [out, [str(tmp_path / "*.nothing")]], {}
    if case == "all_empty":
        for i in range(3):
            (tmp_path / f"e{i}.txt").write_text("  \n" if i else "")
        return [out, [str(tmp_path / "e*.txt")]], {}
    if case == "all_binary":
        (tmp_path / "b.txt").write_bytes(b"\x00\x01\x02")
        (tmp_path / "c.txt").write_bytes(b"\xff\xfe bad utf8")
        return [out, [str(tmp_path / "b.txt"), str(tmp_path / "c.txt")]], {}
    if case == "missing_input":
        return [out, [str(tmp_path / "nope.txt")]], {}
    (tmp_path / "ok.txt").write_text("some text to tokenize " * 20)
    ok = [str(tmp_path / "ok.txt")]
    if case == "vocab_too_small":
        return [out, ok], {"vocab_size": 257}
    if case == "out_dir_is_a_file":
        (tmp_path / "out").write_text("I am a file")
        return [out, ok], {}
    if case == "tokenizer_missing":
        return [out, ok], {"tokenizer": str(tmp_path / "tok.json")}
    if case == "tokenizer_does_not_parse":
        (tmp_path / "tok.json").write_text("{not json")
        return [out, ok], {"tokenizer": str(tmp_path / "tok.json")}
    if case == "vocab_smaller_than_tokenizer":
        prepare(str(tmp_path / "first"), ok, vocab_size=400, progress=False)
        return [out, ok], {"tokenizer": str(tmp_path / "first" / "tokenizer.json"), "vocab_size": 258}
    if case == "jsonl_bad_line":
        (tmp_path / "d.jsonl").write_text('{"text": "fine"}\nnot json\n')
        return [out, [str(tmp_path / "d.jsonl")]], {}
    if case == "jsonl_no_text_anywhere":
        (tmp_path / "d.jsonl").write_text('{"body": "x"}\n{"text": null}\n')
        return [out, [str(tmp_path / "d.jsonl")]], {}
    if case == "bad_val_fraction":
        return [out, ok], {"val_fraction": 1.0}
    raise AssertionError(case)


BAD = {
    "no_text_like_files": "empty corpus: folder",
    "glob_matches_nothing": "matched no files",
    "all_empty": "empty corpus: all 3 input files",
    "all_binary": "no readable text in 2 input files: 2 binary or non-UTF-8",
    "missing_input": "nope.txt does not exist",
    "vocab_too_small": "vocab_size 257 is too small",
    "out_dir_is_a_file": "is a file",
    "tokenizer_missing": "tok.json does not exist",
    "tokenizer_does_not_parse": "tok.json does not parse",
    "vocab_smaller_than_tokenizer": "vocab_size 258 is smaller than the",
    "jsonl_bad_line": "d.jsonl:2: not a JSON object",
    "jsonl_no_text_anywhere": "2 JSONL lines without a \"text\" string",
    "bad_val_fraction": "val_fraction 1.0",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_data_error(tmp_path, case):
    args, kwargs = bad_case(tmp_path, case)
    with pytest.raises(DataError) as info:
        prepare(*args, vocab_size=kwargs.pop("vocab_size", 300), progress=False, **kwargs)
    message = str(info.value)
    assert BAD[case] in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_bad_argument_types():
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        prepare("unused", vocab_size="2048")
    with pytest.raises(TypeError, match="out_dir must be a path"):
        prepare(42)


def test_default_corpus_files():
    files = default_corpus_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.endswith(".py") and os.path.isabs(f) for f in files)
    assert not any("site-packages" in f.split(os.sep) or "dist-packages" in f.split(os.sep) for f in files)
    assert any(f.endswith(os.sep + "json" + os.sep + "decoder.py") for f in files)


@pytest.mark.slow
def test_prepare_default_corpus(tmp_path):
    start = time.perf_counter()
    meta = prepare(str(tmp_path / "std"), vocab_size=2048, progress=False)
    first = time.perf_counter() - start
    assert meta["train"]["tokens"] > 1_000_000 and meta["val"]["documents"] >= 1
    assert meta["inputs"]["files"] == len(default_corpus_files())
    start = time.perf_counter()
    assert prepare(str(tmp_path / "std"), vocab_size=2048, progress=False) == meta
    assert time.perf_counter() - start < 0.2 * first
