"""convert_to_fp8: which layers it swaps, what it keeps, and that a converted model still trains."""
import copy

import pytest
import torch
import torch.nn as nn

from tilewise.fp8 import Fp8Linear, Fp8Recipe, Fp8State, convert_to_fp8, recipe_from_config


class PlainLinear(nn.Linear):
    """A subclass computing x W^T + b, as tilewise.model.Linear does."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.act = nn.GELU()
        self.down = PlainLinear(64, 32, bias=False)
        self.odd = nn.Linear(32, 24)             # 24 is not a multiple of 16: kept
        self.head = nn.Linear(32, 16)            # skipped by name in the tests
        self.mha = nn.MultiheadAttention(32, 2)  # its out_proj is read directly: kept
        self.shared = nn.Linear(32, 32)
        self.blocks = nn.ModuleList([nn.Sequential(self.shared, nn.ReLU()) for _ in range(2)])

    def forward(self, x):
        h = self.down(self.act(self.up(x)))
        for b in self.blocks:
            h = h + b(h)
        return self.head(h), self.odd(h)


def test_swaps_and_skips():
    net = Net()
    params_before = {n: p for n, p in net.named_parameters()}
    state = convert_to_fp8(net, "delayed", skip=lambda name: name == "head")
    assert isinstance(state, Fp8State)
    assert isinstance(net.up, Fp8Linear) and isinstance(net.down, Fp8Linear)
    assert type(net.odd) is nn.Linear and type(net.head) is nn.Linear
    assert not isinstance(net.mha.out_proj, Fp8Linear)
    # a module reachable under two names converts once, and both names see the same Fp8Linear
    assert isinstance(net.shared, Fp8Linear) and net.blocks[0][0] is net.shared and net.blocks[1][0] is net.shared
    assert state.num_tensors == 3 * 3  # up, down, shared
    slots = sorted(m.fp8_slot for m in {id(m): m for m in net.modules() if isinstance(m, Fp8Linear)}.values())
    assert slots == [0, 3, 6]
    assert state.names[:3] == ["up.input", "up.weight", "up.grad_output"]
    # parameters are the same objects (optimizers, tying and checkpoints keep working)
    for n, p in net.named_parameters():
        assert p is params_before[n]
    assert all(m.fp8_state is state for m in net.modules() if isinstance(m, Fp8Linear))


def test_converted_model_matches_and_trains():
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    state = convert_to_fp8(net, Fp8Recipe(scaling="delayed", history_len=4))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (net, ref))
    g = torch.Generator().manual_seed(1)
    target_w = torch.randn(16, 32, generator=g) / 6
    losses, ref_losses = [], []
    for _ in range(40):
        x = torch.randn(64, 32, generator=g)
        y = x @ target_w.t()
        for m, o, log in ((net, opt, losses), (ref, ref_opt, ref_losses)):
            out, _ = m(x)
            loss = (out - y).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            log.append(loss.item())
        state.step()
    assert losses[-1] < 0.5 * losses[0]  # it learns
    assert abs(losses[-1] - ref_losses[-1]) < 0.1 * ref_losses[-1] + 1e-3  # like the fp32 model
    assert state.skipped.sum() == 0 and state.steps.item() == 40


def test_state_dict_survives_resume():
    net = Net()
    state = convert_to_fp8(net, "delayed")
    for _ in range(3):
        net(torch.randn(8, 32))[0].sum().backward()
        state.step()
    saved = state.state_dict()
    net2 = Net()
    state2 = convert_to_fp8(net2, "delayed")
    state2.load_state_dict(saved)
    assert state2.warm and torch.equal(state2.scale, state.scale)


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        convert_to_fp8("model")
    with pytest.raises(TypeError, match="from_linear"):
        convert_to_fp8(nn.Linear(16, 16))
    with pytest.raises(TypeError, match="callable"):
        convert_to_fp8(Net(), skip="head")
    with pytest.raises(ValueError, match="scaling"):
        convert_to_fp8(Net(), "rowwise")


def test_recipe_from_config():
    from tilewise.config import Fp8Config
    assert recipe_from_config(Fp8Config()) is None
    r = recipe_from_config(Fp8Config(recipe="current", format="e4m3", history_len=8, amax_compute="most_recent",
                                     margin=1))
    assert r == Fp8Recipe(scaling="current", formats="e4m3", history_len=8, amax_compute="most_recent", margin=1)


def test_tilewise_gpt_converts_and_steps():
    from tilewise.config import ModelConfig
    from tilewise.model import GPT
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=64)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    state = convert_to_fp8(model, "delayed", skip=lambda name: name.endswith("lm_head"))
    n = sum(isinstance(m, Fp8Linear) for m in model.modules())
    assert n == 2 * 4  # qkv, proj, up, down per block
    idx = torch.randint(0, 256, (4, 32))
    loss, ref_loss = model(idx, idx), ref(idx, idx)  # the mean cross-entropy
    assert abs(loss.item() - ref_loss.item()) < 0.02 * ref_loss.item()
    loss.backward()
    state.step()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
