"""Export a tilewise run as a HuggingFace transformers model directory: config.json + model.safetensors.

GPT-2 settings (layernorm, gelu, learned positions, plain multi-head attention) become GPT2LMHeadModel;
Llama settings (rmsnorm, swiglu, rope) become LlamaForCausalLM. Tensor by tensor:
  GPT-2  Conv1D weights are stored (in, out), so every linear weight is transposed. The fused qkv weight
         (rows: q heads, k heads, v heads) is c_attn's column order already; mlp.up + mlp.up_bias are c_fc.
         The c_proj biases are the norms' input_bias (model.branch_bias_names).
         Biases the run does not have (bias=false) are exported as zeros, since GPT-2 always has them.
  Llama  qkv rows split into q_proj, k_proj, v_proj; mlp.up rows: the first half is gate_proj, the second
         up_proj. RoPE is rotate-half in both, so q and k need no permutation.
Vocabulary: tilewise pads the embedding to a multiple of model.pad_vocab_to rows. vocab="padded" (default)
exports every row, so the logits equal tilewise's; vocab="tokenizer" keeps the tokenizer's rows only (from
the data directory's meta.json), for tools that expect the tokenizer's size. Weights keep their dtype (fp32).
Only the model's byte ranges of the checkpoint are read; the optimizer state is not touched.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..model import branch_bias_names
from .load import load_tensors
from .manifest import CheckpointError, resolve

__all__ = ["export_hf"]


def _run_config(run_dir: str):
    from ..config import from_dict
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"export: {run_dir!r} is not a run directory (no config.json)")
    with open(path) as f:
        return from_dict(json.load(f))


def _family(mc) -> str:
    if (mc.norm, mc.mlp, mc.pos) == ("layernorm", "gelu", "learned") and mc.kv_heads == mc.n_head:
        return "gpt2"
    if (mc.norm, mc.mlp, mc.pos) == ("rmsnorm", "swiglu", "rope"):
        return "llama"
    raise CheckpointError(f"export: model.norm={mc.norm!r}, model.mlp={mc.mlp!r}, model.pos={mc.pos!r}, "
                     f"n_kv_head={mc.n_kv_head} match neither GPT-2 (layernorm, gelu, learned, no grouped-query "
                     f"attention) nor Llama (rmsnorm, swiglu, rope)")


def _gpt2(mc, w: dict, vocab: int) -> tuple[dict, dict]:
    d, ff = mc.d_model, mc.ff_dim
    branch_biases = branch_bias_names(mc.n_layer)

    def zeros(n):
        return torch.zeros(n, dtype=w["wte.weight"].dtype)

    def bias(name, n):
        return w[name] if name in w else zeros(n)
    out = {"transformer.wte.weight": w["wte.weight"], "transformer.wpe.weight": w["wpe.weight"],
           "transformer.ln_f.weight": w["norm_f.weight"], "transformer.ln_f.bias": bias("norm_f.bias", d)}
    for i in range(mc.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        qkv_out = 3 * d
        out.update({
            dst + "ln_1.weight": w[src + "norm1.weight"], dst + "ln_1.bias": bias(src + "norm1.bias", d),
            dst + "attn.c_attn.weight": w[src + "attn.qkv.weight"].t(),
            dst + "attn.c_attn.bias": bias(src + "attn.qkv.bias", qkv_out),
            dst + "attn.c_proj.weight": w[src + "attn.proj.weight"].t(),
            dst + "attn.c_proj.bias": bias(branch_biases[i][0], d),
            dst + "ln_2.weight": w[src + "norm2.weight"], dst + "ln_2.bias": bias(src + "norm2.bias", d),
            dst + "mlp.c_fc.weight": w[src + "mlp.up.weight"].t(),
            dst + "mlp.c_fc.bias": bias(src + "mlp.up_bias", ff),
            dst + "mlp.c_proj.weight": w[src + "mlp.down.weight"].t(),
            dst + "mlp.c_proj.bias": bias(branch_biases[i][1], d),
        })
    if not mc.tie_embeddings:
        out["lm_head.weight"] = w["lm_head.weight"]
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
              "n_positions": mc.seq_len, "n_ctx": mc.seq_len, "n_embd": d, "n_layer": mc.n_layer,
              "n_head": mc.n_head, "n_inner": ff, "activation_function": "gelu_new",
              "layer_norm_epsilon": mc.norm_eps, "resid_pdrop": mc.dropout, "embd_pdrop": mc.dropout,
              "attn_pdrop": mc.dropout, "initializer_range": mc.init_std, "scale_attn_weights": True,
              "tie_word_embeddings": mc.tie_embeddings}
    return out, config


def _llama(mc, w: dict, vocab: int) -> tuple[dict, dict]:
    hd, nq, nkv, ff = mc.head_dim, mc.n_head, mc.kv_heads, mc.ff_dim
    branch_biases = branch_bias_names(mc.n_layer)
    out = {"model.embed_tokens.weight": w["wte.weight"], "model.norm.weight": w["norm_f.weight"]}
    for i in range(mc.n_layer):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = w[src + "attn.qkv.weight"].split([nq * hd, nkv * hd, nkv * hd])
        gate, up = w[src + "mlp.up.weight"].split([ff, ff])
        out.update({
            dst + "input_layernorm.weight": w[src + "norm1.weight"],
            dst + "post_attention_layernorm.weight": w[src + "norm2.weight"],
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
            dst + "self_attn.v_proj.weight": v, dst + "self_attn.o_proj.weight": w[src + "attn.proj.weight"],
            dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": w[src + "mlp.down.weight"],
        })
        if mc.bias:   # attention_bias covers q, k, v and o; mlp_bias gate, up and down (tilewise's up has none)
            qb, kb, vb = w[src + "attn.qkv.bias"].split([nq * hd, nkv * hd, nkv * hd])
            out.update({dst + "self_attn.q_proj.bias": qb, dst + "self_attn.k_proj.bias": kb,
                        dst + "self_attn.v_proj.bias": vb, dst + "self_attn.o_proj.bias": w[branch_biases[i][0]],
                        dst + "mlp.gate_proj.bias": torch.zeros(ff, dtype=qb.dtype),
                        dst + "mlp.up_proj.bias": torch.zeros(ff, dtype=qb.dtype),
                        dst + "mlp.down_proj.bias": w[branch_biases[i][1]]})
    if not mc.tie_embeddings:
        out["lm_head.weight"] = w["lm_head.weight"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": mc.d_model, "intermediate_size": ff, "num_hidden_layers": mc.n_layer,
              "num_attention_heads": nq, "num_key_value_heads": nkv, "head_dim": hd, "hidden_act": "silu",
              "max_position_embeddings": mc.seq_len, "rms_norm_eps": mc.norm_eps, "rope_theta": mc.rope_theta,
              "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_theta},
              "attention_bias": mc.bias, "mlp_bias": mc.bias, "attention_dropout": mc.dropout,
              "initializer_range": mc.init_std, "tie_word_embeddings": mc.tie_embeddings}
    return out, config


def export_hf(run_dir: str, out_dir: str, *, vocab: str = "padded", checkpoint: str | None = None) -> dict:
    """Write a transformers model directory for the run's latest checkpoint (or `checkpoint`) into out_dir.

    Returns {"out_dir", "architecture", "step", "vocab_size", "params"}. Also copies the run's
    tokenizer.json, when its data directory has one.
    """
    if vocab not in ("padded", "tokenizer"):
        raise CheckpointError(f"export: vocab={vocab!r}; expected 'padded' or 'tokenizer'")
    run_dir, out_dir = os.fspath(run_dir), os.fspath(out_dir)
    cfg = _run_config(run_dir)
    mc = cfg.model
    family = _family(mc)
    ckpt_dir = resolve(checkpoint or run_dir)
    from ..model import GPT
    with torch.device("meta"):
        expected = {k: (v.shape, v.dtype) for k, v in GPT(mc).state_dict().items()}
    tensors, state = load_tensors(ckpt_dir, [f"model.{k}" for k in sorted(expected)])
    w = {k[len("model."):]: v for k, v in tensors.items()}
    for name, (shape, _) in expected.items():
        if w[name].shape != shape:
            raise CheckpointError(f"export: {ckpt_dir}: tensor 'model.{name}' has shape {list(w[name].shape)}; the "
                                  f"run's config.json gives {list(shape)}")
    rows = mc.vocab_size
    tokenizer = os.path.join(cfg.data.dir, "tokenizer.json") if cfg.data.dir else ""
    if vocab == "tokenizer":
        meta_path = os.path.join(cfg.data.dir, "meta.json")
        if not cfg.data.dir or not os.path.isfile(meta_path):
            raise CheckpointError(f"export: vocab='tokenizer' needs the run's data directory's meta.json; "
                                  f"{meta_path!r} does not exist")
        with open(meta_path) as f:
            rows = json.load(f)["vocab_size"]
        if not 0 < rows <= mc.vocab_size:
            raise CheckpointError(f"export: {meta_path} gives vocab_size {rows}; the model has {mc.vocab_size} rows")
        for name in ("wte.weight", "lm_head.weight"):
            if name in w:
                w[name] = w[name][:rows]
    weights, config = (_gpt2 if family == "gpt2" else _llama)(mc, w, rows)
    dtype = w["wte.weight"].dtype
    config.update({"torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
                   "bos_token_id": None, "eos_token_id": None, "use_cache": True})

    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer and os.path.isfile(tokenizer):
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
    return {"out_dir": out_dir, "architecture": config["architectures"][0], "step": state["step"],
            "vocab_size": rows, "params": sum(v.numel() for v in weights.values())}
