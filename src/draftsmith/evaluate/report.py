"""The evaluation report: report.json (everything measured: `EvaluationReport`, which stage.py builds, report.md
renders and the quickstart, the gate's callers and the tests read), report.md (a readable summary: its first line
the gate's verdict, τ and the speed-up at each concurrency) and PNG charts (per-position acceptance; τ and speed-up
against k; with --concurrency, tokens/s and speed-up against concurrency), written atomically into the output
directory. The charts need matplotlib (the `report` extra, which an install beside vLLM does not bring): without it
the report is written without them and says, in report.md and in one line, how to get them."""

from __future__ import annotations

import io
from pathlib import Path

from pydantic import BaseModel, field_serializer

from draftsmith.core.fsio import atomic_write_bytes, atomic_write_json, atomic_write_text

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
ACCEPTANCE_PNG = "acceptance_per_position.png"
TAU_PNG = "tau_speedup_vs_k.png"
CONCURRENCY_PNG = "speedup_vs_concurrency.png"
DOMAINS_PNG = "tau_by_domain.png"
CHARTS_HINT = "charts need matplotlib: pip install 'draftsmith[report]' (or matplotlib), then evaluate again"


class SegmentReport(BaseModel):
    """One segment's rounds (reasoning, content, tool call): τ and the acceptance per position (None without
    rounds)."""

    rounds: int
    tau: float | None
    acceptance_per_pos: list[float] | None


class DecodeCounts(BaseModel):
    """Counts of one decoding run (k = 0: the target alone), as specdec.DecodeStats takes them."""

    k: int
    num_prompts: int = 0
    num_new_tokens: int = 0
    elapsed_s: float = 0.0
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = []
    # (rounds, accepted draft tokens) of each prompt, in order, where the engine reports them per prompt
    per_prompt: list[tuple[int, int]] = []


class DecodeReport(DecodeCounts):
    """One decoding run's counts and what they give: τ, acceptance per position, tokens/s and τ's 95 % interval
    over the prompts."""

    tau: float
    acceptance_per_pos: list[float]
    tokens_per_s: float
    tau_95: tuple[float, float] | None = None


class RunReport(DecodeReport):
    """A run with the draft at one k: its speed-up over the target alone and its rounds by segment."""

    speedup: float | None = None
    by_segment: dict[str, SegmentReport] | None = None


class PositionCheck(BaseModel):
    """One draft position in the gate: the fraction of rounds whose proposal there was accepted, in each engine."""

    position: int  # 1-based, as the report shows it
    reference: float
    served: float
    allowed: float
    agrees: bool

    @field_serializer("reference", "served", "allowed")
    def _rounded(self, value: float) -> float:
        return round(value, 4)

    @property
    def gap(self) -> float:
        return self.served - self.reference


class TrainingPrediction(BaseModel):
    """What training's last held-out evaluation predicts for the first `positions` positions (gate.py)."""

    acceptance_per_pos: list[float]
    tau: float
    positions: int
    line: str | None = None  # the verdict's words on it


class GateResult(BaseModel):
    """The gate's verdict at one k (gate.judge)."""

    passed: bool
    verdict: str  # one line: the first line of the report, the summary's and (failed) the error's
    k: int
    reference_tau: float
    served_tau: float
    positions: list[PositionCheck]
    config_drift: list[str] = []
    not_read_by_vllm: list[str] = []
    training: TrainingPrediction | None = None

    @field_serializer("reference_tau", "served_tau")
    def _rounded(self, value: float) -> float:
        return round(value, 4)


class GateReport(BaseModel):
    passed: bool
    checks: list[GateResult]


class ServedRun(BaseModel):
    """The fields of vLLM's result JSON kept for one server at one concurrency (loadgen.py saves one per
    concurrency)."""

    completed: int | None = None
    total_output_tokens: int | None = None
    duration: float | None = None
    output_throughput: float | None = None
    request_throughput: float | None = None
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_tpot_ms: float | None = None
    spec_decode_acceptance_length: float | None = None
    spec_decode_acceptance_rate: float | None = None


class ConcurrencyRow(BaseModel):
    concurrency: int
    requests: int
    draft: ServedRun
    target_alone: ServedRun
    speedup: float | None
    itl_ratio: float | None = None
    identical_outputs: str  # "same/requests"


class ConcurrencySweep(BaseModel):
    """The speed-up by concurrency through `draftsmith serve` (load.sweep)."""

    k: int
    dtype: str
    load_generator: str
    max_new_tokens: int
    rows: list[ConcurrencyRow]
    stops_paying_at: int | None


