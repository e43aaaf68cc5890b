"""A linear's forward+backward with its weight gradient going into an fp32 main_grad (Megatron's
buffer, te.ops' accumulate_into_main_grad) against the same step into .grad, and against eager
PyTorch adding the bf16 .grad into main_grad afterwards (what accumulation costs without the
GEMM's beta = 1). Large-MLP fc1 shapes (T=8192, 4096 -> 16384), bf16; ms per step (CUDA events,
median), and the main_grad's error against the float64 sum after the timed steps.

    python bench/bench_main_grad.py [--reps N]
"""

import argparse

import fusible
import torch
from bench_mlp import median_ms
from fusible import ops, recipe

T, K, N = 8192, 4096, 16384


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30, help="timed steps per variant (median)")
    args = p.parse_args()
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    x = torch.randn(T, K, **bf16)
    dy = torch.randn(T, N, **bf16)
    plain = ops.Linear(K, N, **bf16)
    into = ops.Linear(K, N, accumulate_into_main_grad=True, **bf16)
    into.load_state_dict(plain.state_dict())
    into.weight.main_grad = torch.zeros(N, K, device="cuda")
    eager = torch.nn.Linear(K, N, **bf16)
    eager.weight.main_grad = torch.zeros(N, K, device="cuda")

    def clear():
        for m in (plain, into, eager):
            for q in m.parameters():
                q.grad = None

    def eager_step():
        eager(x).backward(dy)
        eager.weight.main_grad.add_(eager.weight.grad)

    def fp8(model):
        def step():
            with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
                y = model(x)
            y.backward(dy)

        return step

    rows = {
        "fusible .grad": lambda: plain(x).backward(dy),
        "fusible main_grad": lambda: into(x).backward(dy),
        "eager .grad + main_grad.add_": eager_step,
        "fusible FP8 .grad": fp8(plain),
        "fusible FP8 main_grad": fp8(into),
    }
    print(f"Linear {K} -> {N}, {T} tokens, bf16, fp32 main_grad (median ms, CUDA events)")
    for name, step in rows.items():
        print(f"{name:32s} {median_ms(step, args.reps, setup=clear):8.3f}")
    # The precision of the accumulated sum: a fresh buffer, 8 steps of one (x, dy).
    into.weight.main_grad.zero_()
    for _ in range(8):
        into(x).backward(dy)
    want = 8 * (dy.double().T @ x.double())
    err = (into.weight.main_grad.double() - want).abs().max().item()
    eager.weight.main_grad.zero_()
    for _ in range(8):
        eager.weight.grad = None
        eager_step()
    err_eager = (eager.weight.main_grad.double() - want).abs().max().item()
    print(
        f"max |main_grad - float64| after 8 steps: fusible {err:.3e}, eager bf16 .grad added "
        f"{err_eager:.3e} (|sum| max {want.abs().max().item():.1f})"
    )


if __name__ == "__main__":
    main()
