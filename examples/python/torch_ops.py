"""The te.ops names gpt.py uses, as plain torch.nn modules: the PyTorch eager model (and, under
torch.compile, the compiled one) that the fusible model is compared against. Same math: the
Sequential adds its extra input after the last op, as AddExtraInput does."""

import torch
import torch.nn.functional as F


class Sequential(torch.nn.Sequential):
    """Runs the modules in order; AddExtraInput adds the call's next extra input."""

    def forward(self, x, *extra_inputs):
        extras = iter(extra_inputs)
        for module in self:
            x = x + next(extras) if isinstance(module, AddExtraInput) else module(x)
        return x


class AddExtraInput(torch.nn.Module):
    """A marker: Sequential adds an extra input at its place."""


class Linear(torch.nn.Linear):
    def __init__(self, in_features, out_features, *, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)


class LayerNorm(torch.nn.LayerNorm):
    def __init__(self, normalized_shape, *, eps=1e-5, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, normalized_shape, *, eps=1e-5, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)


class GELU(torch.nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


class SwiGLU(torch.nn.Module):
    """silu(a) * b over the halves [a, b] of the last dim (te.ops' layout)."""

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b
