"""The `draftsmith` command: a thin typer shell over each stage's `run(cfg)`.

Each stage's options are generated from its pydantic config (the config package), so a config field and its
`--option` can never drift apart. User mistakes (DraftsmithError) print one line and exit 1.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, TypeVar

import typer
from pydantic.fields import FieldInfo
from rich.console import Console
from rich.table import Table
from rich.text import Text

from draftsmith import __version__, config
from draftsmith.core import threads
from draftsmith.core.errors import DraftsmithError

app = typer.Typer(
    name="draftsmith",
    help="Train speculative-decoding drafts (EAGLE-3, Eagle 3.1, P-EAGLE, DFlash, DSpark) for Hugging Face causal LMs "
    "and serve them with vLLM.\n\nPipeline: prepare -> extract -> train -> export -> evaluate -> serve (or `quickstart` "
    "for all of it).\n\nDocs: docs/index.md",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
store_app = typer.Typer(
    help="Work with hidden-state stores: verify checksums, merge stores from many writers.\n\nDocs: docs/formats.md",
    no_args_is_help=True,
)
app.add_typer(store_app, name="store")
console = Console()
err_console = Console(stderr=True)

# the page of docs/ that explains each stage command: its help ends with it
DOCS = dict(regenerate="guides/agentic.md", feed="guides/online.md", train="guides/methods.md")
DOCS |= dict(evaluate="guides/evaluation.md", serve="guides/serving.md", quickstart="getting-started/quickstart.md")
DOCS |= dict(improve="guides/improve.md")
# the help panels of the long commands, each with its options; "*": where any option not named goes
PANELS = {
    "train": {
        "Data": "data target aux_layer_ids max_samples eval_fraction split_seed trust_remote_code",
        "Draft and method": "method num_layers init_from lm_head_init *",
        "Optimisation": "lr weight_decay epochs max_steps token_budget grad_accum warmup_steps schedule min_lr_ratio "
        "clip noise_std seed precision compile attention_kernel activation_checkpointing",
        "Online training": "engine spool remote_engines stall_timeout_s spool_gb spool_dtype keep_epoch0 "
        "engine_tensor_parallel_size engine_data_parallel_size engine_devices vllm_strategy engine_dtype vllm_compile",
        "Distributed": "distributed num_workers device",
        "Logging and checkpoints": "output eval_every save_every keep_checkpoints log_every resume force",
        "Probes (real acceptance while training)": "probe_every probe_prompts probe_num_prompts probe_max_new_tokens "
        "probe_engine probe_device",
    },
    "evaluate": {
        "Draft, target and output": "draft target output engine device dtype trust_remote_code *",
        "Prompts": "prompts num_prompts eval_fraction split_seed chat_template_kwargs",
        "Decoding": "k max_new_tokens temperature seed baseline",
        "Gate and concurrency": "gate gate_tolerance concurrency",
        "vLLM engine": "vllm_args max_model_len vllm_kv_cache_gb tensor_parallel_size vllm_timeout_s",
    },
}


def _panel(command: str, option: str) -> str | None:
    panels = PANELS.get(command, {})
    named = [p for p, options in panels.items() if option in options.split()]
    return next(iter(named or [p for p, options in panels.items() if "*" in options.split()]), None)


def _fail(message: str, code: int = 1) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


T = TypeVar("T")


def _call(fn: Callable[[], T]) -> T:
    """Run a stage, turning user errors into one line and an interrupt into a resume hint."""
    try:
        return fn()
    except DraftsmithError as err:
        raise _fail(str(err)) from None
    except KeyboardInterrupt:
        raise _fail("interrupted; run the same command again to resume where it stopped", 130) from None


def _print_result(result: config.StageResult) -> None:
    table = Table(title=f"draftsmith {result.stage}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in result.summary.items():
        table.add_row(str(key), Text(_fmt(value)))  # data, not markup: "draftsmith[report]" stays as it is
    if "output" not in result.summary:
        table.add_row("output", str(result.output))
    console.print(table)
    for label, command in result.commands.items():
        console.print(f"[bold]{label}:[/]")
        console.print(command, soft_wrap=True, markup=False, highlight=False)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _unwrap_optional(annotation: object) -> object:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _option(name: str, field: FieldInfo, positional: bool, panel: str | None = None) -> tuple[object, object]:
    """(annotation, default) for one config field; every default is None so only given flags override."""
    annotation = _unwrap_optional(field.annotation)
    origin = typing.get_origin(annotation)
    help_text = field.description or ""
    default = field.get_default(call_default_factory=True)
    if default not in (None, [], "", {}):
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        help_text += f"  [default: {shown}]"
    flag = "--" + name.replace("_", "-")
    kwargs: dict[str, Any] = {"help": help_text, "show_default": False, "rich_help_panel": panel}
    if annotation is bool:
        decl = typer.Option(f"{flag}/--no-{name.replace('_', '-')}", **kwargs)
        return Optional[bool], decl  # noqa: UP045 - typer reads Optional[...]
    py_type = annotation if origin is Literal or annotation in (int, float, str, Path) else str
    if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("repeatable"):
        return Optional[list[str]], typer.Option(flag, **kwargs)  # noqa: UP045 - typer reads Optional[...]
    if origin in (list, tuple):
        kwargs["help"] = help_text + "  (comma-separated)"
    if positional:
        return Optional[py_type], typer.Argument(help=kwargs["help"], show_default=False, rich_help_panel=panel)  # noqa: UP045 - typer reads Optional[...]
    return Optional[py_type], typer.Option(flag, **kwargs)  # noqa: UP045 - typer reads Optional[...]


def _keyword(name: str, annotation: object, decl: object) -> inspect.Parameter:
    """A generated command's keyword parameter: `Annotated[annotation, decl]`, None by default."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[annotation, decl])


