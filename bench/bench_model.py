"""GPT training-step benchmark (examples/python/gpt.py, Llama style): ms per step (forward, backward
and AdamW step), tokens/s and peak memory, side by side in one run for the same model and data:

    eager           the model on torch.nn modules (examples/python/torch_ops.py), bf16 autocast
    compile         torch.compile(fullgraph=True) of that model's loss
    fusible         the model on fusible ops, bf16 autocast
    fusible_compile torch.compile(fullgraph=True) of the fusible model's loss
    fp8_<recipe>    fusible under fusible.autocast with Float8CurrentScaling / DelayedScaling /
                    Float8BlockScaling (and bf16 autocast for everything else)

Parameters are fp32 (AdamW fused); every variant starts from the same seed. Timing: CUDA events
per step after warm-up, median of --reps. Memory: torch.cuda.max_memory_allocated over one
steady-state step (parameters, optimizer state and activations). Batches come from the token files
of gpt_data.py when --data-dir has them, else uniform random tokens (the time does not depend on
the values). Writes model.json and merges its rows into latest.json in $BENCH_OUT (default
build/bench).

usage: python bench/bench_model.py [--sizes gpt_small,gpt_medium] [--reps N] [--variants ...]
"""

import argparse
import dataclasses
import gc
import json
import os
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "python"))
import gpt  # noqa: E402
import gpt_data  # noqa: E402
import train_gpt  # noqa: E402
from bench_mlp import median_ms, merge_latest  # noqa: E402

VARIANTS = (
    "eager",
    "compile",
    "fusible",
    "fusible_compile",
    "fp8_current",
    "fp8_delayed",
    "fp8_block",
)
# Batches that fill most of the H200's memory in eager bf16.
BATCH = {"gpt_small": 160, "gpt_medium": 24}  # eager gpt_small: 41 GiB at 64
GEMM_NAMES = ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "wgmma")


def settings(variant):
    """(impl, compile, fp8) of a variant."""
    if variant.startswith("fp8_"):
        return "fusible", False, variant[4:]
    return (
        "eager" if variant in ("eager", "compile") else "fusible",
        variant.endswith("compile"),
        "none",
    )


def batches(config, batch, data_dir, count):
    """`count` (tokens, targets) batches on the GPU, the same for every variant."""
    if data_dir and (pathlib.Path(data_dir) / "train.bin").exists():
        loader = gpt_data.loader(data_dir, "train", config.seq_len, batch, seed=0, steps=count)
        return [(t.cuda(), y.cuda()) for t, y in loader]
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(count):
        w = torch.randint(
            config.vocab_size, (batch, config.seq_len + 1), device="cuda", generator=g
        )
        out.append((w[:, :-1], w[:, 1:]))
    return out


def gpu_time_split(step, top=12):
    """One profiled step: GPU ms in GEMM kernels and in the rest, and the top kernels by time."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    totals = {}
    for e in kernels:
        us = getattr(e, "device_time_total", None) or e.cuda_time_total
        totals[e.name] = totals.get(e.name, 0.0) + us
    gemm = sum(t for n, t in totals.items() if any(g in n.lower() for g in GEMM_NAMES))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {
        "gemm_ms": gemm / 1e3,
        "other_ms": (sum(totals.values()) - gemm) / 1e3,
        "kernels": len(kernels),
        "top": [(name[:90], us / 1e3) for name, us in ranked],
    }


def measure(size, variant, batch, data, reps, warmup, profile=False):
    impl, compiled, fp8 = settings(variant)
    args = train_gpt.defaults(
        train_gpt.parse_args(
            [
                "--config",
                size,
                "--impl",
                impl,
                "--fp8",
                fp8,
                "--batch-size",
                str(batch),
                "--device",
                "cuda",
                "--precision",
                "bf16",
                "--no-progress",
            ]
        )
    )
    config = dataclasses.replace(gpt.CONFIGS[size], style="llama")
    torch.manual_seed(0)
    model = train_gpt.build_model(config, impl, "cuda")
    optimizer = train_gpt.make_optimizer(model, args)
    loss_fn = torch.compile(model.loss, fullgraph=True) if compiled else model.loss
    i = 0

    def step():
        nonlocal i
        tokens, targets = data[i % len(data)]
        i += 1
        with train_gpt.precision_context(args):
            loss = loss_fn(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        first_s = None
        if compiled:  # the first step compiles: timed on its own
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
        ms = median_ms(step, reps, warmup=warmup)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        mib = torch.cuda.max_memory_allocated() / 2**20
        result = {"step_ms": ms, "tokens_per_s": batch * config.seq_len / ms * 1e3, "mem_mib": mib}
        if first_s is not None:
            result["first_step_s"] = first_s
        if profile:
            result["profile"] = gpu_time_split(step)
    except torch.OutOfMemoryError:
        result = {"step_ms": None, "tokens_per_s": None, "mem_mib": None, "oom": True}
    result["parameters"] = gpt.parameter_count(model)
    return result


def release():
    """Frees the last variant's model, optimizer state and compiled graphs."""
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


