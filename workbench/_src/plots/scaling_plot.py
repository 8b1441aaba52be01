"""The scaling figure (throughput, speed-up, efficiency vs replicas, each with its ideal line) and
the live notebook sink that shows it growing a point per finished configuration.

Drawn on matplotlib's Agg canvas directly (never pyplot): no window, no inline-backend side
effects, safe without a frontend. The live sink updates one display handle in place
(`display(..., display_id=True)` then `handle.update(...)`); it never clears other output.
"""

from __future__ import annotations

import io

from workbench._src.plots import breakdown_plot, theme

DPI = 90


# Readable at the size a notebook shows the figure (it is scaled down to the cell's width).
FONTS = {"font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12, "legend.fontsize": 12}


def draw(study):
    """Returns a matplotlib Figure of the study's points so far (planned x-range shown at once)."""
    import matplotlib

    with theme.context(), matplotlib.rc_context(FONTS):  # the JupyterLab theme's colours
        return _draw(study)


def _draw(study):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    table = study.table
    planned = study.planned or [1]
    fig = Figure(figsize=(17, 4.2), dpi=DPI)
    FigureCanvasAgg(fig)
    ax_thr, ax_sp, ax_eff, ax_parts = fig.subplots(1, 4, gridspec_kw={"width_ratios": [1, 1, 1, 0.9]})
    xs = sorted(set(planned) | set(study.reference))
    for ax in (ax_thr, ax_sp, ax_eff):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
        ax.set_xlabel("replicas")
        ax.grid(True, alpha=0.3)
    base_n = min(planned)
    ideal_x = [n for n in xs if n >= base_n]
    if len(table):
        base = table.iloc[0]
        ideal_thr = [base["examples_per_sec"] * n / base["replicas"] for n in planned]
        ax_thr.plot(planned, ideal_thr, "--", color="grey", label="ideal")
        # p90 whisker: throughput if every step took the p90 time (slow tail).
        low = table["global_batch"] / table["step_time_p90_s"]
        ax_thr.vlines(table["replicas"], low, table["examples_per_sec"], color="C0", alpha=0.5)
        ax_thr.plot(table["replicas"], table["examples_per_sec"], "o-", color="C0", label="measured")
        ax_sp.plot(table["replicas"], table["speedup"], "o-", color="C0", label="measured")
        ax_eff.plot(table["replicas"], table["efficiency"] * 100, "o-", color="C0", label="measured")
        if "examples_per_sec_min" in table and (table.get("repeats", 1) > 1).any():  # the spread
            ax_thr.errorbar(
                table["replicas"], table["examples_per_sec"], fmt="none", ecolor="C0", capsize=4,
                yerr=[table["examples_per_sec"] - table["examples_per_sec_min"],
                      table["examples_per_sec_max"] - table["examples_per_sec"]],
            )  # fmt: skip
        if "unreliable" in table and table["unreliable"].any():  # measured on a busy machine
            bad = table[table["unreliable"].astype(bool)]
            for ax, ys in ((ax_thr, bad["examples_per_sec"]), (ax_eff, bad["efficiency"] * 100)):
                ax.plot(bad["replicas"], ys, "x", color="C3", markersize=12, mew=2, label="busy machine")
    ax_sp.plot(ideal_x, [n / base_n for n in ideal_x], "--", color="grey", label="ideal")
    ax_eff.axhline(100, ls="--", color="grey", label="ideal")
    if study.reference:
        ref_n = sorted(study.reference)
        ref_sp = [study.reference[n] for n in ref_n]
        ax_sp.plot(ref_n, ref_sp, "s:", color="C3", label=study.reference_label)
        ax_eff.plot(
            ref_n,
            [s / (n / ref_n[0]) * 100 for s, n in zip(ref_sp, ref_n)],
            "s:",
            color="C3",
            label=study.reference_label,
        )
    # examples/s over each configuration's measured run (run_stats, as its sidebar card shows);
    # the whisker reaches the throughput a p90-slow step would give.
    ax_thr.set(title="throughput (whole run; whisker: p90 step)", ylabel="examples/s")
    ax_sp.set(title=f"speed-up over {base_n} replica{'s' if base_n > 1 else ''}", ylabel="speed-up")
    # Every point stays on the figure: an efficiency above 100% (noise, or a cache effect) widens
    # the axis instead of being drawn off the top.
    top = max([110.0] + [e * 100 * 1.1 for e in table.get("efficiency", []) if e == e])
    ax_eff.set(title="efficiency", ylabel="% of ideal", ylim=(0, top))
    _draw_parts(ax_parts, table)
    ax_thr.set_xticks(planned, [str(x) for x in planned])
    ax_thr.set_xlim(min(planned) / 1.3, max(planned) * 1.3)
    ax_sp.set_yscale("log", base=2)  # ideal speed-up is then a straight diagonal
    ax_sp.yaxis.set_major_formatter(_plain_formatter())
    labels: dict = {}  # one legend for the three panels, without duplicates
    for ax in (ax_thr, ax_sp, ax_eff):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(
        labels.values(),
        labels.keys(),
        loc="upper center",
        ncol=len(labels),
        fontsize=12,
        bbox_to_anchor=(0.5, 0.94),
        frameon=False,
    )
    done = len(table)
    fig.suptitle(f"{study.title}  ({done}/{len(planned)} configurations)", fontsize=14)
    note = _note(table)
    if note:
        fig.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=11, color="#a00000", wrap=True)
    fig.tight_layout(rect=(0, 0.07 if note else 0, 1, 0.88))
    return fig


def _draw_parts(ax, table) -> None:
    """Where a step's time goes at each configuration (the slowest worker's), stacked."""
    columns = [f"{p}_s" for p in breakdown_plot.PARTS]
    ax.set_title("step time: where it goes")
    if not len(table) or not all(c in table for c in columns) or table[columns].isna().all().all():
        ax.text(0.5, 0.5, "no breakdown measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        return
    rows = [{p: row[f"{p}_s"] for p in breakdown_plot.PARTS} for _, row in table.iterrows()]
    breakdown_plot.draw_stacked(ax, [str(int(n)) for n in table["replicas"]], rows)
    ax.set_xlabel("replicas")
    ax.legend(fontsize=9, loc="upper left")


def _plain_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


def _note(table) -> str:
    busy = ""
    if len(table) and "unreliable" in table and table["unreliable"].any():
        ns = ", ".join(str(int(n)) for n in table.loc[table["unreliable"].astype(bool), "replicas"])
        busy = f"UNRELIABLE at n={ns}: other processes or CPU steal during the measurement (x). "
    if not len(table) or "shared_cores" not in table or not table["shared_cores"].any():
        return busy.strip()
    cores = int(table["physical_cores"].iloc[0])
    most = int(table["replicas"].max())
    what = (
        "worker processes on one machine"
        if (table["devices_kind"] == "CPU process").any()
        else "virtual CPU devices"
    )
    return busy + (
        f"NOTE: replicas are {what} sharing {cores} physical core(s) (up to {most} "
        "replicas on them): this shows distribution overhead, not the speed-up of real devices."
    )


def png_bytes(study) -> bytes:
    buf = io.BytesIO()
    draw(study).savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()
