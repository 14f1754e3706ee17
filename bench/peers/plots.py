"""The plots of docs/benchmarks.md (PNG, matplotlib): throughput, jobs in flight, and jobs finished after a
SIGKILL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.peers.report import DAGGER, DASH, WORKLOAD_TITLES, crash_time, gpu_runs, label, rate_stats, with_variants
from bench.peers.systems import OFFLOAD_WEBHOOKS


def plots(results: dict[str, Any], img: Path) -> list[str]:
    """PNG files written under `img` (names relative to it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    for draw in (_throughput, _in_flight, _durability):
        drawn = draw(plt, results)
        if drawn is not None:
            fig, name = drawn
            fig.savefig(img / name, dpi=110)
            plt.close(fig)
            written.append(name)
    return written


def _throughput(plt: Any, results: dict[str, Any]) -> tuple[Any, str] | None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    systems = results["systems"]
    stats = {w: rate_stats(results, w) for w in ("noop", "io")}
    if not any(stats.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(systems) + 1.6))
    for ax, (workload, title) in zip(axes, WORKLOAD_TITLES.items(), strict=True):
        names = [n for n in systems if (stats[workload].get(n) or {}).get("median") is not None]
        meds = [stats[workload][n]["median"] for n in names]
        lo = [m - stats[workload][n]["min"] for n, m in zip(names, meds, strict=True)]
        hi = [stats[workload][n]["max"] - m for n, m in zip(names, meds, strict=True)]
        ys = list(range(len(names)))[::-1]
        colors = ["#d9480f" if n.startswith("offload") else "#4263eb" for n in names]
        ax.barh(ys, meds, xerr=[lo, hi], color=colors, capsize=3, ecolor="#555555")
        ax.set_yticks(ys, [label(n) + (f" {DAGGER}" if stats[workload][n]["capped"] else "") for n in names])
        for y, m, h in zip(ys, meds, hi, strict=True):
            ax.text(m + h, y, f"  {m:,.0f}", va="center", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_title(f"{title} (median, min{DASH}max)")
        ax.set_xlabel("jobs per second, one worker process, 100 in flight")
        ax.margins(x=0.18)
    fig.tight_layout()
    return fig, "peers-throughput.png"


def _in_flight(plt: Any, results: dict[str, Any]) -> tuple[Any, str] | None:
    gpu = gpu_runs(results)
    if not gpu:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in with_variants(results["systems"]):
        runs = [r for r in gpu.get(name, []) if not r["error"] and r["samples"]]
        if not runs:
            continue
        r = runs[0]
        ts, inflight = [s[0] for s in r["samples"]], [s[1] for s in r["samples"]]
        ax.plot(
            ts,
            inflight,
            label=f"{label(name)} (peak {r['peak_in_flight']:,})",
            linewidth=2.5 if name in ("offload", OFFLOAD_WEBHOOKS) else 1.3,
        )
    ax.set_xlabel("seconds since the first enqueue")
    ax.set_ylabel("jobs in flight in the worker process")
    sample = next(iter(gpu.values()))[0]
    ax.set_title(f"{sample['n']:,} jobs of {results['params']['gpu_seconds']:g} s each, one worker process")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, "peers-inflight.png"


def _durability(plt: Any, results: dict[str, Any]) -> tuple[Any, str] | None:
    crashes = [c for c in results["crashes"] if not c["error"] and c["samples"]]
    if not crashes:
        return None
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for c in crashes:
        ax.step(
            [s[0] for s in c["samples"]],
            [s[1] for s in c["samples"]],
            where="post",
            label=f"{label(c['system'])}: {crash_time(c)}",
            linewidth=2.5 if c["system"] == "offload" else 1.3,
        )
    ax.axhline(crashes[0]["n"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("seconds since the worker was SIGKILLed (a new worker started at once)")
    ax.set_ylabel("jobs finished")
    ax.set_title(f"{crashes[0]['n']} jobs of {crashes[0]['sleep_s']:g} s, SIGKILL with jobs in flight")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig, "peers-durability.png"
