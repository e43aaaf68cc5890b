"""Trains the demo MLP (and on CUDA, bf16, FP8 and MoE variants) for a number of steps under
torch.use_deterministic_algorithms(True) and saves every parameter: two runs of this script must
save bit-identical files (tests/python/test_determinism.py).

usage: CUBLAS_WORKSPACE_CONFIG=:4096:8 python train_determinism.py OUT.pt [--device D] [--steps N]
"""

import argparse
import os
import sys

import fusible
import torch
from fusible import ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
from train_mlp import build  # noqa: E402  (the demo's own model)


def train_demo(device, dtype, steps, fp8=False, tokens=256, hidden=128, ffn=512):
    torch.manual_seed(0)
    block, residual_add = build(hidden, ffn, device, dtype)
    optimizer = torch.optim.AdamW(block.parameters(), lr=3e-3)
    mix = torch.randn(hidden, hidden, device=device, dtype=dtype) / 8
    for _ in range(steps):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        target = x + 0.5 * torch.sin(x @ mix)
        with fusible.autocast(enabled=fp8):
            h, residual = block(x)
        loss = (residual_add(h, residual) - target).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return {k: v.detach().cpu() for k, v in block.state_dict().items() if torch.is_tensor(v)}


def train_moe(device, steps, experts=4, tokens=512, hidden=128, ffn=256):
    """GroupedLinear + ScaledSwiGLU + GroupedLinear (the fused expert MLP) with a fixed router."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    mlp = ops.Sequential(
        ops.GroupedLinear(experts, hidden, 2 * ffn, bias=False, device=device, dtype=dtype),
        ops.ScaledSwiGLU(),
        ops.GroupedLinear(experts, ffn, hidden, bias=False, device=device, dtype=dtype),
    )
    optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    splits = torch.tensor([200, 0, 120, tokens - 320], device=device)
    for _ in range(steps):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        probs = torch.rand(tokens, device=device, dtype=dtype)
        y = mlp(x, splits, probs, splits)
        loss = (y.float() - x.float()).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return {k: v.detach().cpu() for k, v in mlp.state_dict().items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    runs = {"demo_fp32": train_demo(args.device, torch.float32, args.steps)}
    if args.device == "cuda":
        runs["demo_bf16"] = train_demo(args.device, torch.bfloat16, args.steps)
        if torch.cuda.get_device_capability() >= (9, 0):
            runs["demo_fp8"] = train_demo(args.device, torch.bfloat16, args.steps, fp8=True)
        runs["moe_bf16"] = train_moe(args.device, args.steps)
    torch.save(runs, args.out)


if __name__ == "__main__":
    main()