class DomainReport(BaseModel):
    """One domain of a suite (evaluate --prompts suite): its prompt set and its own runs."""

    name: str
    prompts: str
    num_prompts: int
    baseline: DecodeReport | None = None
    runs: list[RunReport]


class EvaluationReport(BaseModel):
    """report.json: everything `draftsmith evaluate` measured (a key absent from an older file reads as None)."""

    engine: str
    target: str
    draft: str
    prompts: str
    num_prompts: int
    max_new_tokens: int
    temperature: float
    aux_layer_ids: list[int] = []
    draft_vocab_size: int | None = None
    lossless: dict[str, str] | None = None  # greedy outputs identical to the target alone's, per k
    vllm_version: str | None = None
    dtype: str | None = None
    gate: GateReport | None = None
    concurrency: ConcurrencySweep | None = None
    baseline: DecodeReport | None = None
    runs: list[RunReport]  # the whole evaluation's (a suite: all its domains together)
    domains: list[DomainReport] = []  # a suite's, each apart
    segments_note: str | None = None  # why the runs have no split by segment, where the engine keeps none


def charts_available() -> bool:
    """matplotlib can be imported here (the `report` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    """matplotlib's pyplot, drawing off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def acceptance_chart(runs: list[RunReport], title: str) -> bytes:
    """Grouped bars: acceptance rate at each draft position, one colour per k."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(runs))
    for j, run in enumerate(runs):
        rates = run.acceptance_per_pos
        xs = [i + 1 + (j - (len(runs) - 1) / 2) * width for i in range(len(rates))]
        ax.bar(xs, rates, width=width, label=f"k={run.k} (τ={run.tau:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (fraction of rounds)")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, max(len(r.acceptance_per_pos) for r in runs) + 1))
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def tau_speedup_chart(runs: list[RunReport], title: str) -> bytes:
    """τ (left axis) and speed-up over the target alone (right axis) against k."""
    ks = [r.k for r in runs]
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    ax.plot(ks, [r.tau for r in runs], "o-", color="tab:blue", label="τ (mean acceptance length)")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("τ", color="tab:blue")
    ax.set_xticks(ks)
    ax.grid(alpha=0.3)
    speedups = [r.speedup for r in runs]
    if any(s is not None for s in speedups):
        ax2 = ax.twinx()
        ax2.plot(
            ks, [s if s is not None else float("nan") for s in speedups], "s--", color="tab:orange", label="speed-up"
        )
        ax2.axhline(1.0, color="tab:orange", alpha=0.3, lw=1)
        ax2.set_ylabel("speed-up vs target alone", color="tab:orange")
    ax.set_title(title)
    return _png(fig)


def concurrency_chart(sweep: ConcurrencySweep, title: str) -> bytes:
    """Output tokens/s with the draft and with the target alone (left axis) and the speed-up (right) against the
    concurrency, on a log scale."""
    rows = sweep.rows
    cs = [r.concurrency for r in rows]
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    nan = float("nan")  # a run the load generator reported no throughput for
    ax.plot(cs, [r.draft.output_throughput or nan for r in rows], "o-", color="tab:blue", label="with the draft")
    ax.plot(cs, [r.target_alone.output_throughput or nan for r in rows], "o:", color="tab:gray", label="target alone")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    speedups = [r.speedup or nan for r in rows]
    ax2.plot(cs, speedups, "s--", color="tab:orange")
    ax2.axhline(1.0, color="tab:orange", alpha=0.4, lw=1)  # below it the draft costs more than it saves
    ax2.set_ylim(0, max([1.25, *(1.15 * s for s in speedups if s == s)]))
    ax2.set_ylabel(f"speed-up (k={sweep.k})", color="tab:orange")
    ax.set_title(title)
    return _png(fig)


def domain_chart(domains: list[DomainReport], title: str) -> bytes:
    """τ of each domain (bars, one colour per k) with its 95 % interval over the domain's prompts."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    ks = [r.k for r in domains[0].runs]
    width = 0.8 / max(1, len(ks))
    for j, k in enumerate(ks):
        runs = [next(r for r in d.runs if r.k == k) for d in domains]
        xs = [i + (j - (len(ks) - 1) / 2) * width for i in range(len(domains))]
        errors = [
            [r.tau - r.tau_95[0] if r.tau_95 else 0.0 for r in runs],
            [r.tau_95[1] - r.tau if r.tau_95 else 0.0 for r in runs],
        ]
        ax.bar(xs, [r.tau for r in runs], width=width, yerr=errors, capsize=3, label=f"k={k}")
    ax.set_xticks(range(len(domains)), [f"{d.name}\n({d.prompts})" for d in domains])
    ax.set_ylim(bottom=1.0)  # τ is at least 1: the target's own token each round
    ax.set_ylabel("τ (mean acceptance length)")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def speedup_line(sweep: ConcurrencySweep) -> str:
    """'1.31x at 1, 1.02x at 4, 0.93x at 16: stops paying at 16' (the summary's and the report's first line)."""
    parts = [
        f"{r.speedup:.2f}x at {r.concurrency}" if r.speedup is not None else f"– at {r.concurrency}" for r in sweep.rows
    ]
    stop = sweep.stops_paying_at
    return ", ".join(parts) + (f": stops paying at {stop}" if stop else ": pays at every concurrency measured")


