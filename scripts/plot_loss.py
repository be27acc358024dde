#!/usr/bin/python3
"""Plots the loss curve of a ctitan run from its metrics.jsonl.

    scripts/plot_loss.py outputs/metrics.jsonl docs/loss_curve.png [--title TEXT]

train appends to <dump_folder>/metrics.jsonl, so one file can hold several runs (a rerun, a
resume from a checkpoint). A run starts wherever the logged step does not go up, or the run's
elapsed_s goes down; each run is drawn as a line of its own, never joined back to the one before.
(A resume whose first logged step and time both lie past the last run's continues its line.)

Uses Debian's python3-matplotlib (scripts/install_deps.sh installs it), hence the
explicit /usr/bin/python3.
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def new_run():
    return {"steps": [], "losses": [], "lrs": [], "val_steps": [], "val_losses": [], "elapsed": 0.0}


def read_runs(path):
    """The runs of a metrics.jsonl, in file order: dicts of steps, losses, lrs, val_steps,
    val_losses. Raises ValueError naming the line that is not JSON."""
    runs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            if "validation_loss" in rec:  # {"step", "validation_loss", ...}: the run it follows
                if not runs:
                    runs.append(new_run())
                runs[-1]["val_steps"].append(rec["step"])
                runs[-1]["val_losses"].append(rec["validation_loss"])
                continue
            last = runs[-1] if runs else None
            if not last or (last["steps"] and (rec["step"] <= last["steps"][-1] or
                                               rec.get("elapsed_s", last["elapsed"]) < last["elapsed"])):
                runs.append(new_run())
            runs[-1]["elapsed"] = rec.get("elapsed_s", 0.0)
            runs[-1]["steps"].append(rec["step"])
            runs[-1]["losses"].append(rec["loss"])
            runs[-1]["lrs"].append(rec["lr"])
    return [r for r in runs if r["steps"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", help="metrics.jsonl written by train")
    ap.add_argument("output", help="PNG to write")
    ap.add_argument("--title", default="ctitan: Llama 3 debug model on Moby-Dick")
    a = ap.parse_args()
    try:
        runs = read_runs(a.metrics)
    except ValueError as e:
        print(f"plot_loss: {e}", file=sys.stderr)
        return 1
    if not runs:
        print(f"plot_loss: {a.metrics} has no records", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax2 = ax.twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(runs):
        name = "" if len(runs) == 1 else f"run {i + 1} (steps {r['steps'][0]}-{r['steps'][-1]}): "
        color = "tab:blue" if len(runs) == 1 else colors[i % len(colors)]
        ax.plot(r["steps"], r["losses"], color=color, label=name + "loss (nats/token)")
        if r["val_steps"]:
            ax.plot(r["val_steps"], r["val_losses"], "o-", color="tab:green" if len(runs) == 1 else color,
                    markersize=3, label=name + "validation loss")
        ax2.plot(r["steps"], r["lrs"], color="tab:orange" if len(runs) == 1 else color, alpha=0.6,
                 linestyle="-" if len(runs) == 1 else ":", label=name + "learning rate")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax2.set_ylabel("learning rate")
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.88), fontsize="small" if len(runs) > 1 else None)
    ax.set_title(a.title)
    fig.tight_layout()
    fig.savefig(a.output)
    points = sum(len(r["steps"]) for r in runs)
    spans = ", ".join(f"steps {r['steps'][0]}-{r['steps'][-1]} loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
                      for r in runs)
    print(f"plot_loss: wrote {a.output} ({len(runs)} run{'s' if len(runs) > 1 else ''}, {points} points: {spans})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
