"""Every user mistake is one line naming the file, the record (where there is one) and the reason, with exit code 1
and no traceback: malformed conversations given to `prepare`, broken `--config` files, and the wrong artefact (or
none) given to every other command. A bad record in otherwise good data is a counted skip that names its file and
record instead."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from draftsmith import serve
from draftsmith.cli import app
from draftsmith.config import PrepareConfig
from draftsmith.prepare import run as prepare_run
from draftsmith.prepare.dataset import open_prepared

runner = CliRunner()


def _conv(user: str = "What is the capital of France?", answer: str = "Paris.") -> dict:
    return {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]}


def _msgs(*turns: tuple[str, object]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


def _jsonl(*records: object) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def assert_one_line_error(result, *needles: str) -> str:
    """The command failed with exit code 1 and exactly one `error:` line holding every needle."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # a DraftsmithError, not a crash
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _prepare(tmp_path: Path, target: Path, *data: Path | str, **options: str):
    args = [
        "prepare",
        "--data",
        ",".join(map(str, data)),
        "--target",
        str(target),
        "--output",
        str(tmp_path / "out"),
        "--num-workers",
        "1",
    ]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", value]
    return runner.invoke(app, args)


# ------------------------------------------------------------------ prepare: malformed input files


def _parquet_bytes(table: pa.Table, tmp_path: Path) -> bytes:
    pq.write_table(table, tmp_path / "scratch.parquet")
    return (tmp_path / "scratch.parquet").read_bytes()