def _stage_command(
    name: str, cfg_cls: type[config.StageConfig], help_text: str, positional: tuple[str, ...] = ()
) -> None:
    """Register `draftsmith NAME` from its config class; its `run` is imported when it runs (`_runner`)."""
    config_option = typer.Option("--config", "-c", help="YAML file with options; flags override it.")
    params = [_keyword("config_file", Path | None, config_option)]
    for field_name, field in cfg_cls.flag_fields().items():
        extra = field.json_schema_extra
        if typing.get_origin(field.annotation) is dict and not (isinstance(extra, dict) and extra.get("json_flag")):
            continue  # a YAML-only section (a recipe's per-stage options): no flag for it
        option = _option(field_name, field, field_name in positional, _panel(name, field_name))
        params.append(_keyword(field_name, *option))
    # the options in their panels' order (help lists the panels in the order it meets them)
    panels: list[str | None] = [None, *PANELS.get(name, {})]
    params.sort(key=lambda p: panels.index(_panel(name, p.name) if p.name != "config_file" else None))

    def command(**kwargs: Any) -> None:
        config_file = kwargs.pop("config_file")
        cfg = _call(lambda: config.load_config(cfg_cls, config_file, kwargs))
        if name == "train":  # before the stage loads torch: OpenMP reads its wait policy once, then
            threads.choose()
        try:
            run = _runner(name)
        finally:
            threads.release()
        _print_result(_call(lambda: run(cfg)))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # read by typer; functions take it
    command.__name__ = name
    app.command(name, help=f"{help_text}\n\nDocs: docs/{DOCS.get(name, 'getting-started/stages.md')}")(command)


def _runner(name: str) -> Callable[..., config.StageResult]:
    """A stage's `run`, imported when its command runs: `draftsmith --help` loads no stage (nor torch)."""
    run: Callable[..., config.StageResult]  # each stage's takes its own config
    if name == "regenerate":
        from draftsmith.prepare.regenerate import run
    elif name == "prepare":
        from draftsmith.prepare.stage import run
    elif name == "extract":
        from draftsmith.extract.stage import run
    elif name == "train":
        from draftsmith.train.stage import run
    elif name == "feed":
        from draftsmith.extract.vllm.feed import run
    elif name == "export":
        from draftsmith.export.stage import run
    elif name == "evaluate":
        from draftsmith.evaluate.stage import run
    elif name == "serve":
        from draftsmith.serve import run
    elif name == "quickstart":
        from draftsmith.quickstart import run
    elif name == "improve":
        from draftsmith.improve import run
    else:
        raise AssertionError(name)
    return run


