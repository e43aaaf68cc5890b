"""Host time of the small MLP (T=16, H=1024, F=4096) forward+backward per FP8 recipe against
fusible bf16, where the GPU work is tiny and each call's host work is what counts; then where the
host time of one FP8 current-scaling step goes (torch.profiler CPU self time by op). CUDA only.

Wall time per step: a back-to-back loop of 200 steps synchronized at the end; every config in
turn, 7 rounds, min per config.

    python bench/bench_fp8_small_host.py [--rows N]
"""

import argparse
import statistics
import time

import fusible
import torch
from bench_mlp import SHAPES, make_models
from bench_small_host import wall_us


def phase_us(fn, x, dy, params, iters=200):
    """Median host wall time of the forward and of the backward alone, each between syncs."""
    fwd, bwd = [], []
    for i in range(iters + 20):
        for q in params:
            q.grad = None
        x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = fn(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        y.backward(dy)
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 20:
            fwd.append((t1 - t0) * 1e6)
            bwd.append((t3 - t2) * 1e6)
    return statistics.median(fwd), statistics.median(bwd)


LABELS = ["fusible", "fusible_fp8", "fusible_fp8_delayed", "fusible_fp8_block", "eager"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=18, help="profiler table rows")
    p.add_argument("--rounds", type=int, default=7, help="rounds of every config in turn")
    p.add_argument(
        "--profile",
        nargs="*",
        default=["fusible", "fusible_fp8"],
        help="models whose CPU self time by op is tabled",
    )
    args = p.parse_args()
    s = SHAPES["small"]
    torch.manual_seed(0)
    models, params, _ = make_models(s["T"], s["H"], s["F"], "cuda")
    x = torch.randn(s["T"], s["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step_of(fn):
        def step():
            for q in params:
                q.grad = None
            x.grad = None
            fn(x).backward(dy)

        return step

    # The per-tensor casts of small tensors as plain launches too (fusible._C switch; one
    # cooperative launch each by default); and delayed scaling without the snapshot that puts its
    # state back after a failed call (what that snapshot costs).
    one_launch = fusible._C._fp8_cast_one_launch()
    configs = [(label, label, one_launch, True) for label in LABELS]
    configs += [
        (f"{m} (plain-launch casts)", m, False, True)
        for m in ("fusible_fp8", "fusible_fp8_delayed")
    ]
    configs.append(("fusible_fp8_delayed (no rollback)", "fusible_fp8_delayed", one_launch, False))
    # Round robin, min per config over the rounds: a config timed after the others must not gain
    # from a host that warms up as it goes (timed in blocks, whichever came last looked faster).
    times = {name: float("inf") for name, *_ in configs}
    try:
        for _ in range(args.rounds):
            for name, model, cast_one_launch, rollback in configs:
                fusible._C._set_fp8_cast_one_launch(cast_one_launch)
                fusible._C._set_fp8_state_rollback(rollback)
                t = wall_us(step_of(models[model]), repeats=1)
                times[name] = min(times[name], t)
    finally:
        fusible._C._set_fp8_cast_one_launch(one_launch)
        fusible._C._set_fp8_state_rollback(True)
    print(f"small MLP forward+backward, host wall time per step (us, min of {args.rounds} rounds")
    print("of 200 steps, configs in turn)")
    for name in times:
        print(f"  {name:34s} {times[name]:8.1f}  ({times[name] / times['fusible']:.2f}x bf16)")
    print("host time per phase (us, median of 200; synchronized before and after each phase)")
    for label in ("fusible", "fusible_fp8"):
        fwd, bwd = phase_us(models[label], x, dy, params)
        print(f"  {label:22s} forward {fwd:7.1f}  backward {bwd:7.1f}")
    for label in args.profile:
        step = step_of(models[label])
        step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        print(f"{label}, CPU self time of 10 steps by op:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
