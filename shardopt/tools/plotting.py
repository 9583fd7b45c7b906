"""PNG charts for `shardopt tune`, `shardopt bench` and the benchmark reports (matplotlib, optional)."""
from __future__ import annotations

from typing import Sequence


def require_matplotlib():
    """matplotlib.pyplot on the non-interactive Agg backend, or an error saying how to install it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("writing PNG charts needs matplotlib, which is not installed: "
                          "pip install matplotlib (or pip install 'shardopt[bench]')") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_chart(path: str, title: str, xlabel: str, ylabel: str, series: dict[str, Sequence[tuple[float, float]]],
               logx: bool = False, mark: tuple[float, float] | None = None) -> None:
    """One line per series of (x, y) points; `mark` circles one point (e.g. the recommendation)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    if mark is not None:
        ax.plot([mark[0]], [mark[1]], marker="o", markersize=14, markerfacecolor="none", color="red",
                label="recommended")
    if logx:
        ax.set_xscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_panels(path: str, title: str, labels: Sequence[str], panels: Sequence[tuple[str, dict[str, Sequence]]],
               reference: dict[int, float] | None = None) -> None:
    """Side-by-side horizontal bar panels sharing the row labels: `panels` are (x label, {series: a value
    per label, None for "error"}), `reference` maps a panel to an x drawn dashed (e.g. 1.0 for "x DDP")."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 0.45 * len(labels) + 1.6), sharey=True)
    axes = list(axes) if len(panels) > 1 else [axes]
    for i, (ax, (xlabel, series)) in enumerate(zip(axes, panels)):
        height = 0.8 / max(1, len(series))
        for s, (name, values) in enumerate(series.items()):
            ys = [r + s * height for r in range(len(labels))]
            ax.barh(ys, [v if v is not None else 0 for v in values], height=height, label=name)
            for y, v in zip(ys, values):
                if v is None:
                    ax.text(0, y, " error", va="center", fontsize=8, color="firebrick")
        if reference and i in reference:
            ax.axvline(reference[i], color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    axes[0].set_yticks([r + 0.4 - 0.4 / max(1, len(panels[0][1])) for r in range(len(labels))])
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
