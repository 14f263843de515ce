"""Readers: JSON arrays as a stream (cut-off files keep every complete record), JSON Lines, parquet, arrow,
`datasets` directories, globs, and the inputs they refuse."""

from __future__ import annotations

import json

import pytest

from draftsmith.core.errors import DraftsmithError
from draftsmith.prepare import readers
from draftsmith.prepare.readers import DAMAGED_TAIL, Source, expand_sources, iter_source


def _conv(i: int) -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": f"question {i} " + "é" * (i % 7)},
            {"from": "gpt", "value": f"answer {i}"},
        ],
    }


def _read(path, fmt="json"):
    return list(iter_source(Source(path, fmt)))


@pytest.fixture
def small_chunks(monkeypatch):
    """Force many chunk boundaries (inside strings, numbers and multi-byte characters)."""
    monkeypatch.setattr(readers, "_CHUNK", 7)


def test_json_array_streams_across_chunks(tmp_path, small_chunks):
    records = [_conv(i) for i in range(30)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    out = _read(path)
    assert [r.data for r in out] == records
    assert [r.index for r in out] == list(range(30)) and all(r.bad is None for r in out)


@pytest.mark.parametrize("cut", [-1, -2, -40, -77, -150])
def test_cut_off_json_array_keeps_complete_records_and_reports_the_tail(tmp_path, small_chunks, cut):
    records = [_conv(i) for i in range(10)]
    text = json.dumps(records, indent=1)
    path = tmp_path / "cut.json"
    path.write_bytes(text.encode()[:cut])
    out = _read(path)
    good = [r for r in out if r.bad is None]
    assert [r.data for r in good] == records[: len(good)]
    assert len(good) >= 8
    assert out[-1].bad == DAMAGED_TAIL and out[-1].index == len(good)
    assert str(len(text.encode()[:cut])) in out[-1].detail  # names the byte where the file ends


def test_json_array_syntax_error_names_file_and_record(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"conversations": []}, {"conversations": [} , {"a": 1}]')
    with pytest.raises(DraftsmithError, match=r"broken.json: record 1: invalid JSON"):
        _read(path)
    path.write_text('[{"a": 1} {"b": 2}]')
    with pytest.raises(DraftsmithError, match=r"broken.json: record 1: invalid JSON.*expected ','"):
        _read(path)


def test_json_lines_bad_line_is_counted_not_fatal(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        "{not json",
        "",
        json.dumps({"messages": []}),
    ]
    path.write_text("\n".join(lines) + "\n")
    out = _read(path)
    assert [r.bad for r in out] == [None, "invalid JSON", None]
    assert "line 2" in out[1].detail and out[2].index == 2


def test_json_lines_cut_off_last_line_is_a_damaged_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(_conv(0)) + "\n" + json.dumps(_conv(1))[:-5])
    out = _read(path)
    assert out[0].data == _conv(0) and out[1].bad == DAMAGED_TAIL


def test_non_utf8_bytes_reach_the_record_not_the_whole_file(tmp_path):
    path = tmp_path / "latin1.json"
    good = json.dumps(_conv(0)).encode()
    bad = json.dumps(_conv(1)).encode().replace(b"question", b"caf\xe9")
    path.write_bytes(b"[" + good + b"," + bad + b"]")
    out = _read(path)
    assert out[0].data == _conv(0)
    assert "\udce9" in out[1].data["conversations"][0]["value"]  # kept as a marker; normalisation skips it


