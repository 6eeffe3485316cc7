"""Training-dynamics plots like the paper's Fig. 3: one line per run, smoothed, raw data faint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

PANELS = [
    ("entropy", "token entropy (nats)"),
    ("reward", "training reward"),
    ("full_solve", "full-solve ratio"),
    ("len/mean", "response length (tokens)"),
]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window >= 1); the first points average what exists."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_dynamics(runs: dict[str, list[list[dict]]], out_base: Path, h_tgt: Optional[float] = None,
                  eval_key: Optional[str] = None, window: int = 10) -> list[Path]:
    """Plot metric rows (metrics.jsonl) per label: each run's raw values faint, the smoothed mean
    over the label's runs (seeds) solid. `runs` maps a label to one or more runs' rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(PANELS)
    if eval_key is None:
        keys = {k for group in runs.values() for rows in group for r in rows for k in r
                if k.startswith("eval/") and k.endswith("/acc")}
        eval_key = sorted(keys)[0] if keys else None
    if eval_key:
        panels.append((eval_key, f"evaluation accuracy ({eval_key.split('/')[1]})"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes, panels):
        for ci, (label, group) in enumerate(runs.items()):
            c = colors[ci % len(colors)]
            by_step: dict[int, list[float]] = {}
            for rows in group:
                pts = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                if not key.startswith("eval/"):
                    ax.plot(xs, ys, color=c, alpha=0.2, linewidth=0.7)
                for x, y in pts:
                    by_step.setdefault(x, []).append(y)
            if not by_step:
                continue
            xs = sorted(by_step)
            ys = [sum(by_step[x]) / len(by_step[x]) for x in xs]
            n = len(group)
            name = f"{label} (mean of {n})" if n > 1 else label
            if key.startswith("eval/"):
                ax.plot(xs, ys, marker="o", color=c, label=name)
            else:
                ax.plot(xs, smooth(ys, window), color=c, label=name, linewidth=1.8)
        if key == "entropy" and h_tgt is not None:
            ax.axhline(h_tgt, color="k", linestyle="--", linewidth=1, label=f"H_tgt = {h_tgt:g}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out_base.parent.mkdir(parents=True, exist_ok=True)
    paths = [out_base.with_suffix(".png"), out_base.with_suffix(".svg")]
    for p in paths:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return paths
