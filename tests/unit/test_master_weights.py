"""distlab.master_weights: fp32 masters of bf16 weights, stepped by AdamW.

The masters must be exactly what fp32 AdamW makes of the same gradients (the bf16 weights being those masters
rounded), keep updates that bf16 rounds away, survive a checkpoint bit for bit, follow an LR scheduler, and
stay equal on every DDP rank; the config accepts them only where they work."""

from __future__ import annotations

import datetime
import io
import multiprocessing
import time

import pytest
import torch

from distlab.config import ConfigError, TrainConfig
from distlab.master_weights import MASTERS_KEY, MasterWeightOptimizer, make_master_weight_optimizer
from distlab.measure.state import measure_state

ADAMW = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8}


def tiny_model(seed: int = 0, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def groups(params, weight_decay: float = 0.01) -> list[dict]:
    """As Strategy.make_optimizer groups them: decay on matrices, none on vectors."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def in_group_order(params) -> list[torch.Tensor]:
    """`params` (model order) in the order the optimizer holds them, its masters' order."""
    return [p.detach() for g in groups(params) for p in g["params"]]


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(n)]


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 + 0.5 * (step % 3))  # changes every step


def backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    dtype = next(model.parameters()).dtype
    ((model(x.to(dtype)).float() - y) ** 2).mean().backward()


def train_step(model, opt, sched, x, y) -> None:
    """The loop's step: backward, clip the model's (bf16) gradients, step, schedule, zero."""
    backward(model, x, y)
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def moments(opt) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for k, v in sorted(s.items())]


def assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (x - y).abs().max()


# ----------------------------------------------------------------------------- (a) exactly fp32 AdamW

def test_the_masters_are_exactly_fp32_adamw_on_the_same_gradients_and_the_weights_are_them_rounded():
    model = tiny_model()
    opt = MasterWeightOptimizer(groups(model.parameters()), torch.optim.AdamW, **ADAMW)
    sched = schedule(opt)
    # the reference: fp32 weights (the bf16 ones, widened exactly), plain AdamW, the same schedule
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(groups(ref), **ADAMW)
    ref_sched = schedule(ref_opt)
    for x, y in batches(8):
        backward(model, x, y)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5)
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float()  # the same (clipped) gradients the masters get
        opt.step(), ref_opt.step()
        sched.step(), ref_sched.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
    assert_equal(opt.master_params, in_group_order(ref))
    assert_equal([p.detach() for p in model.parameters()], [r.detach().bfloat16() for r in ref])
    assert_equal(moments(opt), moments(ref_opt))
    # and the masters hold what bf16 cannot: they are not the weights widened
    assert any(not torch.equal(m, p.float()) for m, p in zip(opt.master_params, in_group_order(model.parameters())))


def test_an_update_bf16_rounds_away_is_kept_by_the_master():
    # weight 1.0, AdamW's step ~lr = 1e-3 each time: under half the gap below 1.0 in bf16 (2^-9 ~ 0.00195)
    def weight():
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        return w

    plain, mastered = weight(), weight()
    plain_opt = torch.optim.AdamW([plain], lr=1e-3, weight_decay=0.0)
    master_opt = make_master_weight_optimizer([{"params": [mastered], "weight_decay": 0.0}], lr=1e-3)
    for _ in range(10):
        for w, o in ((plain, plain_opt), (mastered, master_opt)):
            w.sum().backward()  # gradient +1: every step pushes the weight down
            o.step()
            o.zero_grad(set_to_none=True)
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.bfloat16))  # ten updates, all lost
    master = master_opt.master_params[0]
    assert torch.allclose(master, torch.full((4,), 0.99), atol=1e-4)  # ten updates of 1e-3, all kept
    assert torch.equal(mastered.detach(), master.bfloat16()) and bool((mastered < 1).all())


def test_an_fp32_weight_is_its_own_master_and_a_weight_without_gradient_is_left_alone():
    bf16 = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.bfloat16))
    fp32 = torch.nn.Parameter(torch.randn(3))
    idle = torch.nn.Parameter(torch.randn(2, dtype=torch.bfloat16))
    before = idle.detach().clone()
    opt = make_master_weight_optimizer([{"params": [bf16, fp32, idle]}], lr=0.1)
    assert len(opt.master_params) == 2 and opt.param_groups[0]["params"][1] is fp32  # no copy of the fp32 one
    ((bf16.float() ** 2).sum() + (fp32 ** 2).sum()).backward()
    fp32_before = fp32.detach().clone()
    opt.step()
    assert not torch.equal(fp32.detach(), fp32_before)  # stepped in place
    assert torch.equal(idle.detach(), before) and opt.state.get(opt.param_groups[0]["params"][2]) in (None, {})
    assert sorted(opt.state_dict()[MASTERS_KEY]) == [0, 2]  # masters saved for the bf16 weights only


