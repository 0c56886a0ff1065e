"""AdamW's one-pass update (tilewise.ops.adamw): the kernel (the interpreter on CPU) against a float64
AdamW, and the optimizer against torch.optim.AdamW, whose state it shares."""
import copy

import pytest
import torch

from tilewise import ops
from tilewise.ops.adamw import AdamW, adamw_step_


def float64_adamw(p, grads, lr, beta1, beta2, eps, weight_decay, scale=1.0):
    """AdamW (decoupled weight decay) in float64 over a list of gradients, one step each."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double() / scale
        p = p * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1 ** t) * m / ((v / (1 - beta2 ** t)).sqrt() + eps)
    return p, m, v


@pytest.mark.parametrize("lr_tensor", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_matches_float64_adamw(device, lr_tensor, scaled):
    """Five updates of an odd-sized fp32 tensor (two programs and a ragged tail): parameter and moments
    within fp32 rounding of the float64 AdamW; the lr and the gradient's divisor as device tensors or not."""
    gen = torch.Generator().manual_seed(3)
    n, lr, b1, b2, eps, wd, scale = 4096 + 1234, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3.0
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 0.1 for _ in range(5)]
    p, m, v = p0.clone().to(device), torch.zeros(n, device=device), torch.zeros(n, device=device)
    step = torch.zeros((), device=device)
    lr_arg = torch.tensor(lr, device=device) if lr_tensor else lr
    scale_arg = torch.tensor([scale], device=device) if scaled else None
    with ops.use("triton"):
        for g in grads:
            step += 1
            adamw_step_(p, g.to(device), m, v, step, lr_arg, b1, b2, eps, wd, scale_arg)
    want = float64_adamw(p0, grads, lr, b1, b2, eps, wd, scale if scaled else 1.0)
    for name, got, ref in zip("pmv", (p, m, v), want):
        err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 2e-6, f"{name}: relative error {err:.2e}"
    assert not torch.equal(p.cpu(), p0)


def test_bf16_parameter_updates_in_fp32_and_rounds_once(device):
    """A bf16 parameter and moments: the update is computed in fp32 and each result rounded to bf16 once
    (equal to the float64 AdamW rounded, within one bf16 ulp)."""
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(3000, generator=gen).bfloat16()
    g = (torch.randn(3000, generator=gen) * 0.1).bfloat16()
    p = p0.clone().to(device)
    m, v = (torch.zeros(3000, device=device).bfloat16() for _ in range(2))
    with ops.use("triton"):
        adamw_step_(p, g.to(device), m, v, torch.ones((), device=device), 1e-2, 0.9, 0.95, 1e-8, 0.0)
    ref, _, _ = float64_adamw(p0.float(), [g.float()], 1e-2, 0.9, 0.95, 1e-8, 0.0)
    ulp = ref.abs().clamp_min(1e-3) * 2.0 ** -7
    assert ((p.cpu().double() - ref).abs() <= ulp).all()


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 40))


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def train(model, opt, steps, seed=1, scale=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen)
        model(x).square().mean().backward()
        if scale is not None:
            opt.grad_scale = scale
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("scaled", [False, True])
def test_optimizer_matches_torch_adamw(scaled):
    """On CPU (torch's fused AdamW; the interpreter for the large weights, min_numel lowered so both
    matrices count as large): after six steps every parameter and moment agrees with torch.optim.AdamW's
    (the small ones, biases and LayerNorm, take torch's step in both)."""
    ref_model, model = make_model(), make_model()
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ref_opt, opt = torch.optim.AdamW(groups(ref_model), **kw), AdamW(groups(model), **kw)
    opt.min_numel = 1000
    scale = torch.tensor([2.5]) if scaled else None
    with ops.use("triton"):
        train(model, opt, 6, scale=scale)
    train(ref_model, ref_opt, 6, scale=scale)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        for a, b in ((p, q), (opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]),
                     (opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7, msg=name)
        assert float(opt.state[p]["step"]) == 6.0
    assert sum(p.numel() >= opt.min_numel for p in model.parameters()) == 2


def test_state_dict_moves_between_torch_and_tilewise():
    """Three steps with tilewise's AdamW, its state_dict loaded into torch.optim.AdamW, three more steps:
    the same parameters as six steps of tilewise's AdamW alone (and the other way round)."""
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    with ops.use("triton"):
        a = make_model()
        opt_a = AdamW(groups(a), **kw)
        opt_a.min_numel = 1000
        train(a, opt_a, 6)

        b = make_model()
        opt_b = AdamW(groups(b), **kw)
        opt_b.min_numel = 1000
        train(b, opt_b, 3)
        opt_t = torch.optim.AdamW(groups(b), **kw)
        opt_t.load_state_dict(copy.deepcopy(opt_b.state_dict()))
        train(b, opt_t, 3, seed=2)
        back = AdamW(groups(b), **kw)
        back.load_state_dict(copy.deepcopy(opt_t.state_dict()))
        assert set(back.state_dict()["state"]) == set(opt_b.state_dict()["state"])
    # a's second three steps drew other inputs: compare b against a run that did the same
    c = make_model()
    with ops.use("triton"):
        opt_c = AdamW(groups(c), **kw)
        opt_c.min_numel = 1000
        train(c, opt_c, 3)
        train(c, opt_c, 3, seed=2)
    for p, q in zip(b.parameters(), c.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-7)


@pytest.mark.gpu
def test_gpu_optimizer_matches_torch_fused_adamw():
    """On the GPU, capturable with a tensor lr and a grad_scale (as the trainer steps): four steps over the
    same gradients (a 4M-element weight in tilewise's kernel, the rest in torch's) agree with torch's fused
    AdamW to a ten-thousandth of the learning rate in every element."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.LayerNorm(2048)).cuda()
    mine = copy.deepcopy(ref)
    lr = torch.tensor(1e-3, device="cuda")
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True, capturable=True)
    ref_opt, opt = torch.optim.AdamW(groups(ref), **kw), AdamW(groups(mine), **kw)
    for _ in range(4):
        grads = [torch.randn_like(p) * 1e-2 for p in ref.parameters()]
        for model, o in ((ref, ref_opt), (mine, opt)):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            o.grad_scale = torch.tensor([1.7], device="cuda")
            o.step()
            o.zero_grad(set_to_none=True)
    assert sum(p.numel() >= opt.min_numel for p in mine.parameters()) == 1
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"], rtol=1e-5,
                                   atol=1e-12)
