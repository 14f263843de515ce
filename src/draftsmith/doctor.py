"""`draftsmith doctor`: what is installed, what hardware there is, which extraction strategy will work for which
architecture, and -- given a target's config.json -- what its store and its draft's training will cost (and, with
`--online-rate`, the spool that online training from vLLM engines needs).

vLLM is never imported here: the probe reads its source (the installed one, or any tree given with --vllm-source),
so doctor is fast and prints no vLLM log line. Nor does it import torch or transformers: versions come from the
installed packages' metadata, the CPU and GPUs from /proc (core/hardware.py), and only `--target` loads the
trainer's model code for the draft's sizes (planning.py). `--runtime` adds the one fact only a running vLLM can
tell (what async_scheduling resolves to), from an engine config built in a subprocess. `--json` prints one JSON
object (`report(...)`) for scripts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import textwrap
from pathlib import Path
from typing import TypedDict, Unpack

from rich.console import Console
from rich.table import Table
from rich.text import Text

from draftsmith import __version__
from draftsmith.core import hardware, pins
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.target_config import read_config
from draftsmith.extract.vllm import dtypes, probe, tables
from draftsmith.extract.vllm.source import locate, package_dir


class Sizing(TypedDict, total=False):
    """What --target's sizes are computed for: `planning.sizing_rows`'s keywords that doctor takes."""

    tokens: int | None
    distinct_tokens: int | None
    tensor_parallel_size: int
    gpu_memory_gb: float | None
    online_rate: float | None
    spool_lead_s: float


def _version_of(distribution: str) -> str:
    """An installed distribution's version from its metadata (importing torch or transformers takes seconds)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _vllm_version() -> str:
    """The installed vLLM's version read from its files (importing vLLM takes seconds and logs)."""
    located = locate(None)
    if located is None:
        return "not installed"
    return located.version or f"installed, version unknown ({located.package})"


def environment_rows() -> list[tuple[str, str]]:
    rows = [
        ("draftsmith", __version__),
        ("python", platform.python_version()),
        ("platform", f"{platform.system()} {platform.machine()}"),
        ("cpu cores", str(os.cpu_count())),
        ("torch", _version_of("torch")),
        ("transformers", _version_of("transformers")),
        ("vllm", _vllm_version()),
        ("gpus", ", ".join(hardware.gpu_names()) or "none (CPU only)"),
        ("cache", str(pins.cache_dir())),
    ]
    for name, cached in pins.cache_status().items():
        rows.append((f"asset: {name}", "cached" if cached else "not cached (fetched on first use)"))
    return rows


def read_target_config(target: str | Path) -> dict:
    """A target's config.json: from its directory, or the file itself (planning a target not downloaded yet)."""
    path = Path(target).expanduser()
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise DraftsmithError(f"{path}: cannot read target config ({err})") from None
    if path.is_dir():
        return read_config(path)
    raise DraftsmithError(f"--target {target}: neither a model directory nor a config.json file")


def check_online(target: str | None, online_rate: float | None, spool_lead_s: float) -> None:
    """One line for an --online-rate / --spool-lead-s doctor cannot size a spool from."""
    if online_rate is not None and online_rate <= 0:
        raise DraftsmithError(
            f"--online-rate {online_rate:g}: must be > 0 (training tokens per second the "
            "trainer consumes, all ranks together)"
        )
    if spool_lead_s <= 0:
        raise DraftsmithError(f"--spool-lead-s {spool_lead_s:g}: must be > 0 (seconds the engines may run ahead)")
    if online_rate is not None and target is None:
        raise DraftsmithError("--online-rate: give --target too (the spool's rows come from the target's hidden size)")


def report(
    *, target: str | None = None, vllm_source: str | Path | None = None, runtime: bool = False, **sizing: Unpack[Sizing]
) -> dict:
    """Everything doctor finds, as one JSON-ready dict: {"draftsmith", "environment", "vllm": {source, version,
    platform, architecture, facts, strategy, reason, usable, capabilities}, "architectures": [one per architecture:
    its table row (architecture, "vLLM class", "aux ids vLLM reaches", connector, direct, notes), strategy, usable,
    support], "target": {path, architecture, sizes} when a target is given}."""
    check_online(target, sizing.get("online_rate"), sizing.get("spool_lead_s", 60.0))
    config, main, reports = _probe(target, vllm_source, runtime)
    out: dict = {
        "draftsmith": __version__,
        "environment": dict(environment_rows()),
        "vllm": {
            "source": main.source,
            "version": main.facts.version,
            "platform": main.facts.platform,
            "architecture": main.architecture,
            "facts": main.facts.model_dump(),
            "strategy": main.strategy,
            "reason": main.reason,
            "usable": main.usable,
            "capabilities": [cap.model_dump() for cap in main.capabilities],
        },
        "architectures": [
            {
                **tables.architecture_row(r),
                "strategy": r.strategy,
                "usable": r.usable,
                "support": r.support.model_dump() if r.support is not None else None,
            }
            for r in reports
        ],
    }
    if config is not None:
        sizes = target_sizes(config, **sizing)
        out["target"] = {"path": str(target), "architecture": main.architecture, "sizes": dict(sizes)}
        if main.facts.installed:
            out["target"]["vllm_dtype_auto"] = dtypes.choose_dtype("auto", main, config).model_dump()
    return out


