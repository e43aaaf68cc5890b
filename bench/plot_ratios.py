"""PNG chart of latest.json: each workload's fusible and torch.compile figures as a ratio to eager
(above 1: better than eager; time, memory and kernel counts all read lower-is-better).

usage: python bench/plot_ratios.py [latest.json] [out.png]
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "bench/results/latest.json"
    dst = sys.argv[2] if len(sys.argv) > 2 else "bench/results/ratios.png"
    with open(src) as f:
        latest = json.load(f)
    rows = latest["rows"]
    names = [r["workload"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.38
    for i, impl in enumerate(("fusible", "compile")):
        ratios = [r["eager"] / r[impl] if r[impl] else 0 for r in rows]
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        ax.bar(xs, ratios, width, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("eager / impl (higher is better)")
    ax.set_title(f"{latest['gpu']}, torch {latest['torch']}, {latest['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
