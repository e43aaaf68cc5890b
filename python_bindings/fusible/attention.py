"""Helpers for the attention that runs between fuser groups (it is not a fusible op).

`split_qkv_rotary` turns a packed q/k/v projection (the output of a `Linear(d, 3 d)`) into the
per-head q, k, v that `torch.nn.functional.scaled_dot_product_attention` takes, with rotary position
embedding applied to q and k, in one kernel each way: the forward writes rotated q and k once (v
stays a view of the projection) and the backward writes the projection's gradient in one pass,
where the same math in PyTorch ops takes a dozen elementwise kernels, a stack and a concatenation.
"""

import torch

__all__ = ["split_qkv_rotary"]


class _SplitQkvRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads):
        qk = torch.ops.fusible.qkv_rotary_fwd(qkv, cos, sin, num_heads)
        ctx.save_for_backward(cos, sin)
        batch, seq, _ = qkv.shape
        v = qkv.view(batch, seq, 3, num_heads, -1)[:, :, 2]
        return qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return torch.ops.fusible.qkv_rotary_bwd(dq, dk, dv, cos, sin), None, None, None


def split_qkv_rotary(qkv, num_heads, cos, sin):
    """q, k, v [batch, heads, seq, head_dim] of a packed projection with rotary embedding.

    Args:
        qkv: [batch, seq, 3 * num_heads * head_dim], q then k then v, heads in order within each
            (the layout of `qkv.view(batch, seq, 3, num_heads, head_dim)`).
        num_heads: attention heads.
        cos, sin: [>= seq, head_dim / 2], the cosine and sine of each position's angle for each
            pair; pairs are interleaved: elements (2i, 2i + 1) of a head rotate by angle i.
            Not differentiated (they are fixed tables).

    Returns:
        (q, k, v), views in the layout SDPA reads without a copy: q and k from one new tensor,
        v from qkv itself. Computed in fp32 (fp64 for fp64 data), rounded once.
    """
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("split_qkv_rotary: cos and sin are fixed tables; they take no gradient")
    return _SplitQkvRotary.apply(qkv, cos, sin, num_heads)
