"""HuggingFace export: transformers loads the directory and its logits equal tilewise's (GPT-2 and Llama)."""
import json
import os

import pytest
import torch

from tilewise.checkpoint import Checkpointer, CheckpointError
from tilewise.checkpoint.export import export_hf
from tilewise.config import Config, ModelConfig
from tilewise.model import GPT

FAMILIES = {
    "gpt2": dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=64),
    "gpt2-untied": dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=64, d_ff=96, tie_embeddings=False),
    "llama": dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=80,
                  norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False, rope_theta=500000.0),
    "llama-bias-tied": dict(vocab_size=128, seq_len=32, n_layer=2, n_head=4, d_model=64, d_ff=80, norm="rmsnorm",
                            mlp="swiglu", pos="rope", bias=True, tie_embeddings=True, norm_eps=1e-6),
}


def make_run(tmp_path, family: str, data_dir: str = "") -> tuple[str, GPT]:
    """A run directory as the trainer leaves it: config.json and checkpoints/ with model, optimizer and RNG."""
    cfg = Config(model=ModelConfig(**FAMILIES[family]))
    cfg.data.dir = data_dir
    run = str(tmp_path / f"run-{family}")
    os.makedirs(run)
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():   # every parameter random: a bias or norm weight in the wrong place shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update({f"optim.{k}.exp_avg": torch.randn_like(v) for k, v in model.state_dict().items()})
    tensors["rng.cpu"] = torch.get_rng_state()
    Checkpointer(os.path.join(run, "checkpoints")).save(5, tensors, {"config": cfg.to_dict()})
    return run, model.eval()


def hf_logits(out_dir: str, idx: torch.Tensor, dtype) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir).to(dtype).eval()
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_logits_match_tilewise(tmp_path, family):
    pytest.importorskip("transformers")
    run, model = make_run(tmp_path, family)
    out = str(tmp_path / "hf")
    info = export_hf(run, out)
    expected_arch = "GPT2LMHeadModel" if family.startswith("gpt2") else "LlamaForCausalLM"
    assert info["architecture"] == expected_arch and info["step"] == 5 and info["vocab_size"] == 128
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == [expected_arch]
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    # float64 on both sides: any mapping mistake is far above rounding. Both libraries compute the RoPE
    # tables in fp32 (differently), so Llama agrees to fp32 rounding of the angles, GPT-2 to fp64 rounding.
    with torch.no_grad():
        ours64 = model.double()(idx)
    theirs64 = hf_logits(out, idx, torch.float64)
    err64 = ((theirs64 - ours64).norm() / ours64.norm()).item()
    assert err64 < (1e-10 if family.startswith("gpt2") else 1e-6), err64
    # float32, as exported: both within fp32 rounding of the float64 result.
    with torch.no_grad():
        ours32 = model.float()(idx)
    theirs32 = hf_logits(out, idx, torch.float32)
    for logits in (ours32, theirs32):
        err32 = ((logits.double() - ours64).norm() / ours64.norm()).item()
        assert err32 < 1e-5, err32


def test_vocab_sliced_to_the_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    data = tmp_path / "data"
    os.makedirs(data)
    (data / "meta.json").write_text(json.dumps({"vocab_size": 100}))
    (data / "tokenizer.json").write_text("{}")
    run, model = make_run(tmp_path, "llama", str(data))
    out = str(tmp_path / "hf")
    assert export_hf(run, out, vocab="tokenizer")["vocab_size"] == 100
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    idx = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model.double()(idx)
    theirs = hf_logits(out, idx, torch.float64)
    assert theirs.shape[-1] == 100
    assert ((theirs - ours[..., :100]).norm() / ours.norm()).item() < 1e-6


def test_export_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a run directory"):
        export_hf(str(tmp_path), str(tmp_path / "out"))
    run, _ = make_run(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="vocab='all'"):
        export_hf(run, str(tmp_path / "out"), vocab="all")
    with pytest.raises(CheckpointError, match="meta.json"):
        export_hf(run, str(tmp_path / "out"), vocab="tokenizer")
    cfg = json.load(open(os.path.join(run, "config.json")))
    cfg["model"]["mlp"] = "swiglu"
    json.dump(cfg, open(os.path.join(run, "config.json"), "w"))
    with pytest.raises(ValueError, match="match neither GPT-2 .* nor Llama"):
        export_hf(run, str(tmp_path / "out"))
    cfg["model"]["mlp"], cfg["model"]["d_model"] = "gelu", 96
    json.dump(cfg, open(os.path.join(run, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="tensor 'model.*' has shape"):
        export_hf(run, str(tmp_path / "out"))
