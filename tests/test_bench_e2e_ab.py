"""bench/e2e_ab.py: its settings reach the ops they name, and bad arguments are refused by name."""
import importlib
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import e2e_ab  # noqa: E402

attention = importlib.import_module("tilewise.ops.attention")
sm90_bwd = importlib.import_module("tilewise.ops.attention_sm90_bwd")


def test_atomic_configs_are_configs_of_the_kernel():
    for head_dim, config in e2e_ab.ATOMIC_CONFIGS.items():
        assert config in sm90_bwd.CONFIGS["dkdv_dq"][head_dim]


def test_atomic_backward_routes_every_covered_backward(monkeypatch):
    calls = []
    monkeypatch.setattr(sm90_bwd, "backward", lambda *args, **kw: calls.append((args, kw)) or "ran")
    monkeypatch.setattr(attention, "_gluon_wins", lambda kind, *args: False)   # restored after the test
    e2e_ab.atomic_backward()
    assert attention._gluon_wins("bwd", None, None, 0, None, None) is True
    assert attention._gluon_wins("fwd", None, None, 0, None, None) is False   # the forward still races
    q = torch.zeros(1, 4, 2, 64)
    assert sm90_bwd.backward(None, q, None, None, None, None, True, 0.125, grads=None) == "ran"
    (args, kw), = calls
    assert args[1] is q and args[6:] == (True, 0.125)
    assert kw == {"dq_mode": "atomic", "dkdv_dq_config": e2e_ab.ATOMIC_CONFIGS[64], "grads": None}


def _refusal(monkeypatch, capsys, *argv):
    """main()'s exit code and stderr for argv; e2e.main must not be reached."""
    import e2e
    monkeypatch.setattr(e2e, "main", lambda: pytest.fail("ran e2e.main on bad arguments"))
    monkeypatch.setattr(sys, "argv", ["e2e_ab.py", *argv])
    code = e2e_ab.main()
    return code, capsys.readouterr().err


def test_bad_arguments_are_named(monkeypatch, capsys):
    assert _refusal(monkeypatch, capsys) == (
        2, "bench/e2e_ab.py: give exactly one of --attn-bwd, --head-chunk-mb, --head-chunk-rows, "
           "--cublaslt, --embedding\n")
    code, err = _refusal(monkeypatch, capsys, "--attn-bwd", "atomic", "--head-chunk-mb", "64")
    assert code == 2 and "exactly one" in err
    assert _refusal(monkeypatch, capsys, "--head-chunk-mb", "0") == (
        2, "bench/e2e_ab.py: --head-chunk-mb=0; expected >= 1\n")
    assert _refusal(monkeypatch, capsys, "--head-chunk-rows", "-3") == (
        2, "bench/e2e_ab.py: --head-chunk-rows=-3; expected >= 1\n")


def _result_of(monkeypatch, tmp_path, argv, probe, **e2e_args):
    """Run e2e_ab.main() on argv with e2e.main stood in by what it does with its results (write them after a
    config, with `e2e_args` as its parsed arguments), probe() called first; returns (what probe returned,
    the e2e_ab.json written). Nothing may reach e2e.json or the committed results folder."""
    import argparse
    import json
    import e2e
    monkeypatch.setattr(e2e, "write", e2e.write)   # restored after the test, as every setattr here
    monkeypatch.setattr(e2e, "RESULTS", str(tmp_path / "committed"))   # where e2e.write's own file would go
    seen = []

    def fake_main():
        seen.append(probe())
        e2e.write([{"variant": "tilewise"}], argparse.Namespace(out=str(tmp_path), **e2e_args))
        return 0
    monkeypatch.setattr(e2e, "main", fake_main)
    monkeypatch.setattr(sys, "argv", ["e2e_ab.py", *argv])
    assert e2e_ab.main() == 0
    assert not (tmp_path / "e2e.json").exists() and not (tmp_path / "committed").exists()
    result = json.load(open(tmp_path / "e2e_ab.json"))
    assert result["rows"] == [{"variant": "tilewise"}]
    return seen[0], result


def test_head_chunk_setting_and_result_file(monkeypatch, tmp_path):
    """The chunk reaches cross_entropy.CHUNK_BYTES, and the rows go to e2e_ab.json (never e2e.json) with the
    setting and a command that reruns them."""
    ce = importlib.import_module("tilewise.ops.cross_entropy")
    monkeypatch.setattr(ce, "CHUNK_BYTES", ce.CHUNK_BYTES)   # restored after the test
    seen, result = _result_of(monkeypatch, tmp_path, ["--head-chunk-mb", "64", "--configs", "gpt-1.3b"],
                              lambda: (list(sys.argv[1:]), ce.CHUNK_BYTES), quick=False, configs="gpt-1.3b", fp8=[])
    assert seen == (["--configs", "gpt-1.3b"], 64 << 20)
    assert result["setting"] == {"head_chunk_mb": 64}
    assert result["command"] == ("PYTHONPATH=src python3 bench/e2e_ab.py --head-chunk-mb 64 "
                                 "--configs gpt-1.3b --fp8 '' --out DIR")


def test_head_chunk_rows_setting(monkeypatch, tmp_path):
    ce = importlib.import_module("tilewise.ops.cross_entropy")
    monkeypatch.setattr(ce, "default_chunk_rows", ce.default_chunk_rows)   # restored after the test
    rows, result = _result_of(monkeypatch, tmp_path, ["--head-chunk-rows", "5632", "--quick"],
                              lambda: [ce.default_chunk_rows(n, 50304, 2) for n in (32768, 100)],
                              quick=True, configs="", fp8=[])
    assert rows == [5632, 100]   # a shorter input is one chunk
    assert result["setting"] == {"head_chunk_rows": 5632}
    assert result["command"] == "PYTHONPATH=src python3 bench/e2e_ab.py --head-chunk-rows 5632 --quick --out DIR"


@pytest.mark.parametrize("value, switches", [("mlp", (True, False, False)), ("linear", (False, True, False)),
                                             ("all", (True, True, False)), ("tuned", (True, True, True))])
def test_cublaslt_setting(monkeypatch, tmp_path, value, switches):
    mlp = importlib.import_module("tilewise.ops.mlp")
    cublaslt = importlib.import_module("tilewise.ops.cublaslt")
    for module, name in ((mlp, "CUBLASLT_MLP"), (cublaslt, "GEMMS"), (cublaslt, "TUNE")):
        monkeypatch.setattr(module, name, False)   # restored after the test
    seen, result = _result_of(monkeypatch, tmp_path, ["--cublaslt", value, "--quick"],
                              lambda: (mlp.CUBLASLT_MLP, cublaslt.GEMMS, cublaslt.TUNE), quick=True, configs="", fp8=[])
    assert seen == switches and result["setting"] == {"cublaslt": value}
    assert result["command"] == f"PYTHONPATH=src python3 bench/e2e_ab.py --cublaslt {value} --quick --out DIR"


def test_embedding_setting(monkeypatch, tmp_path):
    emb = importlib.import_module("tilewise.ops.embedding")
    monkeypatch.setattr(emb, "TRITON_EMBEDDING", False)   # restored after the test
    seen, result = _result_of(monkeypatch, tmp_path, ["--embedding", "triton", "--quick"],
                              lambda: emb.TRITON_EMBEDDING, quick=True, configs="", fp8=[])
    assert seen is True and result["setting"] == {"embedding": "triton"}