def target_sizes(config: dict, **options: Unpack[Sizing]) -> list[tuple[str, str]]:
    """--target's sizes (`planning.sizing_rows`'s rows for these options)."""
    from draftsmith import planning  # with the trainer's model code (torch): only when a target is given

    return planning.sizing_rows(config, **options)


def dtype_line(report: probe.ProbeReport, config: dict | None) -> str:
    """The dtype `auto` starts this vLLM in for the target (extract, train --engine vllm, feed, evaluate, serve),
    and why."""
    choice = dtypes.choose_dtype("auto", report, config)
    line = f"{choice.dtype} ({choice.why})"
    return line + (f"; if it cannot run, {choice.fallback} once" if choice.fallback else "")


def _probe(
    target: str | None, vllm_source: str | Path | None, runtime: bool
) -> tuple[dict | None, probe.ProbeReport, list[probe.ProbeReport]]:
    """(--target's config.json, the probe for its architecture, one probe per tested architecture and for its own)."""
    config = read_target_config(target) if target else None
    # without --target, the usual Llama architecture
    architecture = (config.get("architectures") or ["unknown"])[0] if config else "LlamaForCausalLM"
    main = probe.probe(vllm_source, architecture=architecture, config=config, resolve_config=runtime)
    archs = list(probe.TESTED_ARCHITECTURES)
    if architecture not in archs:
        archs.insert(0, architecture)
    reports = probe.probe_architectures(archs, vllm_source, configs={architecture: config} if config else None)
    return config, main, reports


def _say(console: Console, text: str, style: str | None = None, *, wrap: bool = False, indent: int = 0) -> None:
    """One line of the summary, cut to the screen with an ellipsis (or, `wrap`, wrapped under its indent)."""
    lines = textwrap.wrap(text, max(20, console.width - indent), break_on_hyphens=False) if wrap else [text]
    for line in lines:  # wrapped here, not by rich: no line is padded with spaces to the screen's width
        console.print(Text(" " * indent + line, style=style or ""), no_wrap=True, overflow="ellipsis", highlight=False)


def hardware_line(*, on_gpu: bool) -> str:
    """The CPU's ISA class, whether it computes bf16 in hardware, and what `auto` precision takes here (train,
    extract --backend hf: `hardware.auto_dtype_name`), then the CPU's model name (cut first where the line is long)."""
    cpu = hardware.cpu_info()
    kinds = " + ".join(name for name, has in (("AMX-BF16", cpu.amx), ("AVX512-BF16", cpu.avx512_bf16)) if has)
    bf16 = f"bf16 in hardware ({kinds})" if kinds else "no bf16 in hardware"
    auto = hardware.auto_dtype_name("cuda" if on_gpu else "cpu")
    where = " on the GPU" if on_gpu else ""
    return f"CPU {cpu.isa}, {bf16} · auto precision: {auto}{where} · {cpu.model}"