def several_segments(run: RunReport) -> bool:
    """The run's rounds fall in more than one segment (reasoning, content, tool call): worth showing apart."""
    return sum(bool(c.rounds) for c in (run.by_segment or {}).values()) > 1


def _headline(report: EvaluationReport) -> str:
    """The first line: what a pipeline reading this report decides on, τ, and whether the draft pays where it is
    served."""
    gate, sweep = report.gate, report.concurrency
    headline = [f"**Gate: {'passed' if gate.passed else 'FAILED'}**"] if gate else []
    if report.runs:
        headline.append("τ " + ", ".join(f"{r.tau:.2f} at k={r.k}" for r in report.runs))
    if sweep:
        headline.append(f"speed-up by concurrency (k={sweep.k}): {speedup_line(sweep)}")
    return " · ".join(headline)


def _gate_lines(gate: GateReport) -> list[str]:
    lines = [f"- {check.verdict}" for check in gate.checks]
    lines += ["", "| k | position | reference decoder | vLLM | allowed gap | agrees |", "|---|---|---|---|---|---|"]
    for check in gate.checks:
        for p in check.positions:
            lines.append(
                f"| {check.k} | {p.position} | {p.reference:.3f} | {p.served:.3f} | "
                f"{p.allowed:.3f} | {'yes' if p.agrees else 'NO'} |"
            )
    return [*lines, ""]