def test_bom_and_leading_whitespace(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf \n" + json.dumps([_conv(0)]).encode())
    assert _read(path)[0].data == _conv(0)


def test_empty_and_non_json_files_are_refused(tmp_path):
    (tmp_path / "empty.json").write_text("  \n")
    with pytest.raises(DraftsmithError, match="empty.json: file is empty"):
        _read(tmp_path / "empty.json")
    (tmp_path / "x.json").write_text("hello")
    with pytest.raises(DraftsmithError, match=r"x.json: invalid JSON \(the text starts with .hello.\)"):
        _read(tmp_path / "x.json")


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(DraftsmithError, match="nope.json: input file does not exist"):
        expand_sources([str(tmp_path / "nope.json")])
    with pytest.raises(DraftsmithError, match="no file matches"):
        expand_sources([str(tmp_path / "*.jsonl")])


def test_directory_of_mixed_formats_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text(json.dumps(_conv(0)) + "\n")
    pq.write_table(pa.Table.from_pylist([_conv(1)]), tmp_path / "b.parquet")
    with pytest.raises(DraftsmithError, match=r"mixes formats \(1 json, 1 parquet files\)"):
        expand_sources([str(tmp_path)])


def test_directory_of_one_format_reads_every_file_and_ignores_the_rest(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.json").write_text(json.dumps([_conv(0)]))
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps(_conv(1)) + "\n")
    (tmp_path / "README.md").write_text("# data")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "c.json").write_text("garbage")
    sources = expand_sources([str(tmp_path)])
    assert [s.path.name for s in sources] == ["a.json", "b.jsonl"]
    assert [r.data for s in sources for r in iter_source(s)] == [_conv(0), _conv(1)]


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(DraftsmithError, match="no .json / .jsonl / .parquet / .arrow files"):
        expand_sources([str(tmp_path)])


def test_parquet_arrow_and_saved_dataset(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_conv(i) for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert [r.data for r in _read(tmp_path / "d.parquet", "parquet")] == rows

    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    (source,) = expand_sources([str(tmp_path / "saved")])
    assert source.format == "dataset"
    assert [r.data for r in iter_source(source)] == rows

    arrow_files = sorted((tmp_path / "saved").glob("*.arrow"))
    (arrow,) = expand_sources([str(arrow_files[0])])
    assert arrow.format == "arrow" and [r.data for r in iter_source(arrow)] == rows


def test_unreadable_parquet_is_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DraftsmithError, match="bad.parquet: not a readable parquet file"):
        _read(tmp_path / "bad.parquet", "parquet")


@pytest.mark.slow
def test_embedded_sharegpt_is_cut_off_and_keeps_17671_records(sharegpt_file):
    count = 0
    tail = []
    for record in iter_source(Source(sharegpt_file, "json")):
        if record.bad:
            tail.append(record)
        else:
            count += 1
    assert count == 17671
    assert len(tail) == 1 and tail[0].bad == DAMAGED_TAIL and tail[0].index == 17671


def test_a_cut_at_any_byte_keeps_every_complete_record(tmp_path, small_chunks):
    records = [
        {
            "conversations": [{"from": "human", "value": 'a\u00e9\\"\n\u4e2d'}],
            "n": -1.5e3,
            "ok": True,
            "none": None,
            "no": False,
            "esc": "\\u00e9",
        }
        for _ in range(3)
    ]
    data = json.dumps(records, ensure_ascii=True).encode()
    complete_ends = []
    depth = 0
    for i, ch in enumerate(data.decode()):  # byte == char here: ensure_ascii
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                complete_ends.append(i + 1)
    path = tmp_path / "cut.json"
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        out = _read(path)
        expected_good = sum(end <= cut for end in complete_ends)
        assert [r.data for r in out if r.bad is None] == records[:expected_good], cut
        assert out[-1].bad == DAMAGED_TAIL, cut


def test_a_single_json_document_holding_a_list_of_conversations(tmp_path):
    path = tmp_path / "doc.json"
    path.write_text(json.dumps({"version": 2, "data": [_conv(0), _conv(1)]}, indent=2))
    assert [r.data for r in _read(path)] == [_conv(0), _conv(1)]
    path.write_text(json.dumps(_conv(3), indent=2))  # one pretty-printed conversation
    assert [r.data for r in _read(path)] == [_conv(3)]
    path.write_text(json.dumps({"a": [_conv(0)], "b": [_conv(1)]}, indent=2))
    with pytest.raises(DraftsmithError, match="neither a conversation nor holds one list"):
        _read(path)
    path.write_text('{\n  "data": [1, 2,\n}')
    with pytest.raises(DraftsmithError, match="doc.json: record 0: invalid JSON at line 3"):
        _read(path)


def test_json_lines_with_a_damaged_first_line_is_still_json_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"conversations": [\n' + json.dumps(_conv(1)) + "\n" + json.dumps(_conv(2)) + "\n")
    out = _read(path)
    assert [r.bad for r in out] == ["invalid JSON", None, None] and out[2].data == _conv(2)
