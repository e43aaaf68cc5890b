"""Fused functions for the parts of a transformer that run between fuser groups (they are not
fusible ops): attention's input and the loss.

`split_qkv_rotary` turns a packed q/k/v projection (the output of a `Linear(d, 3 d)`) into the
per-head q, k, v that `torch.nn.functional.scaled_dot_product_attention` takes, with rotary position
embedding applied to q and k, in one kernel each way: the forward writes rotated q and k once (v
stays a view of the projection) and the backward writes the projection's gradient in one pass,
where the same math in PyTorch ops takes a dozen elementwise kernels, a stack and a concatenation.

`cross_entropy` reads the logits in their own dtype (bf16 under autocast) and keeps only one float
per row for the backward, which writes (softmax - onehot) * dloss in one pass: no float32 copy of
the logits and no stored softmax, the two largest tensors of a language model's step.
"""

import torch

__all__ = ["cross_entropy", "split_qkv_rotary"]


class _SplitQkvRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads):
        qk = torch.ops.fusible.qkv_rotary_fwd(qkv, cos, sin, num_heads)
        ctx.save_for_backward(cos, sin)
        batch, seq, width = qkv.shape
        v = qkv.view(batch, seq, 3, num_heads, width // (3 * num_heads))[:, :, 2]  # 0 rows too
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


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        loss, stats = torch.ops.fusible.cross_entropy_fwd(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, stats)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, stats = ctx.saved_tensors
        dlogits = torch.ops.fusible.cross_entropy_bwd(
            dloss.contiguous(), logits, targets, stats, ctx.ignore_index
        )
        return dlogits, None, None


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean"):
    """Softmax cross-entropy, as `torch.nn.functional.cross_entropy` with class-index targets,
    except that the classes are the last dim (a language model's [batch, seq, vocab] logits), where
    torch reads them from dim 1: pass `logits.movedim(1, -1)` for torch's [N, C, d1, ...] layout.

    Args:
        logits: [..., classes] (classes last), any floating dtype; read as they are, math in
            float32 (float64 for float64 logits).
        targets: [...] int64 class indices. A target outside [0, classes) other than
            `ignore_index` raises on CPU and gives a NaN loss on CUDA (no device-side assert).
        ignore_index: targets equal to it add no loss and no gradient; "mean" averages over the
            others (NaN when all are ignored, as in PyTorch).
        reduction: "mean", "sum" or "none" (the per-position losses, shaped as targets).

    Returns:
        The loss in float32 (float64 for float64 logits).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
        )
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            "cross_entropy: expected logits [..., classes] and targets [...] of the same leading "
            f"shape, got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    flat = _CrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index
    )
    if reduction == "none":
        return flat.view(targets.shape)
    if reduction == "sum":
        return flat.sum()
    return flat.sum() / (targets != ignore_index).sum()
