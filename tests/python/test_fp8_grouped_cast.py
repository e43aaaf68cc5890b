"""fp8_cast_grouped: the current-scaling casts of an MoE layer's groups of rows in one op (two
kernels on CUDA for all groups), each group with the scale of its own amax. Its bytes must be those
of fp8_cast on each group alone: data, each group's transpose and 1 / scale."""

import pytest
import torch
from conftest import DEVICES, cuda_only
from test_fp8_amax_handoff import _assert_same_cast

F = torch.ops.fusible


def _per_group(x, sizes, fmt, margin, transpose):
    """fp8_cast on each group, laid out as fp8_cast_grouped lays out its outputs."""
    casts = [F.fp8_cast(part, fmt, margin, transpose) for part in x.split(sizes)]
    data = torch.cat([c[0] for c in casts])
    data_t = torch.cat([c[1].reshape(-1) for c in casts]) if transpose else casts[0][1]
    return data, data_t, torch.cat([c[2] for c in casts])


def _rows(sizes, cols, dtype, device):
    # Groups of very different ranges: a shared scale would be visibly wrong for most of them.
    parts = [torch.randn(m, cols, device=device) * 10.0 ** (g % 5 - 2) for g, m in enumerate(sizes)]
    return torch.cat(parts).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_cast_equals_a_cast_per_group(device, dtype, transpose):
    torch.manual_seed(0)
    sizes, cols = [64, 0, 16, 136, 8, 0], 96
    x = _rows(sizes, cols, dtype, device)
    for fmt, margin in (("e4m3", 0.0), ("e5m2", 1.0)):
        got = F.fp8_cast_grouped(x, sizes, fmt, margin, transpose)
        _assert_same_cast(got, _per_group(x, sizes, fmt, margin, transpose))
        assert got[2].shape == (len(sizes),)
        assert got[2][1].item() == 1.0  # an empty group: amax 0, scale 1


@cuda_only
@pytest.mark.parametrize("shape", ["wide", "narrow", "fallback"])
def test_grouped_cast_cuda_equals_the_cpu_reference(shape):
    """The kernels' paths: 8-element vectors (bf16, rows and groups multiples of 8), 4-element
    ones (groups of 4 rows), and what they cannot take (cols not a multiple of 4: the ATen path);
    more than 64 groups (launched 64 at a time)."""
    torch.manual_seed(1)
    sizes, cols = {
        "wide": ([8 * (g % 7) for g in range(70)], 136),
        "narrow": ([4 * (g % 5) for g in range(9)], 68),
        "fallback": ([3, 5, 0, 7], 30),
    }[shape]
    x = _rows(sizes, cols, torch.bfloat16, "cuda")
    for transpose in (False, True):
        got = F.fp8_cast_grouped(x, sizes, "e4m3", 0.0, transpose)
        want = F.fp8_cast_grouped(x.cpu(), sizes, "e4m3", 0.0, transpose)
        _assert_same_cast([t.cpu() for t in got], want)
        _assert_same_cast(got, _per_group(x, sizes, "e4m3", 0.0, transpose))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_cast_a_nonfinite_group_keeps_to_itself(device):
    """An inf in one group gives that group scale 1 (as fp8_cast); a NaN is left out of its
    group's amax (as TransformerEngine's); the other groups keep their scales."""
    sizes = [16, 16, 16]
    x = _rows(sizes, 32, torch.bfloat16, device)
    x[20, 3] = float("nan")
    x[40, 1] = float("inf")
    data, data_t, scale_inv = F.fp8_cast_grouped(x, sizes, "e4m3", 0.0, True)
    finite = x[16:32].float().nan_to_num(0.0).abs().amax().item()
    assert scale_inv[1].item() == pytest.approx(finite / 448.0) and scale_inv[2].item() == 1.0
    assert scale_inv[0].item() != 1.0
    _assert_same_cast((data, data_t, scale_inv), _per_group(x, sizes, "e4m3", 0.0, True))


