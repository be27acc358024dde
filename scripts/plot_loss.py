#!/usr/bin/python3
"""Plots the loss curve of a ctitan run from its metrics.jsonl.

    scripts/plot_loss.py outputs/metrics.jsonl docs/loss_curve.png [--title TEXT]

Uses Debian's python3-matplotlib (scripts/install_deps.sh installs it), hence the
explicit /usr/bin/python3.
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="metrics.jsonl written by train")
    ap.add_argument("output", help="PNG to write")
    ap.add_argument("--title", default="ctitan: Llama 3 debug model on Moby-Dick")
    a = ap.parse_args()
    steps, losses, lrs = [], [], []
    val_steps, val_losses = [], []  # validation records: {"step", "validation_loss", ...}
    with open(a.metrics) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                print(f"plot_loss: {a.metrics}:{n}: not JSON: {e}", file=sys.stderr)
                return 1
            if "validation_loss" in rec:
                val_steps.append(rec["step"])
                val_losses.append(rec["validation_loss"])
                continue
            steps.append(rec["step"])
            losses.append(rec["loss"])
            lrs.append(rec["lr"])
    if not steps:
        print(f"plot_loss: {a.metrics} has no records", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, losses, color="tab:blue", label="loss (nats/token)")
    if val_steps:
        ax.plot(val_steps, val_losses, "o-", color="tab:green", markersize=3, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(steps, lrs, color="tab:orange", alpha=0.6, label="learning rate")
    ax2.set_ylabel("learning rate")
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88))
    ax.set_title(a.title)
    fig.tight_layout()
    fig.savefig(a.output)
    print(f"plot_loss: wrote {a.output} ({len(steps)} points, loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
