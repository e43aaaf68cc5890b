"""MLP block benchmark (the SHAPES below): fusible vs PyTorch eager vs torch.compile, one run.
    y = x + fc2(gelu_tanh(fc1(layernorm(x)))), bf16, biases on; in fusible, the
    Sequential(MakeExtraOutput, LayerNorm, Linear, GELU, Linear, AddExtraInput) with the residual
    routed through a channel. `fusible_fp8`: the same Sequential under
    fusible.autocast(recipe=Float8CurrentScaling()) (FP8 GEMMs), against eager and compiled bf16;
    its relative error against eager bf16 (y and every gradient) is printed and recorded;
    `fusible_fp8_block`: the same under Float8BlockScaling (block-scaled FP8 GEMMs; printed);
    `fusible_fp8_delayed`: the same under DelayedScaling; on the small MLP,
    `fusible_fp8_min_tokens`: Float8CurrentScaling(fp8_min_tokens=1024), the opt-in that keeps
    GEMMs over fewer tokens in bf16.
Timing: CUDA events per repetition, warm-up first, median of many; every forward+backward starts
with the parameters' and input's .grad cleared (as the eager baselines do), outside the timed span,
so no gradient accumulation is timed or counted. Memory: the peak allocated during one
forward+backward minus what was allocated before it. Writes a table to stdout and bench_mlp.json
to $BENCH_OUT (default build/bench), and merges its rows into latest.json there.

usage: python bench/bench_mlp.py [--parts small,large] [--reps N]
"""

import argparse
import json
import os
import re
import statistics
import time

import fusible
import torch
import torch.nn.functional as F
from fusible import ops, recipe

SHAPES = {"small": dict(T=16, H=1024, F=4096), "large": dict(T=8192, H=4096, F=16384)}
MIN_TOKENS = 1024  # fusible_fp8_min_tokens: Float8CurrentScaling(fp8_min_tokens=MIN_TOKENS)


def hbm_tbs():
    """The current GPU's nominal HBM bandwidth (TB/s): H200 4.8, H100 SXM 3.35 (else H200's)."""
    return 3.35 if "H100" in torch.cuda.get_device_name() else 4.8


def median_ms(fn, reps, warmup=5, setup=lambda: None):
    """Median of CUDA-event times of fn(); setup() runs before each, outside the timed span."""
    for _ in range(warmup):
        setup()
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        setup()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def merge_latest(out_dir, rows, meta):
    """Merges rows into out_dir/latest.json (the issue's row format, one file for every bench):
    rows of the same workload are replaced, the others kept; meta (gpu, date, torch...) updated."""
    path = os.path.join(out_dir, "latest.json")
    latest = json.load(open(path)) if os.path.exists(path) else {"rows": []}
    latest.update(meta)
    names = {r["workload"] for r in rows}
    latest["rows"] = [r for r in latest["rows"] if r["workload"] not in names] + list(rows)
    with open(path, "w") as f:
        json.dump(latest, f, indent=1)


def make_models(T, H, F_, dev):
    dt = torch.bfloat16
    make, add = ops.MakeExtraOutput(), ops.AddExtraInput()
    make.set_extra_output_channel(0, "residual", output_to_caller=False)
    add.set_extra_input_channel(0, "residual")
    seq = ops.Sequential(
        make,
        ops.LayerNorm(H, device=dev, dtype=dt),
        ops.Linear(H, F_, device=dev, dtype=dt),
        ops.GELU(),
        ops.Linear(F_, H, device=dev, dtype=dt),
        add,
    )
    _, ln, fc1, _, fc2, _ = list(seq)

    def fusible_fn(x):
        return seq(x)

    def eager_fn(x):
        h = F.layer_norm(x, (H,), ln.weight, ln.bias, 1e-5)
        h = F.gelu(F.linear(h, fc1.weight, fc1.bias), approximate="tanh")
        return x + F.linear(h, fc2.weight, fc2.bias)

    def fusible_fp8_fn(x):
        with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
            return seq(x)  # the backward follows the forward's recipe

    def fusible_fp8_block_fn(x):
        with fusible.autocast(recipe=recipe.Float8BlockScaling()):
            return seq(x)

    def fusible_fp8_delayed_fn(x):
        with fusible.autocast(recipe=recipe.DelayedScaling()):
            return seq(x)

    models = {
        "fusible": fusible_fn,
        "eager": eager_fn,
        "compile": torch.compile(eager_fn),
        "fusible_fp8": fusible_fp8_fn,
        "fusible_fp8_block": fusible_fp8_block_fn,
        "fusible_fp8_delayed": fusible_fp8_delayed_fn,
    }
    if T < MIN_TOKENS:  # the opt-in for small shapes: its GEMMs in bf16 below the threshold

        def fusible_fp8_min_tokens_fn(x):
            with fusible.autocast(recipe=recipe.Float8CurrentScaling(fp8_min_tokens=MIN_TOKENS)):
                return seq(x)

        models["fusible_fp8_min_tokens"] = fusible_fp8_min_tokens_fn
    return models, list(seq.parameters()), seq