_stage_command(
    "regenerate",
    config.RegenerateConfig,
    "Have the target answer the conversations' user turns itself (vLLM or transformers), so the draft "
    "trains on the target's own answers; writes messages JSONL that `draftsmith prepare --data` reads.",
)
_stage_command(
    "prepare",
    config.PrepareConfig,
    "Render conversations with the target's chat template into token shards with assistant loss masks.",
)
_stage_command(
    "extract",
    config.ExtractConfig,
    "Run the target over a prepared set and store its aux-layer hidden states (transformers or vLLM).",
)
_stage_command(
    "train",
    config.TrainConfig,
    "Train a draft (--method eagle3, eagle3.1, peagle, dflash, dspark) from a store (offline) or a prepared set "
    "(online).",
)
_stage_command(
    "feed",
    config.FeedConfig,
    "The engine side of online training on another node: a vLLM engine that computes the chunks a "
    "`train --engine vllm --remote-engines` trainer plans and publishes them to its --spool (Mooncake).",
)
_stage_command(
    "export",
    config.ExportConfig,
    "Write a trained draft as a vLLM, SGLang or speculators model directory.",
    positional=("checkpoint",),
)
_stage_command(
    "evaluate",
    config.EvaluateConfig,
    "Measure acceptance length and speed-up by real speculative decoding (reference decoder or vLLM).",
)
_stage_command(
    "serve",
    config.ServeConfig,
    "Serve a draft with its target: vLLM's OpenAI-compatible server, speculative decoding by the draft's method."
    "\n\nListens on 127.0.0.1:8000 unless --host / --port say otherwise; Ctrl-C or SIGTERM stops it. "
    "Other `vllm serve` options go in --vllm-args.",
    positional=("draft",),
)
_stage_command(
    "improve",
    config.ImproveConfig,
    "A better draft from what the target served (serve --record): hold out the newest requests, train from the "
    "current draft on the rest, prove both on the held-out ones, and promote the new one only where it is better "
    "beyond the intervals (OUT/vN, OUT/current).",
)
_stage_command(
    "quickstart",
    config.QuickstartConfig,
    "The whole path on the embedded default: prepare -> extract -> train -> export -> evaluate, resumable."
    "\n\nA --config recipe (see recipes/) may also hold one section per stage, e.g. `train: {lr: 5.0e-4}`, "
    "whose options go on top of what --budget chose.",
)


# `draftsmith doctor`'s options: what each one asks of it
DOCTOR_HELP = {
    "target": "A target's model directory or its config.json alone: add its vLLM row and what its store and its "
    "draft's training will take (from the config, no weights read).",
    "tokens": "Tokens of the data set to size the store for.",
    "prepared": "A prepared set to size the store for: its tokens, one context per generation, and its distinct "
    "tokens, what extract stores where samples share prefixes (agentic traffic).",
    "tensor_parallel_size": "GPUs the target's weights are split over, for the per-GPU weight size.",
    "gpu_memory_gb": "Memory of one training GPU in GiB (80 for an 80 GB H100/A100): says whether the draft's "
    "training fits it and the largest --token-budget that does.",
    "online_rate": "Training tokens per second the trainer consumes (all ranks together): with --target, the "
    "--spool-gb that `train --engine vllm` needs for it, in bf16 and fp8.",
    "spool_lead_s": "How far ahead of the trainer the engines may run, in seconds of its consumption, for "
    "--online-rate.",
    "vllm_source": "Probe the vLLM source in this directory instead of the installed vLLM: a site-packages, an "
    "unpacked wheel, a checkout, or the vllm package itself (read, never imported; no runtime step).",
    "runtime": "Also ask the installed vLLM what async_scheduling resolves to here: it builds its engine config for "
    "the target in a subprocess (some seconds).",
    "as_json": "Print one JSON object (versions, the probe's facts, strategy and reason, one entry per architecture) "
    "and nothing else, for scripts.",
    "verbose": "The full tables: every environment row and asset, every capability the probe read with what it "
    "found and means, every architecture's row per strategy.",
}


