"""`draftsmith doctor`: what is installed, what hardware there is, which extraction strategy will work for which
architecture, and -- given a target's config.json -- what its store and its draft's training will cost (and, with
`--online-rate`, the spool that online training from vLLM engines needs).

vLLM is never imported here: the probe reads its source (the installed one, or any tree given with --vllm-source),
so doctor is fast and prints no vLLM log line. `--runtime` adds the one fact only a running vLLM can tell (what
async_scheduling resolves to), from an engine config built in a subprocess. `--json` prints one JSON object
(`report(...)`) for scripts."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
from pathlib import Path

import torch
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from draftsmith import __version__
from draftsmith.config import ExtractConfig, TrainConfig
from draftsmith.core import assets, sizing
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import resolve_layer_ids
from draftsmith.core.targets import read_config, text_config
from draftsmith.extract.vllm import probe
from draftsmith.extract.vllm.source import locate, package_dir
from draftsmith.train.model import DraftSpec  # doctor sits above every stage


def _version_of(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception as err:  # noqa: BLE001 - a broken install is exactly what doctor must report
        return f"broken ({type(err).__name__}: {err})"


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
        ("torch", torch.__version__),
        ("transformers", _version_of("transformers")),
        ("vllm", _vllm_version()),
    ]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows.append(("gpus", ", ".join(names)))
    else:
        rows.append(("gpus", "none (CPU only)"))
    rows.append(("cache", str(assets.cache_dir())))
    for name, cached in assets.cache_status().items():
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


def sizing_rows(config: dict, *, tokens: int | None = None, tensor_parallel_size: int = 1,
                aux_layer_ids: list[int] | None = None, draft_vocab_size: int | None = None,
                token_budget: int | None = None, ttt_steps: int | None = None,
                gpu_memory_gb: float | None = None, online_rate: float | None = None,
                spool_lead_s: float = 60.0) -> list[tuple[str, str]]:
    """The big-target arithmetic for one config, as (what, how much) rows; defaults are the stages' defaults.
    `gpu_memory_gb`: one more row, whether the draft's training fits one GPU of that many GiB. `online_rate`
    (training tokens/s, all ranks): the spool `train --engine vllm` needs for a `spool_lead_s` engine lead."""

    shape = sizing.target_shape(config)
    train = TrainConfig()
    layer_ids = resolve_layer_ids(aux_layer_ids or ExtractConfig().aux_layer_ids, shape.num_layers)
    aux = layer_ids[:-1]
    assert train.num_layers is not None  # TrainConfig's validator sets the method's default
    draft = DraftSpec.from_target_config(config, draft_vocab_size or train.draft_vocab_size, train.num_layers, aux)
    memory = sizing.training_memory(draft, token_budget=token_budget or train.token_budget,
                                    ttt_steps=ttt_steps or train.ttt_steps)
    tp = max(1, tensor_parallel_size)
    moe = (f"; MoE: {shape.moe_layers} of {shape.num_layers} layers, {shape.experts} experts, "
           f"{shape.experts_per_token} per token" + (f" + {shape.shared_experts} shared" if shape.shared_experts
                                                     else "") if shape.moe_layers else "")
    def weights(devices: int) -> str:
        return ", ".join(f"{name} {sizing.human_bytes(sizing.weight_bytes(shape.params, size, devices))}"
                         for name, size in (("bf16", 2), ("fp8", 1), ("int4 (group 32)", 0.5 + 2 / 32)))

    rows = [
        ("text backbone", f"{shape.num_layers} layers, hidden {shape.hidden_size}, vocabulary {shape.vocab_size}, "
                          f"{'multi-head latent' if shape.attention == 'mla' else 'GQA'} attention{moe}"),
        ("parameters", f"{sizing.human_count(shape.params)} ({sizing.human_count(shape.active_params)} per token)"),
        ("weights", weights(1) + (f"; per GPU at TP={tp}: " + weights(tp) if tp > 1 else "")),
    ]
    stored = sizing.stored_weight_bytes(config, shape)
    if "quantization_config" in config or "quantization_config" in text_config(config):
        rows.append(("weights as stored", f"{sizing.human_bytes(stored.bytes)}: {stored.how}" + (
            "" if stored.read else " (its quantization_config is not one this arithmetic reads: bf16 assumed)")))
    rows.append(("vLLM loads it on", vllm_fit_line(stored.bytes, gpu_memory_gb)))
    per_token = {d: sizing.store_bytes_per_token(shape.hidden_size, len(layer_ids), d) for d in ("bf16", "fp8")}
    rows.append(("store layer ids", f"{','.join(map(str, layer_ids))} (aux {','.join(map(str, aux))}, then N)"))
    rows.append(("store bytes per token", f"bf16 {per_token['bf16']:,}, fp8 {per_token['fp8']:,} "
                                          f"({len(layer_ids)} layers x {shape.hidden_size})"))
    for count in ([tokens] if tokens else []) + [1_000_000]:
        rows.append((f"store for {count:,} tokens", f"bf16 {sizing.human_bytes(count * per_token['bf16'])}, "
                                                  f"fp8 {sizing.human_bytes(count * per_token['fp8'])}"))
    rows.extend(spool_rows(per_token, online_rate, spool_lead_s, tokens=tokens,
                           tokens_per_step=token_budget or train.token_budget))
    rows.append(("draft", f"{sizing.human_count(memory.draft_params)} trainable parameters (1 layer, hidden "
                          f"{draft.hidden_size}, {draft.num_attention_heads} heads x {draft.head_dim}, "
                          f"{draft.num_key_value_heads} KV heads, MLP {draft.intermediate_size}, draft vocabulary "
                          f"{draft.draft_vocab_size})"))
    rows.append(("draft training memory (estimate)",
                 f"{sizing.human_bytes(memory.total)} per GPU at {token_budget or train.token_budget} tokens per "
                 f"micro-batch, {ttt_steps or train.ttt_steps} TTT steps: weights + AdamW "
                 f"{sizing.human_bytes(memory.weights_and_optimizer)}, target embedding + head (bf16) "
                 f"{sizing.human_bytes(memory.target_head)}, activations {sizing.human_bytes(memory.activations)}"))
    if gpu_memory_gb is not None:
        rows.append((f"fits one {gpu_memory_gb:g} GiB GPU?", training_fit_line(
            draft, gpu_memory_gb, token_budget=token_budget or train.token_budget,
            ttt_steps=ttt_steps or train.ttt_steps)))
    return rows


GPU_KINDS_GIB = {"80 GiB (H100, A100)": 80.0, "141 GiB (H200)": 141.0}


def vllm_fit_line(weights_bytes: float, gpu_memory_gb: float | None) -> str:
    """Per GPU kind, the smallest tensor parallel size at which vLLM holds the weights (sizing.vllm_fits: 0.9 of the
    GPU, 4 GiB left for activations and a KV cache)."""
    kinds = dict(GPU_KINDS_GIB)
    if gpu_memory_gb is not None:
        kinds = {f"{gpu_memory_gb:g} GiB": gpu_memory_gb, **kinds}
    parts = []
    for name, gib in kinds.items():
        sizes = [(tp, *sizing.vllm_fits(weights_bytes, tp, gib * sizing.GiB)) for tp in (1, 2, 4, 8)]
        fit = next((s for s in sizes if s[1]), None)
        if fit is None:
            _, _, per, usable = sizes[-1]
            parts.append(f"{name}: not at TP=8 ({sizing.human_bytes(per)} per GPU of {sizing.human_bytes(usable)})")
        else:
            tp, _, per, usable = fit
            parts.append(f"{name}: TP={tp} ({sizing.human_bytes(per)} per GPU of {sizing.human_bytes(usable)})")
    return "; ".join(parts) + " (0.9 of each GPU, 4 GiB kept for activations and the KV cache)"


def spool_rows(per_token: dict[str, int], online_rate: float | None, lead_s: float, *, tokens: int | None,
               tokens_per_step: int) -> list[tuple[str, str]]:
    """The online spool rows: the `--spool-gb` for `online_rate` training tokens/s with the engines `lead_s` seconds
    ahead (`sizing.spool_bytes`, never below 4 chunks of one step of `tokens_per_step`), in bf16 and fp8, beside the
    offline store of `tokens`; without a rate, one row saying how to ask. `per_token`: the store row by dtype."""
    if online_rate is None:
        return [("online spool", "--online-rate TOKENS_PER_S: the spool `train --engine vllm` needs")]
    floor = {d: sizing.min_spool_bytes(b, tokens_per_step) for d, b in per_token.items()}
    bound = {d: max(sizing.spool_bytes(b, online_rate, lead_s), floor[d]) for d, b in per_token.items()}
    flag = {d: f"{math.ceil(b / sizing.GiB * 10) / 10:g}" for d, b in bound.items()}  # GiB, rounded up
    line = (f"{sizing.human_bytes(bound['bf16'])} bf16 / {sizing.human_bytes(bound['fp8'])} fp8: --spool-gb "
            f"{flag['bf16']} (--spool-dtype fp8: --spool-gb {flag['fp8']})")
    if tokens:
        line += (f"; vs the offline store of {tokens:,} tokens: {sizing.human_bytes(tokens * per_token['bf16'])} "
                 f"bf16 / {sizing.human_bytes(tokens * per_token['fp8'])} fp8")
    least = (f"{sizing.SPOOL_CHUNKS} chunks of one optimizer step, {tokens_per_step:,} tokens a step (--token-budget "
             f"x --grad-accum x ranks): {sizing.human_bytes(floor['bf16'])} bf16 / "
             f"{sizing.human_bytes(floor['fp8'])} fp8")
    return [(f"online spool ({_number(online_rate)} tok/s, {_number(lead_s)} s lead)", line),
            ("online spool floor", least)]


def _number(x: float) -> str:
    """20000.0 -> '20,000', 2.5 -> '2.5' (never an exponent)."""
    return f"{x:,.0f}" if x == int(x) else f"{x:,.2f}".rstrip("0")


def check_online(target: str | None, online_rate: float | None, spool_lead_s: float) -> None:
    """One line for an --online-rate / --spool-lead-s doctor cannot size a spool from."""
    if online_rate is not None and online_rate <= 0:
        raise DraftsmithError(f"--online-rate {online_rate:g}: must be > 0 (training tokens per second the "
                              "trainer consumes, all ranks together)")
    if spool_lead_s <= 0:
        raise DraftsmithError(f"--spool-lead-s {spool_lead_s:g}: must be > 0 (seconds the engines may run ahead)")
    if online_rate is not None and target is None:
        raise DraftsmithError("--online-rate: give --target too (the spool's rows come from the target's hidden "
                              "size)")


def training_fit_line(draft, gpu_memory_gb: float, *, token_budget: int, ttt_steps: int) -> str:
    """One line: whether the draft's training (one process) fits a GPU of `gpu_memory_gb` GiB (`sizing.training_fit`,
    10 % kept for the CUDA context and allocator slack), and the largest --token-budget that does."""
    fit = sizing.training_fit(draft, gpu_memory_gb * sizing.GiB, token_budget=token_budget, ttt_steps=ttt_steps)
    usage = (f"{sizing.human_bytes(fit.needed_bytes)} of the {sizing.human_bytes(fit.usable_bytes)} usable "
             f"(90 %) at --token-budget {token_budget}")
    if fit.max_token_budget < 16:
        return (f"no: {usage}, and the weights, AdamW state and target head alone do not fit; use a GPU with more "
                "memory or shard the draft (--distributed fsdp2 under torchrun)")
    most = f"--token-budget up to {fit.max_token_budget:,} fits"
    if fit.fits:
        return f"yes: {usage}; {most}"
    return f"no: {usage}; {most} (raise --grad-accum to keep the batch)"


def report(*, target: str | None = None, tokens: int | None = None, tensor_parallel_size: int = 1,
           gpu_memory_gb: float | None = None, vllm_source: str | Path | None = None,
           runtime: bool = False, online_rate: float | None = None, spool_lead_s: float = 60.0) -> dict:
    """Everything doctor finds, as one JSON-ready dict: {"draftsmith", "environment", "vllm": {source, version,
    platform, architecture, facts, strategy, reason, usable, capabilities}, "architectures": [one per architecture:
    its table row (architecture, "vLLM class", "aux ids vLLM reaches", connector, direct, notes), strategy, usable,
    support], "target": {path, architecture, sizes} when a target is given}."""
    check_online(target, online_rate, spool_lead_s)
    config = read_target_config(target) if target else None
    architecture = (config.get("architectures") or ["unknown"])[0] if config else "LlamaForCausalLM"
    main = probe.probe(vllm_source, architecture=architecture, config=config, resolve_config=runtime)
    out: dict = {
        "draftsmith": __version__,
        "environment": dict(environment_rows()),
        "vllm": {"source": main.source, "version": main.facts.version, "platform": main.facts.platform,
                 "architecture": main.architecture, "facts": main.facts.model_dump(), "strategy": main.strategy,
                 "reason": main.reason, "usable": main.usable,
                 "capabilities": [cap.model_dump() for cap in main.capabilities]},
        "architectures": [{**probe.architecture_row(r), "strategy": r.strategy, "usable": r.usable,
                           "support": r.support.model_dump() if r.support is not None else None}
                          for r in _architecture_reports(architecture, config, vllm_source)],
    }
    if config is not None:
        out["target"] = {"path": str(target), "architecture": architecture, "sizes": dict(sizing_rows(
            config, tokens=tokens, tensor_parallel_size=tensor_parallel_size, gpu_memory_gb=gpu_memory_gb,
            online_rate=online_rate, spool_lead_s=spool_lead_s))}
        if main.facts.installed:
            out["target"]["vllm_dtype_auto"] = probe.choose_dtype("auto", main, config).model_dump()
    return out


def dtype_line(report: probe.ProbeReport, config: dict | None) -> str:
    """The dtype `auto` starts this vLLM in for the target (extract, train --engine vllm, feed, evaluate, serve),
    and why."""
    choice = probe.choose_dtype("auto", report, config)
    line = f"{choice.dtype} ({choice.why})"
    return line + (f"; if it cannot run, {choice.fallback} once" if choice.fallback else "")


def _architecture_reports(architecture: str, config: dict | None, vllm_source: str | Path | None):
    archs = list(probe.TESTED_ARCHITECTURES)
    if architecture not in archs:
        archs.insert(0, architecture)
    return probe.probe_architectures(archs, vllm_source, configs={architecture: config} if config else None)


def _say(console: Console, text: str, style: str | None = None, *, wrap: bool = False, indent: int = 0) -> None:
    """One line of the summary, cut to the screen with an ellipsis (or, `wrap`, wrapped under its indent)."""
    if wrap:
        console.print(Padding(Text(text, style=style or ""), (0, 0, 0, indent), expand=False), highlight=False)
    else:
        console.print(Text(" " * indent + text, style=style or ""), no_wrap=True, overflow="ellipsis",
                      highlight=False)


def print_summary(console: Console, main: probe.ProbeReport, reports: list[probe.ProbeReport],
                  target_rows: list[tuple[str, str]] | None, target: str | None, config: dict | None) -> None:
    """doctor on one screen: versions and hardware, the strategy this vLLM takes and why, the capabilities that are
    missing, unknown or worth knowing, one line per architecture, and the target's sizes when one is given."""
    env = dict(environment_rows())
    gpus = "no GPU" if env["gpus"].startswith("none") else f"GPUs: {env['gpus']}"
    _say(console, f"draftsmith {env['draftsmith']} · Python {env['python']} · {env['platform']} · "
                  f"{env['cpu cores']} CPU cores · {gpus}", "bold")
    _say(console, f"torch {env['torch']} · transformers {env['transformers']} · vllm {env['vllm']}", indent=2)
    assets_rows = {k.removeprefix("asset: "): v for k, v in env.items() if k.startswith("asset: ")}
    missing = [name for name, state in assets_rows.items() if state != "cached"]
    _say(console, f"cache {env['cache']}: {len(assets_rows) - len(missing)} of {len(assets_rows)} default assets "
                  "cached" + (f" (fetched on first use: {', '.join(missing)})" if missing else ""), indent=2)
    facts = main.facts
    if not facts.installed:
        _say(console, f"vLLM: not found ({main.reason})", "bold", wrap=True)
    else:
        _say(console, f"vLLM {facts.version} ({facts.platform or 'platform unknown'}), read from its source, never "
                      "imported", "bold")
        head = f"strategy: {main.strategy} for {main.architecture}" if main.strategy else \
            f"no vLLM strategy for {main.architecture}"
        _say(console, f"{head} ({main.reason})", None if main.strategy else "red", wrap=True, indent=2)
        caps = main.capabilities
        worth = [c for c in caps if c.unknown or c.ok is False]
        counts = f"{sum(c.ok is True for c in caps)} as needed, {sum(c.ok is None for c in caps)} informational"
        if worth:
            counts += f", {sum(c.ok is False and not c.unknown for c in caps)} missing, " \
                      f"{sum(c.unknown for c in caps)} unknown"
        if target_rows is None:  # with a target, its sizes end with the choice for it
            _say(console, f"compute dtype (auto): {dtype_line(main, config)}", wrap=True, indent=2)
        _say(console, f"capabilities: {counts}", indent=2)
        for cap in worth:
            mark = "?" if cap.unknown else "✗"
            _say(console, f"{mark} {cap.name}: {cap.found} — {cap.meaning}", "yellow" if cap.unknown else "red",
                 indent=4)
    _say(console, "architectures: strategy · aux ids vLLM reaches · notes", "bold")
    width = max((len(r.architecture) for r in reports), default=0)
    for r in reports:
        row = probe.architecture_row(r)
        _say(console, f"{r.architecture:<{width}}  {r.strategy or 'none':<9} {row['aux ids vLLM reaches']:<5} "
                      f"{row['notes'] if row['notes'] != '-' else ''}".rstrip(), indent=2)
    if target_rows is not None:
        _say(console, f"target {target}: sizes from its config.json", "bold")
        for key, value in target_rows:
            _say(console, f"{key}: {value}", wrap=True, indent=2)
    _say(console, "the full tables: draftsmith doctor --verbose · everything for scripts: --json", "dim")


