"""MoE expert MLP benchmark (issue 15): 8 experts, 16384 tokens routed unevenly (already grouped
by expert, as after the router's permutation; each expert's count a multiple of 16, as padded for
FP8), H=4096, F=2048, bf16, no biases:
    y_e = fc2_e(probs * swiglu(fc1_e(x_e))) for each expert e over its rows.
Implementations, one run:
  fusible      Sequential(GroupedLinear(8, H, 2F), ScaledSwiGLU(), GroupedLinear(8, F, H)) with the
               split sizes on the device (no host synchronization)
  eager        a PyTorch loop of F.linear per expert over x.split(sizes) (sizes a host list)
  compile      the same loop under torch.compile
  grouped_mm   torch._grouped_mm for the two GEMMs (device offsets) with eager SwiGLU and scaling
  fusible_fp8  fusible's Sequential under fusible.autocast(recipe=Float8CurrentScaling()): FP8
               grouped GEMMs, against the others in bf16
All compute the same function from the same weights (checked: relative error against eager).
Timing as bench_mlp.py (CUDA events, warm-up, median; .grad cleared outside the timed span).
Writes bench_moe.json and merges its rows into latest.json in $BENCH_OUT (default build/bench).

usage: python bench/bench_moe.py [--reps N] [--profile] [--host]
  --host also prints, per implementation, the host time to issue one forward+backward (no sync
  inside) beside its wall time: where they are close, the host sets the step's pace.
"""

import argparse
import json
import os
import statistics
import time

import fusible
import torch
import torch.nn.functional as F
from bench_mlp import idle_gaps, kernel_table, median_ms, merge_latest, peak_mib
from fusible import ops, recipe

E, T, H, FF = 8, 16384, 4096, 2048
SHARES = (0.22, 0.18, 0.15, 0.13, 0.11, 0.09, 0.07, 0.05)  # uneven routing


