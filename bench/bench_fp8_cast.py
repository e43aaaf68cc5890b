"""FP8 cast kernels against the HBM bandwidth: ms per call and bytes moved / time for the casts the
FP8 linears run on activations (data and its transpose), per recipe, on GPT-sized tensors.

    python bench/bench_fp8_cast.py [--reps N]

Bytes moved: the 16-bit input read once plus the FP8 outputs written (rows and transpose) and the
scales; the amax pass of current scaling reads the input a second time (counted).
"""

import argparse

import fusible  # noqa: F401  (registers torch.ops.fusible)
import torch
from bench_mlp import hbm_tbs, median_ms

SHAPES = {  # [tokens, features] of a gpt_small and a gpt_medium activation
    "gpt_small_x": (163840, 768),
    "gpt_small_ffn": (163840, 2048),
    "gpt_medium_x": (49152, 2048),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50, help="timed calls per kernel (median)")
    args = p.parse_args()
    f = torch.ops.fusible
    hist, scale = torch.zeros(16, device="cuda"), torch.ones(1, device="cuda")
    print(f"{'tensor':14s} {'cast':22s} {'ms':>8s} {'GB/s':>8s} {'of HBM':>7s}")
    for name, (m, k) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        n = m * k
        casts = {
            # read x twice (amax, then cast), write data and its transpose
            "current (amax + cast)": (lambda: f.fp8_cast(x, "e4m3", 0.0, True), 2 * n * 2 + 2 * n),
            "delayed": (
                lambda: f.fp8_cast_delayed(x, "e4m3", hist, scale, 0.0, "max", True),
                n * 2 + 2 * n,
            ),
            "block 1x128": (
                lambda: f.fp8_cast_block(x, "e4m3", 1, True, True),
                n * 2 + 2 * n + 2 * n // 128 * 4,
            ),
            "block 128x128": (
                lambda: f.fp8_cast_block(x, "e4m3", 2, True, True),
                n * 2 + 2 * n,
            ),
        }
        for cast, (fn, nbytes) in casts.items():
            ms = median_ms(fn, args.reps)
            gbs = nbytes / ms / 1e6
            print(f"{name:14s} {cast:22s} {ms:8.3f} {gbs:8.0f} {gbs / hbm_tbs() / 10:6.0f}%")


if __name__ == "__main__":
    main()
