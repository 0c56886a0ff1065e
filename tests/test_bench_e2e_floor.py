"""bench/e2e_floor.py: its byte model against a hand count, and its floors against the committed e2e run."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import e2e_floor  # noqa: E402


def test_bytes_of_a_small_model_by_hand():
    s = {"d": 4, "f": 16, "layers": 2, "seq": 8}
    got = e2e_floor.memory_bound_bytes(s, tokens=16)
    td, tf = 16 * 4, 16 * 16
    assert got["add+norm fwd"] == 10 * td + 4 * 12 * td   # the first norm reads fp32 embeddings, no residual
    assert got["bias+gelu fwd"] == 2 * 4 * tf and got["bias+gelu bwd"] == 2 * 6 * tf
    assert got["cross-entropy"] == 4 * 16 * e2e_floor.VOCAB


def test_parameter_count_is_the_models():
    import dataclasses
    import torch
    from tilewise.config import load_config
    from tilewise.model import GPT
    for preset in ("gpt2-124m", "gpt-1.3b"):
        cfg = dataclasses.replace(load_config(preset).model, vocab_size=e2e_floor.VOCAB)
        with torch.device("meta"):
            model = GPT(cfg)
        assert e2e_floor.params(e2e_floor.model_shape(preset))["total"] == model.num_params()


def test_floors_are_below_the_measured_step(tmp_path):
    """Every kind's floor is at most what the committed e2e run measured, and the best step at most the
    measured one: a byte model that counts more than the kernels move fails here."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e_floor.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.load(open(tmp_path / "e2e_floor.json"))["rows"]
    assert {r["shape"]["config"] for r in rows} == {"gpt2-124m", "gpt-1.3b"}
    for r in rows:
        for kind, floor in r["floor_ms"].items():
            assert floor <= r["measured_ms"][kind] + 1e-9, (r["shape"], kind, floor, r["measured_ms"][kind])
        assert r["best_step_ms"] < r["tilewise_step_ms"]
        assert r["best_x_baseline"] == round(r["baseline_step_ms"] / r["best_step_ms"], 3)