def test_zero_grad_clears_the_weights_and_the_masters_gradients():
    model = tiny_model()
    opt = make_master_weight_optimizer(groups(model.parameters()), **ADAMW)
    backward(model, *batches(1)[0])
    opt.step()
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in opt.master_params)
    opt.zero_grad(set_to_none=True)
    assert all(t.grad is None for t in [*model.parameters(), *opt.master_params])


def test_the_masters_start_from_the_weights_as_they_are_at_the_first_step():
    # DDP broadcasts rank 0's weights after the optimizer is built; the masters must be those, not the old ones
    model = tiny_model(seed=0)
    opt = make_master_weight_optimizer(groups(model.parameters()), **ADAMW)
    with torch.no_grad():
        for p, q in zip(model.parameters(), tiny_model(seed=5).parameters()):
            p.copy_(q)
    assert_equal([m.bfloat16() for m in opt.state_dict()[MASTERS_KEY].values()], in_group_order(model.parameters()))


def test_the_masters_count_as_optimizer_state():
    model = tiny_model()
    opt = make_master_weight_optimizer(groups(model.parameters()), **ADAMW)
    backward(model, *batches(1)[0])
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    # AdamW's two fp32 moments, and the fp32 master: 12 bytes a weight
    assert measure_state(model, opt).optimizer_state == 12 * n


# ----------------------------------------------------------------------------- (b) checkpoint resume

