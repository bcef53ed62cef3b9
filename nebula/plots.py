"""Plots a workload may want of a run: curves of metrics over steps, as PNG (matplotlib, no display)."""
from __future__ import annotations

import statistics
from pathlib import Path


def plot_curves(curves: dict[str, list[tuple[int, float]]], out: Path, title: str, ylabel: str,
                smooth: int = 1) -> Path:
    """One line per label of (step, value) points, each a moving average over `smooth` points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        steps, values = [p[0] for p in points], [p[1] for p in points]
        averaged = [statistics.fmean(values[max(0, i - smooth + 1):i + 1]) for i in range(len(values))]
        ax.plot(steps, averaged, label=label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel if smooth == 1 else f"{ylabel} (moving average of {smooth})")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def metric_curve(metrics_file: Path, key: str = "loss") -> list[tuple[int, float]]:
    """(step, value) of every step record of a stage's metrics.jsonl that has `key`."""
    from nebula.runtime.metrics import read_records
    return [(r["step"], r[key]) for r in read_records(metrics_file) if key in r]
