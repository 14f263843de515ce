"""The evaluation report: report.json (everything measured), report.md (a readable summary: its first line the
gate's verdict, τ and the speed-up at each concurrency) and PNG charts (per-position acceptance; τ and speed-up
against k; with --concurrency, tokens/s and speed-up against concurrency), written atomically into the output
directory. The charts need
matplotlib (the `report` extra, which an install beside vLLM does not bring): without it the report is written
without them and says, in report.md and in one line, how to get them."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from draftsmith.core.fsio import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
)

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
ACCEPTANCE_PNG = "acceptance_per_position.png"
TAU_PNG = "tau_speedup_vs_k.png"
CONCURRENCY_PNG = "speedup_vs_concurrency.png"
CHARTS_HINT = "charts need matplotlib: pip install 'draftsmith[report]' (or matplotlib), then evaluate again"


def charts_available() -> bool:
    """matplotlib can be imported here (the `report` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return buf.getvalue()


def acceptance_chart(runs: list[dict], title: str) -> bytes:
    """Grouped bars: acceptance rate at each draft position, one colour per k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(runs))
    for j, run in enumerate(runs):
        rates = run["acceptance_per_pos"]
        xs = [i + 1 + (j - (len(runs) - 1) / 2) * width for i in range(len(rates))]
        ax.bar(xs, rates, width=width, label=f"k={run['k']} (τ={run['tau']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (fraction of rounds)")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, max(len(r["acceptance_per_pos"]) for r in runs) + 1))
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    data = _png(fig)
    plt.close(fig)
    return data


def tau_speedup_chart(runs: list[dict], title: str) -> bytes:
    """τ (left axis) and speed-up over the target alone (right axis) against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["k"] for r in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, [r["tau"] for r in runs], "o-", color="tab:blue", label="τ (mean acceptance length)")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("τ", color="tab:blue")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    speedups = [r.get("speedup") for r in runs]
    if any(s is not None for s in speedups):
        ax2 = ax.twinx()
        ax2.plot(
            ks, [s if s is not None else float("nan") for s in speedups], "s--", color="tab:orange", label="speed-up"
        )
        ax2.axhline(1.0, color="tab:orange", alpha=0.3, lw=1)
        ax2.set_ylabel("speed-up vs target alone", color="tab:orange")
    ax.set_title(title)
    data = _png(fig)
    plt.close(fig)
    return data


def concurrency_chart(sweep: dict[str, Any], title: str) -> bytes:
    """Output tokens/s with the draft and with the target alone (left axis) and the speed-up (right) against the
    concurrency, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep["rows"]
    cs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(cs, [r["draft"]["output_throughput"] for r in rows], "o-", color="tab:blue", label="with the draft")
    ax.plot(cs, [r["target_alone"]["output_throughput"] for r in rows], "o:", color="tab:gray", label="target alone")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    speedups = [r["speedup"] or float("nan") for r in rows]
    ax2.plot(cs, speedups, "s--", color="tab:orange")
    ax2.axhline(1.0, color="tab:orange", alpha=0.4, lw=1)  # below it the draft costs more than it saves
    ax2.set_ylim(0, max([1.25, *(1.15 * s for s in speedups if s == s)]))
    ax2.set_ylabel(f"speed-up (k={sweep['k']})", color="tab:orange")
    ax.set_title(title)
    data = _png(fig)
    plt.close(fig)
    return data


def speedup_line(sweep: dict[str, Any]) -> str:
    """'1.31x at 1, 1.02x at 4, 0.93x at 16: stops paying at 16' (the summary's and the report's first line)."""
    parts = [
        f"{r['speedup']:.2f}x at {r['concurrency']}" if r["speedup"] is not None else f"– at {r['concurrency']}"
        for r in sweep["rows"]
    ]
    stop = sweep.get("stops_paying_at")
    return ", ".join(parts) + (f": stops paying at {stop}" if stop else ": pays at every concurrency measured")


def several_segments(run: dict) -> bool:
    """The run's rounds fall in more than one segment (reasoning, content, tool call): worth showing apart."""
    return sum(bool(c["rounds"]) for c in (run.get("by_segment") or {}).values()) > 1


