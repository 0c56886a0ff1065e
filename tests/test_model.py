"""The model against an independent, textbook pre-norm transformer written with plain torch ops."""
import math

import pytest
import torch
import torch.nn.functional as F

from tilewise.config import ModelConfig, PRESETS, load_config
from tilewise.model import GPT, branch_bias_names


def small_config(family: str) -> ModelConfig:
    if family == "gpt2":
        return ModelConfig(vocab_size=96, seq_len=24, n_layer=2, n_head=4, d_model=32)
    return ModelConfig(vocab_size=96, seq_len=24, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=48,
                       norm="rmsnorm", mlp="swiglu", pos="rope", bias=False, tie_embeddings=False)


def textbook_forward(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """x = emb; for each block: x += attn(norm1(x)); x += mlp(norm2(x)); logits = head(norm_f(x))."""
    c = model.cfg
    T = idx.shape[1]

    def norm(mod, x):
        if c.norm == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), mod.weight, mod.bias, c.norm_eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * mod.weight

    def rotate(x):  # (B, H, T, D), rotate-half RoPE
        half = x.shape[-1] // 2
        inv = 1.0 / c.rope_theta ** (torch.arange(0, x.shape[-1], 2, dtype=x.dtype) / x.shape[-1])
        ang = torch.arange(T, dtype=x.dtype)[:, None] * inv[None]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), -1)

    x = model.wte.weight[idx]
    if model.wpe is not None:
        x = x + model.wpe.weight[:T]
    params = dict(model.named_parameters())
    for blk, (attn_bias, mlp_bias) in zip(model.blocks, branch_bias_names(c.n_layer)):
        a = blk.attn
        h = norm(blk.norm1, x)
        qkv = F.linear(h, a.qkv.weight, a.qkv.bias)
        q, k, v = qkv.split([c.n_head * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = q.view(*q.shape[:2], c.n_head, c.head_dim).transpose(1, 2)
        k = k.view(*k.shape[:2], c.kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(*v.shape[:2], c.kv_heads, c.head_dim).transpose(1, 2)
        if c.pos == "rope":
            q, k = rotate(q), rotate(k)
        rep = c.n_head // c.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(*x.shape[:2], -1)
        x = x + F.linear(o, a.proj.weight, params.get(attn_bias))
        h = norm(blk.norm2, x)
        m = blk.mlp
        if c.mlp == "swiglu":
            gate, up = F.linear(h, m.up.weight).chunk(2, -1)
            inner = F.silu(gate) * up
        else:
            inner = F.gelu(F.linear(h, m.up.weight, m.up_bias), approximate="tanh")
        x = x + F.linear(inner, m.down.weight, params.get(mlp_bias))
    x = norm(model.norm_f, x)
    return F.linear(x, model.head_weight)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_matches_textbook_transformer(family):
    torch.manual_seed(0)
    model = GPT(small_config(family)).double()
    with torch.no_grad():  # non-trivial norms and biases, so a missing term shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    idx = torch.randint(0, 96, (3, 24))
    logits = model(idx)
    assert logits.shape == (3, 24, 96)
    expected = textbook_forward(model, idx)
    err = (logits - expected).norm() / expected.norm()
    assert err < 1e-10, err


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_loss_equals_cross_entropy_of_logits(family):
    torch.manual_seed(1)
    model = GPT(small_config(family)).double()
    idx, tgt = torch.randint(0, 96, (2, 24)), torch.randint(0, 96, (2, 24))
    loss = model(idx, tgt)
    expected = F.cross_entropy(model(idx).reshape(-1, 96), tgt.reshape(-1))
    assert torch.allclose(loss, expected, rtol=1e-10)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_kv_cache_generation_equals_full_forward(family):
    torch.manual_seed(2)
    model = GPT(small_config(family)).double().eval()
    prompt = torch.randint(0, 96, (2, 5))
    out = model.generate(prompt, 12, temperature=0)
    assert out.shape == (2, 17)
    assert torch.equal(out[:, :5], prompt)
    greedy = model(out[:, :-1])[:, 4:].argmax(-1)
    assert torch.equal(greedy, out[:, 5:])


def test_generate_respects_vocab_limit_and_seq_len():
    torch.manual_seed(3)
    model = GPT(small_config("gpt2")).eval()
    out = model.generate(torch.zeros(4, 3, dtype=torch.long), 100, temperature=1.5, vocab_limit=10)
    assert out.shape == (4, 24)  # capped at seq_len
    assert int(out[:, 3:].max()) < 10


def test_dropout_changes_training_output_only():
    torch.manual_seed(4)
    cfg = small_config("gpt2")
    cfg.dropout = 0.5
    model = GPT(cfg)
    idx = torch.randint(0, 96, (2, 24))
    model.train()
    a, b = model(idx), model(idx)
    assert not torch.allclose(a, b)
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_presets_build_and_have_expected_sizes():
    sizes = {}
    for name in PRESETS:
        cfg = load_config(name)
        cfg.model.vocab_size = 50304 if name.startswith("gpt") else 32768
        with torch.device("meta"):
            sizes[name] = GPT(cfg.model).num_params()
    assert 120e6 < sizes["gpt2-124m"] < 130e6
    assert 340e6 < sizes["gpt2-350m"] < 370e6
    assert 1.2e9 < sizes["gpt-1.3b"] < 1.45e9
    assert 1.0e9 < sizes["llama-1b"] < 1.4e9
    tiny = load_config("tiny")
    tiny.model.vocab_size = 2048
    assert GPT(tiny.model).num_params() < 5e6


def test_sequence_longer_than_seq_len_is_an_error():
    model = GPT(small_config("gpt2"))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize("attention", ["fp8", "fp8_rotate"])
def test_fp8_attention_option_trains_close_to_flash(attention):
    """model.attention='fp8' / 'fp8_rotate' route attention through ops.fp8_flash_attention: the loss stays
    within FP8's error of the bf16-attention model's from the same weights, and every gradient is finite."""
    cfg = ModelConfig(vocab_size=96, seq_len=24, n_layer=2, n_head=2, d_model=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    fp8 = GPT(ModelConfig(**{**cfg.__dict__, "attention": attention}))
    fp8.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 96, (3, 24))
    base, loss = ref(idx, idx), fp8(idx, idx)
    assert abs(loss.item() - base.item()) < 0.02 * base.item() and loss.item() != base.item()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fp8.parameters())


def test_sdpa_attention_option_matches_flash():
    """model.attention='sdpa' (torch's SDPA, the e2e yardstick) computes the same model: the loss and the
    gradients of the flash model from the same weights, within fp32 rounding."""
    cfg = ModelConfig(vocab_size=96, seq_len=24, n_layer=2, n_head=4, n_kv_head=2, d_model=64)
    torch.manual_seed(0)
    ref = GPT(cfg)
    sdpa = GPT(ModelConfig(**{**cfg.__dict__, "attention": "sdpa"}))
    sdpa.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 96, (3, 24))
    base, loss = ref(idx, idx), sdpa(idx, idx)
    assert abs(loss.item() - base.item()) < 1e-5 * base.item()
    base.backward()
    loss.backward()
    for (name, p), q in zip(ref.named_parameters(), sdpa.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_fp8_rotate_needs_a_power_of_two_head_dim():
    with pytest.raises(ValueError, match="fp8_rotate.*power of two >= 32; it is 40"):
        ModelConfig(n_head=4, d_model=160, attention="fp8_rotate").validate()
    with pytest.raises(ValueError, match="model.attention='fp4'"):
        ModelConfig(attention="fp4").validate()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_triton_kernels_train_the_model_as_the_reference_ops(family):
    """The whole model in the interpreter (every Triton op, the packed QKV attention of the GPT-2 family
    and the split one of the llama family) against the PyTorch reference ops: loss and every gradient."""
    from tilewise import ops
    torch.manual_seed(0)
    model = GPT(small_config(family))
    idx = torch.randint(0, 96, (2, 24))
    results = []
    for mode in ("reference", "triton"):
        model.zero_grad(set_to_none=True)
        with ops.use(mode):
            loss = model(idx, idx)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for (name, _), a, b in zip([("loss", None)] + list(model.named_parameters()), *results):
        err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert err < 1e-3, f"{name}: relative error {err:.2e}"