def peak_mib(step, params):
    """MiB allocated at the peak of one step above what was allocated before it."""
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def cuda_kernels(fn):
    """CUDA kernels one call of fn launches (torch.profiler), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# cuBLAS(Lt)'s GEMM kernels (nvjet_*, *gemm*, CUTLASS's) and its split-K reduction.
GEMM_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass|splitKreduce", re.IGNORECASE)


def nongemm_gpu_ms(fn):
    """GPU time (ms) of one call of fn spent in kernels other than GEMMs (torch.profiler, after a
    warm-up call): the casts, norms, activations and reductions around the GEMMs."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return (
        sum(
            e.time_range.elapsed_us()
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not GEMM_KERNEL.search(e.name)
        )
        / 1e3
    )


def kernel_table(fn):
    """fn's CUDA kernels and the ops that launched them, by total GPU time (one call after a
    warm-up)."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=70
    )


def idle_gaps(fn, top=6):
    """Where the GPU idles during one call of fn (torch.profiler, after a warm-up call): the span
    from the first kernel's start to the last one's end, the busy time, and the largest gaps
    with the kernels on either side."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    gaps, busy, end = [], 0.0, kernels[0][0]
    for (start, stop, name), prev in zip(kernels, [None] + kernels[:-1]):
        if prev is not None and start > end:
            gaps.append((start - end, prev[2][:50], name[:50]))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    lines = [f"span {(end - kernels[0][0]) / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms"]
    lines += [f"  gap {g:7.1f} us after {a} before {b}" for g, a, b in sorted(gaps)[::-1][:top]]
    return "\n".join(lines)


def fp8_errors(models, params, x, dy, label="fusible_fp8"):
    """Relative (Frobenius) error of an FP8 model's y and gradients against eager bf16's."""
    out = {}
    for label in ("eager", label):
        for p in params:
            p.grad = None
        xg = x.clone().requires_grad_()
        y = models[label](xg)
        y.backward(dy)
        out[label] = [y.detach(), xg.grad] + [p.grad for p in params]
    names = ["y", "dx", "d_ln_w", "d_ln_b", "d_fc1_w", "d_fc1_b", "d_fc2_w", "d_fc2_b"]
    return {
        n: ((a.double() - b.double()).norm() / b.double().norm()).item()
        for n, a, b in zip(names, out[label], out["eager"])
    }


