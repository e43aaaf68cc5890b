"""Host time per call (no synchronization inside the timed loop) of the grouped GEMM ops against
torch._grouped_mm on the same operands: what a launch-bound caller pays on the CPU.

usage: python bench/bench_grouped_host.py
"""

import time

import fusible  # noqa: F401  (registers torch.ops.fusible)
import torch

F = torch.ops.fusible


def host_us(fn, n=50):
    """Mean host microseconds per call of fn over n calls, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main():
    dev, dt = "cuda", torch.bfloat16
    for rows, k, n in ((16384, 4096, 4096), (64, 64, 64)):
        x = torch.randn(rows, k, device=dev, dtype=dt)
        w = torch.randn(8, n, k, device=dev, dtype=dt)
        dy = torch.randn(rows, n, device=dev, dtype=dt)
        split = torch.full((8,), rows // 8, device=dev)
        offs = split.cumsum(0).to(torch.int32)
        cases = {
            "fusible.grouped_linear_fwd": lambda: F.grouped_linear_fwd(x, w, split),
            "torch._grouped_mm (fwd)": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs),
            "fusible.grouped_linear_dgrad": lambda: F.grouped_linear_dgrad(dy, w, split),
            "torch._grouped_mm (dgrad)": lambda: torch._grouped_mm(dy, w, offs),
            "fusible.grouped_linear_wgrad": lambda: F.grouped_linear_wgrad(dy, x, split),
            "torch._grouped_mm (wgrad)": lambda: torch._grouped_mm(dy.t(), x, offs),
            "fusible.grouped_bias_bwd": lambda: F.grouped_bias_bwd(dy, split),
        }
        print(f"rows {rows}, K {k}, N {n}: host us per call")
        for name, fn in cases.items():
            print(f"  {name:30} {host_us(fn):8.1f}")


if __name__ == "__main__":
    main()
