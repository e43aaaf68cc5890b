"""Tensor and sequence parallelism on CPU: 2- and 4-process gloo groups over loopback
(torch.multiprocessing, bounded by the process group's timeout). Each rank's shard of a
LayerNorm + column + row parallel MLP with every parameter random, forward, every gradient and the
parameters after three SGD / AdamW steps, against the single-process float64 model; te.ops'
summand bias layout and checkpoints; the collectives alone; deferred init; configuration errors."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fusible import ops
from fusible.ops._distributed import group_spec

T, H, FF = 8, 12, 16  # rows, model width, hidden width (divisible by 2 and 4)
# Under the sanitizer (scripts/sanitize.sh sets FUSIBLE_SANITIZE) two ranks only: four run the same
# code in twice the processes, each several times slower there.
WORLD_SIZES = [2] if os.environ.get("FUSIBLE_SANITIZE") else [2, 4]


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
    """Every parameter random and nonzero (a zero bias hid a row-parallel bias error)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(
        ln_w=1 + 0.2 * r(H),
        ln_b=0.3 * r(H),
        w1=r(FF, H) * 0.3,
        b1=r(FF),
        w2=r(H, FF) * 0.3,
        b2=r(H),
        x=r(T, H),
        dy=[r(T, H) for _ in range(STEPS)],
    )


STEPS = 3
PARAMS = ("ln_w", "ln_b", "w1", "b1", "w2", "b2")  # in model.parameters() order
KEYS = ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias")  # the state-dict keys


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _reference_run(full, optimizer):
    """The single-process float64 model (plain torch): per step its output and gradients, then
    its parameters after STEPS optimizer steps."""
    p = {k: full[k].clone().requires_grad_() for k in PARAMS}
    x = full["x"].clone().requires_grad_()
    opt = _optimizer(optimizer, list(p.values()))
    steps = []
    for dy in full["dy"]:
        opt.zero_grad()
        x.grad = None
        h = torch.nn.functional.layer_norm(x, (H,), p["ln_w"], p["ln_b"])
        h = torch.nn.functional.gelu(h @ p["w1"].T + p["b1"], approximate="tanh")
        y = h @ p["w2"].T + p["b2"]
        y.backward(dy)
        steps.append((y.detach(), x.grad.clone(), {k: v.grad.clone() for k, v in p.items()}))
        opt.step()
    return steps, {k: v.detach() for k, v in p.items()}


def _mlp(world_size, sequence_parallel, device="cpu", dtype=torch.float32, **linear_kw):
    """LayerNorm -> column Linear -> GELU -> row Linear; with sequence_parallel the rows of x
    (and y) are sharded, and the LayerNorm sums its parameter gradients over the group."""
    kw = dict(device=device, dtype=dtype, sequence_parallel=sequence_parallel)
    norm = ops.LayerNorm(H, device=device, dtype=dtype, sequence_parallel=sequence_parallel)
    fc1 = ops.Linear(H, FF, tensor_parallel_mode="column", **kw)
    fc2 = ops.Linear(FF, H, tensor_parallel_mode="row", **kw, **linear_kw)
    return ops.Sequential(norm, fc1, ops.GELU(), fc2)


def _full_state(full):
    return {key: full[name] for key, name in zip(KEYS, PARAMS)}


