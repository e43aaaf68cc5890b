"""DelayedScaling across ranks (te's reduce_amax and autocast's amax_reduction_group), on CPU over
2-process gloo groups: a column + row parallel MLP whose shards have different amaxes trains
under FP8 delayed scaling as the single-process model does, FP8 states included; with
reduce_amax=False each rank keeps its own; ranks that cast different tensors raise alike instead
of hanging."""

import fusible
import pytest
import torch
import torch.distributed as dist
from fusible import _C, autocast, ops, recipe
from test_tensor_parallel import _spawn

T, H, FF, STEPS = 16, 16, 32, 3
D = torch.float64


def _full():
    """Random parameters; the second half of fc1's rows and of fc2's columns larger, so that each
    rank's shard has its own amax."""
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(FF, H, generator=g, dtype=D) * 0.3
    w1[FF // 2 :] *= 4
    w2 = torch.randn(H, FF, generator=g, dtype=D) * 0.3
    w2[:, FF // 2 :] *= 3
    b1, b2 = torch.randn(FF, generator=g, dtype=D), torch.randn(H, generator=g, dtype=D)
    data = [
        (torch.randn(T, H, generator=g, dtype=D), torch.randn(T, H, generator=g, dtype=D))
        for _ in range(STEPS)
    ]
    return {"0.weight": w1, "0.bias": b1, "2.weight": w2, "2.bias": b2}, data


def _model(parallel, dtype=D):
    kw = dict(dtype=dtype, device="cpu")
    fc1 = ops.Linear(H, FF, tensor_parallel_mode="column" if parallel else None, **kw)
    fc2 = ops.Linear(FF, H, tensor_parallel_mode="row" if parallel else None, **kw)
    return ops.Sequential(fc1, ops.GELU(), fc2)


def _states(model):
    """Every FP8 state of the model's linears: [(amax_history, scale)] forward then backward."""
    out = []
    for linear in (model[0], model[2]):
        state = _C._fp8_state(linear._basic_op_list()[0]._cpp)
        out += [t for d in ("forward", "backward") for t in state[d]]
    return out


def _train(model, data, fp8_recipe, group=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for x, dy in data:
        opt.zero_grad()
        with autocast(recipe=fp8_recipe, amax_reduction_group=group):
            y = model(x)
        y.backward(dy)
        opt.step()
        outputs.append(y.detach())
    with autocast(recipe=fp8_recipe, amax_reduction_group=group):
        pass  # the last backward's amaxes are reduced at the next entry
    return outputs


def _states_match(model, reference, exact):
    pairs = [(a, b) for sa, sb in zip(_states(model), _states(reference)) for a, b in zip(sa, sb)]
    if exact:
        return all(torch.equal(a, b) for a, b in pairs)
    return all(torch.allclose(a, b, rtol=1e-5, atol=0) for a, b in pairs)


def _mlp_case(rank, world_size, reduce, explicit_group, dtype):
    full, data = _full()
    full = {k: v.to(dtype) for k, v in full.items()}
    data = [(x.to(dtype), dy.to(dtype)) for x, dy in data]
    fp8 = recipe.DelayedScaling(amax_history_len=4, reduce_amax=reduce)
    reference = _model(parallel=False, dtype=dtype)
    reference.load_state_dict(full)
    # The whole model on each rank, reducing nothing.
    ref_outputs = _train(
        reference, data, recipe.DelayedScaling(amax_history_len=4, reduce_amax=False)
    )

    model = _model(parallel=True, dtype=dtype)
    ops.load_full_state_dict(model, full)
    group = dist.new_group(list(range(world_size))) if explicit_group else None
    outputs = _train(model, data, fp8, group)
    # float64: the casts are emulated; float32 (16-row multiples): FP8 data and GEMMs, whose sums
    # split over the ranks round differently in the last bits.
    same_states = _states_match(model, reference, exact=dtype == D)
    if not reduce:
        # Each rank's shard keeps its own amax. Rank 1 holds the larger halves (their amaxes are
        # the whole tensors'); rank 0's scales are not the whole tensors'.
        assert same_states == (rank == 1)
        return
    assert same_states
    for y, ref in zip(outputs, ref_outputs):
        torch.testing.assert_close(y, ref)
    trained = ops.full_state_dict(model)
    for key in full:
        torch.testing.assert_close(trained[key], reference.state_dict()[key], msg=key)


@pytest.mark.parametrize(
    "reduce,explicit_group,dtype",
    [(True, False, D), (True, True, D), (False, False, D), (True, False, torch.float32)],
)
def test_parallel_mlp_under_delayed_scaling_matches_one_process(reduce, explicit_group, dtype):
    _spawn(2, _mlp_case, reduce, explicit_group, dtype)


def _micro_batches_case(rank, world_size, history_len):
    """Two forwards inside one autocast (micro-batches): both cast with the period's scales (the
    second as a fresh model would), and the reduction adds one history entry, the max of both."""
    full, _ = _full()
    fp8 = recipe.DelayedScaling(amax_history_len=history_len)
    model, fresh = _model(parallel=True), _model(parallel=True)
    ops.load_full_state_dict(model, full)
    ops.load_full_state_dict(fresh, full)
    g = torch.Generator().manual_seed(5)
    x1, x2 = torch.randn(T, H, generator=g, dtype=D), 3 * torch.randn(T, H, generator=g, dtype=D)
    with autocast(recipe=fp8):
        model(x1)
        y2 = model(x2)
    with autocast(recipe=fp8):
        y_fresh = fresh(x2)
    torch.testing.assert_close(y2, y_fresh, rtol=0, atol=0)
    history = _states(model)[0][0]  # fc1's input: x, the same on every rank
    newest = torch.tensor([max(x1.abs().max(), x2.abs().max())], dtype=torch.float32)
    expected = torch.cat([newest, torch.zeros(history_len - 1)])
    torch.testing.assert_close(history, expected, rtol=0, atol=0)


@pytest.mark.parametrize("history_len", [1, 4])
def test_micro_batches_cast_with_the_period_scales(history_len):
    _spawn(2, _micro_batches_case, history_len)


def _failed_call_case(rank, world_size, tracked):
    """A call that raises after its casts (on both ranks alike: an extra input of the wrong shape
    after the row-parallel fc2) leaves no amax in the period: the next reduction gives the
    histories and scales of a twin that never made the call. The model runs nested in another
    Sequential (a plain step there). tracked=False: its state was loaded, so the failing call's
    casts are the first to track it."""
    full, data = _full()
    fp8 = recipe.DelayedScaling(amax_history_len=4)
    model, twin = _model(parallel=True), _model(parallel=True)
    for m in (model, twin):
        ops.load_full_state_dict(m, full)
    x = data[0][0]
    with autocast(recipe=fp8):
        twin(x)
        if tracked:
            model(x)
    if not tracked:
        model.load_state_dict(twin.state_dict())
    failing = ops.Sequential(model, ops.AddExtraInput())
    with autocast(recipe=fp8), pytest.raises(RuntimeError, match="AddExtraInput"):
        failing(x * 40, torch.randn(T, 5, dtype=D))
    with autocast(recipe=fp8):
        pass  # the reduction
    assert _states_match(model, twin, exact=True)


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "loaded"])
def test_a_failed_call_leaves_no_amax_in_the_period(tracked):
    _spawn(2, _failed_call_case, tracked)


def _experts_case(rank, world_size):
    """Data parallel experts: rank 1's expert 2 gets no rows in the first two steps (its cast is
    skipped there). Every rank still tracks all of the op's histories, as te registers a module's
    quantizers, so the reductions pair up; each step adds one entry to every expert's input
    history, on every rank: the max over the ranks of that step's amax (0 from a rank without
    rows)."""
    torch.manual_seed(0)  # the same parameters on every rank
    op = ops.GroupedLinear(3, H, H, dtype=D, device="cpu")
    with torch.no_grad():
        for p in op.parameters():
            p.uniform_(-1, 1)
    fp8 = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(10 + rank)  # each rank's own tokens
    plans = {0: [[4, 4, 8]] * 3, 1: [[8, 8, 0], [6, 10, 0], [2, 2, 12]]}
    local = []  # [step][expert]: this rank's amax of the expert's rows (0 without rows)
    for sizes in plans[rank]:
        x = torch.randn(16, H, dtype=D) * (1 + rank)
        local.append([float(p.abs().max()) if len(p) else 0.0 for p in x.split(sizes)])
        with autocast(recipe=fp8):
            y = op(x, torch.tensor(sizes))
        y.backward(torch.randn_like(y))
    with autocast(recipe=fp8):
        pass
    everyone = [None] * world_size
    dist.all_gather_object(everyone, local)
    state = _C._fp8_state(op._cpp)
    for g in range(3):
        newest_first = [max(r[step][g] for r in everyone) for step in (2, 1, 0)]
        expected = torch.tensor(newest_first + [0.0], dtype=torch.float32)
        torch.testing.assert_close(state["forward"][g][0], expected, rtol=0, atol=0)
    flat = torch.cat(
        [t.flatten() for d in ("forward", "backward") for h, s in state[d] for t in (h, s)]
    )
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def test_experts_without_rows_on_one_rank_reduce_alike():
    _spawn(2, _experts_case)


def _nested_case(rank, world_size):
    """Only the outermost autocast reduces (as te's): an inner one on one rank alone is no
    collective."""
    fp8 = recipe.DelayedScaling(amax_history_len=4)
    model = _model(parallel=True)
    x = torch.randn(T, H, dtype=D)
    with autocast(recipe=fp8):
        if rank == 0:
            with autocast(recipe=fp8):
                y = model(x)
        else:
            y = model(x)
    y.sum().backward()
    with autocast(recipe=fp8):
        pass
    scales = torch.cat([s for h, s in _states(model)])
    gathered = [torch.empty_like(scales) for _ in range(world_size)]
    dist.all_gather(gathered, scales)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


def test_only_the_outermost_autocast_reduces():
    _spawn(2, _nested_case)


def _fp8_weights_case(rank, world_size):
    """FP8 weights (quantized_model_init) under DelayedScaling with a reduction: each optimizer
    write quantizes with the weight's own (reduced) scale, and the weights stay finite."""
    fp8 = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(3)
    with fusible.quantized_model_init(recipe=fp8):
        model = ops.Sequential(ops.Linear(H, FF, device="cpu"), ops.GELU(), ops.Linear(FF, H))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(20 + rank)  # each rank's own data: the weights' amaxes differ
    for _ in range(STEPS):
        opt.zero_grad()
        with autocast(recipe=fp8):
            y = model(torch.randn(T, H) * (1 + rank))
        y.backward(torch.randn_like(y))
        opt.step()
    with autocast(recipe=fp8):
        pass
    for linear in (model[0], model[2]):
        weight = linear.weight
        own = _C._fp8_state(linear._basic_op_list()[0]._cpp)["forward"][1][1]  # the weight's
        assert torch.isfinite(weight.dequantize()).all()
        torch.testing.assert_close(weight._scale_inv, own.reciprocal(), rtol=0, atol=0)
        gathered = [torch.empty_like(own) for _ in range(world_size)]
        dist.all_gather(gathered, own)
        assert all(torch.equal(g, own) for g in gathered) and own.item() != 1.0


def test_fp8_weights_quantize_with_their_reduced_scale():
    _spawn(2, _fp8_weights_case)


def _nested_recipes_case(rank, world_size):
    with autocast(recipe=recipe.DelayedScaling(amax_history_len=4)):
        with pytest.raises(NotImplementedError, match="different recipe or group"):
            with autocast(recipe=recipe.DelayedScaling(amax_history_len=8)):
                pass
        assert _C._fp8_autocast_state()[1].amax_history_len == 4  # the outer one, unchanged


def test_nested_autocasts_reducing_with_different_recipes_are_refused():
    _spawn(2, _nested_recipes_case)


def _mismatch_case(rank, world_size):
    fp8 = recipe.DelayedScaling(amax_history_len=4)
    model = _model(parallel=True)
    extra = ops.Linear(H, H, dtype=D, device="cpu")
    x = torch.randn(T, H, dtype=D)
    with pytest.raises(RuntimeError, match="every rank must run the same FP8 ops"):
        with autocast(recipe=fp8):
            y = model(x)
            if rank == 0:
                extra(y)  # two more delayed casts on rank 0 alone
    assert not _C._fp8_autocast_state()[0]  # the autocast was left all the same


def test_ranks_that_cast_different_tensors_raise_instead_of_hanging():
    _spawn(2, _mismatch_case)


def _zeros_case(rank, world_size):
    """A period whose casts of a tensor saw only zeros on every rank (its first cast included, so
    the scratch entry of the last period must not count again) leaves that tensor's history and
    scale as they are, as te's update does; the weight's, cast with non-zero values, rolls."""
    torch.manual_seed(0)
    op = ops.BasicLinear(H, H, dtype=D, device="cpu")
    fp8 = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(20 + rank)
    x = torch.randn(8, H, dtype=D) * (1 + rank)
    with autocast(recipe=fp8):
        op(x)
    state = _C._fp8_state(op._cpp)["forward"]
    (x_history, x_scale), (w_history, _) = [(h.clone(), s.clone()) for h, s in state]
    amaxes = [None] * world_size
    dist.all_gather_object(amaxes, float(x.abs().max()))
    assert x_history[0].item() == pytest.approx(max(amaxes))
    for _ in range(2):
        with autocast(recipe=fp8):
            op(torch.zeros(8, H, dtype=D))
    (x_now, x_scale_now), (w_now, _) = _C._fp8_state(op._cpp)["forward"]
    assert torch.equal(x_now, x_history) and torch.equal(x_scale_now, x_scale)
    assert torch.equal(w_now[2:], w_history[:2]) and w_now[0] == w_history[0]  # two entries


def test_a_tensor_cast_only_with_zeros_keeps_its_reduced_history():
    _spawn(2, _zeros_case)


def test_one_process_reduces_nothing():
    """reduce_amax without torch.distributed (or over one rank): the recipe has no group."""
    cpp = _C.Fp8Recipe("delayed", "e4m3", "e5m2", 0.0)
    assert cpp.amax_group is None
    with autocast(recipe=recipe.DelayedScaling(amax_history_len=2)):
        assert _C._fp8_autocast_state()[1].amax_group is None


def test_recipe_key_carries_the_group():
    """A compiled call's backward rebuilds its recipe from the key, group included."""
    group = ("a;b c", 4, 3)  # any characters in the name
    cpp = _C.Fp8Recipe("delayed", "e4m3", "e5m2", 1.0, 8, "most_recent", amax_group=group)
    key = _C._fp8_recipe_key(cpp)
    assert key.endswith(";4;3;cpu;a;b c")
    assert _C._fp8_recipe_key(_C.Fp8Recipe("delayed", "e4m3", "e5m2", 1.0)).endswith(";1;0;cpu;")
