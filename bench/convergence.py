"""Convergence of the GPT example (examples/python/train_gpt.py) in bf16 and FP8: the same model
(Llama-style gpt_small by default), seed and data, trained by PyTorch eager (torch.nn modules),
fusible bf16 and fusible FP8 with each recipe; then one PNG of the loss curves and a table of the
final eval losses against eager bf16.

    python bench/convergence.py --variants eager,fusible   # BENCH_OUT/convergence_<variant>.json
    python bench/convergence.py --plot DIR [DIR ...]        # PNG and table from those records
"""

import argparse
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "python"))
import train_gpt  # noqa: E402

VARIANTS = ("eager", "fusible", "fp8_current", "fp8_delayed", "fp8_block")


def train(variant, args, out_dir):
    impl = "eager" if variant == "eager" else "fusible"
    fp8 = variant[4:] if variant.startswith("fp8_") else "none"
    run_args = train_gpt.defaults(
        train_gpt.parse_args(
            [
                "--config",
                args.config,
                "--impl",
                impl,
                "--fp8",
                fp8,
                "--steps",
                str(args.steps),
                "--batch-size",
                str(args.batch_size),
                "--eval-every",
                str(args.eval_every),
                "--eval-batches",
                str(args.eval_batches),
                "--out",
                str(pathlib.Path(args.scratch) / variant),
                "--no-save",
                "--no-progress",
                "--seed",
                str(args.seed),
            ]
            + (["--data-dir", args.data_dir] if args.data_dir else [])
        )
    )
    _, history = train_gpt.train(run_args)
    record = {
        "variant": variant,
        "config": args.config,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "history": history,
    }
    (out_dir / f"convergence_{variant}.json").write_text(json.dumps(record))


def smooth(values, beta=0.98):
    out, avg = [], None
    for v in values:
        avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg)
    return out


def plot(dirs, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {}
    for d in dirs:
        for f in sorted(pathlib.Path(d).glob("convergence_*.json")):
            r = json.loads(f.read_text())
            records[r["variant"]] = r
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant in [v for v in VARIANTS if v in records]:
        h = records[variant]["history"]
        steps, losses = zip(*h["train"])
        ax_train.plot(steps, smooth(losses), label=variant, linewidth=1)
        ax_eval.plot(*zip(*h["eval"]), "o-", label=variant, markersize=3, linewidth=1)
    for ax, title in ((ax_train, "train loss (EMA 0.98)"), (ax_eval, "eval loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    base = records.get("eager", {}).get("history", {}).get("eval")
    print("| variant | final eval loss | vs eager bf16 |")
    print("| --- | --- | --- |")
    for variant in [v for v in VARIANTS if v in records]:
        final = records[variant]["history"]["eval"][-1][1]
        rel = f"{(final / base[-1][1] - 1) * 100:+.2f}%" if base else "-"
        print(f"| {variant} | {final:.4f} | {rel} |")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="which runs to train")
    p.add_argument("--config", default="gpt_small", help="model size (gpt.CONFIGS)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--eval-every", type=int, default=200, help="steps between eval passes")
    p.add_argument("--eval-batches", type=int, default=16, help="batches per eval pass")
    p.add_argument("--seed", type=int, default=1234, help="initialization and data order")
    p.add_argument("--data-dir", default="", help="gpt_data.py token files")
    p.add_argument("--scratch", default="/tmp/convergence", help="the runs' own output folders")
    p.add_argument("--plot", nargs="+", metavar="DIR", help="plot the records in these folders")
    p.add_argument("--png", default=str(HERE / "results" / "convergence.png"), help="plot file")
    args = p.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    out_dir = pathlib.Path(os.environ.get("BENCH_OUT", "build/bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        train(variant, args, out_dir)


if __name__ == "__main__":
    main()
