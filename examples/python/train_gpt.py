"""Trains the GPT of gpt.py on the Python standard library's source (gpt_data.py): AdamW with
weight decay, warmup and a cosine schedule, gradient clipping, bf16 autocast on CUDA, optional FP8
(fusible.autocast) and torch.compile, periodic eval loss and perplexity, checkpoints that resume
bit-exactly, and a PNG of the loss curves beside the checkpoint. The model is built on the meta
device and materialized where it trains.

    python examples/python/train_gpt.py                       # CUDA: gpt_small; CPU: tiny
    python examples/python/train_gpt.py --config tiny --steps 200 --out runs/tiny
    python examples/python/train_gpt.py --fp8 current --compile
    python examples/python/train_gpt.py --out runs/tiny --resume   # continue where it stopped
"""

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpt  # noqa: E402
import gpt_data  # noqa: E402

RECIPES = ("current", "delayed", "block")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        choices=sorted(gpt.CONFIGS),
        help="model size (default: gpt_small " "on CUDA, tiny on CPU)",
    )
    p.add_argument(
        "--style",
        choices=("llama", "gpt2"),
        default="llama",
        help="llama: RMSNorm, SwiGLU, rotary, no biases; gpt2: LayerNorm, GELU, "
        "learned positions, biases",
    )
    p.add_argument(
        "--impl",
        choices=("fusible", "eager"),
        default="fusible",
        help="fusible ops, or the same model on plain torch.nn modules (torch_ops.py)",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    p.add_argument(
        "--batch-size",
        type=int,
        default=0,
        help="sequences per step (default: 16 on CUDA, 8 on CPU)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=0.0,
        help="peak learning rate (default: 3e-3 for tiny, 6e-4 otherwise)",
    )
    p.add_argument(
        "--min-lr-ratio",
        type=float,
        default=0.1,
        help="the cosine schedule's final learning rate, as a fraction of the peak",
    )
    p.add_argument(
        "--warmup", type=int, default=0, help="linear warmup steps (default: 5%% of --steps)"
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=0.1,
        help="AdamW weight decay of the matrices (norms and biases: none)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: off)")
    p.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        help="bf16: fp32 parameters, bf16 torch.autocast (default on CUDA); fp32 "
        "(default on CPU)",
    )
    p.add_argument(
        "--fp8",
        choices=("none", *RECIPES),
        default="none",
        help="FP8 GEMMs under fusible.autocast with this recipe (fusible only)",
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile(fullgraph=True) of the model's loss"
    )
    p.add_argument("--eval-every", type=int, default=100, help="steps between eval passes")
    p.add_argument("--eval-batches", type=int, default=8, help="batches per eval pass")
    p.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="steps between checkpoints (default: at the end only)",
    )
    p.add_argument(
        "--out", default="runs/gpt", help="folder of the checkpoint, history.json and loss.png"
    )
    p.add_argument(
        "--no-save", action="store_true", help="write no checkpoint (history and PNG only)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out (same settings)",
    )
    p.add_argument(
        "--stop-at",
        type=int,
        default=0,
        help="stop after this step and save, as an interrupted run would (the "
        "schedule still spans --steps); --resume continues it",
    )
    p.add_argument(
        "--data-dir",
        default="",
        help="token files (default: data/stdlib-<vocab>-<files> beside this script; "
        "built from this Python's standard library when missing)",
    )
    p.add_argument(
        "--data-files",
        type=int,
        default=-1,
        help="how many standard-library files to tokenize (0: all; default: 300 for "
        "tiny, all otherwise)",
    )
    p.add_argument("--seed", type=int, default=1234, help="initialization and data order")
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines instead)")
    return p.parse_args(argv)


def defaults(args):
    """Fills the options whose default depends on the device."""
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.config = args.config or ("gpt_small" if cuda else "tiny")
    args.batch_size = args.batch_size or (16 if cuda else 8)
    args.lr = args.lr or (3e-3 if args.config == "tiny" else 6e-4)
    args.warmup = args.warmup or max(1, args.steps // 20)
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    if args.data_files < 0:
        args.data_files = 300 if args.config == "tiny" else 0
    if args.fp8 != "none" and args.impl != "fusible":
        raise SystemExit("train_gpt: --fp8 needs --impl fusible")
    return args


def model_config(args):
    return dataclasses.replace(gpt.CONFIGS[args.config], style=args.style)


def op_library(impl):
    if impl == "fusible":
        from fusible import ops

        return ops
    import torch_ops

    return torch_ops


def build_model(config, impl, device):
    """Built on the meta device, then materialized on `device` and initialized."""
    # With fusible ops, fusible's fused rotary embedding and cross-entropy too (the eager model:
    # the same math in PyTorch ops, gpt.torch_functional).
    functional = None
    if impl == "fusible":
        import fusible

        functional = fusible.functional
    model = gpt.GPT(config, op_library(impl), device="meta", functional=functional)
    model.to_empty(device=device)
    model.reset_parameters()
    return model


def make_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=args.lr, betas=(0.9, 0.95), fused=args.device.startswith("cuda")
    )


