"""Fp8State: delayed scaling updates, history roll, non-finite amax handling, checkpoint round trip,
and the one-collective MAX reduction across ranks (gloo, two processes)."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tilewise.fp8 import E4M3, E5M2, Fp8Recipe, Fp8State, as_recipe, fp8_max


def make_state(history_len=4, amax_compute="max", margin=0, dtypes=(E4M3, E4M3, E5M2)):
    return Fp8State(Fp8Recipe(history_len=history_len, amax_compute=amax_compute, margin=margin), dtypes)


def record(state, values):
    """What the casts of one step would do: fold amaxes into the history's current row."""
    cur = state.amax_history[0]
    cur.copy_(torch.maximum(cur, torch.tensor(values, dtype=torch.float32)))


def test_history_rolls_and_max_mode_uses_the_window():
    s = make_state(history_len=3)
    steps = [[2.0, 4.0, 8.0], [1.0, 16.0, 0.5], [0.5, 1.0, 0.25], [0.25, 0.5, 0.125]]
    for i, amaxes in enumerate(steps):
        record(s, amaxes)
        s.step()
        # after the roll, row 0 is empty and rows 1.. hold the last steps, newest first
        assert torch.equal(s.amax_history[0], torch.zeros(3))
        want_rows = list(reversed(steps[max(0, i - 1):i + 1]))
        for r, row in enumerate(want_rows, start=1):
            assert s.amax_history[r].tolist() == row
        window = torch.tensor(steps[max(0, i - 2):i + 1]).amax(0)  # history_len=3 steps
        want = s.fp8_max / window
        assert torch.allclose(s.scale, want, rtol=1e-7)
        assert torch.allclose(s.scale_inv, 1 / want, rtol=1e-6)
    assert s.steps.item() == 4 and s.warm


def test_most_recent_mode_and_margin():
    s = make_state(amax_compute="most_recent", margin=2)
    record(s, [100.0, 1.0, 2.0])
    s.step()
    record(s, [1.0, 2.0, 4.0])
    s.step()
    want = torch.tensor([448.0 / 1 / 4, 448.0 / 2 / 4, 57344.0 / 4 / 4])
    assert torch.equal(s.scale, want)  # not the larger 100 of the step before: most_recent
    m = make_state(amax_compute="max", margin=2)
    for amaxes in ([100.0, 1.0, 2.0], [1.0, 2.0, 4.0]):
        record(m, amaxes)
        m.step()
    assert torch.equal(m.scale, torch.tensor([448.0 / 100 / 4, 448.0 / 2 / 4, 57344.0 / 4 / 4]))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_amax_is_skipped_and_counted(bad):
    s = make_state()
    record(s, [2.0, 2.0, 2.0])
    s.step()
    before = s.scale.clone()
    s.amax_history[0] = torch.tensor([bad, 4.0, 1.0])
    s.step()
    assert s.scale[0] == before[0]  # slot 0 kept its scale
    assert s.scale[1] == 448.0 / 4.0 and s.scale[2] == 57344.0 / 2.0  # the others updated
    assert s.skipped.tolist() == [1, 0, 0] and s.skipped_total().item() == 1
    assert torch.isfinite(s.amax_history).all() and s.amax_history[1, 0] == 0  # entered as 0
    assert torch.isfinite(s.scale).all() and torch.isfinite(s.scale_inv).all()
    record(s, [1.0, 1.0, 1.0])
    s.step()  # training goes on: next finite amax updates slot 0 (max over the window)
    assert s.scale[0] == 448.0 / 2.0 and s.skipped.tolist() == [1, 0, 0]


def test_zero_amax_keeps_scale():
    s = make_state(amax_compute="most_recent")
    record(s, [4.0, 4.0, 4.0])
    s.step()
    before = s.scale.clone()
    s.step()  # nothing recorded: amax 0 carries no information
    assert torch.equal(s.scale, before) and s.skipped.sum() == 0


