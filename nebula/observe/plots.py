"""Plots a workload may want of a run: curves of metrics over steps, as PNG (matplotlib, no display)."""
from __future__ import annotations

import statistics
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from nebula.runtime.records import read_records

Curves = dict[str, list[tuple[int, float]]]  # label -> (step, value) points


def plot_curves(curves: Curves, out: Path, title: str, ylabel: str, smooth: int = 1,
                marks: dict[str, float] | None = None) -> Path:
    """One line per label of (step, value) points, each a moving average over `smooth` points;
    `marks` (label -> step) draws a labelled vertical line at each, e.g. where a run changed sites."""
    return plot_panels({ylabel: curves}, out, title, smooth, marks)


def plot_panels(panels: dict[str, Curves], out: Path, title: str, smooth: int = 1,
                marks: dict[str, float] | None = None) -> Path:
    """plot_curves with one panel per y label (stacked, sharing the step axis): for metrics whose
    scales differ, such as the losses of two stages."""
    fig = Figure(figsize=(7, 1.5 + 3 * len(panels)))  # no pyplot: no display, no global figure state
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)
    for ax, (ylabel, curves) in zip(axes[:, 0], panels.items()):
        _draw(ax, curves, ylabel, smooth, marks or {})
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _draw(ax: Axes, curves: Curves, ylabel: str, smooth: int, marks: dict[str, float]) -> None:
    for label, points in curves.items():
        steps, values = [p[0] for p in points], [p[1] for p in points]
        averaged = [statistics.fmean(values[max(0, i - smooth + 1):i + 1]) for i in range(len(values))]
        ax.plot(steps, averaged, label=label, linewidth=1.2)
    for label, step in marks.items():
        ax.axvline(step, color="black", linestyle="--", linewidth=0.9, label=label)
    ax.set_ylabel(ylabel if smooth == 1 else f"{ylabel} (moving average of {smooth})")
    ax.legend(fontsize=7)


def metric_curve(metrics_file: Path, key: str = "loss") -> list[tuple[int, float]]:
    """(step, value) of every step record of a stage's metrics.jsonl that has `key`."""
    return [(r["step"], r[key]) for r in read_records(metrics_file) if key in r]
