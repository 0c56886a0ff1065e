"""A decoder-only transformer whose every computation goes through tilewise.ops.

GPT-2 (LayerNorm, GELU, learned positions, tied embeddings) and Llama (RMSNorm, RoPE, SwiGLU, grouped-query
attention) are settings of one ModelConfig. The residual stream follows the fused pre-norm pattern: each
norm also adds its branch's output into the residual, so one kernel reads the branch output and the
residual once and writes the normed activations and the new residual once:

    y, h = add_dropout_norm(branch_out, h, norm)   # h = h + dropout(branch_out); y = norm(h)

The linears that end a branch (attention's proj, the MLP's down) have no bias of their own: the norm that
adds their output holds it (Norm.input_bias) and the kernel adds it before the dropout. The model is GPT-2's,
and the bias's gradient, the column sums of the kernel's dx, comes out of the kernel's backward pass over dx
instead of a pass of its own (the MLP's up bias goes into the GELU the same way). Block i's MLP bias is
therefore block i + 1's norm1.input_bias (the final norm's for the last block): branch_bias_names.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from . import ops
from .config import ModelConfig


class Linear(nn.Linear):
    """nn.Linear whose matmul is tilewise.ops.linear; tilewise.fp8 swaps these for Fp8Linear."""

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)


class Norm(nn.Module):
    """The parameters of a LayerNorm/RMSNorm, and with adds_branch the bias of the branch output it adds into
    the residual (input_bias, with cfg.bias); the computation is the fused op."""

    def __init__(self, width: int, cfg: ModelConfig, adds_branch: bool = True):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if cfg.bias and cfg.norm == "layernorm" else None
        self.input_bias = nn.Parameter(torch.zeros(width)) if cfg.bias and adds_branch else None

    def add_and_norm(self, x, residual, dropout_p):
        return ops.add_dropout_norm(x, residual, self.weight, self.bias, x_bias=self.input_bias, kind=self.kind,
                                    eps=self.eps, dropout_p=dropout_p, training=self.training)


def branch_bias_names(n_layer: int) -> list[tuple[str, str]]:
    """Per block, the names of its attention output's and MLP output's biases (see the module docstring)."""
    return [(f"blocks.{i}.norm2.input_bias",
             f"blocks.{i + 1}.norm1.input_bias" if i + 1 < n_layer else "norm_f.input_bias") for i in range(n_layer)]


class KVCache:
    """Keys and values of the positions seen so far, per layer, for incremental decoding."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype):
        shape = (cfg.n_layer, batch, max_len, cfg.kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0   # positions already cached (committed by advance())

    def update(self, layer: int, k, v):
        end = self.length + k.shape[1]
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def advance(self, n: int):
        self.length += n


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.n_head, self.n_kv, self.head_dim = layer, cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.kind = cfg.attention
        self.qkv = Linear(cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.bias)
        self.proj = Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)   # its bias: norm2's input_bias

    def forward(self, x, rope=None, cache: KVCache | None = None):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.n_head + 2 * self.n_kv, self.head_dim)
        if self.kind == "flash" and rope is None and cache is None:   # one gradient for qkv, no concatenation
            return self.proj(ops.flash_attention_qkv(qkv, self.n_kv, causal=True).reshape(B, T, -1))
        q, k, v = qkv.split([self.n_head, self.n_kv, self.n_kv], dim=2)  # strided views, no copy
        if rope is not None:
            q, k = ops.apply_rope(q, *rope), ops.apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if self.kind == "flash":
            out = ops.flash_attention(q, k, v, causal=True)
        elif self.kind == "sdpa":
            out = ops.sdpa_attention(q, k, v, causal=True)
        else:
            out = ops.fp8_flash_attention(q, k, v, causal=True, rotate=self.kind == "fp8_rotate")
        return self.proj(out.reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.mlp
        if cfg.mlp == "swiglu":
            self.up = Linear(cfg.d_model, 2 * cfg.ff_dim, bias=False)   # gate and up, one GEMM
            self.up_bias = None
        else:
            self.up = Linear(cfg.d_model, cfg.ff_dim, bias=False)       # its bias is fused into the GELU
            self.up_bias = nn.Parameter(torch.zeros(cfg.ff_dim)) if cfg.bias else None
        self.down = Linear(cfg.ff_dim, cfg.d_model, bias=False)   # its bias: the next norm's input_bias

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down(ops.swiglu(self.up(x)))
        after_gelu = getattr(self.down, "after_gelu", None)   # an Fp8Linear: the GELU inside its FP8 input cast
        if after_gelu:
            return after_gelu(self.up(x), self.up_bias)
        if isinstance(self.up, Linear) and isinstance(self.down, Linear):   # the GELU inside the GEMMs
            return ops.gelu_mlp(x, self.up.weight, self.up_bias, self.down.weight)
        return self.down(ops.bias_gelu(self.up(x), self.up_bias))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.dropout = cfg.dropout
        self.norm1, self.attn = Norm(cfg.d_model, cfg, adds_branch=layer > 0), Attention(cfg, layer)
        self.norm2, self.mlp = Norm(cfg.d_model, cfg), MLP(cfg)

    def forward(self, x, residual, rope=None, cache=None):
        """x: the previous branch's output (or the embeddings); returns this block's MLP output and the residual."""
        y, residual = self.norm1.add_and_norm(x, residual, self.dropout)
        x = self.attn(y, rope, cache)
        y, residual = self.norm2.add_and_norm(x, residual, self.dropout)
        return self.mlp(y), residual


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = Norm(cfg.d_model, cfg)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.pos == "rope":
            cos, sin = ops.rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 initialization: N(0, std), the projections into the residual scaled by 1/sqrt(2 * layers)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name:
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    @property
    def head_weight(self):
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 * params + 6 * layers * seqlen * d_model (causal attention)."""
        c = self.cfg
        return 6 * self.num_params() + 6 * c.n_layer * c.seq_len * c.d_model

    def hidden_states(self, idx, cache: KVCache | None = None):
        """The final normed hidden states (B, T, d_model) of token ids idx (B, T)."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.seq_len:
            raise ValueError(f"sequence of {start + T} tokens is longer than the model's seq_len {self.cfg.seq_len}")
        x = ops.embedding(idx, self.wte.weight, None if self.wpe is None else self.wpe.weight, start)
        rope = None
        if self.cfg.pos == "rope":
            rope = (self.rope_cos[start:start + T], self.rope_sin[start:start + T])
        residual = None
        for block in self.blocks:
            x, residual = block(x, residual, rope, cache)
        y, _ = self.norm_f.add_and_norm(x, residual, self.cfg.dropout)
        return y

    def forward(self, idx, targets=None):
        """With targets: the mean cross-entropy (the logits are never materialized). Without: the logits."""
        y = self.hidden_states(idx)
        if targets is None:
            return ops.linear(y, self.head_weight)
        return ops.linear_cross_entropy(y.reshape(-1, y.shape[-1]), self.head_weight, targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                 vocab_limit: int | None = None, generator: torch.Generator | None = None):
        """Sample up to max_new_tokens after the prompt idx (B, T) with a KV cache; returns (B, T + new).

        vocab_limit: sample only ids below it (the tokenizer's size; the embedding rows past it are padding).
        temperature 0 is greedy decoding.
        """
        max_len = min(self.cfg.seq_len, idx.shape[1] + max_new_tokens)
        max_new_tokens = max_len - idx.shape[1]
        if max_new_tokens <= 0:
            return idx
        dtype = next(self.parameters()).dtype
        cache = KVCache(self.cfg, idx.shape[0], max_len, idx.device, dtype)
        tokens, step_input = idx, idx
        for _ in range(max_new_tokens):
            y = self.hidden_states(step_input, cache)
            cache.advance(step_input.shape[1])
            logits = ops.linear(y[:, -1], self.head_weight).float()
            if vocab_limit is not None:
                logits[:, vocab_limit:] = float("-inf")
            if temperature <= 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            tokens = torch.cat((tokens, next_token), dim=1)
            step_input = next_token
        return tokens
