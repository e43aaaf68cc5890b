"""accumulate_into_main_grad accumulates in main_grad's precision: the wgrad GEMM adds dy^T x into
an fp32 main_grad with no rounding to the compute dtype (bf16) between, as TransformerEngine's
GEMM with beta = 1 does; the kernels it runs on (linear_wgrad_add_, fp8_gemm_out's accumulate)
against float64 references."""

import fusible
import pytest
import torch
from conftest import DEVICES, FP8_BLOCK_GEMM_DEVICES, FP8_GEMM_DEVICES
from fusible import ops, recipe

F = torch.ops.fusible
BF = torch.bfloat16


def _f64_wgrad(dy, x):
    """dy^T x over all leading dims, in float64, of the values as given."""
    return dy.double().reshape(-1, dy.shape[-1]).T @ x.double().reshape(-1, x.shape[-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_wgrad_add_accumulates_bf16_products_in_fp32(device, beta):
    torch.manual_seed(0)
    dy = torch.randn(2, 96, 24, device=device).to(BF)
    x = torch.randn(2, 96, 40, device=device).to(BF)
    out = torch.randn(24, 40, device=device)
    want = beta * out.double() + 0.75 * _f64_wgrad(dy, x)
    F.linear_wgrad_add_(out, dy, x, 0.75, beta)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_wgrad_add_with_beta_zero_ignores_nan_in_out(device):
    torch.manual_seed(1)
    dy, x = torch.randn(32, 16, device=device), torch.randn(32, 8, device=device)
    out = torch.full((16, 8), float("nan"), device=device)
    F.linear_wgrad_add_(out, dy, x, 1.0, 0.0)
    torch.testing.assert_close(out.double(), _f64_wgrad(dy, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_wgrad_add_into_a_bf16_out_rounds_once(device):
    """Small integers: the fp32 sum is exact, so one rounding to bf16 is the float64 sum's; the
    product rounded to bf16 before the add (two roundings) is not, for some elements."""
    g = torch.Generator().manual_seed(2)
    ints = lambda lo, hi, *s: torch.randint(lo, hi, s, generator=g).to(device, BF)  # noqa: E731
    dy, x, out = ints(-16, 17, 64, 16), ints(-16, 17, 64, 24), ints(-50, 51, 16, 24)
    product = _f64_wgrad(dy, x)
    want = (out.double() + product).to(BF)
    twice = (out.double() + product.to(BF).double()).to(BF)
    assert not torch.equal(twice, want)  # the check below can fail
    F.linear_wgrad_add_(out, dy, x)
    assert torch.equal(out, want)


@pytest.mark.parametrize("device", DEVICES)
def test_the_cuda_ops_run_one_gemm_not_the_reference(device):
    """On CUDA the accumulation is cuBLASLt's (no ATen matmul of the fallback), bf16 and FP8."""
    if device == "cpu":
        pytest.skip("the reference is what CPU runs")
    dy, x = torch.randn(64, 32, device=device).to(BF), torch.randn(64, 48, device=device).to(BF)
    a, _, sa = F.fp8_cast(torch.randn(32, 64, device=device), "e4m3")
    b, _, sb = F.fp8_cast(torch.randn(48, 64, device=device), "e4m3")
    out = torch.zeros(32, 48, device=device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.linear_wgrad_add_(out, dy, x)
        F.fp8_gemm_out(a, sa, b, sb, out, None, 1.0, False, 0, 0, True)
    names = {e.name for e in prof.events()}
    assert not names & {"aten::addmm", "aten::mm", "aten::matmul", "aten::addmm_"}, names


def test_wgrad_add_bad_arguments_name_it():
    dy, x = torch.randn(8, 4), torch.randn(8, 6)
    with pytest.raises(RuntimeError, match=r"linear_wgrad_add_: expected out of shape \[4, 6\]"):
        F.linear_wgrad_add_(torch.zeros(6, 4), dy, x)
    with pytest.raises(RuntimeError, match="linear_wgrad_add_: expected dy and x with the same"):
        F.linear_wgrad_add_(torch.zeros(4, 6), dy, x[:7])


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
def test_fp8_gemm_out_accumulates_in_fp32(device):
    torch.manual_seed(3)
    a, _, sa = F.fp8_cast(torch.randn(32, 64, device=device), "e4m3")
    b, _, sb = F.fp8_cast(torch.randn(48, 64, device=device), "e5m2")
    out = torch.randn(32, 48, device=device)
    start = out.clone()
    product = F.fp8_gemm(a, sa, b, sb, torch.float32)[0]
    F.fp8_gemm_out(a, sa, b, sb, out, None, 1.0, False, 0, 0, True)
    torch.testing.assert_close(out, start + product, rtol=1e-6, atol=1e-5)


def _train(model, steps, device, fp8=False, seed=4):
    """steps forward+backward passes of model on bf16 data (the inputs and output gradients drawn
    per step); under an FP8 autocast with fp8."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    inputs = []
    for _ in range(steps):
        x = torch.randn(128, 32, generator=gen).to(device=device, dtype=BF)
        dy = torch.randn(128, 16, generator=gen).to(device=device, dtype=BF)
        with fusible.autocast(enabled=fp8, recipe=recipe.Float8CurrentScaling()):
            y = model(x)
        y.backward(dy)
        inputs.append((x, dy))
    return inputs


@pytest.mark.parametrize("device", DEVICES)
def test_linear_main_grad_is_the_fp32_sum_of_bf16_products(device):
    """Three steps into a random fp32 main_grad: the sum of the bf16 products, exact to fp32. The
    gradient rounded to bf16 first (as before) is off by far more than the bound."""
    torch.manual_seed(5)
    lin = ops.Linear(32, 16, device=device, dtype=BF, accumulate_into_main_grad=True)
    torch.nn.init.normal_(lin.bias)
    start = torch.randn(16, 32, device=device)
    lin.weight.main_grad = start.clone()
    inputs = _train(lin, 3, device)
    want = start.double() + sum(_f64_wgrad(dy, x) for x, dy in inputs)
    bound = 1e-4 * want.abs().max().item()
    assert (lin.weight.main_grad.double() - want).abs().max().item() < bound
    rounded = start.double() + sum(_f64_wgrad(dy, x).to(BF).double() for x, dy in inputs)
    assert (rounded - want).abs().max().item() > 10 * bound
    assert lin.weight.grad is None and lin.bias.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_through_the_fused_mlp_backward(device):
    """fc2's wgrad runs inside the fused bias + GELU + linear backward, fc1's in its own: both
    accumulate in fp32; overwrite_main_grad writes over NaN."""
    torch.manual_seed(6)
    seq = ops.Sequential(
        ops.Linear(32, 64, device=device, dtype=BF, accumulate_into_main_grad=True),
        ops.GELU(),
        ops.Linear(64, 16, device=device, dtype=BF, accumulate_into_main_grad=True),
    )
    fc1, fc2 = seq[0], seq[2]
    for p in (fc1.bias, fc2.bias):
        torch.nn.init.normal_(p)
    fc1.weight.main_grad = torch.full((64, 32), float("nan"), device=device)
    fc1.weight.overwrite_main_grad = True
    start = torch.randn(16, 64, device=device)
    fc2.weight.main_grad = start.clone()
    [(x, dy)] = _train(seq, 1, device)

    def weight_grads(dtype):  # autograd's, computed in dtype from the same values
        w1, w2 = (fc.weight.detach().to(dtype).requires_grad_() for fc in (fc1, fc2))
        h = torch.nn.functional.gelu(
            torch.nn.functional.linear(x.to(dtype), w1, fc1.bias.detach().to(dtype)),
            approximate="tanh",
        )
        y = torch.nn.functional.linear(h, w2, fc2.bias.detach().to(dtype))
        (y * dy.to(dtype)).sum().backward()
        return w1.grad.double(), w2.grad.double()

    ref = weight_grads(torch.float64)
    bf16_autograd = weight_grads(BF)
    got = (fc1.weight.main_grad.double(), fc2.weight.main_grad.double() - start.double())
    for g, r, b in zip(got, ref, bf16_autograd):
        assert torch.isfinite(g).all()
        # Relative error against float64 no larger than bf16 autograd's (which rounds dw too).
        err = ((g - r).norm() / r.norm()).item()
        assert err <= ((b - r).norm() / r.norm()).item() and err < 1e-2
    for got in (fc1.weight.main_grad, fc2.weight.main_grad):
        assert not torch.equal(got, got.to(BF).float())  # not rounded to bf16 on the way


@pytest.mark.parametrize("device", FP8_BLOCK_GEMM_DEVICES)
def test_block_scaled_main_grad_accumulates_in_fp32(device):
    """Float8BlockScaling: two steps into a random fp32 main_grad are the start plus each step's
    weight gradient of the same run without main_grad, within that gradient's bf16 rounding."""
    torch.manual_seed(8)
    lin = ops.Linear(128, 128, device=device, dtype=BF)
    torch.nn.init.normal_(lin.bias)
    mg = ops.Linear(128, 128, device=device, dtype=BF, accumulate_into_main_grad=True)
    mg.load_state_dict(lin.state_dict())
    start = torch.randn(128, 128, device=device)
    mg.weight.main_grad = start.clone()
    want = start.double()
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        x = torch.randn(128, 128, generator=gen).to(device, BF)
        dy = torch.randn(128, 128, generator=gen).to(device, BF)
        for model in (lin, mg):
            with fusible.autocast(recipe=recipe.Float8BlockScaling()):
                y = model(x)
            y.backward(dy)
        want += lin.weight.grad.double()
        lin.weight.grad = None
    got = mg.weight.main_grad.double()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2 * 2**-8 * want.abs().max().item())
    assert not torch.equal(mg.weight.main_grad, mg.weight.main_grad.to(BF).float())


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
def test_fp8_main_grad_is_the_wgrad_gemm_in_fp32(device):
    """Under FP8 the wgrad GEMM of the FP8 operands accumulates into main_grad in fp32: rounded to
    bf16 it is the weight gradient of the same run without main_grad."""
    torch.manual_seed(7)
    lin = ops.Linear(32, 16, device=device, dtype=BF)
    torch.nn.init.normal_(lin.bias)
    _train(lin, 1, device, fp8=True)
    want = lin.weight.grad.clone()
    mg = ops.Linear(32, 16, device=device, dtype=BF, accumulate_into_main_grad=True)
    mg.load_state_dict(lin.state_dict())
    mg.weight.main_grad = torch.zeros(16, 32, device=device)
    _train(mg, 1, device, fp8=True)
    got = mg.weight.main_grad
    assert not torch.equal(got, got.to(BF).float())
    if device == "cpu":  # the emulation: one fp32 product, rounded once either way
        assert torch.equal(got.to(BF), want)
    else:
        torch.testing.assert_close(got.to(BF), want, rtol=2**-7, atol=1e-3)


def _grouped_steps(op, sizes, steps, device, fp8=False, seed=10):
    """steps forward+backward passes of a GroupedLinear(., 32, 16) on bf16 rows split by sizes
    -> the (x, dy) of each step."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    inputs = []
    for _ in range(steps):
        x = torch.randn(rows, 32, generator=gen).to(device, BF)
        dy = torch.randn(rows, 16, generator=gen).to(device, BF)
        with fusible.autocast(enabled=fp8, recipe=recipe.Float8CurrentScaling()):
            y = op(x, torch.tensor(sizes, device=device))
        y.backward(dy)
        inputs.append((x, dy))
    return inputs


@pytest.mark.parametrize("single", [False, True])
def test_grouped_main_grad_is_the_fp32_sum_per_group(single):
    """Split sizes on the host (CPU): per-group or single grouped weights, a group without rows,
    two steps into random fp32 main_grads: each group's sum of bf16 products, exact to fp32 (the
    bf16-rounded sum is not). (bf16 on CUDA adds the grouped GEMM's gradients: tested below.)"""
    device = "cpu"
    torch.manual_seed(11)
    sizes = [48, 0, 80]
    op = ops.GroupedLinear(
        3, 32, 16, device=device, dtype=BF, accumulate_into_main_grad=True,
        single_grouped_weight=single,
    )  # fmt: skip
    for name, p in op.named_parameters():
        if name.startswith("bias"):
            torch.nn.init.normal_(p)
    starts = torch.randn(3, 16, 32, device=device)
    if single:
        op.weight.main_grad = starts.clone()
    else:
        for g in range(3):
            getattr(op, f"weight{g}").main_grad = starts[g].clone()
    inputs = _grouped_steps(op, sizes, 2, device)
    bounds = [0, 48, 48, 128]
    for g in range(3):
        got = op.weight.main_grad[g] if single else getattr(op, f"weight{g}").main_grad
        parts = [_f64_wgrad(dy[bounds[g] : bounds[g + 1]], x[bounds[g] : bounds[g + 1]])
                 for x, dy in inputs]  # fmt: skip
        want = starts[g].double() + sum(parts)
        if g == 1:  # no rows: unchanged
            assert torch.equal(got, starts[g])
            continue
        bound = 1e-4 * want.abs().max().item()
        assert (got.double() - want).abs().max().item() < bound
        rounded = starts[g].double() + sum(p.to(BF).double() for p in parts)
        assert (rounded - want).abs().max().item() > 10 * bound
    assert all(p.grad is None for n, p in op.named_parameters() if n.startswith("weight"))


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
def test_grouped_fp8_main_grad_is_the_wgrad_gemm_in_fp32(device):
    """FP8 GEMMs per group (rows multiples of 16): overwritten main_grads (NaN before) rounded to
    bf16 are the weight gradients of the same run without main_grad."""
    torch.manual_seed(12)
    sizes = [32, 0, 64]
    plain = ops.GroupedLinear(3, 32, 16, device=device, dtype=BF)
    for g in range(3):
        torch.nn.init.normal_(getattr(plain, f"bias{g}"))
    _grouped_steps(plain, sizes, 1, device, fp8=True)
    into = ops.GroupedLinear(3, 32, 16, device=device, dtype=BF, accumulate_into_main_grad=True)
    into.load_state_dict(plain.state_dict())
    for g in range(3):
        w = getattr(into, f"weight{g}")
        w.main_grad = torch.full((16, 32), float("nan"), device=device)
        w.overwrite_main_grad = True
    _grouped_steps(into, sizes, 1, device, fp8=True)
    for g in range(3):
        got, want = getattr(into, f"weight{g}").main_grad, getattr(plain, f"weight{g}").grad
        assert torch.isfinite(got).all()
        if g == 1:
            assert torch.count_nonzero(got) == 0
            continue
        assert not torch.equal(got, got.to(BF).float())
        if device == "cpu":
            assert torch.equal(got.to(BF), want)
        else:
            torch.testing.assert_close(got.to(BF), want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_bf16_on_cuda_adds_the_grouped_gemm_gradients(device):
    """bf16 on CUDA: the split sizes stay on the device (no host wait), so main_grad gets the one
    grouped GEMM's bf16 gradients added: start + the gradients of the same run without
    main_grad."""
    if device == "cpu":
        pytest.skip("CPU has the sizes on the host: the per-group GEMMs (tested above)")
    torch.manual_seed(13)
    sizes = [48, 0, 80]
    plain = ops.GroupedLinear(3, 32, 16, device=device, dtype=BF)
    for g in range(3):
        torch.nn.init.normal_(getattr(plain, f"bias{g}"))
    _grouped_steps(plain, sizes, 1, device)
    into = ops.GroupedLinear(3, 32, 16, device=device, dtype=BF, accumulate_into_main_grad=True)
    into.load_state_dict(plain.state_dict())
    starts = torch.randn(3, 16, 32, device=device)
    for g in range(3):
        getattr(into, f"weight{g}").main_grad = starts[g].clone()
    _grouped_steps(into, sizes, 1, device)
    for g in range(3):
        want = starts[g] + getattr(plain, f"weight{g}").grad.float()
        assert torch.equal(getattr(into, f"weight{g}").main_grad, want)
