"""The docs cannot drift from the code: the generated reference pages are current, every `draftsmith ...` command a
page or the README shows parses with the real CLI, every relative link resolves, every page is in the site's nav,
every command's help names the page that explains it, and the README stays a landing page. Fast, and without
mkdocs (CI builds the site with `mkdocs build --strict` in its own venv)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import unicodedata
from pathlib import Path

import pytest
import typer
import yaml

from draftsmith.cli import PANELS, app

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
FENCE = re.compile(r"^(```+|~~~+)(.*)$")
# click's exceptions, wherever typer takes click from (typer 0.29 carries its own copy)
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
CLICK_EXIT = getattr(importlib.import_module(CLICK_ERROR.__module__), "Exit", typer.Exit)


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_is_current():
    gen = _generator()
    pages = gen.render_all()
    assert (
        "`--max-length`" in pages["reference/cli/prepare.md"]
        and "## Online training" in pages["reference/cli/train.md"]
    )
    assert "`lr`" in pages["reference/config.md"] and "`method: dflash`" in pages["reference/config.md"]
    assert not gen.stale(), "run: python scripts/gen_cli_docs.py"


# ---- every command a page shows parses with the CLI -------------------------------------------------------------


def _fenced_blocks(text: str):
    """(info string, [lines]) of every fenced code block."""
    block, info, fence = None, "", ""
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if block is None and match:
            block, fence, info = [], match.group(1), match.group(2).strip()
        elif block is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            yield info, block
            block = None
        elif block is not None:
            block.append(line)


def _logical_lines(lines: list[str]):
    """Shell lines with their `\\` continuations joined."""
    current = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            yield current + line
            current = ""
    if current:
        yield current


def _draftsmith_args(line: str) -> list[list[str]]:
    """The arguments of each `draftsmith ...` (or `.venv/bin/draftsmith`, `python -m draftsmith`, `torchrun ... -m
    draftsmith`) command on a shell line, without comments, split at `&&`, `;` and `|`."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []
    found, segment = [], []
    for word in [*words, ";"]:
        if word not in ("&&", "||", ";", "|"):
            segment.append(word)
            continue
        while segment and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", segment[0]):  # VAR=value before a command
            segment.pop(0)
        if segment and (segment[0] == "draftsmith" or segment[0].endswith("/draftsmith")):
            found.append(segment[1:])
        elif "-m" in segment and segment[segment.index("-m") + 1 :][:1] == ["draftsmith"]:
            found.append(segment[segment.index("-m") + 2 :])
        segment = []
    return found


def _commands_shown() -> list[tuple[str, list[str]]]:
    """(where, args) for every command in the fenced blocks of README.md and docs/: in `console` blocks the `$ `
    lines (the rest is output), in every other block each line that runs draftsmith."""
    shown = []
    for page in PAGES:
        for info, lines in _fenced_blocks(page.read_text(encoding="utf-8")):
            if info.split()[:1] in (["python"], ["yaml"], ["json"]):
                continue
            if info.startswith("console"):
                lines = [line.strip()[2:] for line in lines if line.strip().startswith("$ ")]
            for line in _logical_lines(lines):
                for args in _draftsmith_args(line):
                    shown.append((f"{page.relative_to(ROOT)}: {line.strip()}", args))
    return shown


def _parse(args: list[str]) -> None:
    """Parse args as `draftsmith ARGS` would, down to the leaf command, without running anything."""
    command = typer.main.get_command(app)
    ctx = command.make_context("draftsmith", list(args), resilient_parsing=False)
    while getattr(command, "commands", None):
        protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])
        name, sub, rest = command.resolve_command(ctx, [*protected, *ctx.args])
        assert sub is not None, f"no command {name}"
        command, ctx = sub, sub.make_context(name, rest, parent=ctx, resilient_parsing=False)