def run_part(name, reps, profile=False):
    s = SHAPES[name]
    dev = "cuda"
    torch.manual_seed(0)
    models, params, _ = make_models(s["T"], s["H"], s["F"], dev)
    x = torch.randn(s["T"], s["H"], device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn_like(x)
    rows = {}
    for label, fn in models.items():
        with torch.no_grad():
            fwd = median_ms(lambda: fn(x), reps)

        def zero_grads():  # as the eager baselines: each step starts with no .grad
            for p in params:
                p.grad = None
            xg.grad = None

        def step():
            fn(xg).backward(dy)

        def fresh_step():
            zero_grads()
            step()

        fb = median_ms(step, reps, setup=zero_grads)
        rows[label] = {"forward_ms": fwd, "fwd_bwd_ms": fb, "fwd_bwd_mib": peak_mib(step, params)}
        with torch.no_grad():
            rows[label]["kernels_fwd"] = cuda_kernels(lambda: fn(x))
        rows[label]["kernels_fwd_bwd"] = cuda_kernels(fresh_step)
        rows[label]["nongemm_fwd_bwd_ms"] = nongemm_gpu_ms(fresh_step)
        if profile and (label.startswith("fusible") or label == "eager"):
            with torch.no_grad():
                print(f"== {name} {label}: kernels of one forward\n{kernel_table(lambda: fn(x))}")
            print(f"== {name} {label}: kernels of one forward+backward\n{kernel_table(fresh_step)}")
            print(f"== {name} {label}: GPU idle in one forward+backward\n{idle_gaps(fresh_step)}")
    errors = fp8_errors(models, params, x, dy)
    block_errors = fp8_errors(models, params, x, dy, "fusible_fp8_block")
    print(
        f"{name}: fusible FP8 block scaling, relative error against eager bf16: "
        + "  ".join(f"{k} {v:.2e}" for k, v in block_errors.items())
    )
    return rows, errors


def latest_rows(results, parts):
    """The issue's row format: one row per workload, fusible / eager / compile side by side."""
    fields = [("fwd", "forward_ms", "ms"), ("fwd_bwd", "fwd_bwd_ms", "ms")]
    fields_large = [
        ("fwd_bwd_mem", "fwd_bwd_mib", "MiB"),
        ("fwd_bwd_kernels", "kernels_fwd_bwd", "count"),
    ]
    rows = []
    for part in parts:
        for suffix, key, unit in fields + (fields_large if part == "large" else []):
            row = {"workload": f"mlp_{part}_bf16_{suffix}", "unit": unit}
            for impl in ("fusible", "eager", "compile"):
                row[impl] = results[part][impl][key]
            rows.append(row)
    if "large" in parts:  # GPU time outside GEMM kernels, one bf16 forward+backward
        row = {"workload": "mlp_large_bf16_nongemm_gpu_ms", "unit": "ms"}
        for impl in ("fusible", "eager", "compile"):
            row[impl] = results["large"][impl]["nongemm_fwd_bwd_ms"]
        rows.append(row)
    # fusible FP8 (current, block, delayed scaling) against eager and compiled bf16, and fusible
    # bf16 (the small MLP's FP8 target is relative to it)
    recipes = (
        ("fp8", "fusible_fp8"),
        ("fp8_block", "fusible_fp8_block"),
        ("fp8_delayed", "fusible_fp8_delayed"),
    )
    for part in parts:
        fp8_fields = fields + fields_large if part == "large" else fields[1:]
        extra = (("fp8_min_tokens", "fusible_fp8_min_tokens"),)
        for name, impl_key in recipes + tuple(e for e in extra if e[1] in results[part]):
            for suffix, key, unit in fp8_fields:
                row = {"workload": f"mlp_{part}_{name}_{suffix}", "unit": unit}
                row["fusible"] = results[part][impl_key][key]
                for impl in ("eager", "compile"):
                    row[impl] = results[part][impl][key]
                row["fusible_bf16"] = results[part]["fusible"][key]
                rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="small,large")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="print fusible's kernels by GPU time")
    args = p.parse_args()
    out_dir = os.environ.get("BENCH_OUT", "build/bench")
    os.makedirs(out_dir, exist_ok=True)
    results = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    for part in args.parts.split(","):
        results[part], results[f"{part}_fp8_rel_err"] = run_part(part, args.reps, args.profile)
    with open(os.path.join(out_dir, "bench_mlp.json"), "w") as f:
        json.dump(results, f, indent=1)
    meta = {k: results[k] for k in ("gpu", "date", "torch")}
    if "large" in args.parts.split(","):
        meta["mlp_large_fp8_rel_err_vs_eager_bf16"] = results["large_fp8_rel_err"]
    merge_latest(out_dir, latest_rows(results, args.parts.split(",")), meta)
    print(f"MLP bf16 on {results['gpu']} (median ms, CUDA events)")
    header = ("part", "impl", "forward", "fwd+bwd", "fwd vs eager", "f+b vs eager")
    print("{:6} {:8} {:>9} {:>9} {:>13} {:>13}".format(*header))
    for part in args.parts.split(","):
        eager = results[part]["eager"]
        for impl, r in results[part].items():
            fwd_ratio = eager["forward_ms"] / r["forward_ms"]
            fb_ratio = eager["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            print(
                f"{part:6} {impl:8} {r['forward_ms']:9.3f} {r['fwd_bwd_ms']:9.3f} "
                f"{fwd_ratio:12.2f}x {fb_ratio:12.2f}x"
            )
    print("CUDA kernels per call (torch.profiler): forward / forward+backward; MiB above inputs")
    for part in args.parts.split(","):
        for impl, r in results[part].items():
            print(
                f"{part:6} {impl:8} {r['kernels_fwd']:4d} / {r['kernels_fwd_bwd']:4d}   "
                f"{r['fwd_bwd_mib']:9.1f} MiB"
            )
    print("fusible FP8 (current scaling): relative error against eager bf16")
    for part in args.parts.split(","):
        errs = results[f"{part}_fp8_rel_err"]
        print(f"{part:6} " + "  ".join(f"{k} {v:.2e}" for k, v in errs.items()))


if __name__ == "__main__":
    main()
