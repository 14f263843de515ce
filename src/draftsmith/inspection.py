"""`draftsmith inspect`: any artefact's manifest, or one sample with its loss-masked span (and shared prefix) shown."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import read_manifest_json
from draftsmith.core.targets import load_tokenizer
from draftsmith.extract import store
from draftsmith.prepare.dataset import open_prepared


def _open_samples(path: Path, kind: str):
    if kind == "prepared":
        return open_prepared(path)
    if kind == "store":
        return store.open(path)
    raise DraftsmithError(f"{path}: a {kind!r} artefact has no samples; drop --sample to see its manifest")


def _manifest_table(path: Path, data: dict) -> Table:
    table = Table(title=f"{path} ({data.get('kind', '?')})", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in data.items():
        if isinstance(value, list) and len(value) > 8:
            value = f"{len(value)} entries"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value)
        table.add_row(key, str(value))
    return table


def highlighted_text(tokenizer, input_ids: list[int], loss_mask: list[int]) -> Text:
    """The decoded sample, loss-masked (trained-on) spans in bold green, the rest dim."""
    text = Text()
    position = 0
    for masked, group in itertools.groupby(loss_mask, key=bool):
        n = len(list(group))
        piece = tokenizer.decode(input_ids[position : position + n], skip_special_tokens=False)
        text.append(piece, style="bold green" if masked else "dim")
        position += n
    return text


def run(path: Path, *, sample: int | None, as_json: bool, console: Console) -> None:
    path = Path(path)
    if not path.exists():
        raise DraftsmithError(f"{path}: does not exist")
    data = read_manifest_json(path)
    kind = str(data.get("kind", "unknown"))
    if sample is None:
        if as_json:
            print(json.dumps(data, indent=2))
        else:
            console.print(_manifest_table(path, data))
        return
    samples = _open_samples(path, kind)
    if not 0 <= sample < len(samples):
        raise DraftsmithError(f"{path}: --sample {sample} out of range (the {kind} set has {len(samples)} samples)")
    item = samples[sample]
    input_ids = [int(t) for t in item["input_ids"].tolist()]
    loss_mask = [int(m) for m in item["loss_mask"].tolist()]
    if as_json:
        sample_id = int(item.get("sample_id", sample))
        print(json.dumps({"sample_id": sample_id, "input_ids": input_ids, "loss_mask": loss_mask}))
        return
    tokenizer = load_tokenizer(Path(samples.manifest.target.path))
    parent, shared = samples.prefix(sample) if kind == "prepared" else (-1, 0)
    console.print(
        f"[bold]{path}[/] sample {sample}: {len(input_ids)} tokens, {sum(loss_mask)} loss-masked"
        + (f", the first {shared} those of sample {parent}" if shared else "")
        + " ([bold green]trained on[/], [dim]context[/])"
    )
    console.print(highlighted_text(tokenizer, input_ids, loss_mask))
    if "hidden_states" in item:
        console.print(
            f"hidden_states: {tuple(item['hidden_states'].shape)} {item['hidden_states'].dtype}, "
            f"layer ids {list(samples.layer_ids)}"
        )
