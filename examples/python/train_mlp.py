"""Trains a residual MLP block built from fusible ops on synthetic data (CUDA if present, else CPU):
    y = x + fc2(gelu(fc1(layernorm(x))))
MakeExtraOutput hands the residual out of the first fuser; AddExtraInput adds it back.

usage: python examples/python/train_mlp.py [--steps N] [--tokens T] [--hidden H] [--ffn F]
"""

import argparse
import time

import torch
from fusible import ops
from tqdm import tqdm


def build(hidden, ffn, device, dtype):
    block = ops.Sequential(
        ops.MakeExtraOutput(),
        ops.LayerNorm(hidden, device=device, dtype=dtype),
        ops.Linear(hidden, ffn, device=device, dtype=dtype),
        ops.GELU(),
        ops.Linear(ffn, hidden, device=device, dtype=dtype),
    )
    return block, ops.AddExtraInput()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--tokens", type=int, default=512, help="rows of x per step")
    parser.add_argument(
        "--hidden", type=int, default=128, help="the block's width (LayerNorm, fc2)"
    )
    parser.add_argument("--ffn", type=int, default=512, help="fc1's output width")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    block, residual_add = build(args.hidden, args.ffn, device, torch.float32)
    optimizer = torch.optim.AdamW(block.parameters(), lr=3e-3)
    mix = torch.randn(args.hidden, args.hidden, device=device) / 8

    first = last = None
    start = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"training on {device}")
    for step in bar:
        x = torch.randn(args.tokens, args.hidden, device=device)
        target = x + 0.5 * torch.sin(x @ mix)
        h, residual = block(x)
        y = residual_add(h, residual)
        loss = (y - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            last = loss.item()
            first = last if first is None else first
            bar.set_postfix(loss=f"{last:.5f}")
    elapsed = time.perf_counter() - start
    print(
        f"device {device}: loss {first:.5f} -> {last:.5f}, "
        f"{args.steps * args.tokens / elapsed:,.0f} tokens/s"
    )
    if not last < first:
        raise SystemExit("loss did not fall")


if __name__ == "__main__":
    main()
