"""The routing-quality figure: one panel per metric, bars per contender grouped by workload.

Error bars span the min-max over repeats (the spread the fairness rules ask to report); the oracle's
bars are hatched because its TTFT and throughput come from one core and compare only in hit rate.

Usage on its own: ``.venv/bin/python benchmarks/routing/plot.py benchmarks/results/routing_quality.json``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PANELS = (
    ("hit_rate", "prefix-cache hit rate (%)", 100.0),
    ("ttft_mean_ms", "mean TTFT (ms)", 1.0),
    ("ttft_p90_ms", "p90 TTFT (ms)", 1.0),
    ("requests_per_s", "throughput (requests/s)", 1.0),
    ("imbalance", "load imbalance (max / mean requests)", 1.0),
)


def contender_order(summary: dict) -> list[str]:
    """Every contender that appears in any workload, in first-seen order (the oracle last)."""
    names: list[str] = []
    for by_contender in summary.values():
        for name in by_contender:
            if name not in names:
                names.append(name)
    return sorted(names, key=lambda n: n.startswith("oracle"))


def bar_values(summary: dict, workloads: list[str], name: str, key: str, scale: float):
    """(means, [lower errors, upper errors]) for one contender's bars across workloads (0 if absent)."""
    means, low, high = [], [], []
    for workload in workloads:
        stat = summary[workload].get(name, {}).get(key)
        if not isinstance(stat, dict):
            means.append(0.0)
            low.append(0.0)
            high.append(0.0)
            continue
        means.append(stat["mean"] * scale)
        # max(0, ...): equal runs give a mean a rounding error outside [min, max]
        low.append(max(0.0, (stat["mean"] - stat["min"]) * scale))
        high.append(max(0.0, (stat["max"] - stat["mean"]) * scale))
    return means, [low, high]


def plot(summary: dict, path: Path) -> None:
    """Write the figure for `summary` (quality.summarise's shape) to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(summary)
    names = contender_order(summary)
    width = 0.8 / max(1, len(names))
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(max(8, 2.2 * len(workloads) + 4), 3.2 * len(PANELS)))
    colours = plt.get_cmap("tab10")
    for ax, (key, label, scale) in zip(axes, PANELS, strict=True):
        for index, name in enumerate(names):
            means, errors = bar_values(summary, workloads, name, key, scale)
            positions = [w + (index - (len(names) - 1) / 2) * width for w in range(len(workloads))]
            ax.bar(
                positions, means, width, yerr=errors, capsize=3, label=name, color=colours(index % 10),
                hatch="//" if name.startswith("oracle") else None,
            )  # fmt: skip
        ax.set_ylabel(label)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=min(4, len(names)), loc="upper left", bbox_to_anchor=(0, 1.35))
    axes[-1].set_xlabel("workload")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    plot(json.loads(source.read_text())["summary"], source.with_suffix(".png"))
