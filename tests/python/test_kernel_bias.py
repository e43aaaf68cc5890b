"""torch.ops.fusible.bias_fwd / bias_bwd: values vs float64, errors, opcheck on CPU and CUDA."""

import pytest
import torch
from conftest import DEVICES, assert_close_to_ref


class TestBiasKernels:
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
    @pytest.mark.parametrize("shape", [(7,), (3, 17), (2, 5, 64), (300, 40)])  # last: row chunks
    def test_values(self, device, dtype, shape):
        if device == "cpu" and dtype in (torch.float16, torch.bfloat16):
            pytest.skip("CPU reference runs in fp32/fp64 in CI")
        x = torch.randn(shape, dtype=torch.float64)
        b = torch.randn(shape[-1], dtype=torch.float64)
        dy = torch.randn(shape, dtype=torch.float64)
        y = torch.ops.fusible.bias_fwd(x.to(device, dtype), b.to(device, dtype))
        assert_close_to_ref(y, x.to(dtype).double() + b.to(dtype).double(), dtype)
        db = torch.ops.fusible.bias_bwd(dy.to(device, dtype))
        ref = dy.to(dtype).double().reshape(-1, shape[-1]).sum(0)
        assert_close_to_ref(db, ref, dtype, gemm=True)

    def test_wrong_answer_would_fail(self):
        x, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        y = torch.ops.fusible.bias_fwd(x, b)
        with pytest.raises(AssertionError):
            assert_close_to_ref(y, x - b, torch.float64)

    def test_errors(self):
        x = torch.randn(2, 3)
        with pytest.raises(RuntimeError, match=r"bias_fwd: expected x.size\(-1\) == 4, got 3"):
            torch.ops.fusible.bias_fwd(x, torch.randn(4))
        with pytest.raises(TypeError, match="same dtype"):
            torch.ops.fusible.bias_fwd(x, torch.randn(3, dtype=torch.float64))
        with pytest.raises(TypeError, match="floating-point"):
            torch.ops.fusible.bias_bwd(torch.ones(3, dtype=torch.int64))

    @pytest.mark.parametrize("device", DEVICES)
    def test_opcheck(self, device):
        x = torch.randn(4, 8, device=device)
        b = torch.randn(8, device=device)
        torch.library.opcheck(torch.ops.fusible.bias_fwd.default, (x, b))
        torch.library.opcheck(torch.ops.fusible.bias_bwd.default, (x,))
