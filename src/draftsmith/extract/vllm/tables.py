"""The probe's reports as doctor shows them: its capability table, and one row per target architecture."""

from __future__ import annotations

from rich.table import Table

from draftsmith.extract.vllm.architectures import ArchitectureSupport
from draftsmith.extract.vllm.probe import STRATEGIES, ProbeReport


def render_probe_table(report: ProbeReport):
    """The probe as a rich Table: capability, found, usable, meaning; the chosen strategy in the caption."""
    table = Table(title="vLLM extraction capabilities (found by inspection)", title_justify="left")
    table.add_column("capability", style="bold")
    for column in ("found", "ok", "what it means"):
        table.add_column(column)
    marks = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}  # by cap.ok
    for cap in report.capabilities:
        table.add_row(cap.name, cap.found, "[yellow]unknown[/yellow]" if cap.unknown else marks[cap.ok], cap.meaning)
    if report.strategy:
        table.caption = f"strategy: [bold]{report.strategy}[/bold] ({report.reason})"
    else:
        table.caption = f"[bold red]no vLLM strategy[/bold red]: {report.reason}"
    table.caption_justify = "left"
    return table


def architecture_row(report: ProbeReport) -> dict[str, str]:
    """One architecture's row in words: what vLLM reaches, what each strategy does, and the notes."""
    s = report.support or ArchitectureSupport(architecture=report.architecture)
    if not s.registered:
        return {
            "architecture": s.architecture,
            "vLLM class": "not registered",
            "aux ids vLLM reaches": "-",
            **{name: "no" for name in STRATEGIES},
            "notes": "not in this vLLM's model registry: use --backend hf",
        }

    def cell(name: str) -> str:
        if not report.usable.get(name):
            return "no: " + report.why_not(name)
        if name == "connector" and not s.reaches_embeddings:
            return "yes (ids >= 1; id 0 asked for: direct or taps)"
        return "yes"

    stack = s.decoder_stack or "?"
    assert s.vllm_class is not None  # set with registered
    cls = s.vllm_class + (f" -> {s.language_model}" if s.language_model else "") + f" ({stack}.forward)"
    return {
        "architecture": s.architecture,
        "vLLM class": cls,
        "aux ids vLLM reaches": s.reachable,
        **{name: cell(name) for name in STRATEGIES},
        "notes": "; ".join(s.notes) or "-",
    }


def render_architecture_table(reports: list[ProbeReport]):
    """doctor's second table: one row per target architecture."""
    table = Table(title="vLLM extraction per target architecture (found by inspection)", title_justify="left")
    rows = [architecture_row(r) for r in reports]
    for column in rows[0] if rows else {"architecture": ""}:
        table.add_column(column, style="bold" if column == "architecture" else None)
    for row in rows:
        table.add_row(*row.values())
    return table
