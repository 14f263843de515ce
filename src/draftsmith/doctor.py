"""`draftsmith doctor`: what is installed, what hardware there is, and which extraction strategy will work."""

from __future__ import annotations

import importlib.util
import os
import platform

from rich.console import Console
from rich.table import Table

from draftsmith import __version__
from draftsmith.core import assets


def _version_of(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return str(getattr(importlib.import_module(module), "__version__", "installed"))
    except Exception as err:  # noqa: BLE001 - a broken install is exactly what doctor must report
        return f"broken ({type(err).__name__}: {err})"


def environment_rows() -> list[tuple[str, str]]:
    import torch

    rows = [
        ("draftsmith", __version__),
        ("python", platform.python_version()),
        ("platform", f"{platform.system()} {platform.machine()}"),
        ("cpu cores", str(os.cpu_count())),
        ("torch", torch.__version__),
        ("transformers", _version_of("transformers")),
        ("vllm", _version_of("vllm")),
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


def run(console: Console) -> None:
    table = Table(title="draftsmith doctor", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in environment_rows():
        table.add_row(key, value)
    console.print(table)
    try:
        from draftsmith.extract.vllm import probe
    except ImportError:
        console.print("vLLM capability probe: not built yet in this version")
        return
    console.print(probe.render_probe_table(probe.probe()))