def split_sizes():
    # Multiples of 16, as a router pads each expert's tokens for FP8 (te's Fp8Padding): the FP8
    # GEMMs take groups of whole 16-row blocks.
    sizes = [int(T * s) // 16 * 16 for s in SHARES]
    sizes[0] += T - sum(sizes)
    return sizes


def swiglu(h):
    gate, lin = h.chunk(2, dim=-1)
    return F.silu(gate) * lin


def make_models(sizes, dev):
    dt = torch.bfloat16
    torch.manual_seed(0)
    w1 = (torch.randn(E, 2 * FF, H, device=dev, dtype=dt) * H**-0.5).requires_grad_()
    w2 = (torch.randn(E, H, FF, device=dev, dtype=dt) * FF**-0.5).requires_grad_()
    w1s = [w.detach().clone().requires_grad_() for w in w1]
    w2s = [w.detach().clone().requires_grad_() for w in w2]
    fc1 = ops.GroupedLinear(E, H, 2 * FF, bias=False, device=dev, dtype=dt)
    fc2 = ops.GroupedLinear(E, FF, H, bias=False, device=dev, dtype=dt)
    with torch.no_grad():
        for e in range(E):
            getattr(fc1, f"weight{e}").copy_(w1[e])
            getattr(fc2, f"weight{e}").copy_(w2[e])
    seq = ops.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    split_dev = torch.tensor(sizes, device=dev)
    offs = split_dev.cumsum(0).to(torch.int32)

    def fusible_fn(x, probs):
        return seq(x, split_dev, probs, split_dev)

    def fusible_fp8_fn(x, probs):
        with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
            return seq(x, split_dev, probs, split_dev)

    def eager_fn(x, probs):
        ys = []
        for e, (xe, pe) in enumerate(zip(x.split(sizes), probs.split(sizes))):
            a = swiglu(F.linear(xe, w1s[e])) * pe[:, None]
            ys.append(F.linear(a, w2s[e]))
        return torch.cat(ys)

    def grouped_mm_fn(x, probs):
        h = torch._grouped_mm(x, w1.transpose(-2, -1), offs)
        a = swiglu(h) * probs[:, None]
        return torch._grouped_mm(a, w2.transpose(-2, -1), offs)

    models = {
        "fusible": fusible_fn,
        "eager": eager_fn,
        "compile": torch.compile(eager_fn),
        "grouped_mm": grouped_mm_fn,
        "fusible_fp8": fusible_fp8_fn,
    }
    params = {
        "fusible": list(seq.parameters()),
        "fusible_fp8": list(seq.parameters()),
        "eager": w1s + w2s,
        "compile": w1s + w2s,
        "grouped_mm": [w1, w2],
    }
    return models, params


def host_issue_ms(step, setup, reps):
    """Median host time to issue step() (after setup(), synchronized before, not inside) and the
    median wall time until the GPU finishes it, in ms."""
    issue, wall = [], []
    for _ in range(reps):
        setup()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return statistics.median(issue), statistics.median(wall)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="print fusible's kernels by GPU time")
    p.add_argument("--host", action="store_true", help="print host issue time against wall time")
    args = p.parse_args()
    out_dir = os.environ.get("BENCH_OUT", "build/bench")
    os.makedirs(out_dir, exist_ok=True)
    dev = "cuda"
    sizes = split_sizes()
    models, params = make_models(sizes, dev)
    torch.manual_seed(1)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(T, device=dev, dtype=torch.bfloat16)
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["date"], results["split_sizes"], rows = time.strftime("%Y-%m-%d"), sizes, {}
    outputs = {}
    for label, fn in models.items():

        def zero_grads(label=label):
            for t in params[label] + [xg, pg]:
                t.grad = None

        def step(fn=fn):
            fn(xg, pg).backward(dy)

        with torch.no_grad():
            fwd = median_ms(lambda fn=fn: fn(x, probs), args.reps)
        fb = median_ms(step, args.reps, setup=zero_grads)
        zero_grads()
        step()
        outputs[label] = [fn(x, probs).detach(), xg.grad.clone(), pg.grad.clone()]
        rows[label] = {
            "forward_ms": fwd,
            "fwd_bwd_ms": fb,
            "fwd_bwd_mib": peak_mib(step, params[label] + [xg, pg]),
        }
        if args.host:
            issue, wall = host_issue_ms(step, zero_grads, args.reps)
            rows[label]["host_issue_ms"], rows[label]["host_wall_ms"] = issue, wall
            print(
                f"== {label}: host issues a forward+backward in {issue:.3f} ms, wall {wall:.3f} ms"
            )
        if args.profile and label in ("fusible", "grouped_mm", "fusible_fp8"):

            def fresh_step(zero_grads=zero_grads, step=step):
                zero_grads()
                step()

            print(f"== {label}: kernels of one forward+backward\n{kernel_table(fresh_step)}")
            print(f"== {label}: GPU idle in one forward+backward\n{idle_gaps(fresh_step)}")
    for label in models:
        errs = [rel_err(a, b) for a, b in zip(outputs[label], outputs["eager"])]
        rows[label]["rel_err_vs_eager"] = dict(zip(("y", "dx", "dprobs"), errs))
    results["impls"] = rows
    with open(os.path.join(out_dir, "bench_moe.json"), "w") as f:
        json.dump(results, f, indent=1)
    latest = {k: results[k] for k in ("gpu", "date", "torch")} | {"moe_split_sizes": sizes}
    bf16 = [impl for impl in models if impl != "fusible_fp8"]
    fields = (("fwd", "forward_ms", "ms"), ("fwd_bwd", "fwd_bwd_ms", "ms"))
    fields += (("fwd_bwd_mem", "fwd_bwd_mib", "MiB"),)
    latest["rows"] = [
        {"workload": f"moe_grouped_bf16_{suffix}", "unit": unit}
        | {impl: rows[impl][key] for impl in bf16}
        for suffix, key, unit in fields
    ]
    # FP8 against the bf16 implementations (the issue's `fusible_bf16` column: fusible's bf16)
    latest["rows"] += [
        {"workload": f"moe_grouped_fp8_{suffix}", "unit": unit, "fusible": rows["fusible_fp8"][key]}
        | {impl: rows[impl][key] for impl in bf16 if impl != "fusible"}
        | {"fusible_bf16": rows["fusible"][key]}
        for suffix, key, unit in fields
    ]
    merge_latest(out_dir, latest.pop("rows"), latest)
    print(
        f"MoE expert MLP (bf16; fusible_fp8: FP8 current scaling) on {results['gpu']}, "
        f"split {sizes} (median ms, CUDA events)"
    )
    header = ("impl", "forward", "fwd+bwd", "MiB", "fwd vs eager", "f+b vs eager")
    print("{:11} {:>9} {:>9} {:>9} {:>12} {:>12}  rel err vs eager (y, dx, dprobs)".format(*header))
    for impl, r in rows.items():
        fwd_ratio = rows["eager"]["forward_ms"] / r["forward_ms"]
        ratio = rows["eager"]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        errs = " ".join(f"{v:.1e}" for v in r["rel_err_vs_eager"].values())
        print(
            f"{impl:11} {r['forward_ms']:9.3f} {r['fwd_bwd_ms']:9.3f} {r['fwd_bwd_mib']:9.1f} "
            f"{fwd_ratio:11.2f}x {ratio:11.2f}x  {errs}"
        )


if __name__ == "__main__":
    main()
