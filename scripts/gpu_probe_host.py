"""Where the small MLP's host time goes on this GPU machine, and what cuBLASLt's workspace costs:
host us per call (min of 5 x 200 back-to-back calls) of the small MLP (fusible and eager), of
single ops and of the primitives under them; CUDA events per call; and the GPU time of the large
MLP's GEMMs (median of 20, CUDA events). Run once as is and once with CUBLASLT_WORKSPACE_SIZE=0
(torch's knob, which our GEMM layer reads too) to see what algorithms without workspace cost.

usage: python scripts/gpu_probe_host.py
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from bench_mlp import SHAPES, make_models, median_ms  # noqa: E402

F = torch.ops.fusible
tf = torch.nn.functional


def host_us(fn, iters=200, repeats=5):
    for _ in range(20):
        fn()
    res = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) / iters * 1e6)
    return min(res)


def cuda_events(fn):
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(names), sum("emset" in n for n in names)


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()

    return run


def main():
    ws = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "default")
    print(f"== CUBLASLT_WORKSPACE_SIZE={ws} on {torch.cuda.get_device_name()}")
    s = SHAPES["small"]
    torch.manual_seed(0)
    models, params, seq = make_models(s["T"], s["H"], s["F"], "cuda")
    x = torch.randn(s["T"], s["H"], device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)

    def fwd_bwd(f):
        def run():
            for p in params:
                p.grad = None
            f(xg).backward(dy)

        return run

    _, ln, fc1, _, fc2, _ = list(seq)
    h1 = F.layernorm_fwd(x, ln.weight, ln.bias, 1e-5, False)[0]
    small = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    rows = [
        ("small fwd fusible", no_grad(lambda: seq(x))),
        ("small fwd eager", no_grad(lambda: models["eager"](x))),
        ("small fwd+bwd fusible", fwd_bwd(models["fusible"])),
        ("small fwd+bwd eager", fwd_bwd(models["eager"])),
        ("fusible::linear_fwd (bias)", no_grad(lambda: F.linear_fwd(h1, fc1.weight, fc1.bias))),
        ("aten linear (bias)", no_grad(lambda: tf.linear(h1, fc1.weight, fc1.bias))),
        ("fusible::linear_fwd (no bias)", no_grad(lambda: F.linear_fwd(h1, fc1.weight, None))),
        ("aten linear (no bias)", no_grad(lambda: tf.linear(h1, fc1.weight))),
        ("fusible::bias_fwd", no_grad(lambda: F.bias_fwd(small, ln.bias))),
        ("aten add", no_grad(lambda: small + ln.bias)),
        ("torch.empty [16, 1024]", lambda: torch.empty(16, 1024, device="cuda")),
        ("python call of torch.ops no-op-ish (aten.alias)", lambda: torch.ops.aten.alias(small)),
    ]
    print(f"{'host us per call (min of 5 x 200)':50} {'us':>8} {'events':>7} {'memsets':>8}")
    for name, fn in rows:
        n, m = cuda_events(fn)
        print(f"{name:50} {host_us(fn):8.1f} {n:7d} {m:8d}")

    # Host time by event (CPU self time) over 50 forward+backward calls, fusible and eager:
    # autograd nodes, our ops, CUDA runtime calls (launches, memsets), the allocator.
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name in ("fusible", "eager"):
        step = fwd_bwd(models[name])
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(50):
                step()
            torch.cuda.synchronize()
        print(f"== {name} forward+backward, host self time per call by event (50 calls)")
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:22]
        for e in rows:
            print(f"  {e.key[:70]:70} {e.self_cpu_time_total / 50:8.1f} us {e.count / 50:6.1f}x")

    big = SHAPES["large"]
    T, H, F_ = big["T"], big["H"], big["F"]
    xb = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(F_, H, device="cuda", dtype=torch.bfloat16) * 0.02
    b1 = torch.randn(F_, device="cuda", dtype=torch.bfloat16)
    hb = torch.randn(T, F_, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(H, F_, device="cuda", dtype=torch.bfloat16) * 0.02
    b2 = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    dyb = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    gemms = [
        (
            "fc1 fwd + GELU aux (linear_bias_act_fwd)",
            lambda: F.linear_bias_act_fwd(xb, w1, b1, "gelu"),
        ),
        ("fc2 fwd + bias + residual (linear_add)", lambda: F.linear_add(hb, w2, b2, xb, 1.0)),
        ("fc2 dgrad (linear_dgrad)", lambda: F.linear_dgrad(dyb, w2, 1.0)),
        ("fc2 wgrad (linear_wgrad)", lambda: F.linear_wgrad(dyb, hb, 1.0)),
        ("aten linear fc1 (bias)", lambda: tf.linear(xb, w1, b1)),
    ]
    print(f"{'large GEMMs, GPU ms (median of 20)':50} {'ms':>8} {'events':>7} {'memsets':>8}")
    with torch.no_grad():
        for name, fn in gemms:
            n, m = cuda_events(fn)
            print(f"{name:50} {median_ms(fn, reps=20, warmup=3):8.3f} {n:7d} {m:8d}")


if __name__ == "__main__":
    main()
