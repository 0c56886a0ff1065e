"""TokenDataset: windows of the token stream, the (seed, epoch) order, ranks, shard checks, cu_seqlens, unigram loss."""
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch

from tilewise.data import DataError, TokenDataset, cu_seqlens_of, unigram_val_loss, write_token_shards

VOCAB, EOT = 50_000, 0


def stream(n, seed=0, eot_every=None):
    """Distinct-looking tokens (1..VOCAB-1) so a window identifies its position; eot at random places."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=n)
    if eot_every:
        tokens[rng.random(n) < 1.0 / eot_every] = EOT
    return tokens


def row_of(tokens, window, seq_len):
    """The row number whose window (seq_len + 1 tokens at row * seq_len) equals `window`; asserts it is unique."""
    rows = (len(tokens) - 1) // seq_len
    hits = [r for r in range(rows) if np.array_equal(tokens[r * seq_len:r * seq_len + seq_len + 1], window)]
    assert len(hits) == 1
    return hits[0]


@pytest.fixture
def data(tmp_path):
    """train: 1001 tokens over shards of 37 tokens (rows cross shard boundaries); val: 300 tokens."""
    train, val = stream(1001, 1, eot_every=20), stream(300, 2, eot_every=20)
    write_token_shards(str(tmp_path), {"train": train, "val": val}, vocab_size=VOCAB, eot_id=EOT, shard_tokens=37)
    return str(tmp_path), train, val


def test_batch_shapes_and_shift(data):
    path, train, _ = data
    ds = TokenDataset(path, "train", 16)
    assert (ds.num_tokens, ds.rows_per_epoch, ds.vocab_size, ds.eot_id) == (1001, 62, VOCAB, EOT)
    x, y = ds.batch(3, 8)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.numpy(), y.numpy()):
        r = row_of(train, np.r_[row_x, row_y[-1]], 16)  # a window at a multiple of seq_len
        assert np.array_equal(row_y, train[r * 16 + 1:r * 16 + 17])


def test_order_is_the_seeded_permutation_and_covers_an_epoch(data):
    path, train, _ = data
    ds = TokenDataset(path, "train", 16, seed=5)
    b = 2  # 62 rows: 31 batches an epoch
    seen = []
    for index in range(31):
        rows = ds.rows(index, b)
        seen += [row_of(train, r, 16) for r in rows]
    assert sorted(seen) == list(range(62))
    assert seen == np.random.default_rng((5, 0)).permutation(62).tolist()
    assert torch.equal(ds.batch(7, b)[0], TokenDataset(path, "train", 16, seed=5).batch(7, b)[0])
    assert not torch.equal(ds.batch(7, b)[0], TokenDataset(path, "train", 16, seed=6).batch(7, b)[0])


def test_epoch_wrap(data):
    path, train, _ = data
    ds = TokenDataset(path, "train", 16, seed=2)
    x, _ = ds.batch(6, 10)  # positions 60..69: two rows of epoch 0, then eight of epoch 1
    p0, p1 = (np.random.default_rng((2, e)).permutation(62) for e in (0, 1))
    want = [p0[60], p0[61]] + list(p1[:8])
    expect = np.stack([train[r * 16:r * 16 + 16] for r in want])
    assert np.array_equal(x.numpy(), expect)
    assert ds.epoch(6, 10) == pytest.approx(60 / 62)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_split_the_global_batch(data, world_size):
    path, _, _ = data
    whole = TokenDataset(path, "train", 16, seed=1)
    for index in (0, 5, 13):  # 13 * 8 crosses an epoch boundary
        x, y = whole.batch(index, 8)
        parts = [TokenDataset(path, "train", 16, seed=1, rank=r, world_size=world_size).batch(index, 8)
                 for r in range(world_size)]
        for r, (px, py) in enumerate(parts):
            assert px.shape == (8 // world_size, 16)
            assert torch.equal(px, x[r::world_size]) and torch.equal(py, y[r::world_size])


def test_too_few_tokens(data):
    path, _, _ = data
    TokenDataset(path, "val", 299)
    with pytest.raises(DataError, match=r"val split .* has 300 tokens; one row of seq_len 300 needs 301"):
        TokenDataset(path, "val", 300)


def test_truncated_shard_names_file_and_offset(data):
    path, _, _ = data
    shard = os.path.join(path, "train_002.bin")
    with open(shard, "r+b") as f:
        f.truncate(37 * 2 - 1)  # half a token at the end
    with pytest.raises(DataError, match=r"train_002\.bin is truncated: 73 bytes .* token offset 36"):
        TokenDataset(path, "train", 16)
    with open(shard, "r+b") as f:
        f.truncate(30 * 2)  # whole tokens, fewer than meta.json says
    with pytest.raises(DataError, match=r"train_002\.bin is truncated: it holds 30 tokens, meta.json says 37; .*token offset 30"):
        TokenDataset(path, "train", 16)
    os.remove(shard)
    with pytest.raises(DataError, match=r"train_002\.bin is missing"):
        TokenDataset(path, "train", 16)


def test_out_of_vocab_token_names_file_and_offset(data):
    path, _, _ = data
    shard = os.path.join(path, "train_003.bin")  # stream tokens 111..147
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[5] = VOCAB + 7
    tokens.tofile(shard)
    ds = TokenDataset(path, "train", 16, seed=0)
    bad_row = 116 // 16  # stream offset 116 is in row 7 (tokens 112..128)
    position = int(np.flatnonzero(ds.permutation(0) == bad_row)[0])
    other = 1 if position // 4 == 0 else 0
    ds.batch(other, 4)  # a batch without that row reads fine
    with pytest.raises(DataError, match=rf"token id {VOCAB + 7} >= vocab_size {VOCAB} in .*train_003\.bin at token offset 5 "):
        ds.batch(position // 4, 4)


def test_bad_arguments(data):
    path, _, _ = data
    with pytest.raises(ValueError, match="split='test'"):
        TokenDataset(path, "test", 16)
    with pytest.raises(ValueError, match="rank=2 is not below world_size=2"):
        TokenDataset(path, "train", 16, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len=0"):
        TokenDataset(path, "train", 0)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        TokenDataset(path, "train", 16.0)
    ds = TokenDataset(path, "train", 16, world_size=2)
    with pytest.raises(ValueError, match="batch_size=3 is the global batch and must be a multiple of world_size=2"):
        ds.batch(0, 3)
    with pytest.raises(ValueError, match="index=-1"):
        ds.batch(-1, 2)
    with pytest.raises(DataError, match="no meta.json"):
        TokenDataset(os.path.join(path, "elsewhere"), "train", 16)


def brute_cu_seqlens(x, eot):
    cuts = [0]
    rows, seq_len = x.shape
    for r in range(rows):
        for t in range(seq_len):
            if x[r, t] == eot and t + 1 < seq_len:
                cuts.append(r * seq_len + t + 1)
        cuts.append((r + 1) * seq_len)
    return cuts


def test_cu_seqlens():
    x = np.array([[5, 0, 6, 7, 0, 8],
                  [0, 0, 9, 9, 9, 0],
                  [1, 2, 3, 4, 5, 6]])
    cu = cu_seqlens_of(torch.from_numpy(x), 0)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 2, 5, 6, 7, 8, 12, 18] == brute_cu_seqlens(x, 0)
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.integers(0, 4, size=(int(rng.integers(1, 5)), int(rng.integers(1, 9))))
        assert cu_seqlens_of(x, 0).tolist() == brute_cu_seqlens(x, 0)


def test_batch_with_cu_seqlens(data):
    path, _, _ = data
    ds = TokenDataset(path, "train", 16, world_size=2, rank=1)
    x, y, cu = ds.batch(4, 8, with_cu_seqlens=True)
    assert torch.equal(x, ds.batch(4, 8)[0])
    flat = x.reshape(-1).numpy()
    assert cu[0] == 0 and cu[-1] == flat.size and bool((cu[1:] > cu[:-1]).all())
    assert set(range(0, flat.size + 1, 16)) <= set(cu.tolist())
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert a // 16 == (b - 1) // 16  # a piece stays inside its row
        assert not (flat[a:b - 1] == EOT).any()  # and contains no eot except as its last token
    assert (flat == EOT).sum() > 0


def test_unigram_val_loss(data):
    path, train, val = data
    counts, n = Counter(train.tolist()), len(train)
    want = -sum(math.log((counts.get(t, 0) + 1) / (n + VOCAB)) for t in val.tolist()) / len(val)
    assert unigram_val_loss(path) == pytest.approx(want, rel=1e-12)
    assert 0 < want < math.log(VOCAB) + 1


def test_unigram_of_a_skewed_corpus_is_below_uniform(tmp_path):
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(300, 0.1))
    train, val = rng.choice(300, size=20_000, p=probs), rng.choice(300, size=2_000, p=probs)
    write_token_shards(str(tmp_path), {"train": train, "val": val}, vocab_size=300, eot_id=0)
    entropy = -(probs * np.log(probs + 1e-30)).sum()
    assert unigram_val_loss(str(tmp_path)) == pytest.approx(entropy, rel=0.1)
    assert unigram_val_loss(str(tmp_path)) < 0.8 * math.log(300)


# ---- StreamingDataset


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    """Text files and a JSONL file (with lines to skip), and a tokenizer trained on them by prepare."""
    import json
    from tilewise.data import prepare
    root = tmp_path_factory.mktemp("stream")
    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    vocab = "kernel tile warp stream shard token loss grad step batch".split()
    texts = {}
    for i in range(5):
        texts[f"f{i}.txt"] = " ".join(rng.choice(vocab, size=int(rng.integers(20, 80)))) + "\n"
        (src / f"f{i}.txt").write_text(texts[f"f{i}.txt"])
    lines, jsonl_docs = [], []
    for i in range(30):
        if i % 7 == 3:
            lines.append(json.dumps({"meta": i}))
        else:
            doc = f"line {i}: " + " ".join(rng.choice(vocab, size=int(rng.integers(3, 30))))
            jsonl_docs.append(doc)
            lines.append(json.dumps({"text": doc}))
    (src / "d.jsonl").write_text("\n".join(lines) + "\n")
    prepare(str(root / "prepared"), [str(src)], vocab_size=320, progress=False)
    return src, texts, jsonl_docs, str(root / "prepared" / "tokenizer.json")


def expected_stream(src, texts, jsonl_docs, tok_path, seed, epochs):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tok_path)
    files = sorted(["d.jsonl"] + list(texts))  # resolve_inputs walks a folder in sorted order
    out = []
    for e in range(epochs):
        for i in np.random.default_rng((seed, e)).permutation(len(files)):
            docs = jsonl_docs if files[i] == "d.jsonl" else [texts[files[i]]]
            for d in docs:
                out += tok.encode(d, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]
    return np.array(out)


def test_streaming_rows_follow_the_stream(text_corpus):
    from tilewise.data import StreamingDataset
    src, texts, jsonl_docs, tok = text_corpus
    want = expected_stream(src, texts, jsonl_docs, tok, seed=4, epochs=4)
    # piece_bytes=64 cuts the JSONL file into many pieces whose edges fall inside lines.
    with StreamingDataset([str(src)], tok, 16, seed=4, num_workers=0, piece_bytes=64) as ds:
        for index in range(12):  # 12 * 6 rows * 16 tokens: more than one epoch
            rows = ds.rows(index, 6)
            for j, r in enumerate(range(index * 6, index * 6 + 6)):
                assert np.array_equal(rows[j], want[r * 16:r * 16 + 17])
        assert ds.skipped["jsonl_no_text"] >= 4
        x, y, cu = ds.batch(2, 6, with_cu_seqlens=True)  # backwards: the stream restarts
        assert np.array_equal(x.numpy(), np.stack([want[r * 16:r * 16 + 16] for r in range(12, 18)]))
        assert torch.equal(x[:, 1:], y[:, :-1]) and cu.dtype == torch.int32
    with StreamingDataset([str(src)], tok, 16, seed=4, num_workers=0, rank=1, world_size=3) as ranked:
        rows = ranked.rows(9, 6)  # a jump forward
        assert np.array_equal(rows, np.stack([want[r * 16:r * 16 + 17] for r in (55, 58)]))


def test_streaming_with_workers_and_prefetcher(text_corpus):
    from tilewise.data import Prefetcher, StreamingDataset
    src, texts, jsonl_docs, tok = text_corpus
    with StreamingDataset([str(src)], tok, 8, seed=1, num_workers=0, piece_bytes=100) as inline:
        want = [inline.batch(k, 4) for k in range(3, 30)]
    with StreamingDataset([str(src)], tok, 8, seed=1, num_workers=2, piece_bytes=100) as ds:
        with Prefetcher(ds, 4, "cpu", start_batch=3) as loader:
            for wx, wy in want:
                x, y = loader.next()
                assert torch.equal(x, wx) and torch.equal(y, wy)


def test_streaming_errors(tmp_path, text_corpus):
    from tilewise.data import Prefetcher, StreamingDataset
    _, _, _, tok = text_corpus
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_bytes(b"\x00binary")
    with StreamingDataset([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], tok, 8, num_workers=0) as ds:
        with Prefetcher(ds, 2, "cpu") as loader:
            with pytest.raises(DataError, match="no readable text in 2 input files: 1 binary or non-UTF-8, 1 empty"):
                loader.next()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine words here"}\n' * 10 + "oops\n")
    with StreamingDataset([str(tmp_path / "bad.jsonl")], tok, 4, num_workers=0, piece_bytes=64) as ds:
        with pytest.raises(DataError, match=r"bad\.jsonl: byte offset 280: not a JSON object"):
            for k in range(100):
                ds.rows(k, 2)
    with pytest.raises(DataError, match="does not exist"):
        StreamingDataset([str(tmp_path / "none.txt")], tok, 4)
    with pytest.raises(DataError, match="tokenizer file .* does not exist"):
        StreamingDataset([str(tmp_path / "a.txt")], str(tmp_path / "tok.json"), 4)
