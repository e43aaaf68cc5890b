"""A/B of FP8 current scaling's amax handoff (a producer's kernel hands max |output| to the next
linear's cast) on the MLP block of bench_mlp.py: the same model in one process, the handoff on
and off in alternating rounds (fusible._C._set_fp8_amax_handoff); per setting the median over 3
rounds of median-of-30 CUDA-event times, and the GPU time outside GEMM kernels.

usage: python bench/bench_fp8_amax_handoff.py
"""

import fusible
import torch
from bench_mlp import SHAPES, make_models, median_ms, nongemm_gpu_ms


def main():
    for part in ("large", "small"):
        s = SHAPES[part]
        torch.manual_seed(0)
        models, params, _ = make_models(s["T"], s["H"], s["F"], "cuda")
        fn = models["fusible_fp8"]
        x = torch.randn(s["T"], s["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def zero_grads():
            for p in params + [x]:
                p.grad = None

        def step():
            fn(x).backward(dy)

        rounds = {True: [], False: []}
        try:
            for _ in range(3):
                for on in (True, False):
                    fusible._C._set_fp8_amax_handoff(on)
                    with torch.no_grad():
                        fwd = median_ms(lambda: fn(x), 30)
                    rounds[on].append((fwd, median_ms(step, 30, setup=zero_grads)))
            for on in (True, False):
                fusible._C._set_fp8_amax_handoff(on)
                nongemm = nongemm_gpu_ms(lambda: (zero_grads(), step()))
                fwd = sorted(r[0] for r in rounds[on])[1]
                fb = sorted(r[1] for r in rounds[on])[1]
                print(
                    f"{part:5} handoff {'on ' if on else 'off'}: forward {fwd:.3f} ms, "
                    f"forward+backward {fb:.3f} ms, GPU outside GEMMs {nongemm:.3f} ms"
                )
        finally:
            fusible._C._set_fp8_amax_handoff(True)


if __name__ == "__main__":
    main()