def markdown(report: dict[str, Any], charts: bool = True) -> str:
    base = report.get("baseline")
    lines = [f"# Speculative decoding: {report['engine']} engine", ""]
    gate = report.get("gate")
    sweep = report.get("concurrency")
    # the first line: what a pipeline reading this report decides on, τ, and whether the draft pays where it is served
    headline = [f"**Gate: {'passed' if gate['passed'] else 'FAILED'}**"] if gate else []
    if report["runs"]:
        headline.append("τ " + ", ".join(f"{r['tau']:.2f} at k={r['k']}" for r in report["runs"]))
    if sweep:
        headline.append(f"speed-up by concurrency (k={sweep['k']}): {speedup_line(sweep)}")
    lines += [" · ".join(headline), ""]
    if gate:
        for check in gate["checks"]:
            lines.append(f"- {check['verdict']}")
        lines += ["", "| k | position | reference decoder | vLLM | allowed gap | agrees |", "|---|---|---|---|---|---|"]
        for check in gate["checks"]:
            for p in check["positions"]:
                lines.append(
                    f"| {check['k']} | {p['position']} | {p['reference']:.3f} | {p['served']:.3f} | "
                    f"{p['allowed']:.3f} | {'yes' if p['agrees'] else 'NO'} |"
                )
        lines.append("")
    lines += [
        f"- target: `{report['target']}`",
        f"- draft: `{report['draft']}`",
        f"- prompts: {report['prompts']} ({report['num_prompts']} prompts), max {report['max_new_tokens']} new tokens, "
        f"temperature {report['temperature']}",
    ]
    if report.get("vllm_version"):
        lines.append(f"- vLLM {report['vllm_version']}")
    if base:
        lines.append(
            f"- target alone: {base['tokens_per_s']:.1f} tokens/s ({base['num_new_tokens']} tokens in "
            f"{base['elapsed_s']:.1f} s)"
        )
    lines += [
        "",
        "| k | τ | τ 95 % interval (over prompts) | acceptance per position | tokens/s | speed-up | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        per_pos = ", ".join(f"{a:.2f}" for a in r["acceptance_per_pos"])
        speedup = f"{r['speedup']:.2f}×" if r.get("speedup") is not None else "–"
        interval = f"{r['tau_95'][0]:.3f} – {r['tau_95'][1]:.3f}" if r.get("tau_95") else "–"
        lines.append(
            f"| {r['k']} | {r['tau']:.3f} | {interval} | {per_pos} | {r['tokens_per_s']:.1f} | {speedup} | "
            f"{r['num_rounds']} |"
        )
    split = [r for r in report["runs"] if several_segments(r)]
    if split:
        lines += [
            "",
            "By what the target was writing (a round counts where its first new token falls):",
            "",
            "| k | segment | rounds | τ | acceptance per position |",
            "|---|---|---|---|---|",
        ]
        for r in split:
            for name, c in r["by_segment"].items():
                if c["rounds"]:
                    per_pos = ", ".join(f"{a:.2f}" for a in c["acceptance_per_pos"])
                    lines.append(f"| {r['k']} | {name} | {c['rounds']} | {c['tau']:.3f} | {per_pos} |")
    if report.get("lossless") is not None:
        lines += ["", f"Greedy outputs identical to the target alone: {report['lossless']}"]
    if sweep:
        lines += [
            "",
            f"Through the server (`draftsmith serve`, {sweep['load_generator']}; the draft at k={sweep['k']}, then the "
            f"target alone; {sweep['dtype']}, up to {sweep['max_new_tokens']} new tokens a request):",
            "",
            "| concurrency | requests | tokens/s target alone | tokens/s with draft | speed-up | ITL ms alone | "
            "ITL ms with draft | TTFT ms alone | TTFT ms with draft | τ served | identical outputs |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sweep["rows"]:
            d, a = r["draft"], r["target_alone"]
            tau = d.get("spec_decode_acceptance_length")
            lines.append(
                f"| {r['concurrency']} | {r['requests']} | {a['output_throughput']:.1f} | "
                f"{d['output_throughput']:.1f} | {_times(r['speedup'])} | {a['mean_itl_ms']:.1f} | "
                f"{d['mean_itl_ms']:.1f} | {a['mean_ttft_ms']:.0f} | {d['mean_ttft_ms']:.0f} | "
                f"{f'{tau:.2f}' if tau else '–'} | {r['identical_outputs']} |"
            )
    lines += [
        "",
        "τ = 1 + accepted draft tokens / rounds (vLLM's mean acceptance length); its interval is a "
        "bootstrap over the prompts (2,000 resamples).",
        "",
    ]
    lines += (
        [f"![acceptance per position]({ACCEPTANCE_PNG})", "", f"![τ and speed-up against k]({TAU_PNG})", ""]
        + ([f"![speed-up against concurrency]({CONCURRENCY_PNG})", ""] if sweep else [])
        if charts
        else [f"No charts: {CHARTS_HINT}.", ""]
    )
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return f"{ratio:.2f}×" if ratio is not None else "–"


def write_report(output: Path, report: dict[str, Any]) -> dict[str, Path]:
    """Write report.json, report.md and, where matplotlib is installed, the two charts; returns their paths (no
    chart paths without matplotlib)."""
    output = Path(output)
    title = f"{Path(str(report['draft'])).name} on {Path(str(report['target'])).name} ({report['engine']})"
    charts = charts_available()
    paths = {"json": output / REPORT_JSON, "markdown": output / REPORT_MD}
    atomic_write_json(paths["json"], report)
    atomic_write_text(paths["markdown"], markdown(report, charts))
    if charts:
        paths.update(acceptance_chart=output / ACCEPTANCE_PNG, tau_chart=output / TAU_PNG)
        atomic_write_bytes(paths["acceptance_chart"], acceptance_chart(report["runs"], title))
        atomic_write_bytes(paths["tau_chart"], tau_speedup_chart(report["runs"], title))
        if report.get("concurrency"):
            paths["concurrency_chart"] = output / CONCURRENCY_PNG
            served = f"{Path(str(report['draft'])).name} on {Path(str(report['target'])).name} (draftsmith serve)"
            atomic_write_bytes(paths["concurrency_chart"], concurrency_chart(report["concurrency"], served))
    return paths


def read_report(path: Path) -> dict[str, Any]:
    path = Path(path)
    return json.loads((path / REPORT_JSON if path.is_dir() else path).read_text(encoding="utf-8"))