@app.command("doctor")
def doctor(  # noqa: PLR0913 - a typer command: one parameter per --option
    target: Annotated[str | None, typer.Option("--target", help=DOCTOR_HELP["target"])] = None,
    tokens: Annotated[int | None, typer.Option("--tokens", help=DOCTOR_HELP["tokens"])] = None,
    prepared: Annotated[Path | None, typer.Option("--prepared", help=DOCTOR_HELP["prepared"])] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", help=DOCTOR_HELP["tensor_parallel_size"])
    ] = 1,
    gpu_memory_gb: Annotated[float | None, typer.Option("--gpu-memory-gb", help=DOCTOR_HELP["gpu_memory_gb"])] = None,
    online_rate: Annotated[
        float | None, typer.Option("--online-rate", metavar="TOKENS_PER_S", help=DOCTOR_HELP["online_rate"])
    ] = None,
    spool_lead_s: Annotated[
        float, typer.Option("--spool-lead-s", metavar="SECONDS", help=DOCTOR_HELP["spool_lead_s"])
    ] = 60.0,
    vllm_source: Annotated[Path | None, typer.Option("--vllm-source", help=DOCTOR_HELP["vllm_source"])] = None,
    runtime: Annotated[bool, typer.Option("--runtime", help=DOCTOR_HELP["runtime"])] = False,
    as_json: Annotated[bool, typer.Option("--json", help=DOCTOR_HELP["as_json"])] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help=DOCTOR_HELP["verbose"])] = False,
) -> None:
    """Show versions, hardware, cached default assets, what vLLM can do per architecture (read from its source,
    never imported), and a target's sizes: one screen, --verbose for the full tables.

    Docs: docs/getting-started/install.md"""
    options = dict(locals())  # doctor.run's keywords, as given
    from draftsmith import doctor as doctor_module  # like every stage: loaded when its command runs

    _call(lambda: doctor_module.run(console, **options))


@app.command("inspect")
def inspect_command(
    path: Annotated[
        Path, typer.Argument(help="Any draftsmith artefact directory (prepared set, store, checkpoint, export).")
    ],
    sample: Annotated[
        int | None, typer.Option("--sample", "-s", help="Show sample i of a prepared set or store.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (for scripts).")] = False,
) -> None:
    """Show an artefact's manifest, or one sample with its loss-masked span highlighted.

    Docs: docs/formats.md"""
    from draftsmith import inspection

    _call(lambda: inspection.run(path, sample=sample, as_json=as_json, console=console))


@store_app.command("verify")
def store_verify(
    path: Annotated[Path, typer.Argument(help="Hidden-state store directory.")],
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Drop damaged shards from the manifest so that `draftsmith extract` recomputes exactly their samples.",
        ),
    ] = False,
) -> None:
    """Re-check every shard's checksum and the manifest's counts; report NaN/Inf tokens.

    Docs: docs/formats.md"""
    from draftsmith.extract.store import verify_store

    report = _call(lambda: verify_store(path, repair=repair))
    console.print(report)
    if not report.ok:
        raise typer.Exit(1)


@store_app.command("merge")
def store_merge(
    inputs: Annotated[list[Path], typer.Argument(help="Stores to merge (same target, layers and dtype).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Merged store directory to create.")],
) -> None:
    """Join stores written by several workers (`extract --shard i/n`) into one.

    Docs: docs/formats.md"""
    from draftsmith.extract.store import merge_stores

    console.print(_call(lambda: merge_stores(inputs, output)))


@app.command("version")
def version() -> None:
    """Print draftsmith's version.

    Docs: docs/index.md"""
    console.print(__version__)


def main() -> None:  # pragma: no cover - entry point
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