def run(console: Console, *, target: str | None = None, tokens: int | None = None,
        tensor_parallel_size: int = 1, gpu_memory_gb: float | None = None, vllm_source: str | Path | None = None,
        runtime: bool = False, as_json: bool = False, online_rate: float | None = None,
        spool_lead_s: float = 60.0, verbose: bool = False) -> None:
    """Print doctor's summary, one screen (`verbose`: its full tables; `as_json`: the one JSON object of `report`).
    `vllm_source`: probe that vLLM tree instead of the installed one (no runtime step); `runtime`: build the
    installed vLLM's engine config too; `online_rate`, `spool_lead_s`: the target's online spool rows
    (`spool_rows`)."""
    check_online(target, online_rate, spool_lead_s)  # a bad rate is one line before anything is printed
    if vllm_source is not None:
        package_dir(vllm_source)  # a wrong --vllm-source is one line before anything is printed
    if as_json:
        console.out(json.dumps(report(target=target, tokens=tokens, tensor_parallel_size=tensor_parallel_size,
                                      gpu_memory_gb=gpu_memory_gb, vllm_source=vllm_source, runtime=runtime,
                                      online_rate=online_rate, spool_lead_s=spool_lead_s),
                               indent=2), highlight=False)
        return
    config = read_target_config(target) if target else None
    architecture = (config.get("architectures") or ["unknown"])[0] if config else "LlamaForCausalLM"
    main = probe.probe(vllm_source, architecture=architecture, config=config, resolve_config=runtime)
    reports = _architecture_reports(architecture, config, vllm_source)
    if not verbose:
        rows = None
        if config is not None:
            rows = sizing_rows(config, tokens=tokens, tensor_parallel_size=tensor_parallel_size,
                               gpu_memory_gb=gpu_memory_gb, online_rate=online_rate, spool_lead_s=spool_lead_s)
            if main.facts.installed:
                rows.append(("vLLM compute dtype (auto)", dtype_line(main, config)))
        print_summary(console, main, reports, rows, target, config)
        return
    table = Table(title="draftsmith doctor", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in environment_rows():
        table.add_row(key, value)
    console.print(table)
    console.print(probe.render_probe_table(main))
    console.print(probe.render_architecture_table(reports))
    if config is not None:
        sizes = Table(title=f"target {target}: sizes from its config.json", show_header=False, title_justify="left")
        sizes.add_column(style="bold")
        sizes.add_column()
        for key, value in sizing_rows(config, tokens=tokens, tensor_parallel_size=tensor_parallel_size,
                                      gpu_memory_gb=gpu_memory_gb, online_rate=online_rate,
                                      spool_lead_s=spool_lead_s):
            sizes.add_row(key, value)
        if main.facts.installed:
            sizes.add_row("vLLM compute dtype (auto)", dtype_line(main, config))
        console.print(sizes)


__all__ = ["check_online", "dtype_line", "environment_rows", "print_summary", "read_target_config", "report", "run",
           "sizing_rows", "spool_rows", "training_fit_line"]