def test_state_dict_round_trip():
    s = make_state(history_len=5)
    for amaxes in ([3.0, 1.0, 0.1], [5.0, 0.5, float("inf")], [1.0, 2.0, 0.2]):
        record(s, amaxes)
        s.step()
    record(s, [7.0, 7.0, 7.0])  # a step in progress is part of the state too
    sd = s.state_dict()
    assert set(sd) == {"amax_history", "scale", "scale_inv", "skipped", "steps"}
    assert all(isinstance(v, torch.Tensor) for v in sd.values())
    fresh = make_state(history_len=5)
    assert not fresh.warm
    fresh.load_state_dict(sd)
    for k, v in sd.items():
        assert torch.equal(getattr(fresh, k), v)
    assert fresh.warm
    sd["scale"].fill_(123.0)  # state_dict holds copies
    assert s.scale[0] != 123.0
    fresh.step()
    s.step()
    assert torch.equal(fresh.scale, s.scale) and torch.equal(fresh.amax_history, s.amax_history)


def test_load_rejects_mismatched_state():
    s = make_state(history_len=4)
    with pytest.raises(ValueError, match="amax_history"):
        s.load_state_dict(make_state(history_len=8).state_dict())
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"scale": s.scale})


def test_recipe_validation():
    assert as_recipe("current").scaling == "current" and as_recipe("delayed").bwd_dtype == E5M2
    assert Fp8Recipe(formats="e4m3").bwd_dtype == E4M3
    assert as_recipe("blockwise").scaling == "blockwise"
    with pytest.raises(ValueError, match="scaling"):
        as_recipe("tensorwise")
    with pytest.raises(ValueError, match="amax_compute"):
        Fp8Recipe(amax_compute="mean")
    with pytest.raises(ValueError, match="history_len"):
        Fp8Recipe(history_len=0)
    with pytest.raises(ValueError, match="margin"):
        Fp8Recipe(margin=-1)
    with pytest.raises(TypeError):
        as_recipe(3)
    with pytest.raises(TypeError):
        fp8_max(torch.bfloat16)
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0


def _reduce_worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        s = make_state(history_len=2, dtypes=(E4M3, E4M3, E4M3, E5M2))
        per_rank = [[1.0, 8.0, float("inf"), 0.5], [4.0, float("nan"), 2.0, 0.25]]
        record(s, per_rank[rank])
        s.step()
        torch.save(s.state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_amax_reduction_across_ranks_is_max_and_skips_nan(tmp_path):
    mp.spawn(_reduce_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k  # every rank ends with the same scales
    # MAX; a NaN or inf on one rank reaches every rank, which all skip that slot
    assert r0["amax_history"][1].tolist() == [4.0, 0.0, 0.0, 0.5]
    assert r0["skipped"].tolist() == [0, 1, 1, 0]
    assert r0["scale"].tolist() == [448.0 / 4.0, 1.0, 1.0, 57344.0 / 0.5]
    assert not any(math.isnan(v) for v in r0["scale"].tolist())


def test_gemm_scale_views_are_16_byte_aligned():
    """cuBLASLt (torch._scaled_mm) rejects scale pointers that are not 16-byte aligned: every slot's view
    of scale_inv must start a 16-byte block, also after .to() and load_state_dict."""
    state = Fp8State.for_linears("delayed", ["a", "b", "c"])
    for copy in (state, Fp8State.for_linears("delayed", ["a", "b", "c"]).to("cpu")):
        for slot in range(copy.num_tensors):
            scale, scale_inv, _ = copy.views(slot)
            assert scale.data_ptr() % 16 == 0 and scale_inv.data_ptr() % 16 == 0
    state.scale_inv.fill_(3.0)
    other = Fp8State.for_linears("delayed", ["a", "b", "c"])
    other.load_state_dict(state.state_dict())
    assert torch.equal(other.views(4)[1], torch.tensor([3.0]))
    assert other.views(4)[1].data_ptr() % 16 == 0
