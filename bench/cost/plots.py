"""The plots of each trace (PNG, matplotlib, a dev dependency): GPU-hours rented by each policy, split into work,
boots and the rest (idle), beside the clairvoyant fleets, and each one's longest wait; and the policy sweep's
cheapest setting of each policy per wait target."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plots(doc: dict[str, Any], img: Path) -> list[str]:
    """PNG files written under `img`, one a trace (names relative to it); none without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    written = []
    for trace in doc["traces"]:
        rows = [(r["policy"], r) for r in trace["runs"]]
        rows += [(f"clairvoyant, max {n}", b) for n, b in trace["bounds"].items()]
        names = [name for name, _ in rows][::-1]
        work = [r["gpu_h_work"] for _, r in rows][::-1]
        boot = [r["boot_gpu_h"] for _, r in rows][::-1]
        rest = [max(0.0, r["gpu_h_rented"] - r["gpu_h_work"] - r["boot_gpu_h"]) for _, r in rows][::-1]
        fig, (ax, ax_wait) = plt.subplots(1, 2, figsize=(11, 0.42 * len(rows) + 1.4), width_ratios=(3, 1))
        ax.barh(names, work, label="work", color="#4c72b0")
        ax.barh(names, boot, left=work, label="boot", color="#dd8452")
        ax.barh(names, rest, left=[w + b for w, b in zip(work, boot, strict=True)], label="idle", color="#c0c0c0")
        ax.set_xlabel("GPU-hours rented")
        ax.set_title(f"{trace['name']}: {trace['about']}", fontsize=9, loc="left")
        ax.legend(loc="lower right", fontsize=8)
        ax_wait.barh(names, [r["wait_min"]["max"] for _, r in rows][::-1], color="#55a868")
        ax_wait.set_xlabel("longest wait, min")
        ax_wait.set_yticks([])
        fig.tight_layout()
        name = f"bench-cost-{trace['name']}.png"
        fig.savefig(img / name, dpi=100)
        plt.close(fig)
        written.append(name)
        if "sweep" in trace:
            written.append(sweep_plot(plt, trace, img))
    return written


def sweep_plot(plt: Any, trace: dict[str, Any], img: Path) -> str:
    """Each policy's cheapest setting per p95 wait target, in $ (a missing bar: no setting meets it)."""
    kinds = [("serverless", "serverless-only", "#dd8452"), ("fleet", "fleet-only", "#4c72b0")]
    kinds += [("hybrid", "hybrid", "#55a868"), ("bound", "offline mix bound", "#c0c0c0")]
    targets = list(trace["sweep"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, (key, label, color) in enumerate(kinds):
        xs = [t + (i - 1.5) * 0.2 for t in range(len(targets))]
        costs = [(trace["sweep"][t][key] or {}).get("cost", 0.0) for t in targets]
        ax.bar(xs, costs, width=0.2, label=label, color=color)
    ax.set_xticks(range(len(targets)), [f"p95 <= {t} min" for t in targets])
    ax.set_ylabel("$ for the trace")
    ax.set_title(f"{trace['name']}: the cheapest setting of each policy per wait target", fontsize=9, loc="left")
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"bench-cost-sweep-{trace['name']}.png"
    fig.savefig(img / name, dpi=100)
    plt.close(fig)
    return name