COMMANDS = _commands_shown()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 60
    shown = {args[0] for _, args in COMMANDS if args}
    assert {"prepare", "extract", "train", "export", "evaluate", "serve", "doctor", "quickstart"} <= shown


@pytest.mark.parametrize("where,args", COMMANDS, ids=[w[:90] for w, _ in COMMANDS])
def test_every_command_the_docs_show_parses(where, args):
    try:
        _parse(args)
    except CLICK_EXIT as done:  # --help, --version: parsed, and would exit here
        assert done.exit_code == 0, where
    except CLICK_ERROR as err:
        pytest.fail(f"{where}\n  does not parse with the CLI: {err.format_message()}")


def test_a_changed_option_fails_the_check():
    with pytest.raises(CLICK_ERROR):
        _parse(["train", "--data", "runs/store", "--no-such-option", "1"])
    with pytest.raises(CLICK_ERROR):
        _parse(["evaluate", "--gate-tolerance", "small"])
    assert _draftsmith_args("torchrun --nproc-per-node 8 -m draftsmith train --data x  # comment") == [
        ["train", "--data", "x"]
    ]
    assert _draftsmith_args("bash scripts/install.sh && .venv/bin/draftsmith quickstart") == [["quickstart"]]


# ---- links and the site's nav -----------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading (what mkdocs anchors are)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _prose(text: str, code: bool = False) -> str:
    """The text without fenced blocks, and without inline code unless `code` (links there are code, not links)."""
    kept, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
        elif not inside:
            kept.append(line if code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def _anchors(path: Path) -> set[str]:
    return {
        _slug(h)
        for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _prose(path.read_text(encoding="utf-8"), code=True), re.M)
    }


def test_every_relative_link_resolves():
    broken, checked = [], 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            checked += 1
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
            elif page.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
                broken.append(f"{page.relative_to(ROOT)}: {target} (outside docs/: the site cannot link it)")
    assert checked > 40
    assert not broken, "broken links:\n" + "\n".join(broken)


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    return [f for item in node for f in _nav_files(item)]


def test_every_page_is_in_the_site_nav():
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_files(site["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, "mkdocs.yml's nav and docs/ differ"
    assert "architecture.md" in nav and "benchmarks.md" in nav and "guides/evaluation.md" in nav


def test_the_docs_extra_pins_mkdocs():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'docs = \["mkdocs==[\d.]+", "mkdocs-material==[\d.]+"\]', text)


# ---- the help and the README ------------------------------------------------------------------------------------


def _leaf_commands(command, path: str = "draftsmith"):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _leaf_commands(sub, f"{path} {name}")


def test_every_commands_help_names_its_docs_page():
    for path, command in _leaf_commands(typer.main.get_command(app)):
        pages = re.findall(r"Docs: (docs/\S+\.md)\s*$", command.help or "")
        assert pages, f"`{path} --help` does not end with its docs page"
        assert (ROOT / pages[0]).is_file(), f"`{path} --help` names {pages[0]}, which does not exist"
    top = typer.main.get_command(app).help
    assert "EAGLE-3, Eagle 3.1, P-EAGLE, DFlash, DSpark" in top and "serve" in top


def test_train_and_evaluate_options_are_in_panels():
    root = typer.main.get_command(app)
    for name, panels in PANELS.items():
        params = [p for p in root.commands[name].params if p.name not in ("help", "config_file")]
        assert {p.rich_help_panel for p in params} == set(panels), name
    train = {p.name: p.rich_help_panel for p in root.commands["train"].params}
    assert train["spool_gb"] == "Online training" and train["block_size"] == "Draft and method"
    assert train["lr"] == "Optimisation" and train["save_every"] == "Logging and checkpoints"


def test_the_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    blocks = [lines for info, lines in _fenced_blocks(text) if info == "bash"]
    assert blocks[:2] == [
        ["bash scripts/install.sh && .venv/bin/draftsmith quickstart"],
        ["bash scripts/install.sh --test && .venv/bin/python -m pytest"],
    ]