def _runs_lines(runs: list[RunReport]) -> list[str]:
    """The table of runs, then (where a run's rounds fall in several segments) the table by segment."""
    lines = [
        "",
        "| k | τ | τ 95 % interval (over prompts) | acceptance per position | tokens/s | speed-up | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        per_pos = ", ".join(f"{a:.2f}" for a in r.acceptance_per_pos)
        interval = f"{r.tau_95[0]:.3f} – {r.tau_95[1]:.3f}" if r.tau_95 else "–"
        lines.append(
            f"| {r.k} | {r.tau:.3f} | {interval} | {per_pos} | {r.tokens_per_s:.1f} | {_times(r.speedup)} | "
            f"{r.num_rounds} |"
        )
    split = [r for r in runs if several_segments(r)]
    if split:
        lines += [
            "",
            "By what the target was writing (a round counts where its first new token falls):",
            "",
            "| k | segment | rounds | τ | acceptance per position |",
            "|---|---|---|---|---|",
        ]
        for r in split:
            for name, c in (r.by_segment or {}).items():
                if c.rounds:
                    per_pos = ", ".join(f"{a:.2f}" for a in c.acceptance_per_pos or [])
                    lines.append(f"| {r.k} | {name} | {c.rounds} | {c.tau:.3f} | {per_pos} |")
    return lines


def _domain_lines(domains: list[DomainReport]) -> list[str]:
    lines = [
        "",
        "By domain:",
        "",
        "| domain | prompts | k | τ | τ 95 % interval (over prompts) | acceptance per position | tokens/s | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in domains:
        for r in d.runs:
            per_pos = ", ".join(f"{a:.2f}" for a in r.acceptance_per_pos)
            interval = f"{r.tau_95[0]:.3f} – {r.tau_95[1]:.3f}" if r.tau_95 else "–"
            lines.append(
                f"| {d.name} | {d.prompts} ({d.num_prompts}) | {r.k} | {r.tau:.3f} | {interval} | {per_pos} | "
                f"{r.tokens_per_s:.1f} | {_times(r.speedup)} |"
            )
    return lines


def _concurrency_lines(sweep: ConcurrencySweep) -> list[str]:
    lines = [
        "",
        f"Through the server (`draftsmith serve`, {sweep.load_generator}; the draft at k={sweep.k}, then the "
        f"target alone; {sweep.dtype}, up to {sweep.max_new_tokens} new tokens a request):",
        "",
        "| concurrency | requests | tokens/s target alone | tokens/s with draft | speed-up | ITL ms alone | "
        "ITL ms with draft | TTFT ms alone | TTFT ms with draft | τ served | identical outputs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sweep.rows:
        d, a = r.draft, r.target_alone
        tau = d.spec_decode_acceptance_length
        lines.append(
            f"| {r.concurrency} | {r.requests} | {a.output_throughput:.1f} | "
            f"{d.output_throughput:.1f} | {_times(r.speedup)} | {a.mean_itl_ms:.1f} | "
            f"{d.mean_itl_ms:.1f} | {a.mean_ttft_ms:.0f} | {d.mean_ttft_ms:.0f} | "
            f"{f'{tau:.2f}' if tau else '–'} | {r.identical_outputs} |"
        )
    return lines


def markdown(report: EvaluationReport, charts: bool = True) -> str:
    """report.md: the headline, the gate's checks, what was measured and how, the tables, the charts."""
    base, sweep = report.baseline, report.concurrency
    lines = [f"# Speculative decoding: {report.engine} engine", "", _headline(report), ""]
    if report.gate:
        lines += _gate_lines(report.gate)
    lines += [
        f"- target: `{report.target}`",
        f"- draft: `{report.draft}`",
        f"- prompts: {report.prompts} ({report.num_prompts} prompts), max {report.max_new_tokens} new tokens, "
        f"temperature {report.temperature}",
    ]
    if report.vllm_version:
        lines.append(f"- vLLM {report.vllm_version}")
    if base:
        lines.append(
            f"- target alone: {base.tokens_per_s:.1f} tokens/s ({base.num_new_tokens} tokens in {base.elapsed_s:.1f} s)"
        )
    lines += _runs_lines(report.runs)
    if report.segments_note:
        lines += ["", report.segments_note]
    if len(report.domains) > 1:
        lines += _domain_lines(report.domains)
    if report.lossless is not None:
        lines += ["", f"Greedy outputs identical to the target alone: {report.lossless}"]
    if sweep:
        lines += _concurrency_lines(sweep)
    lines += [
        "",
        "τ = 1 + accepted draft tokens / rounds (vLLM's mean acceptance length); its interval is a "
        "bootstrap over the prompts (2,000 resamples).",
        "",
    ]
    lines += (
        [f"![acceptance per position]({ACCEPTANCE_PNG})", "", f"![τ and speed-up against k]({TAU_PNG})", ""]
        + ([f"![speed-up against concurrency]({CONCURRENCY_PNG})", ""] if sweep else [])
        + ([f"![τ by domain]({DOMAINS_PNG})", ""] if len(report.domains) > 1 else [])
        if charts
        else [f"No charts: {CHARTS_HINT}.", ""]
    )
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return f"{ratio:.2f}×" if ratio is not None else "–"


# keys today's report.json leaves out where they do not apply (an older reader sees the same file)
_ABSENT_WHEN_NONE = ("lossless", "vllm_version", "gate", "concurrency", "segments_note")


def write_report(output: Path, report: EvaluationReport) -> dict[str, Path]:
    """Write report.json, report.md and, where matplotlib is installed, the charts; returns the paths written."""
    output = Path(output)
    title = f"{Path(report.draft).name} on {Path(report.target).name} ({report.engine})"
    charts = charts_available()
    paths = {"json": output / REPORT_JSON, "markdown": output / REPORT_MD}
    absent = {key for key in _ABSENT_WHEN_NONE if getattr(report, key) is None}
    atomic_write_json(paths["json"], report.model_dump(mode="json", exclude=absent))
    atomic_write_text(paths["markdown"], markdown(report, charts))
    if charts:
        paths.update(acceptance_chart=output / ACCEPTANCE_PNG, tau_chart=output / TAU_PNG)
        atomic_write_bytes(paths["acceptance_chart"], acceptance_chart(report.runs, title))
        atomic_write_bytes(paths["tau_chart"], tau_speedup_chart(report.runs, title))
        if report.concurrency:
            paths["concurrency_chart"] = output / CONCURRENCY_PNG
            served = f"{Path(report.draft).name} on {Path(report.target).name} (draftsmith serve)"
            atomic_write_bytes(paths["concurrency_chart"], concurrency_chart(report.concurrency, served))
        if len(report.domains) > 1:
            paths["domain_chart"] = output / DOMAINS_PNG
            atomic_write_bytes(paths["domain_chart"], domain_chart(report.domains, title))
    return paths


def read_report(path: Path) -> EvaluationReport:
    path = Path(path)
    return EvaluationReport.model_validate_json((path / REPORT_JSON if path.is_dir() else path).read_text("utf-8"))