def save_and_load(obj):
    """Through a file as a checkpoint goes (torch.save; read back as distlab.safe_load reads, tensors only)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def run(steps, model=None, opt_state=None, sched_state=None, data=None):
    model = model or tiny_model()
    opt = make_master_weight_optimizer(groups(model.parameters()), **ADAMW)
    sched = schedule(opt)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
        sched.load_state_dict(sched_state)
    for x, y in data[:steps]:
        train_step(model, opt, sched, x, y)
    return model, opt, sched


def test_a_run_resumed_from_a_checkpoint_continues_exactly_and_without_the_masters_it_would_not():
    data = batches(9)
    whole, whole_opt, _ = run(9, data=data)
    model, opt, sched = run(5, data=data)
    saved = save_and_load({"model": {n: p.detach() for n, p in model.named_parameters()},
                           "optimizer": opt.state_dict(), "scheduler": sched.state_dict()})

    def resume(optimizer_state):
        fresh = tiny_model(seed=3)  # other weights: all of it must come from the checkpoint
        fresh.load_state_dict(saved["model"])
        return run(4, fresh, optimizer_state, saved["scheduler"], data[5:])

    resumed, resumed_opt, _ = resume(saved["optimizer"])
    assert_equal([p.detach() for p in resumed.parameters()], [p.detach() for p in whole.parameters()])
    assert_equal(resumed_opt.master_params, whole_opt.master_params)
    assert_equal(moments(resumed_opt), moments(whole_opt))
    assert resumed_opt.param_groups[0]["lr"] == whole_opt.param_groups[0]["lr"]
    # the masters are what makes it exact: a state without them (a plain AdamW's) resumes from the bf16 weights
    plain = {k: v for k, v in saved["optimizer"].items() if k != MASTERS_KEY}
    lossy, lossy_opt, _ = resume(plain)
    assert any(not torch.equal(a, b) for a, b in zip(lossy_opt.master_params, whole_opt.master_params))


def test_a_state_for_another_model_is_refused():
    model = tiny_model()
    state = make_master_weight_optimizer(groups(model.parameters()), **ADAMW).state_dict()
    state[MASTERS_KEY] = {0: torch.zeros(2)}
    with pytest.raises(ValueError, match="masters"):
        make_master_weight_optimizer(groups(model.parameters()), **ADAMW).load_state_dict(state)


# ----------------------------------------------------------------------------- (c) the LR scheduler

@pytest.mark.parametrize("factor", [0.0, 1.0])
def test_a_lambdalr_sets_the_learning_rate_the_masters_are_stepped_with(factor):
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = make_master_weight_optimizer(groups(model.parameters(), weight_decay=0.1), **ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: factor)
    assert opt.inner.param_groups[0]["lr"] == ADAMW["lr"] * factor  # what the inner AdamW will use
    for x, y in batches(3):
        train_step(model, opt, sched, x, y)
    moved = [not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)]
    assert all(moved) if factor else not any(moved)  # lr 0: neither the update nor the decay moves a weight


# ----------------------------------------------------------------------------- (d) the config

def test_the_config_takes_master_weights_with_bf16_weights_on_single_and_ddp():
    for strategy in ("single", "ddp"):
        assert TrainConfig(master_weights=True, dtype="bf16", lora=False, strategy=strategy).master_weights


@pytest.mark.parametrize("changes, says", [
    ({"dtype": "bf16-autocast"}, "master_weights=true needs dtype='bf16'"),
    ({"dtype": "auto"}, "master_weights=true needs dtype='bf16'"),
    ({"strategy": "fsdp"}, "master_weights=true runs with strategy single or ddp, not 'fsdp'"),
    ({"strategy": "zero2"}, "master_weights=true runs with strategy single or ddp, not 'zero2'"),
    ({"strategy": "tp"}, "master_weights=true runs with strategy single or ddp, not 'tp'"),
    ({"optimizer": "adamw_8bit"}, "master_weights=true steps torch AdamW on the masters, not optimizer='adamw_8bit'"),
    ({"lora": True}, "master_weights=true applies to full fine-tuning (lora=false)"),
])
def test_the_config_refuses_master_weights_where_they_do_not_work(changes, says):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**{"master_weights": True, "dtype": "bf16", "lora": False, **changes})
    assert says in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- ddp

def _ddp_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist  # deferred: only the spawned ranks join a process group
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = tiny_model(seed=rank)  # rank 1 starts from other weights: DDP's broadcast replaces them
    opt = make_master_weight_optimizer(groups(model.parameters()), **ADAMW)  # built before the wrap, as parallelize
    ddp = DistributedDataParallel(model)
    ref = [p.detach().float().clone().requires_grad_() for p in model.parameters()]  # rank 0's, broadcast
    ref_opt = torch.optim.AdamW(groups(ref), **ADAMW)
    for x, y in batches(4, seed=10 + rank):  # each rank its own rows
        backward(ddp, x, y)
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float()  # the all-reduced gradient
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    torch.save({"masters": opt.master_params, "ref": in_group_order(ref),
                "weights": [p.detach() for p in model.parameters()]}, f"{out}.{rank}")
    # DDP goes before its group: freed after destroy_process_group, its reducer drops the group's last
    # reference with the GIL held, and the destructor joins a gloo worker thread that may be waiting for the
    # GIL to free a finished all-reduce (a deadlock: 4 runs in 16 here hung in that join)
    del ddp
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch: ~8 s on 2 cores
def test_under_ddp_every_rank_holds_the_same_masters_exactly_fp32_adamw_of_the_reduced_gradients(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=_ddp_rank, args=(r, str(tmp_path / "store"), str(tmp_path / "out")))
             for r in range(2)]
    try:
        for p in ranks:
            p.start()
        deadline = time.monotonic() + 120
        for p in ranks:
            p.join(max(0.0, deadline - time.monotonic()))
        assert [p.exitcode for p in ranks] == [0, 0], "a rank failed, or was still running after 120 s"
    finally:  # a hung rank is killed here: left alive, multiprocessing's exit handler would wait for it forever
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join()
    r0, r1 = (torch.load(tmp_path / f"out.{r}", weights_only=True) for r in range(2))
    assert_equal(r0["masters"], r1["masters"])
    assert_equal(r0["weights"], r1["weights"])
    assert_equal(r0["masters"], r0["ref"])
    assert_equal(in_group_order(r0["weights"]), [m.bfloat16() for m in r0["masters"]])


# ----------------------------------------------------------------------------- no host sync (CUDA)

@pytest.mark.slow  # a CUDA context takes seconds to start
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_a_step_on_a_gpu_never_waits_for_the_device(fused):
    model = tiny_model().cuda()
    opt = make_master_weight_optimizer(groups(model.parameters()), fused=fused, **ADAMW)
    (x, y), = batches(1)
    for checked in (False, True):  # the first step creates AdamW's state; the second is checked
        backward(model, x.cuda(), y.cuda())
        torch.cuda.set_sync_debug_mode("error" if checked else "default")  # a synchronising call raises
        try:
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(in_group_order(model.parameters())[0], opt.master_params[0].bfloat16())