def latest_rows(results):
    """The issue's rows: eager / compile columns are bf16; fusible is the row's variant."""
    rows = []

    def row(size, name, key, variant, unit):
        r = results[size]
        rows.append(
            {
                "workload": f"{size}_{name}",
                "unit": unit,
                # The other variants first: "fusible" is this row's variant (fusible bf16 is
                # also "fusible_bf16").
                **{
                    ("fusible_bf16" if v == "fusible" else v): r[v][key]
                    for v in VARIANTS
                    if v in r and v not in ("eager", "compile")
                },
                "fusible": r[variant][key],
                "eager": r["eager"][key],
                "compile": r["compile"][key],
            }
        )

    for size in results:
        if not {"fusible", "eager", "compile"} <= results[size].keys():
            continue  # a partial run (--variants): printed, not recorded as the rows
        row(size, "bf16_step_ms", "step_ms", "fusible", "ms")
        row(size, "bf16_mem_mib", "mem_mib", "fusible", "MiB")
        for recipe in ("current", "delayed", "block"):
            if f"fp8_{recipe}" in results[size]:
                row(size, f"fp8_{recipe}_step_ms", "step_ms", f"fp8_{recipe}", "ms")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="gpt_small,gpt_medium", help="model sizes (gpt.CONFIGS)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="which variants to run")
    p.add_argument("--reps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (compiles)")
    p.add_argument("--data-dir", default="", help="gpt_data.py token files (else random tokens)")
    p.add_argument("--batch", type=int, default=0, help="sequences per step (default: BATCH)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one step per variant: GEMM vs other GPU time, top kernels",
    )
    args = p.parse_args()
    out_dir = pathlib.Path(os.environ.get("BENCH_OUT", "build/bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "batch": {s: args.batch or BATCH[s] for s in args.sizes.split(",")},
    }
    for size in args.sizes.split(","):
        config = gpt.CONFIGS[size]
        batch = args.batch or BATCH[size]
        data = batches(config, batch, args.data_dir, 4)
        results[size] = {}
        for variant in args.variants.split(","):
            start = time.perf_counter()
            r = measure(size, variant, batch, data, args.reps, args.warmup, args.profile)
            release()
            results[size][variant] = r
            # After every variant: a run cut short by a time limit keeps what it measured.
            (out_dir / "model.json").write_text(json.dumps({**meta, "results": results}, indent=1))
            summary = {k: v for k, v in r.items() if k != "profile"}
            print(f"{size} {variant}: {summary} ({time.perf_counter() - start:.0f} s)", flush=True)
            if "profile" in r:
                prof = r["profile"]
                print(
                    f"  GPU: GEMMs {prof['gemm_ms']:.1f} ms, other {prof['other_ms']:.1f} ms, "
                    f"{prof['kernels']} kernels; top:"
                )
                for name, ms in prof["top"]:
                    print(f"    {ms:8.2f} ms  {name}")
    merge_latest(str(out_dir), latest_rows(results), meta)
    print(f"GPT training step on {meta['gpu']} (median ms; x: eager / this)")
    for size, by_variant in results.items():
        eager = by_variant.get("eager", {}).get("step_ms")
        for variant, r in by_variant.items():
            ms = r["step_ms"]
            ratio = f"{eager / ms:.2f}x" if ms and eager else "-"
            mem = f"{r['mem_mib']:.0f} MiB" if r["mem_mib"] else "OOM"
            print(f"  {size:10s} {variant:16s} {ms or 0:9.2f} ms  {ratio:>6s}  {mem}")


if __name__ == "__main__":
    main()
