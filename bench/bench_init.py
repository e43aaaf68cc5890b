"""Deferred init: Linear(16384, 16384) fp32 built on meta and materialized (reset on CUDA) vs
built directly on CUDA. Median wall time of N runs, synchronized, in ms. Writes JSON to $BENCH_OUT
(default build/bench).

usage: python bench/bench_init.py [--reps N] [--size N]
"""

import argparse
import json
import os
import statistics
import time

import torch
from fusible import ops


def timed(fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        del out
        torch.cuda.empty_cache()
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--size", type=int, default=16384)
    args = p.parse_args()
    n = args.size

    def direct():
        return ops.Linear(n, n, device="cuda")

    def deferred():
        lin = ops.Linear(n, n, device="meta")
        lin.reset_parameters()
        return lin

    def deferred_first_forward():
        lin = ops.Linear(n, n, device="meta")
        with torch.no_grad():
            lin(torch.randn(1, n, device="cuda"))
        return lin

    def torch_direct():
        return torch.nn.Linear(n, n, device="cuda")

    for fn in (direct, deferred, deferred_first_forward, torch_direct):  # warm-up
        fn()
    res = {
        k: timed(f, args.reps)
        for k, f in [
            ("direct_cuda", direct),
            ("meta_then_reset", deferred),
            ("meta_then_first_forward", deferred_first_forward),
            ("torch_nn_linear_cuda", torch_direct),
        ]
    }
    os.makedirs(os.environ.get("BENCH_OUT", "build/bench"), exist_ok=True)
    with open(
        os.path.join(os.environ.get("BENCH_OUT", "build/bench"), "bench_init.json"), "w"
    ) as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "size": n, **res}, f, indent=1)
    print(f"Linear({n}, {n}) fp32 init on {torch.cuda.get_device_name()} (median ms)")
    for k, v in res.items():
        print(f"  {k:26} {v:8.3f} ms   {v / res['direct_cuda']:5.2f}x direct")


if __name__ == "__main__":
    main()