def print_summary(
    console: Console,
    main: probe.ProbeReport,
    reports: list[probe.ProbeReport],
    target_rows: list[tuple[str, str]] | None,
    target: str | None,
    config: dict | None,
) -> None:
    """doctor on one screen: versions and hardware, the strategy this vLLM takes and why, the capabilities that are
    missing, unknown or worth knowing, one line per architecture, and the target's sizes when one is given."""
    env = dict(environment_rows())
    gpus = "no GPU" if env["gpus"].startswith("none") else f"GPUs: {env['gpus']}"
    versions = f"draftsmith {env['draftsmith']} · Python {env['python']} · {env['platform']}"
    _say(console, f"{versions} · {env['cpu cores']} CPU cores · {gpus}", "bold")
    _say(console, hardware_line(on_gpu=not env["gpus"].startswith("none")), indent=2)
    _say(console, f"torch {env['torch']} · transformers {env['transformers']} · vllm {env['vllm']}", indent=2)
    assets_rows = {k.removeprefix("asset: "): v for k, v in env.items() if k.startswith("asset: ")}
    missing = [name for name, state in assets_rows.items() if state != "cached"]
    cached = f"{len(assets_rows) - len(missing)} of {len(assets_rows)} default assets cached"
    fetched = f" (fetched on first use: {', '.join(missing)})" if missing else ""
    _say(console, f"cache {env['cache']}: {cached}{fetched}", indent=2)
    facts = main.facts
    if not facts.installed:
        _say(console, f"vLLM: not found ({main.reason})", "bold", wrap=True)
    else:
        platform_ = facts.platform or "platform unknown"
        _say(console, f"vLLM {facts.version} ({platform_}), read from its source, never imported", "bold")
        head, style = (f"strategy: {main.strategy} for", None) if main.strategy else ("no vLLM strategy for", "red")
        _say(console, f"{head} {main.architecture} ({main.reason})", style, wrap=True, indent=2)
        caps = main.capabilities
        worth = [c for c in caps if c.unknown or c.ok is False]
        counts = f"{sum(c.ok is True for c in caps)} as needed, {sum(c.ok is None for c in caps)} informational"
        if worth:
            counts += (
                f", {sum(c.ok is False and not c.unknown for c in caps)} missing, "
                f"{sum(c.unknown for c in caps)} unknown"
            )
        if target_rows is None:  # with a target, its sizes end with the choice for it
            _say(console, f"compute dtype (auto): {dtype_line(main, config)}", wrap=True, indent=2)
        _say(console, f"capabilities: {counts}", indent=2)
        for cap in worth:
            mark, style = ("?", "yellow") if cap.unknown else ("✗", "red")
            _say(console, f"{mark} {cap.name}: {cap.found} — {cap.meaning}", style, indent=4)
    _say(console, "architectures: strategy · aux ids vLLM reaches · notes", "bold")
    width = max((len(r.architecture) for r in reports), default=0)
    for r in reports:
        row = tables.architecture_row(r)
        notes = row["notes"] if row["notes"] != "-" else ""
        line = f"{r.architecture:<{width}}  {r.strategy or 'none':<9} {row['aux ids vLLM reaches']:<5} {notes}"
        _say(console, line.rstrip(), indent=2)
    if target_rows is not None:
        _say(console, f"target {target}: sizes from its config.json", "bold")
        for key, value in target_rows:
            _say(console, f"{key}: {value}", wrap=True, indent=2)
    _say(console, "the full tables: draftsmith doctor --verbose · everything for scripts: --json", "dim")


def run(
    console: Console,
    *,
    target: str | None = None,
    vllm_source: str | Path | None = None,
    runtime: bool = False,
    as_json: bool = False,
    verbose: bool = False,
    prepared: Path | None = None,
    **sizing: Unpack[Sizing],
) -> None:
    """Print doctor's summary, one screen (`verbose`: its full tables; `as_json`: the one JSON object of `report`).
    `vllm_source`: probe that vLLM tree instead of the installed one (no runtime step); `runtime`: build the
    installed vLLM's engine config too; `sizing`: `report`'s tokens, tensor_parallel_size, gpu_memory_gb and the
    target's online spool rows (`online_rate`, `spool_lead_s`); `prepared`: a prepared set whose tokens and distinct
    tokens (its samples' shared prefixes counted once) size the store."""
    if prepared is not None:
        from draftsmith.prepare.dataset import open_prepared

        manifest = open_prepared(prepared).manifest
        sizing["tokens"], sizing["distinct_tokens"] = manifest.num_tokens, manifest.num_distinct_tokens
    check_online(target, sizing.get("online_rate"), sizing.get("spool_lead_s", 60.0))  # one line, before any output
    if vllm_source is not None:
        package_dir(vllm_source)  # a wrong --vllm-source is one line before anything is printed
    if as_json:
        found = report(target=target, vllm_source=vllm_source, runtime=runtime, **sizing)
        console.out(json.dumps(found, indent=2), highlight=False)
        return
    config, main, reports = _probe(target, vllm_source, runtime)
    rows = None
    if config is not None:
        rows = target_sizes(config, **sizing)
        if main.facts.installed:
            rows.append(("vLLM compute dtype (auto)", dtype_line(main, config)))
    if not verbose:
        print_summary(console, main, reports, rows, target, config)
        return
    # --verbose: the environment, the probe's capabilities, every architecture, the target's sizes
    console.print(_rows_table("draftsmith doctor", environment_rows()))
    console.print(tables.render_probe_table(main))
    console.print(tables.render_architecture_table(reports))
    if rows is not None:
        console.print(_rows_table(f"target {target}: sizes from its config.json", rows))


def _rows_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """(what, value) rows as a two-column table, the names in bold."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


__all__ = [
    "check_online",
    "dtype_line",
    "environment_rows",
    "hardware_line",
    "print_summary",
    "read_target_config",
    "report",
    "run",
]