# name -> (file name, contents (or a function of tmp_path giving them), what the error line says besides the file)
BAD_FILES = {
    "not JSON": ("chats.json", b"not json at all\n", ["invalid JSON", "not json at all"]),
    "a JSON string": ("chats.json", b'"just a string"\n', ["holds a JSON string", "not a list of conversations"]),
    "a JSON number": ("chats.json", b"42\n", ["holds a JSON number"]),
    "an object that is no conversation": (
        "chats.json",
        b'{"a": 1}\n',
        ["0 of 1 records usable", "no conversations 1", "record 0", "keys: a"],
    ),
    "records without messages": (
        "chats.json",
        json.dumps([{"foo": 1}, {"bar": 2}]).encode(),
        ["0 of 2 records usable: no conversations 2", "record 0: no conversations"],
    ),
    "records that are not objects": (
        "chats.json",
        b"[1, 2, 3]",
        ["0 of 3 records usable: not a JSON object 3", "record 0: record is a JSON number"],
    ),
    "messages not a list": ("chats.jsonl", _jsonl({"messages": "hello"}), ["record 0", "messages is a JSON string"]),
    "empty messages": ("chats.jsonl", _jsonl({"messages": []}), ["record 0", "messages is an empty list"]),
    "wrong role names": (
        "chats.json",
        json.dumps([{"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]).encode(),
        ["unknown role 1", "record 0: turn 0 has role 'alien'", "roles are"],
    ),
    "empty turns": (
        "chats.json",
        json.dumps([_conv(user="   ")]).encode(),
        ["empty turn 1", "record 0: turn 0 (user) is empty"],
    ),
    "no assistant turn": (
        "chats.jsonl",
        _jsonl(*[_msgs(("user", "hi"))] * 12),
        ["0 of 12 records usable: no assistant turn 12", "record 0"],
    ),
    "non-string content": (
        "chats.json",
        json.dumps([_msgs(("user", 5), ("assistant", "x"))]).encode(),
        ["turn without text 1", "record 0: turn 0 (user): content is a JSON number"],
    ),
    "starts with the assistant": (
        "chats.json",
        json.dumps([_msgs(("assistant", "a"), ("user", "b"), ("assistant", "c"))]).encode(),
        ["starts with the assistant 1", "record 0", "--leading-assistant drop"],
    ),
    "binary garbage": ("chats.json", bytes(range(256)) * 4, ["not a text file"]),
    "empty file": ("chats.jsonl", b"", ["file is empty"]),
    "whitespace only": ("chats.jsonl", b"  \n\n \t\n", ["file is empty"]),
    "UTF-16": ("chats.jsonl", _jsonl(_conv()).decode().encode("utf-16"), ["UTF-16", "convert it to UTF-8"]),
    "an empty array": ("chats.json", b"[]", ["holds no records"]),
    "a syntax error mid-array": (
        "chats.json",
        b"[" + json.dumps(_conv()).encode() + b', {"conversations": oops}]',
        ["record 1: invalid JSON"],
    ),
    "every JSON line broken": ("chats.jsonl", b"{oops\n{bad\n", ["record 0: invalid JSON at line 1"]),
    "cut off in the first record": (
        "chats.json",
        b'[{"conversations": [{"from": "human", "val',
        ["0 of 1 records usable: damaged tail", "record 0: cut off"],
    ),
    "a parquet file that is not parquet": ("chats.parquet", b"PAR1 but not really", ["not a readable parquet file"]),
    "parquet rows without messages": (
        "chats.parquet",
        lambda tmp: _parquet_bytes(pa.table({"text": ["a", "b"]}), tmp),
        ["0 of 2 records usable: no conversations 2", "record 0", "keys: text"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_malformed_file_is_one_line_naming_file_record_and_reason(tmp_path, tiny_target_dir, case):
    name, contents, needles = BAD_FILES[case]
    path = tmp_path / "in" / name
    path.parent.mkdir()
    path.write_bytes(contents(tmp_path) if callable(contents) else contents)
    line = assert_one_line_error(_prepare(tmp_path, tiny_target_dir, path), f"{path}: ", *needles)
    assert str(tmp_path / "out") not in line  # the input is named, not the output directory
    assert not (tmp_path / "out").exists()


def test_missing_paths_and_empty_directories_are_one_line(tmp_path, tiny_target_dir):
    assert_one_line_error(
        _prepare(tmp_path, tiny_target_dir, tmp_path / "nope.json"),
        f"{tmp_path / 'nope.json'}: input file does not exist",
    )
    assert_one_line_error(
        _prepare(tmp_path, tiny_target_dir, f"{tmp_path}/nothing-*.jsonl"),
        f"{tmp_path}/nothing-*.jsonl: no file matches this pattern",
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not data")
    assert_one_line_error(
        _prepare(tmp_path, tiny_target_dir, tmp_path / "empty"),
        f"{tmp_path / 'empty'}: no .json / .jsonl / .parquet / .arrow files",
    )
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_bytes(_jsonl(_conv()))
    (mixed / "b.parquet").write_bytes(_parquet_bytes(pa.table({"text": ["a"]}), tmp_path))
    assert_one_line_error(_prepare(tmp_path, tiny_target_dir, mixed), f"{mixed}: directory mixes formats")


def test_a_prepared_set_given_as_conversations_is_named(tmp_path, tiny_target_dir, prepared_dir):
    assert_one_line_error(
        _prepare(tmp_path, tiny_target_dir, prepared_dir),
        f"{prepared_dir}: is a draftsmith 'prepared' artefact, not conversations",
    )


def test_several_useless_files_are_each_named_with_their_counts(tmp_path, tiny_target_dir):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.json"
    a.write_bytes(_jsonl(*[_msgs(("user", "hi"))] * 3))
    b.write_text(json.dumps([{"foo": 1}]))
    c.write_text("[]")
    line = assert_one_line_error(
        _prepare(tmp_path, tiny_target_dir, a, b, c),
        "no usable conversation in 3 input files",
        f"{a}: 0 of 3 records usable: no assistant turn 3",
        f"{b}: 0 of 1 records usable: no conversations 1",
        f"{c}: holds no records",
    )
    assert str(tmp_path / "out") not in line


def _prepare_ok(tmp_path: Path, target: Path, *data: Path):
    return prepare_run(
        PrepareConfig(data=[str(d) for d in data], target=str(target), output=tmp_path / "out", num_workers=1)
    )


def test_a_useless_file_beside_good_ones_is_a_summary_warning(tmp_path, tiny_target_dir):
    bad, good, empty = tmp_path / "chats.jsonl", tmp_path / "good.json", tmp_path / "empty.json"
    bad.write_bytes(_jsonl(*[_msgs(("user", "hi"))] * 12))
    good.write_text(json.dumps([_conv(), _conv("Hi", "Hello.")]))
    empty.write_text("[]")
    result = _prepare_ok(tmp_path, tiny_target_dir, bad, good, empty)
    assert result.summary["conversations"] == 2 and result.summary["skipped: no assistant turn"] == 12
    assert result.summary[f"warning: {bad}"] == (
        "0 of 12 records usable: no assistant turn 12 (first: record 0: no turn is from the assistant)"
    )
    assert result.summary[f"warning: {empty}"] == "holds no records"
    assert f"warning: {good}" not in result.summary
    manifest = open_prepared(tmp_path / "out").manifest
    assert manifest.skip_examples["no assistant turn"] == f"{bad} record 0: no turn is from the assistant"


@pytest.mark.parametrize("case", ["truncated last line", "broken middle line", "one bad record", "BOM"])
def test_bad_records_among_good_ones_are_counted_skips_naming_file_and_record(tmp_path, tiny_target_dir, case):
    data = tmp_path / "chats.jsonl"
    good = _jsonl(_conv())
    contents, reason, example = {
        "truncated last line": (
            good + good[:30],
            "damaged tail (file cut off mid-record)",
            "record 1: line 2 (the last)",
        ),
        "broken middle line": (good + b'{"messages": [\n' + good, "invalid JSON", "record 1: line 2"),
        "one bad record": (
            good + _jsonl(_msgs(("narrator", "x"), ("assistant", "y"))) + good,
            "unknown role",
            "record 1: turn 0 has role 'narrator'",
        ),
        "BOM": (b"\xef\xbb\xbf" + good + good, None, None),
    }[case]
    data.write_bytes(contents)
    result = _prepare_ok(tmp_path, tiny_target_dir, data)
    manifest = open_prepared(tmp_path / "out").manifest
    if reason is None:
        assert result.summary["conversations"] == 2 and result.summary["skipped"] == 0
        return
    assert result.summary[f"skipped: {reason}"] == 1 and result.summary["conversations"] >= 1
    assert manifest.skip_examples[reason].startswith(f"{data} {example}")
    assert f"warning: {data}" not in result.summary


# ------------------------------------------------------------------ --config files

CONFIG_FILES = {
    "unknown key": (
        "max_lenght: 10\nseed: 1\n",
        {
            "prepare": "key max_lenght: not an option of `draftsmith prepare`; did you mean max_length?",
            "train": "key max_lenght: not an option of `draftsmith train`",
        },
    ),
    "wrong type": (
        "max_samples: lots\n",
        {
            "prepare": "key max_samples: Input should be a valid integer",
            "train": "key max_samples: Input should be a valid integer",
        },
    ),
    "bad YAML": ("seed: 1\n  oops: [\n", {"prepare": "line 2 column 7: not valid YAML", "train": "line 2 column 7"}),
    "not a mapping": (
        "- a\n- b\n",
        {"prepare": "expected a mapping of option: value at the top level, found a list", "train": "found a list"},
    ),
    "a scalar": ("just words\n", {"prepare": "found a str", "train": "found a str"}),
    "not UTF-8": (b"\xff\xfe\x00seed: 1", {"prepare": "not UTF-8 text", "train": "not UTF-8 text"}),
}


@pytest.mark.parametrize("command", ["prepare", "train"])
@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_a_broken_config_file_is_one_line_naming_file_and_key(tmp_path, command, case):
    text, expected = CONFIG_FILES[case]
    path = tmp_path / "options.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    result = runner.invoke(app, [command, "--config", str(path), "--output", str(tmp_path / "out")])
    assert_one_line_error(result, f"{path}: ", expected[command])


@pytest.mark.parametrize("command", ["prepare", "train"])
def test_a_missing_or_directory_config_and_a_wrong_flag_beside_a_good_file(tmp_path, command):
    assert_one_line_error(
        runner.invoke(app, [command, "--config", str(tmp_path / "none.yaml")]),
        f"{tmp_path / 'none.yaml'}: config file does not exist",
    )
    assert_one_line_error(runner.invoke(app, [command, "--config", str(tmp_path)]), f"{tmp_path}: is a directory")
    good = tmp_path / "good.yaml"
    good.write_text("seed: 3\n")
    line = assert_one_line_error(
        runner.invoke(app, [command, "--config", str(good), "--max-samples", "0"]),
        "option --max-samples: Input should be greater than or equal to 1",
    )
    assert str(good) not in line  # the flag is wrong, not the file


# ------------------------------------------------------------------ other stages: the wrong input


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory, tiny_target_dir) -> Path:
    out = tmp_path_factory.mktemp("bad-inputs") / "prepared"
    data = out.parent / "good.json"
    data.write_text(json.dumps([_conv(), _conv("Hi", "Hello.")]))
    prepare_run(PrepareConfig(data=[str(data)], target=str(tiny_target_dir), output=out, num_workers=1))
    return out


@pytest.fixture(scope="module")
def wrong(tmp_path_factory, prepared_dir) -> dict[str, Path]:
    """Inputs of the wrong kind: none, a file, a directory without a manifest, a damaged manifest, a manifest of
    a kind no stage takes, and a prepared set (a real artefact, for the stages that take another)."""
    root = tmp_path_factory.mktemp("wrong")
    (root / "a-file.txt").write_text("hello")
    (root / "useless.json").write_text(json.dumps([{"foo": 1}]))
    (root / "plain-dir").mkdir()
    (root / "plain-dir" / "notes.txt").write_text("x")
    for name, text in {
        "bad-json": "{not json",
        "other-kind": json.dumps({"kind": "banana", "version": 1}),
        "fake-checkpoint": json.dumps({"kind": "checkpoint", "version": 1}),
    }.items():
        (root / name).mkdir()
        (root / name / "manifest.json").write_text(text)
    return {
        "missing": root / "missing",
        "file": root / "a-file.txt",
        "plain dir": root / "plain-dir",
        "bad manifest": root / "bad-json",
        "other kind": root / "other-kind",
        "fake checkpoint": root / "fake-checkpoint",
        "prepared": prepared_dir,
        "useless": root / "useless.json",
    }


# command -> how the input is passed; then (input, what the line says besides the path) for each wrong input
STAGES = {
    "extract": (
        ["extract", "--prepared", "{}"],
        {
            "missing": "prepared data set does not exist",
            "file": "expected a prepared data set directory, got a file",
            "plain dir": "not a prepared data set (no manifest.json)",
            "bad manifest": "manifest is not valid JSON",
            "other kind": "is a 'banana' artefact, expected 'prepared'",
            "fake checkpoint": "is a 'checkpoint' artefact, expected 'prepared'",
        },
    ),
    "train": (
        ["train", "--data", "{}"],
        {
            "missing": "found nothing: it does not exist",
            "file": "found a file",
            "plain dir": "found a directory without manifest.json",
            "bad manifest": "manifest is not valid JSON",
            "other kind": "found a 'banana' artefact",
            "fake checkpoint": "found a 'checkpoint' artefact",
        },
    ),
    "export": (
        ["export", "{}"],
        {
            "missing": "does not exist",
            "file": "is a file, not a draft directory",
            "plain dir": "no checkpoint in it",
            "bad manifest": "manifest is not valid JSON",
            "other kind": "is a 'banana' artefact, not a draft",
            "prepared": "is a 'prepared' artefact, not a draft",
            "fake checkpoint": "field target: Field required; this checkpoint manifest is damaged",
        },
    ),
    "evaluate": (
        ["evaluate", "--draft", "{}"],
        {
            "missing": "does not exist",
            "file": "is a file, not a draft directory",
            "bad manifest": "manifest is not valid JSON",
            "prepared": "is a 'prepared' artefact, not a draft",
        },
    ),
    "serve": (
        ["serve", "{}"],
        {
            "missing": "does not exist",
            "file": "is a file, not a draft directory",
            "plain dir": "no checkpoint in it",
            "bad manifest": "manifest is not valid JSON",
            "prepared": "is a 'prepared' artefact, not a draft",
        },
    ),
    "inspect": (
        ["inspect", "{}"],
        {
            "missing": "does not exist",
            "file": "not a draftsmith artefact (no manifest.json)",
            "plain dir": "not a draftsmith artefact (no manifest.json)",
            "bad manifest": "manifest is not valid JSON",
        },
    ),
    "store verify": (
        ["store", "verify", "{}"],
        {
            "missing": "not a hidden-state store",
            "file": "not a hidden-state store",
            "bad manifest": "manifest is not valid JSON",
            "prepared": "is a 'prepared' artefact, expected 'store'",
        },
    ),
    "improve": (
        ["improve", "--draft", "never-read", "--recording", "{}"],  # the recording is read first
        {
            "missing": "no such recording",
            "file": "is a file, not a recording",
            "plain dir": "not a recording (no manifest.json",
            "bad manifest": "manifest is not valid JSON",
            "prepared": "is a 'prepared' artefact, expected 'recording'",
        },
    ),
    "regenerate": (
        ["regenerate", "--engine", "hf", "--data", "{}"],
        {
            "missing": "input file does not exist",
            "file": "invalid JSON (the text starts with 'hello')",
            "plain dir": "no .json / .jsonl / .parquet / .arrow files",
            "prepared": "is a draftsmith 'prepared' artefact, not conversations",
            "useless": "no usable conversations to regenerate (skipped: no conversations 1; first: ",
        },
    ),
}
STAGE_CASES = [(command, kind) for command, (_, kinds) in STAGES.items() for kind in kinds]


@pytest.mark.parametrize(("command", "kind"), STAGE_CASES, ids=[f"{c}-{k}" for c, k in STAGE_CASES])
def test_the_wrong_input_to_a_stage_is_one_line_naming_path_and_reason(
    tmp_path, tiny_target_dir, wrong, monkeypatch, command, kind
):
    def no_vllm(*args, **kwargs):
        raise AssertionError("serve started vLLM with a wrong draft")

    monkeypatch.setattr(serve, "serve_until_stopped", no_vllm)
    template, reasons = STAGES[command]
    args = [a.format(wrong[kind]) for a in template]
    if command not in ("inspect", "store verify", "serve"):
        args += ["--output", str(tmp_path / "out")]
    if command in ("extract", "train", "regenerate"):
        args += ["--target", str(tiny_target_dir)]
    in_manifest = kind == "bad manifest" or "Field required" in reasons[kind]  # the manifest itself is named
    path = wrong[kind] / "manifest.json" if in_manifest else wrong[kind]
    assert_one_line_error(runner.invoke(app, args), f"{path}: ", reasons[kind])
    assert not (tmp_path / "out").exists()
