"""The bf16 passes around the large MLP's GEMMs against the HBM bandwidth: LayerNorm forward, its
backward with the residual's gradient added, the GELU + bias backward and the bias gradient, at the
large MLP's shapes (T=8192, H=4096, F=16384); ms per call and bytes moved / time. Then the norm
over a float32 residual stream beside bf16 weights (autocast): the norm kernels reading x and
writing dx in float32 themselves, against what the ops ran before (a cast of x, then the bf16 norm;
the bf16 backward, a cast of dx, then the add of the residual's gradient), each row with the bytes
it moves.

    python bench/bench_norm_bias.py [--reps N]

Bytes moved: every tensor read once and every output written once (the norm backward reads dy and
x once for dx and the weight and bias gradients; statistics and per-block partial sums left out).
"""

import argparse

import fusible  # noqa: F401  (registers torch.ops.fusible)
import torch
from bench_mlp import hbm_tbs, median_ms

T, H, F_ = 8192, 4096, 16384


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50, help="timed calls per pass (median)")
    args = p.parse_args()
    f = torch.ops.fusible
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, dy, dextra = (torch.randn(T, H, **bf16) for _ in range(3))
    w, b = torch.randn(H, **bf16), torch.randn(H, **bf16)
    _, mean, rstd = f.layernorm_fwd(x, w, b, 1e-5, False)
    dh, pre = torch.randn(T, F_, **bf16), torch.randn(T, F_, **bf16)
    n, nf = T * H, T * F_
    x32, dextra32 = x.float(), dextra.float()
    _, mean32, rstd32 = f.layernorm_fwd(x32, w, b, 1e-5, False)
    passes = {
        "layernorm_fwd": (lambda: f.layernorm_fwd(x, w, b, 1e-5, False), 2 * 2 * n),
        "layernorm_bwd_add": (
            lambda: f.layernorm_bwd_add(dy, x, mean, rstd, w, False, dextra),
            (3 + 1) * 2 * n,
        ),
        "bias_act_bwd gelu": (lambda: f.bias_act_bwd(dh, pre, "gelu"), 3 * 2 * nf),
        "bias_bwd": (lambda: f.bias_bwd(dy), 2 * n),
        "ln_fwd f32 x, cast": (
            lambda: f.layernorm_fwd(x32.to(torch.bfloat16), w, b, 1e-5, False),
            (4 + 2) * n + 2 * 2 * n,
        ),
        "ln_fwd f32 x": (lambda: f.layernorm_fwd(x32, w, b, 1e-5, False), (4 + 2) * n),
        "ln_bwd_add f32, cast": (
            lambda: f.layernorm_bwd(dy, x, mean, rstd, w, False)[0].float() + dextra32,
            3 * 2 * n + (2 + 4) * n + 3 * 4 * n,
        ),
        "ln_bwd_add f32": (
            lambda: f.layernorm_bwd_add(dy, x32, mean32, rstd32, w, False, dextra32),
            (2 + 4 + 4 + 4) * n,
        ),
    }
    print(f"{'pass':20s} {'shape':>12s} {'ms':>8s} {'GB/s':>8s} {'of HBM':>7s}")
    for name, (fn, nbytes) in passes.items():
        ms = median_ms(fn, args.reps)
        gbs = nbytes / ms / 1e6
        shape = f"{T}x{F_ if 'act' in name else H}"
        print(f"{name:20s} {shape:>12s} {ms:8.3f} {gbs:8.0f} {gbs / hbm_tbs() / 10:6.0f}%")


if __name__ == "__main__":
    main()