def _mlp_case(rank, world_size, sequence_parallel, optimizer):
    """Forward, every gradient and the parameters after STEPS optimizer steps of each rank's
    shard, against the single-process float64 model."""
    full = _full_weights()
    ref_steps, ref_params = _reference_run(full, optimizer)
    model = _mlp(world_size, sequence_parallel, dtype=torch.float64)
    fc1, fc2 = model[1], model[3]
    assert fc1.weight.shape == (FF // world_size, H) and fc2.weight.shape == (H, FF // world_size)
    assert fc2.bias.shape == (H,)  # replicated, added once after the reduction
    ops.load_full_state_dict(model, _full_state(full))
    cols = slice(rank * FF // world_size, (rank + 1) * FF // world_size)
    rows = slice(rank * T // world_size, (rank + 1) * T // world_size)
    local = (lambda t: t[rows]) if sequence_parallel else (lambda t: t)  # noqa: E731
    x = local(full["x"]).clone().requires_grad_()
    opt = _optimizer(optimizer, model.parameters())
    shard = dict(ln_w=slice(None), ln_b=slice(None), w1=cols, b1=cols, w2=(slice(None), cols))
    shard["b2"] = slice(None)
    for (ref_y, ref_dx, ref_grads), dy in zip(ref_steps, full["dy"]):
        opt.zero_grad()
        x.grad = None
        y = model(x)
        y.backward(local(dy))
        torch.testing.assert_close(y, local(ref_y))
        torch.testing.assert_close(x.grad, local(ref_dx))
        params = dict(zip(PARAMS, model.parameters()))
        for name, param in params.items():
            torch.testing.assert_close(param.grad, ref_grads[name][shard[name]], msg=name)
        opt.step()
    trained = ops.full_state_dict(model)
    for key, name in zip(KEYS, PARAMS):
        torch.testing.assert_close(trained[key], ref_params[name], msg=name)
    # The replicated parameters stayed equal on every rank (each rank's own, not a gathered one).
    for name, param in zip(PARAMS, model.parameters()):
        if name in ("ln_w", "ln_b", "b2"):
            torch.testing.assert_close(param.detach(), ref_params[name], msg=name)
    plan = model.fusion_plan()[0]  # where collectives run: the bias after the reduction
    reduce = "reduce-scatter" if sequence_parallel else "all-reduce"
    assert plan["forward"][-2:] == [f"BasicLinear[{reduce} output]", "Bias"]
    gather = "BasicLinear[all-gather input]" if sequence_parallel else "BasicLinear"
    assert gather in plan["forward"]
    assert f"BasicLinear[{reduce} dgrad, overlapped]" in plan["backward"]
    grad_sum = ["LayerNorm[all-reduce grad]", "Bias[all-reduce grad]"]
    assert all((label in plan["backward"]) == sequence_parallel for label in grad_sum)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_parallel_mlp_trains_as_the_single_process_model(world_size, sequence_parallel, optimizer):
    _spawn(world_size, _mlp_case, sequence_parallel, optimizer)


def _summand_case(rank, world_size, sequence_parallel):
    """row_parallel_bias="summand" reproduces te.ops: the same forward, and one SGD step moves
    the effective bias (the sum of the summands) world_size times as far as one process does."""
    full = _full_weights()
    ref_steps, _ = _reference_run(full, "sgd")
    model = _mlp(world_size, sequence_parallel, dtype=torch.float64, row_parallel_bias="summand")
    fc2 = model[3]
    assert fc2.row_parallel_bias == "summand" and fc2.tensor_parallel_mode == "row"
    reduce = "ReduceScatter" if sequence_parallel else "AllReduce"
    assert [type(op).__name__ for op in fc2.basic_ops] == ["BasicLinear", "Bias", reduce]
    ops.load_full_state_dict(model, _full_state(full))
    rows = slice(rank * T // world_size, (rank + 1) * T // world_size)
    local = (lambda t: t[rows]) if sequence_parallel else (lambda t: t)  # noqa: E731
    y = model(local(full["x"]))
    torch.testing.assert_close(y, local(ref_steps[0][0]))
    y.backward(local(full["dy"][0]))
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    got = ops.full_state_dict(model)["3.bias"]
    want = full["b2"] - 0.1 * world_size * ref_steps[0][2]["b2"]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_summand_bias_reproduces_te_ops(sequence_parallel):
    _spawn(2, _summand_case, sequence_parallel)


def _te_checkpoint_case(rank, world_size):
    """te.ops' checkpoint layout: te_ops_state_dict writes per-rank summands; they load back into
    a replicated model (summed) and into a summand model, and all three compute the same."""
    torch.manual_seed(21 + rank)
    full = _full_weights()
    model = _mlp(world_size, False, dtype=torch.float64)
    ops.load_full_state_dict(model, _full_state(full))
    te_state = ops.te_ops_state_dict(model)
    assert "3.basic_ops.1.bias" in te_state and "3.bias" not in te_state
    summands = [torch.empty(H, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(summands, te_state["3.basic_ops.1.bias"].contiguous())
    torch.testing.assert_close(sum(summands), full["b2"], rtol=0, atol=0)
    replicated = _mlp(world_size, False, dtype=torch.float64)
    replicated.load_state_dict(te_state)
    torch.testing.assert_close(replicated[3].bias.detach(), full["b2"], rtol=0, atol=0)
    summand = _mlp(world_size, False, dtype=torch.float64, row_parallel_bias="summand")
    summand.load_state_dict(te_state)
    x = full["x"]
    torch.testing.assert_close(replicated(x), model(x))
    torch.testing.assert_close(summand(x), model(x))
    # A summand model's own te.ops checkpoint (its real summands) into the replicated layout.
    with torch.no_grad():
        summand[3].bias.add_(rank + 1.0)
        summand[3].bias.sub_(sum(range(1, world_size + 1)) / world_size)
    again = _mlp(world_size, False, dtype=torch.float64)
    again.load_state_dict(ops.te_ops_state_dict(summand))
    torch.testing.assert_close(again(x), summand(x))
    # torch.nn.Module's default version (1), as a torch.nn.Linear's or Megatron's state dict
    # carries it, is a replicated bias: loaded as it is, not summed over the ranks.
    plain = replicated.state_dict()
    plain._metadata["3"]["version"] = 1
    reloaded = _mlp(world_size, False, dtype=torch.float64)
    reloaded.load_state_dict(plain)
    torch.testing.assert_close(reloaded[3].bias.detach(), full["b2"], rtol=0, atol=0)
    torch.testing.assert_close(reloaded(x), replicated(x), rtol=0, atol=0)
    # te.ops writes an empty _extra_state for every basic op (LayerNorm's too): strict loads.
    te_like = ops.te_ops_state_dict(model)
    for key in ("0._extra_state", "3.basic_ops.0._extra_state", "3.basic_ops.2._extra_state"):
        te_like[key] = torch.empty(0)
    _mlp(world_size, False, dtype=torch.float64).load_state_dict(te_like, strict=True)


def test_te_ops_checkpoint_round_trip():
    _spawn(2, _te_checkpoint_case)


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


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collectives_forward_and_backward(world_size):
    _spawn(world_size, _collectives_case)


def _deferred_init_case(rank, world_size):
    model = _mlp(world_size, False, device="meta")
    assert model[1].weight.is_meta
    y = model(torch.randn(T, H))
    assert y.shape == (T, H) and not model[1].weight.is_meta
    assert model[1].weight.shape == (FF // world_size, H)
    assert model[3].weight.shape == (H, FF // world_size) and model[3].bias.shape == (H,)
    # Every rank initialized its own shard: they differ (a full weight would need one seed).
    gathered = [torch.empty_like(model[1].weight) for _ in range(world_size)]
    dist.all_gather(gathered, model[1].weight.detach().contiguous())
    assert not torch.equal(gathered[0], gathered[1]) or world_size == 1


def test_deferred_init_on_every_rank():
    _spawn(2, _deferred_init_case)


def _checkpoint_case(rank, world_size, folder):
    torch.manual_seed(100 + rank)
    model = _mlp(world_size, True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model[3].bias.copy_(torch.arange(H) * 0.5)  # replicated: the same on every rank
    torch.save(model.state_dict(), os.path.join(folder, f"rank{rank}.pt"))
    dist.barrier()
    fresh = _mlp(world_size, True)
    fresh.load_state_dict(torch.load(os.path.join(folder, f"rank{rank}.pt")))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    full = ops.full_state_dict(model)
    if rank == 0:  # the gathered weights: every rank's shard in rank order
        shards = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world_size)]
        torch.testing.assert_close(full["1.weight"], torch.cat([s["1.weight"] for s in shards]))
        torch.testing.assert_close(full["1.bias"], torch.cat([s["1.bias"] for s in shards]))
        torch.testing.assert_close(full["3.weight"], torch.cat([s["3.weight"] for s in shards], 1))
        torch.testing.assert_close(full["3.bias"], torch.arange(H) * 0.5, rtol=0, atol=0)


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
    # Sequence parallel splits the tokens (dim 0): a 1-D input has none. Gathering or scattering
    # its features gave a wrong result silently; the check runs before any collective (no rank
    # waits for another). A wrong width names the shape given, not the gathered one.
    for mode, features in (("column", 4), ("row", 2)):
        for make in (ops.BasicLinear, ops.Linear):
            sp = make(4, 4, tensor_parallel_mode=mode, sequence_parallel=True, device="cpu")
            with pytest.raises(RuntimeError, match="expected an input of at least 2 dims"):
                sp(torch.randn(features))
    column = ops.BasicLinear(
        4, 4, tensor_parallel_mode="column", sequence_parallel=True, device="cpu"
    )
    with pytest.raises(RuntimeError, match=r"got 3 \(input shape \[1, 3\]\)"):
        column(torch.randn(1, 3))
    # new_group([0]) gives rank 1 a placeholder, not a group: named, not an AttributeError.
    only_rank0 = dist.new_group([0])
    if rank == 1:
        for make in (
            lambda: ops.Linear(
                4, 4, tensor_parallel_mode="column", tensor_parallel_group=only_rank0
            ),
            lambda: ops.AllGather(only_rank0),
            lambda: ops.Bias(4, tensor_parallel=True, tensor_parallel_group=only_rank0),
        ):
            with pytest.raises(ValueError, match="a process group this process is a member of"):
                make()
    with pytest.raises(TypeError, match="expected a torch.distributed ProcessGroup"):
        ops.AllGather("tp")


def test_bad_configurations_raise_clear_errors():
    _spawn(2, _errors_case)


def test_tensor_parallelism_without_a_process_group_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        ops.BasicLinear(4, 4, tensor_parallel_mode="column")
    with pytest.raises(ValueError, match="init_process_group"):
        ops.AllReduce()
    # sequence_parallel without tensor parallelism: one rank's sequence, as te.ops turns it off.
    for cls in (ops.BasicLinear, ops.Linear):
        torch.manual_seed(0)
        sp = cls(4, 3, sequence_parallel=True, device="cpu", dtype=torch.float64)
        torch.manual_seed(0)
        plain = cls(4, 3, device="cpu", dtype=torch.float64)
        assert sp.sequence_parallel is False
        x = torch.randn(5, 4, dtype=torch.float64)
        torch.testing.assert_close(sp(x), plain(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="init_process_group"):
        ops.LayerNorm(4, sequence_parallel=True)
    with pytest.raises(ValueError, match="row_parallel_bias"):
        ops.Linear(4, 4, row_parallel_bias="sum")
    # Fixed at construction: a later write raises instead of being ignored.
    for op, name in [
        (ops.Linear(4, 4, device="cpu"), "row_parallel_bias"),
        (ops.LayerNorm(4, device="cpu"), "sequence_parallel"),
        (ops.RMSNorm(4, device="cpu"), "sequence_parallel"),
        (ops.Bias(4, device="cpu"), "sequence_parallel"),
    ]:
        with pytest.raises(AttributeError):
            setattr(op, name, True)


def _hooked_case(rank, world_size):
    """An op with a forward hook runs through Python (the Sequential's `around` path); its
    collectives must still run without the GIL held (a held GIL hung gloo groups)."""
    torch.manual_seed(7)
    model = _mlp(world_size, False, dtype=torch.float64)
    plain = _mlp(world_size, False, dtype=torch.float64)
    plain.load_state_dict(model.state_dict())
    seen = []
    model[3].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for _ in range(5):
        torch.testing.assert_close(model(x), plain(x))
    assert seen == [(T, H)] * 5


def test_a_hooked_parallel_op_runs_its_collectives():
    _spawn(2, _hooked_case)


def _nccl_mlp_case(rank, world_size):
    """The tensor- and sequence-parallel bf16 MLP on one GPU per rank against the same model on one
    GPU: every parameter random, forward, gradients and the parameters after 3 AdamW steps."""
    full = _full_weights()
    dev, bf = f"cuda:{rank}", torch.bfloat16
    model = _mlp(world_size, True, device=dev, dtype=bf)
    one = ops.Sequential(
        ops.LayerNorm(H, device=dev, dtype=bf),
        ops.Linear(H, FF, device=dev, dtype=bf),
        ops.GELU(),
        ops.Linear(FF, H, device=dev, dtype=bf),
    )
    state = {k: v.to(dev, bf) for k, v in _full_state(full).items()}
    ops.load_full_state_dict(model, state)
    one.load_state_dict(state)
    rows = slice(rank * T // world_size, (rank + 1) * T // world_size)
    opt = _optimizer("adamw", model.parameters())
    opt1 = _optimizer("adamw", one.parameters())
    tol = dict(rtol=1.6e-2, atol=2e-2)  # two bf16 runs, each within bf16 rounding of float64
    for dy in full["dy"]:
        x = full["x"][rows].to(dev, bf).requires_grad_()
        y = model(x)
        y.backward(dy[rows].to(dev, bf))
        x1 = full["x"].to(dev, bf).requires_grad_()
        y1 = one(x1)
        y1.backward(dy.to(dev, bf))
        torch.testing.assert_close(y, y1[rows], **tol)
        torch.testing.assert_close(x.grad, x1.grad[rows], **tol)
        opt.step()
        opt1.step()
        opt.zero_grad()
        opt1.zero_grad()
    trained = ops.full_state_dict(model)
    for key, value in one.state_dict().items():
        torch.testing.assert_close(trained[key], value, **tol, msg=key)


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
        ops.LayerNorm(H, dtype=torch.float64, device="cpu"),
        ops.Linear(H, FF, dtype=torch.float64, device="cpu"),
        ops.GELU(),
        ops.Linear(FF, H, dtype=torch.float64, device="cpu"),
    )
    with torch.no_grad():
        for p in one.parameters():
            p.normal_()
    model = _mlp(world_size, False, dtype=torch.float64)
    ops.load_full_state_dict(model, one.state_dict())
    x = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(model(x), one(x))
    for key, value in ops.full_state_dict(model).items():
        torch.testing.assert_close(value, one.state_dict()[key])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_full_state_dict_loads_into_the_shards(world_size):
    _spawn(world_size, _load_full_case)


def _main_grad_summed_over_ranks(rank, world_size):
    torch.manual_seed(0)  # the same weight and main_grad on every rank
    lin = ops.BasicLinear(6, 4, device="cpu", dtype=torch.float64, accumulate_into_main_grad=True)
    lin._cpp.set_param_grad_reduction(group_spec("BasicLinear", None))
    start = torch.randn(4, 6, dtype=torch.float64)
    lin.weight.main_grad = start.clone()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(world_size)]
    dys = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(world_size)]
    lin(xs[rank]).backward(dys[rank])  # each rank its own rows
    want = start + sum(dy.T @ x for x, dy in zip(xs, dys))
    torch.testing.assert_close(lin.weight.main_grad, want)
    assert lin.weight.grad is None


def test_main_grad_with_a_grad_reduction_adds_the_sum_over_ranks():
    """A linear whose weight gradient is summed over a group (set_param_grad_reduction) adds the
    sum into main_grad, once."""
    _spawn(2, _main_grad_summed_over_ranks)


def _main_grad_dummy_not_reduced(rank, world_size):
    torch.manual_seed(0)
    lin = ops.BasicLinear(6, 4, device="cpu", dtype=torch.float64, accumulate_into_main_grad=True)
    lin._cpp.set_param_grad_reduction(group_spec("BasicLinear", None))
    start = torch.randn(4, 6, dtype=torch.float64)
    lin.weight.main_grad = start.clone()
    lin.weight.grad_added_to_main_grad = False  # Megatron's flag: autograd gets te's dummy
    lin.weight.zero_out_wgrad = True
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(world_size)]
    dys = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(world_size)]
    y = lin(xs[rank])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y.backward(dys[rank])
    reductions = [e for e in prof.events() if e.name == "_c10d_functional::all_reduce"]
    assert len(reductions) == 1  # the gradient's sum; not the dummy's
    want = start + sum(dy.T @ x for x, dy in zip(xs, dys))
    torch.testing.assert_close(lin.weight.main_grad, want)
    assert lin.weight.grad_added_to_main_grad
    assert torch.equal(lin.weight.grad, torch.zeros(4, 6, dtype=torch.float64))


def test_main_grad_reduction_leaves_the_dummy_gradient_alone():
    """With a reduction, te's dummy gradient (Megatron's grad_added_to_main_grad) is not summed
    over the group: one collective per backward, the gradient's."""
    _spawn(2, _main_grad_dummy_not_reduced)


def _glu_mlp(kind, world_size, dtype=torch.float64):
    """H -> 2 FF (column) -> a GLU -> FF -> H (row); world_size 1: the single-process model.
    kind "halves": Linear + SwiGLU; "bias": BasicLinear + Bias + ConstantScale + GEGLU (the
    GLU's halves split across three ops); "interleaved": Linear + SwiGLU(glu_interleave_size=2);
    "nested": the Linear inside a Sequential of its own."""
    tp = dict(tensor_parallel_mode="column") if world_size > 1 else {}
    kw = dict(device="cpu", dtype=dtype)
    if kind == "bias":
        bias = ops.Bias(2 * FF, tensor_parallel=world_size > 1, **kw)
        front = [ops.BasicLinear(H, 2 * FF, **tp, **kw), bias, ops.ConstantScale(0.5), ops.GEGLU()]
    else:
        size = 2 if kind == "interleaved" else None
        fc1 = ops.Linear(H, 2 * FF, **tp, **kw)
        front = [
            ops.Sequential(fc1) if kind == "nested" else fc1,
            ops.SwiGLU(glu_interleave_size=size),
        ]
    row = dict(tensor_parallel_mode="row") if world_size > 1 else {}
    return ops.Sequential(*front, ops.Linear(FF, H, **row, **kw))


def _glu_full_state_case(rank, world_size, kind):
    """A column-parallel weight feeding a GLU: each rank's shard holds its slice of both halves,
    so loading a single-process state dict gives the single-process model, and training it for
    three SGD steps ends where the single-process model does."""
    torch.manual_seed(12)  # the same single-process model on every rank
    one = _glu_mlp(kind, 1)
    with torch.no_grad():
        for p in one.parameters():
            p.normal_(0, 0.5)
    model = _glu_mlp(kind, world_size)
    ops.load_full_state_dict(model, one.state_dict())
    gen = torch.Generator().manual_seed(5)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, one)]
    for _ in range(3):
        x = torch.randn(T, H, dtype=torch.float64, generator=gen)
        ys = [m(x) for m in (model, one)]
        torch.testing.assert_close(ys[0], ys[1])
        for y, opt in zip(ys, opts):
            opt.zero_grad()
            y.pow(2).sum().backward()
            opt.step()
    full = ops.full_state_dict(model)
    assert full.keys() == one.state_dict().keys()
    for key, value in one.state_dict().items():
        torch.testing.assert_close(full[key], value)


@pytest.mark.parametrize("kind", ["halves", "bias", "interleaved", "nested"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_glu_after_a_column_parallel_linear_loads_and_gathers_its_halves(world_size, kind):
    _spawn(world_size, _glu_full_state_case, kind)
