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


def save_figure(fig, out_base: Path) -> list[Path]:
    """Write a matplotlib figure as out_base.png and out_base.svg (tight layout), close it; the paths."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_base.parent.mkdir(parents=True, exist_ok=True)
    paths = [out_base.with_suffix(".png"), out_base.with_suffix(".svg")]
    for p in paths:
        fig.savefig(p, dpi=120)
    plt.close(fig)
    return paths


def _step_axis(ax) -> None:
    """An x axis of training steps: labelled, ticked at whole steps (a 2-step run read 1.0, 1.2, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window >= 1); the first points average what exists."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def smoothing_window(steps: int, window: int = 10) -> int:
    """The trailing window actually used for a run of `steps` steps: at most `window`, and at most a tenth
    of the run (a 3-step run is drawn unsmoothed; 30 steps with a 3-step mean)."""
    return max(1, min(window, steps // 10))


STARE_PANEL = ("stare/sel_pos", "STARE: L+ share of valid tokens (x: gate on)")


def dynamics_panels(runs: dict[str, list[list[dict]]], eval_key: Optional[str] = None) -> list[tuple[str, str]]:
    """The panels of a dynamics plot, (metric key, title): the four of PANELS, STARE's selected share with
    its gate when a run logged it, then the evaluation accuracy (`eval_key`, else the first one logged)."""
    logged = {k for group in runs.values() for rows in group for r in rows for k in r}
    panels = list(PANELS) + ([STARE_PANEL] if STARE_PANEL[0] in logged else [])
    if eval_key is None:
        keys = sorted(k for k in logged if k.startswith("eval/") and k.endswith("/acc"))
        eval_key = keys[0] if keys else None
    if eval_key:
        panels.append((eval_key, f"evaluation accuracy ({eval_key.split('/')[1]})"))
    return panels


def plot_dynamics(runs: dict[str, list[list[dict]]], out_base: Path, h_tgt: Optional[float] = None,
                  eval_key: Optional[str] = None, window: int = 10) -> list[Path]:
    """Plot metric rows (metrics.jsonl) per label: each run's raw values (thin), and the mean over the
    label's runs (seeds) as a trailing moving average (thick) whose window the legend states
    (`smoothing_window`); evaluation points as markers from step 0, on a 0-1 axis. `runs` maps a label
    to one or more runs' rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dynamics_panels(runs, eval_key)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    steps = max((r.get("step", 0) for group in runs.values() for rows in group for r in rows), default=0)
    w = smoothing_window(steps, window)
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
                    ax.plot(xs, ys, color=c, alpha=0.45 if w > 1 else 1.0, linewidth=0.8)
                if key == STARE_PANEL[0]:  # the steps whose update the weights entered (the gate on)
                    on = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r.get("stare/gate")]
                    if on:
                        ax.scatter(*zip(*on), marker="x", s=14, color=c, linewidths=0.8)
                for x, y in pts:
                    by_step.setdefault(x, []).append(y)
            if not by_step:
                continue
            xs = sorted(by_step)
            ys = [sum(by_step[x]) / len(by_step[x]) for x in xs]
            n = len(group)
            mean_of = f"mean of {n} runs" if n > 1 else ""
            if key.startswith("eval/"):
                ax.plot(xs, ys, marker="o", color=c, label=f"{label}" + (f" ({mean_of})" if mean_of else ""))
            elif w > 1:
                ax.plot(xs, smooth(ys, w), color=c, linewidth=1.8,
                        label=f"{label}: {w}-step trailing mean" + (f" of the {mean_of}" if mean_of else "")
                        + "; thin: each step")
            elif n > 1:
                ax.plot(xs, ys, color=c, linewidth=1.8, label=f"{label}: {mean_of}; thin: each run")
            else:
                ax.lines[-1].set_label(f"{label} (each step, unsmoothed)")
        if key == "entropy" and h_tgt is not None:
            ax.axhline(h_tgt, color="k", linestyle="--", linewidth=1, label=f"H_tgt = {h_tgt:g}")
        if key.startswith("eval/"):
            ax.set_ylim(0, 1)  # accuracy as a fraction: a few points of difference look like a few points
        ax.set_title(title)
        _step_axis(ax)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, out_base)


def plot_evals_over_training(evaluations: dict[str, dict[str, dict]], out_base: Path) -> list[Path]:
    """pass@1 and pass@N against the training step, per benchmark and method: the mean over seeds
    with its interval shaded (`seeds_summary`'s: 95% t for 3+ seeds, the range for 2, none for one). `evaluations` maps a method to `sweep.eval_summary`'s output
    ('<bench> n=<N> step=<S>' -> metric -> {'mean', 'ci95'}). Only protocols evaluated at two or
    more steps are drawn; returns [] when there are none."""
    series: dict[tuple[str, int], dict[str, dict[int, dict]]] = {}  # (bench, n) -> method -> step -> metrics
    for method, per_key in evaluations.items():
        for key, metrics in per_key.items():
            bench, n, step = key.split()[:3]  # a '[field=value, ...]' tail: the same series' other protocol
            if step[5:].isdigit():
                series.setdefault((bench, int(n[2:])), {}).setdefault(method, {})[int(step[5:])] = metrics
    series = {k: v for k, v in series.items() if any(len(steps) > 1 for steps in v.values())}
    if not series:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(4.4 * len(series), 3.4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, ((bench, n), methods) in zip(axes[0], sorted(series.items())):
        for ci, (method, steps) in enumerate(methods.items()):
            xs = sorted(steps)
            for metric, style in (("pass@1", "-"), (f"pass@{n}", "--")):
                pts = [(x, steps[x][metric]) for x in xs if metric in steps[x]]
                if not pts or (metric != "pass@1" and n == 1):
                    continue
                px = [x for x, _ in pts]
                ax.plot(px, [m["mean"] for _, m in pts], style, marker="o", markersize=3,
                        color=colors[ci % len(colors)], label=f"{method} {metric}")
                band = [(x, m["ci95"]) for x, m in pts if m.get("ci95")]  # none for one seed
                if band:
                    ax.fill_between([x for x, _ in band], [c[0] for _, c in band], [c[1] for _, c in band],
                                    color=colors[ci % len(colors)], alpha=0.15, linewidth=0)
        ax.set_title(f"{bench} (n={n})")
        _step_axis(ax)
        ax.set_ylabel("%")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # each panel its own: its pass@N differs from the others'
            ax.legend(fontsize=7)
    return save_figure(fig, out_base)


def plot_run(run_dir: Path) -> list[Path]:
    """A training run's own dynamics plot (entropy, reward, length, held-out accuracy from step 0) at
    run_dir/plots/dynamics.png and .svg, H_tgt from its config when the method has one."""
    import json

    import yaml

    from stare_cli.core.runs import with_eval_points

    run_dir = Path(run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = with_eval_points(run_dir, rows)  # step 0's evaluation
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    method = cfg.get("method", {})
    h_tgt = method.get("stare", {}).get("h_tgt") if method.get("name", "").startswith("stare") else None
    return plot_dynamics({method.get("name", "run"): [rows]}, run_dir / "plots" / "dynamics", h_tgt=h_tgt)
