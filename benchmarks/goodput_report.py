"""The tables and the chart of ``benchmarks/goodput.py``: per economy, each system's interval,
time to first step and loss per failure, and goodput side by side."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from goodput_runs import FRESH, MODES, NAMES, SHORT
from report import figure, markdown_table


def summary(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per system: medians of each part of a failure, the expected loss, the checkpoint-
    attributable loss and goodput (``lost``, ``expected``, ``attributable`` in seconds)."""
    cal, runs = results["calibration"], results["failures"]
    step = cal["none"]["step_seconds"]
    base = statistics.median(f["relaunch"] for f in results["relaunch_alone"]["failures"])
    out = {}
    for system, r in runs.items():
        parts = {
            part: statistics.median(f[part] for f in r["failures"])
            for part in ("relaunch", "restore", "recompute", "lost", "load")
        }
        # A replaced node restores what the shared tier holds: a save there is on average half
        # an interval old when the kill comes, plus the time its copy took to commit there.
        recompute = r["interval"] / 2 * step + (r.get("copy_lag_median") or 0.0)
        out[system] = {
            **parts,
            "lost_max": max(f["lost"] for f in r["failures"]),
            "expected": parts["relaunch"] + parts["restore"] + recompute,
            "attributable": parts["relaunch"] - base + parts["restore"] + recompute,
            "added_to_relaunch": parts["relaunch"] - base,
            "goodput": r.get("failure_free_seconds", results.get("failure_free_seconds", 0))
            / r["seconds"],
        }
    return out


def table(results: dict[str, Any]) -> str:
    cal, runs = results["calibration"], results["failures"]
    sums = summary(results)

    def versus(system: str, key: str) -> str:
        if "dcp-disk" not in sums or not sums["dcp-disk"][key]:
            return "-"
        return f"{sums[system][key] / sums['dcp-disk'][key]:.2f}"

    def measured(system: str) -> tuple[str, str]:
        c = cal[system]
        tried = ", ".join(f"{v['interval']}: {v['overhead']:.1%}" for v in c.get("verified", []))
        overhead = c.get("measured_overhead")
        return (
            f"{c.get('estimated_interval', c['interval'])}; measured {tried or '-'}",
            "not measured" if overhead is None else f"{overhead:.1%}",
        )

    rows = []
    for system, r in runs.items():
        s = sums[system]
        tried, overhead = measured(system)
        rows.append(
            (
                NAMES[system],
                MODES[r["mode"]],
                f"{r['interval']} ({tried})",
                f"{cal[system]['overhead_per_save_seconds']:.2f}",
                overhead,
                f"{r['blocking_median']:.3f} / {r['blocking_max']:.3f}",
                f"{s['lost']:.1f} / {s['lost_max']:.1f}",
                f"{s['relaunch']:.1f} / {s['restore']:.2f} / {s['recompute']:.1f}",
                f"{s['expected']:.1f}",
                f"{s['attributable']:.1f}",
                f"{versus(system, 'lost')} / {versus(system, 'expected')} / "
                f"{versus(system, 'attributable')}",
                f"{s['load']:.2f}",
                f"{s['goodput']:.2f}",
            )
        )
    main = markdown_table(
        (
            "system",
            "saves with",
            "interval (steps) (estimate; measured overhead at each)",
            "overhead per save (s)",
            "overhead at the interval",
            "blocking per save, median / max (s)",
            "lost per failure, median / max (s)",
            "relaunch / restore / recompute (s)",
            "lost, expected (s)",
            "checkpoint-attributable, expected (s)",
            "/ DCP disk: lost / expected / attributable",
            "dcp.load (s)",
            "goodput",
        ),
        rows,
    )
    modes = markdown_table(
        (
            "system",
            "saves with",
            "overhead per save (s)",
            "in flight per save (s)",
            "blocking per save, median / max (s)",
        ),
        (
            (
                NAMES[case.partition("/")[0]],
                MODES[case.partition("/")[2]],
                f"{c['overhead_per_save_seconds']:.2f}",
                f"{c.get('in_flight_seconds', float('nan')):.2f}",
                f"{c['blocking_median']:.3f} / {c['blocking_max']:.3f}",
            )
            for case, c in cal.items()
            if "/" in case
        ),
    )
    base = statistics.median(f["relaunch"] for f in results["relaunch_alone"]["failures"])
    lags = [
        f"{NAMES[system]}: {r['copies']} of {r['saves']} saves reached "
        f"{'the peers' if system == 'tiers-peers' else 'the shared tier'}, "
        f"{r['copy_lag_median']:.1f} s after their step (median; max {r['copy_lag_max']:.1f} s); "
        f"a replaced node resumed "
        f"{statistics.median(f['step_reached'] - f['resumed_from_step'] for f in r['failures']):g}"
        " steps behind the step it had reached (median)."
        for system, r in runs.items()
        if r.get("copy_lag_median") is not None
    ]
    return "\n\n".join(
        [
            f"**{results['label']}**",
            main,
            *lags,
            f"Relaunch of the job that never checkpoints (the part no system can avoid): "
            f"{base:.2f} s, median of {len(results['relaunch_alone']['failures'])}. Kills, "
            "seconds after launch (each due an interval plus the slowest restart after the "
            "one before, and made once the job was back with a newer save committed and, "
            "where the store it restores from had fresh memory, steady): "
            + "; ".join(
                f"{NAMES.get(s, s)} "
                + ", ".join(f"{f['killed_at']:.0f}" for f in r.get("failures", []))
                for s, r in runs.items()
            )
            + ".",
            modes,
            first_step_table(results["first_step"]),
        ]
    )


