"""Tensor and sequence parallelism (issue 16) on CPU: 2- and 4-process gloo groups over loopback
(torch.multiprocessing, bounded by the process group's timeout). Each rank's shard of a
column + row parallel MLP, forward and backward, against the single-process float64 model on the
same full weights; the collectives alone; deferred init; checkpoints; configuration errors."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import assert_close_to_ref
from fusible import ops

T, H, FF = 8, 12, 16  # rows, model width, hidden width (divisible by 2 and 4)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, backend="gloo"):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A rank that fails makes the others' collectives time out instead of hanging them.
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def _spawn(world_size, fn, *args, backend="gloo"):
    """fn(rank, world_size, *args) on every rank; an exception on any rank fails the test. The
    NCCL environment variables the machine sets reach the ranks (spawn inherits the environment)."""
    mp.start_processes(
        _entry,
        args=(world_size, _free_port(), fn, args, backend),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )


def _full_weights():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(w1=r(FF, H) * 0.3, b1=r(FF), w2=r(H, FF) * 0.3, b2=r(H), x=r(T, H), dy=r(T, H))


def _reference(full):
    """The single-process float64 MLP and its gradients."""
    p = {k: full[k].clone().requires_grad_() for k in ("w1", "b1", "w2", "b2", "x")}
    h = torch.nn.functional.gelu(p["x"] @ p["w1"].T + p["b1"], approximate="tanh")
    y = h @ p["w2"].T + p["b2"]
    y.backward(full["dy"])
    return y.detach(), {k: v.grad for k, v in p.items()}


def _mlp(world_size, sequence_parallel, device="cpu", dtype=torch.float32):
    kw = dict(device=device, dtype=dtype, sequence_parallel=sequence_parallel)
    fc1 = ops.Linear(H, FF, tensor_parallel_mode="column", **kw)
    fc2 = ops.Linear(FF, H, tensor_parallel_mode="row", **kw)
    return ops.Sequential(fc1, ops.GELU(), fc2)


def _mlp_case(rank, world_size, sequence_parallel):
    full = _full_weights()
    ref_y, ref_grad = _reference(full)
    model = _mlp(world_size, sequence_parallel)
    fc1, fc2 = model[0], model[2]
    cols = slice(rank * FF // world_size, (rank + 1) * FF // world_size)
    rows = slice(rank * T // world_size, (rank + 1) * T // world_size)
    assert fc1.weight.shape == (FF // world_size, H) and fc2.weight.shape == (H, FF // world_size)
    with torch.no_grad():
        fc1.weight.copy_(full["w1"][cols])
        fc1.bias.copy_(full["b1"][cols])
        fc2.weight.copy_(full["w2"][:, cols])
        fc2.bias.copy_(full["b2"] / world_size)  # te.ops: every rank adds its bias before the sum
    x = (full["x"][rows] if sequence_parallel else full["x"]).float().requires_grad_()
    y = model(x)
    dy = full["dy"][rows] if sequence_parallel else full["dy"]
    y.backward(dy.float())
    want_y, want_dx = (
        (ref_y[rows], ref_grad["x"][rows]) if sequence_parallel else (ref_y, ref_grad["x"])
    )
    f32 = torch.float32
    assert_close_to_ref(y, want_y, f32, gemm=True)
    assert_close_to_ref(x.grad, want_dx, f32, gemm=True)
    assert_close_to_ref(fc1.weight.grad, ref_grad["w1"][cols], f32, gemm=True)
    assert_close_to_ref(fc1.bias.grad, ref_grad["b1"][cols], f32, gemm=True)
    assert_close_to_ref(fc2.weight.grad, ref_grad["w2"][:, cols], f32, gemm=True)
    assert_close_to_ref(fc2.bias.grad, ref_grad["b2"], f32, gemm=True)
    plan = model.fusion_plan()[0]  # where collectives run
    collective = "ReduceScatter" if sequence_parallel else "AllReduce"
    assert plan["forward"][-1] == collective and collective in plan["backward"]
    gather = ["BasicLinear[all-gather input]"] if sequence_parallel else ["BasicLinear"]
    assert plan["forward"][:1] == gather
    reduce = "reduce-scatter" if sequence_parallel else "all-reduce"
    assert f"BasicLinear[{reduce} dgrad, overlapped]" in plan["backward"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_row_parallel_mlp_equals_the_single_process_model(world_size, sequence_parallel):
    _spawn(world_size, _mlp_case, sequence_parallel)


def _basic_linear_case(rank, world_size, mode, sequence_parallel):
    """BasicLinear alone in each mode: its own collectives (no composite around it)."""
    full = _full_weights()
    w = full["w1"]  # [FF, H]
    x_full = full["x"]
    dy_full = torch.randn(T, FF, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    op = ops.BasicLinear(
        H,
        FF,
        tensor_parallel_mode=mode,
        sequence_parallel=sequence_parallel,
        device="cpu",
        dtype=torch.float64,
    )
    shard_out = slice(rank * FF // world_size, (rank + 1) * FF // world_size)
    shard_in = slice(rank * H // world_size, (rank + 1) * H // world_size)
    rows = slice(rank * T // world_size, (rank + 1) * T // world_size)
    with torch.no_grad():
        op.weight.copy_(w[shard_out] if mode == "column" else w[:, shard_in])
    if mode == "column":
        x = x_full[rows] if sequence_parallel else x_full
        dy = dy_full[:, shard_out]
    else:
        x = x_full[:, shard_in]
        dy = dy_full[rows] if sequence_parallel else dy_full
    x = x.clone().requires_grad_()
    y = op(x)
    y.backward(dy)
    ref_y = x_full @ w.T
    ref_dx = dy_full @ w
    ref_dw = dy_full.T @ x_full
    if mode == "column":
        torch.testing.assert_close(y, ref_y[:, shard_out])
        torch.testing.assert_close(x.grad, ref_dx[rows] if sequence_parallel else ref_dx)
        torch.testing.assert_close(op.weight.grad, ref_dw[shard_out])
    else:
        torch.testing.assert_close(y, ref_y[rows] if sequence_parallel else ref_y)
        torch.testing.assert_close(x.grad, ref_dx[:, shard_in])
        torch.testing.assert_close(op.weight.grad, ref_dw[:, shard_in])


@pytest.mark.parametrize("mode", ["column", "row"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_basic_linear_in_each_mode(mode, sequence_parallel):
    _spawn(2, _basic_linear_case, mode, sequence_parallel)


def _collectives_case(rank, world_size):
    x = torch.arange(2 * 3, dtype=torch.float64).reshape(2, 3) + 10 * rank
    xs = [torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r for r in range(world_size)]
    x = x.requires_grad_()
    y = ops.AllGather()(x)
    torch.testing.assert_close(y, torch.cat(xs))
    # dy differs by row and rank: the adjoint gives this rank's rows of the sum of every rank's dy.
    dy_of = lambda r: torch.arange(y.numel(), dtype=torch.float64).reshape(y.shape) * (r + 1)  # noqa: E731
    y.backward(dy_of(rank))
    total = sum(dy_of(r) for r in range(world_size))
    torch.testing.assert_close(x.grad, total[2 * rank : 2 * rank + 2])
    z = torch.arange(4 * world_size, dtype=torch.float64).reshape(2 * world_size, 2)
    z = (z + rank).requires_grad_()
    s = ops.ReduceScatter()(z)
    summed = sum(
        torch.arange(4 * world_size, dtype=torch.float64).reshape(-1, 2) + r
        for r in range(world_size)
    )
    torch.testing.assert_close(s, summed[2 * rank : 2 * rank + 2])
    s.backward(torch.full_like(s, float(rank)))
    want = torch.cat([torch.full((2, 2), float(r), dtype=torch.float64) for r in range(world_size)])
    torch.testing.assert_close(z.grad, want)
    a = (torch.ones(3, dtype=torch.float64) * rank).requires_grad_()
    b = ops.AllReduce()(a)
    torch.testing.assert_close(b, torch.full_like(b, float(sum(range(world_size)))))
    b.backward(torch.full_like(b, 2.0))
    torch.testing.assert_close(a.grad, torch.full_like(a, 2.0))  # identity (te.ops)
    with pytest.raises(RuntimeError, match="divisible by the process group's size"):
        ops.ReduceScatter()(torch.ones(2 * world_size + 1, 2))


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_forward_and_backward(world_size):
    _spawn(world_size, _collectives_case)


def _deferred_init_case(rank, world_size):
    model = _mlp(world_size, False, device="meta")
    assert model[0].weight.is_meta
    y = model(torch.randn(T, H))
    assert y.shape == (T, H) and not model[0].weight.is_meta
    assert model[0].weight.shape == (FF // world_size, H)
    assert model[2].weight.shape == (H, FF // world_size)
    # Every rank initialized its own shard: they differ (a full weight would need one seed).
    gathered = [torch.empty_like(model[0].weight) for _ in range(world_size)]
    dist.all_gather(gathered, model[0].weight.detach().contiguous())
    assert not torch.equal(gathered[0], gathered[1]) or world_size == 1


def test_deferred_init_on_every_rank():
    _spawn(2, _deferred_init_case)


def _checkpoint_case(rank, world_size, folder):
    torch.manual_seed(100 + rank)
    model = _mlp(world_size, True)
    torch.save(model.state_dict(), os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    fresh = _mlp(world_size, True)
    fresh.load_state_dict(torch.load(os.path.join(folder, f"rank{rank}.pt")))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    full = ops.full_state_dict(model)
    if rank == 0:  # the gathered weights: every rank's shard in rank order
        shards = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world_size)]
        torch.testing.assert_close(full["0.weight"], torch.cat([s["0.weight"] for s in shards]))
        torch.testing.assert_close(full["0.bias"], torch.cat([s["0.bias"] for s in shards]))
        torch.testing.assert_close(full["2.weight"], torch.cat([s["2.weight"] for s in shards], 1))
        torch.testing.assert_close(full["2.bias"], sum(s["2.bias"] for s in shards))


def test_checkpoint_saved_on_two_ranks_reloads_exactly(tmp_path):
    _spawn(2, _checkpoint_case, str(tmp_path))


def _errors_case(rank, world_size):
    with pytest.raises(ValueError, match="invalid configuration for tensor parallelism"):
        ops.BasicLinear(4, 3, tensor_parallel_mode="column", device="cpu")
    with pytest.raises(ValueError, match="invalid configuration for tensor parallelism"):
        ops.Linear(3, 4, tensor_parallel_mode="row", device="cpu")
    with pytest.raises(ValueError, match="invalid configuration for tensor parallelism"):
        ops.Bias(3, tensor_parallel=True, device="cpu")
    with pytest.raises(ValueError, match="supported modes"):
        ops.BasicLinear(4, 4, tensor_parallel_mode="diagonal", device="cpu")
    # Row parallel + sequence parallel scatters the output's rows: 3 rows cannot be split in two.
    op = ops.BasicLinear(4, 4, tensor_parallel_mode="row", sequence_parallel=True, device="cpu")
    with pytest.raises(RuntimeError, match="divisible by the process group's size"):
        op(torch.randn(3, 2))


def test_bad_configurations_raise_clear_errors():
    _spawn(2, _errors_case)


def test_tensor_parallelism_without_a_process_group_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        ops.BasicLinear(4, 4, tensor_parallel_mode="column")
    with pytest.raises(ValueError, match="init_process_group"):
        ops.AllReduce()
    with pytest.raises(ValueError, match="sequence_parallel needs tensor parallelism"):
        ops.BasicLinear(4, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor parallelism"):
        ops.Linear(4, 4, sequence_parallel=True)


def _hooked_case(rank, world_size):
    """An op with a forward hook runs through Python (the Sequential's `around` path); its
    collectives must still run without the GIL held (a held GIL hung gloo groups)."""
    torch.manual_seed(7)
    model = _mlp(world_size, False, dtype=torch.float64)
    plain = _mlp(world_size, False, dtype=torch.float64)
    plain.load_state_dict(model.state_dict())
    seen = []
    model[2].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for _ in range(5):
        torch.testing.assert_close(model(x), plain(x))
    assert seen == [(T, H)] * 5


def test_a_hooked_parallel_op_runs_its_collectives():
    _spawn(2, _hooked_case)


def _nccl_mlp_case(rank, world_size):
    """The tensor-parallel bf16 MLP on one GPU per rank against the same model on one GPU."""
    full = _full_weights()
    dev, bf = f"cuda:{rank}", torch.bfloat16
    model = _mlp(world_size, True, device=dev, dtype=bf)
    fc1, fc2 = model[0], model[2]
    cols = slice(rank * FF // world_size, (rank + 1) * FF // world_size)
    rows = slice(rank * T // world_size, (rank + 1) * T // world_size)
    with torch.no_grad():
        fc1.weight.copy_(full["w1"][cols])
        fc1.bias.copy_(full["b1"][cols])
        fc2.weight.copy_(full["w2"][:, cols])
        fc2.bias.copy_(full["b2"] / world_size)
    x = full["x"][rows].to(dev, bf).requires_grad_()
    y = model(x)
    y.backward(full["dy"][rows].to(dev, bf))
    one = ops.Sequential(
        ops.Linear(H, FF, device=dev, dtype=bf), ops.GELU(), ops.Linear(FF, H, device=dev, dtype=bf)
    )
    with torch.no_grad():
        one[0].weight.copy_(full["w1"])
        one[0].bias.copy_(full["b1"])
        one[2].weight.copy_(full["w2"])
        one[2].bias.copy_(full["b2"])
    x1 = full["x"].to(dev, bf).requires_grad_()
    y1 = one(x1)
    y1.backward(full["dy"].to(dev, bf))
    tol = dict(rtol=1.6e-2, atol=2e-2)  # two bf16 runs, each within bf16 rounding of float64
    torch.testing.assert_close(y, y1[rows], **tol)
    torch.testing.assert_close(x.grad, x1.grad[rows], **tol)
    torch.testing.assert_close(fc1.weight.grad, one[0].weight.grad[cols], **tol)
    torch.testing.assert_close(fc2.weight.grad, one[2].weight.grad[:, cols], **tol)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_nccl_mlp_on_two_gpus_matches_one_gpu():
    _spawn(2, _nccl_mlp_case, backend="nccl")


def _load_full_case(rank, world_size):
    """A single-process model's state dict loads into the shards (load_full_state_dict); the
    parallel model then computes what the single-process one does, and full_state_dict gives the
    single-process state dict back."""
    torch.manual_seed(11)  # the same single-process model on every rank
    one = ops.Sequential(
        ops.Linear(H, FF, dtype=torch.float64, device="cpu"),
        ops.GELU(),
        ops.Linear(FF, H, dtype=torch.float64, device="cpu"),
    )
    with torch.no_grad():
        one[2].bias.normal_()
    model = _mlp(world_size, False, dtype=torch.float64)
    ops.load_full_state_dict(model, one.state_dict())
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(model(x), one(x))
    for key, value in ops.full_state_dict(model).items():
        torch.testing.assert_close(value, one.state_dict()[key])


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_full_state_dict_loads_into_the_shards(world_size):
    _spawn(world_size, _load_full_case)
