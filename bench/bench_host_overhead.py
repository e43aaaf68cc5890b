"""Per-call host time of the fuser for a 6-op model on tiny tensors (the work is negligible, so the
time is the fuser's own overhead): forward under no_grad, and forward+backward. Runs on CPU, or
CUDA with --device cuda. Median of repeats of a timed loop.

usage: python bench/bench_host_overhead.py [--device cpu|cuda] [--iters N]
"""

import argparse
import statistics
import time

import torch
from fusible import ops


def per_call_us(fn, iters, repeats=7, sync=lambda: None, stat=statistics.median):
    for _ in range(20):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        times.append((time.perf_counter() - t) / iters * 1e6)
    return stat(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="min over repeats is steadier on a busy machine",
    )
    args = p.parse_args()
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.manual_seed(0)
    h = 8
    model = ops.Sequential(
        ops.LayerNorm(h, device=dev),
        ops.BasicLinear(h, h, device=dev),
        ops.Bias(h, device=dev),
        ops.GELU(),
        ops.BasicLinear(h, h, device=dev),
        ops.ConstantScale(0.5),
    )
    x = torch.randn(2, h, device=dev)
    xg = x.clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            model(x)

    def fwd_bwd():
        model(xg).sum().backward()

    stat = min if args.stat == "min" else statistics.median
    print(f"6-op Sequential on {dev}, [2, {h}] input ({args.stat} us per call)")
    print(f"  forward (no_grad)  {per_call_us(fwd, args.iters, 15, sync, stat):8.1f}")
    print(f"  forward+backward   {per_call_us(fwd_bwd, args.iters // 2, 15, sync, stat):8.1f}")


if __name__ == "__main__":
    main()