def learning_rate(step, args):
    """Linear warmup to args.lr, then a cosine down to args.lr * min_lr_ratio at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def precision_context(args):
    """torch.autocast for bf16 and fusible.autocast for FP8, entered around each forward."""
    stack = contextlib.ExitStack()
    if args.precision == "bf16":
        stack.enter_context(torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16))
    if args.fp8 != "none":
        import fusible
        from fusible import recipe

        recipes = {
            "current": recipe.Float8CurrentScaling,
            "delayed": recipe.DelayedScaling,
            "block": recipe.Float8BlockScaling,
        }
        stack.enter_context(fusible.autocast(recipe=recipes[args.fp8]()))
    return stack


@torch.no_grad()
def evaluate(loss_fn, model, args, config, data_dir):
    model.eval()
    batches = gpt_data.loader(
        data_dir, "val", config.seq_len, args.batch_size, seed=0, steps=args.eval_batches
    )
    total = 0.0
    for tokens, targets in batches:
        with precision_context(args):
            total += loss_fn(tokens.to(args.device), targets.to(args.device)).item()
    model.train()
    return total / args.eval_batches


def save(path, model, optimizer, step, history, args):
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "history": history,
        "args": vars(args),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a stop while saving leaves the previous checkpoint whole


def plot(history, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = zip(*history["train"]) if history["train"] else ((), ())
    ax.plot(steps, losses, label="train", linewidth=0.8)
    if history["eval"]:
        ax.plot(*zip(*history["eval"]), "o-", label="eval", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(args):
    torch.manual_seed(args.seed)
    config = model_config(args)
    name = f"stdlib-{config.vocab_size}-{args.data_files or 'all'}"
    data_dir = pathlib.Path(
        args.data_dir or pathlib.Path(__file__).resolve().parent / "data" / name
    )
    meta = gpt_data.prepare(data_dir, config.vocab_size, max_files=args.data_files or None)
    model = build_model(config, args.impl, args.device)
    optimizer = make_optimizer(model, args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.pt"
    step, history = 0, {"train": [], "eval": []}
    if args.resume:
        state = torch.load(ckpt, map_location=args.device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
    loss_fn = torch.compile(model.loss, fullgraph=True) if args.compile else model.loss

    print(
        f"train_gpt: {args.impl} {config.style} {args.config} "
        f"({gpt.parameter_count(model) / 1e6:.1f}M parameters) on {args.device}, "
        f"{args.precision}, fp8 {args.fp8}, compile {args.compile}; "
        f"{meta['train_tokens']:,} training tokens"
    )
    stop = min(args.stop_at or args.steps, args.steps)
    batches = gpt_data.loader(
        data_dir,
        "train",
        config.seq_len,
        args.batch_size,
        args.seed,
        start_step=step,
        steps=stop - step,
    )
    tokens_per_step = args.batch_size * config.seq_len
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=True)
    start, start_step = time.perf_counter(), step
    for tokens, targets in batches:
        lr = learning_rate(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with precision_context(args):
            loss = loss_fn(
                tokens.to(args.device, non_blocking=True),
                targets.to(args.device, non_blocking=True),
            )
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        history["train"].append((step, loss.item()))
        rate = (step - start_step) * tokens_per_step / (time.perf_counter() - start)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{history['train'][-1][1]:.3f}", tok_s=f"{rate:,.0f}")
        # Not at --stop-at: an eval under DelayedScaling advances the amax histories, and a
        # resumed run must see what an uninterrupted one did.
        if step % args.eval_every == 0 or step == args.steps:
            val = evaluate(loss_fn, model, args, config, data_dir)
            history["eval"].append((step, val))
            line = f"step {step}: eval loss {val:.4f}, perplexity {math.exp(val):.2f}"
            (bar.write if bar is not None else print)(line)
        due = (args.save_every and step % args.save_every == 0) or step == stop
        if due and not args.no_save:
            save(ckpt, model, optimizer, step, history, args)
    if bar is not None:
        bar.close()
    (out / "history.json").write_text(json.dumps(history))
    plot(history, out / "loss.png", f"{args.impl} {config.style} {args.config}, fp8 {args.fp8}")
    first, last = history["train"][0][1], history["train"][-1][1]
    wrote = ", ".join(([] if args.no_save else [str(ckpt)]) + [str(out / "loss.png")])
    print(f"train_gpt: loss {first:.4f} -> {last:.4f}; wrote {wrote}")
    return model, history


if __name__ == "__main__":
    train(defaults(parse_args()))