def side_by_side(all_results: dict[str, Any]) -> str:
    """The headline: each system in each economy, expected loss and checkpoint-attributable
    loss per failure, and the ratio to DCP on disk with a cold cache."""
    names = list(all_results)
    sums = {e: summary(r) for e, r in all_results.items()}
    systems = list(dict.fromkeys(s for r in all_results.values() for s in r["failures"]))

    def cell(e: str, system: str) -> str:
        s, d = sums[e].get(system), sums[e].get("dcp-disk")
        if s is None:
            return "-"
        r = all_results[e]["failures"][system]["interval"]
        ratio = (
            f" ({s['expected'] / d['expected']:.2f}x; {s['attributable'] / d['attributable']:.2f}x)"
            if d and system != "dcp-disk" and d["attributable"] > 0
            else ""
        )
        return (
            f"every {r}; {s['expected']:.1f} s / {s['attributable']:.1f} s{ratio}; "
            f"goodput {s['goodput']:.2f}"
        )

    return markdown_table(
        ("system", *(f"{e}: interval; lost expected / checkpoint-attributable" for e in names)),
        ((SHORT[system], *(cell(e, system) for e in names)) for system in systems),
    )


def first_step_table(firsts: dict[str, list[float]]) -> str:
    fresh = statistics.median(firsts[FRESH])
    return markdown_table(
        ("start", "time to first step (s), median / max", "/ fresh start"),
        (
            (name, f"{med:.2f} / {max(v):.2f}", f"{med / fresh:.2f}")
            for name, v in firsts.items()
            for med in [statistics.median(v)]
        ),
    )


def interval_table(cal: dict[str, Any], systems: list[str]) -> str:
    """Phase 1 alone: each system's mode, estimate, and the overhead at each interval tried."""
    return markdown_table(
        (
            "system",
            "saves with",
            "overhead per save (s)",
            "in flight (s)",
            "estimated interval",
            "measured",
        ),
        (
            (
                NAMES[s],
                MODES[cal[s]["mode"]],
                f"{cal[s]['overhead_per_save_seconds']:.2f}",
                f"{cal[s].get('in_flight_seconds', float('nan')):.2f}",
                cal[s]["estimated_interval"],
                ", ".join(f"{v['interval']}: {v['overhead']:.1%}" for v in cal[s]["verified"]),
            )
            for s in systems
        ),
    )


def chart(all_results: dict[str, Any], path: Path) -> None:
    rows = len(all_results)
    shape = {"nrows": rows, "ncols": 2, "figsize": (12, 3.6 * rows), "squeeze": False}
    shape["gridspec_kw"] = {"width_ratios": [3, 1.2]}
    with figure(path, **shape) as (_, axes):
        for (ax, gx), (economy, results) in zip(axes, all_results.items(), strict=True):
            sums = summary(results)
            names = [SHORT[s] for s in sums]
            parts = ["relaunch", "restore", "recompute"]
            bottom = [0.0] * len(sums)
            for part, colour in zip(parts, ["#999999", "#4477aa", "#ee6677"], strict=True):
                values = [s[part] for s in sums.values()]
                ax.barh(names, values, left=bottom, color=colour, label=part)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.invert_yaxis()
            ax.set_title(f"{economy}: training time lost per failure, median (s)", fontsize=10)
            ax.legend(loc="lower right")
            gx.barh(names, [s["goodput"] for s in sums.values()], color="#228833")
            gx.invert_yaxis()
            gx.set_yticklabels([])
            gx.set_xlim(0, 1)
            gx.set_title("goodput", fontsize=10)


def report(results: dict[str, Any]) -> str:
    return "\n\n".join([side_by_side(results), *(table(r) for r in results.values())])