def test_grouped_cast_bad_arguments():
    x = torch.randn(8, 16)
    with pytest.raises(
        ValueError, match=r"fp8_cast_grouped: expected the group sizes to add up to"
    ):
        F.fp8_cast_grouped(x, [4, 3], "e4m3")
    with pytest.raises(ValueError, match=r"fp8_cast_grouped: expected non-negative group sizes"):
        F.fp8_cast_grouped(x, [12, -4], "e4m3")
    with pytest.raises(RuntimeError, match=r"fp8_cast_grouped: expected x to have 2 dims"):
        F.fp8_cast_grouped(x.reshape(2, 4, 16), [1, 1], "e4m3")
    with pytest.raises(ValueError, match=r"fp8_cast_grouped: expected format"):
        F.fp8_cast_grouped(x, [8], "e3m4")


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_out_writes_its_rows_of_a_larger_output(device):
    """fp8_gemm_out: fp8_gemm's result written into a view (a group's rows of GroupedLinear's
    output), the rows around it untouched; wrong shapes are refused."""
    torch.manual_seed(2)
    a, _, sa = F.fp8_cast(torch.randn(32, 64, device=device), "e4m3")
    b, _, sb = F.fp8_cast(torch.randn(48, 64, device=device), "e4m3")
    bias = torch.randn(48, device=device).to(torch.bfloat16)
    out = torch.full((80, 48), 7.0, device=device, dtype=torch.bfloat16)
    F.fp8_gemm_out(a, sa, b, sb, out.narrow(0, 16, 32), bias, 1.0, True)
    want = F.fp8_gemm(a, sa, b, sb, torch.bfloat16, bias, None, 1.0, "none", False, True)[0]
    assert torch.equal(out[16:48], want)
    assert (out[:16] == 7).all() and (out[48:] == 7).all()
    with pytest.raises(RuntimeError, match=r"fp8_gemm_out: expected out of shape \[32, 48\]"):
        F.fp8_gemm_out(a, sa, b, sb, out)


@cuda_only
def test_gemm_takes_a_scale_that_is_not_16_byte_aligned():
    """cuBLASLt refuses scale pointers off a 16-byte boundary (a group's entry of a grouped cast's
    scale_inv, say): fp8_gemm copies such a scale and runs the same GEMM, bit for bit."""
    torch.manual_seed(3)
    a, _, sa = F.fp8_cast(torch.randn(32, 64, device="cuda"), "e4m3")
    b, _, sb = F.fp8_cast(torch.randn(48, 64, device="cuda"), "e4m3")
    scales = torch.cat([sb, sb, sa])  # sa at a 8-byte offset
    want = F.fp8_gemm(a, sa, b, sb, torch.bfloat16)[0]
    assert torch.equal(F.fp8_gemm(a, scales[2:], b, scales[1:2], torch.bfloat16)[0], want)
    out = torch.empty_like(want)
    F.fp8_gemm_out(a, scales[2:], b, scales[1:2], out)
    assert torch.equal(out, want)


def test_gemm_out_bad_arguments_name_it():
    a, _, sa = F.fp8_cast(torch.randn(16, 32), "e4m3")
    b, _, sb = F.fp8_cast(torch.randn(8, 32), "e4m3")
    out = torch.empty(16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_gemm_out: expected a_block and b_block"):
        F.fp8_gemm_out(a, sa, b, sb, out, None, 1.0, False, 3, 3)
    with pytest.raises(ValueError, match="fp8_gemm_out: expected out_dtype"):
        F.fp8_gemm_out(a, sa, b, sb, out.to(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case", ["no_rows", "no_columns", "rows_not_multiple_of_4", "group_over_many_blocks"]
)
def test_grouped_cast_edges(device, case):
    """No rows at all, no columns, a group whose row count the kernel's transpose cannot take
    (the ATen path), and a bf16 group spanning many amax blocks with its max in the last one."""
    torch.manual_seed(4)
    sizes, cols = {
        "no_rows": ([0, 0], 64),
        "no_columns": ([3, 5], 0),
        "rows_not_multiple_of_4": ([6, 10], 64),
        "group_over_many_blocks": ([4096, 8], 64),
    }[case]
    x = torch.randn(sum(sizes), cols, device=device).to(torch.bfloat16)
    if case == "group_over_many_blocks":
        x[4095, 63] = 1000.0  # the group's last element: its amax
    for transpose in (False, True):
        got = F.fp8_cast_grouped(x, sizes, "e4m3", 0.0, transpose)
        _assert_same_cast(got, _per_group(x, sizes, "e4m3", 0.0, transpose))
    if case == "group_over_many_blocks":
        assert got[2][0].item() == pytest.approx(1000.0 / 448.0)
