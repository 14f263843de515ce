"""The prepare stage end to end: bad inputs become counted skips or one-line errors, output is complete or absent."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import build_tiny_target

from draftsmith.config import PrepareConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.prepare.chat import masked_spans
from draftsmith.prepare.dataset import open_prepared
from draftsmith.prepare.stage import run


def _conv(question: str = "What is the capital of France?", answer: str = "Paris is the capital of France.") -> dict:
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


GOOD = [
    _conv(),
    _conv("Hello! How can I help you today?", "The quick brown fox jumps over the lazy dog."),
    {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "return a + b"},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "1 2 3"},
        ]
    },
]


def _prepare(tmp_path, target, data, **overrides):
    cfg = PrepareConfig(
        data=[str(p) for p in data], target=str(target), output=tmp_path / "out", num_workers=1, **overrides
    )
    return run(cfg)


def _write_json(path, records):
    path.write_text(json.dumps(records))
    return path


# ------------------------------------------------------------------ good input


def test_prepare_writes_a_complete_set(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    result = _prepare(tmp_path, tiny_target_dir, [_write_json(tmp_path / "d.json", GOOD)])
    assert result.stage == "prepare" and result.output == tmp_path / "out"
    assert result.summary["conversations"] == 3 and result.summary["skipped"] == 0
    ds = open_prepared(tmp_path / "out", verify=True)
    assert len(ds) == 3 and ds.manifest.skipped == {}
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    spans = [tok.decode(r) for r in masked_spans(ds[2]["input_ids"], ds[2]["loss_mask"])]
    assert spans == ["return a + b<|im_end|>", "1 2 3<|im_end|>"]
    assert ds.manifest.num_loss_tokens == sum(int(ds[i]["loss_mask"].sum()) for i in range(3))
    assert int(ds.token_counts().sum()) == ds.manifest.num_loss_tokens
    config = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert config["target"] == str(tiny_target_dir) and config["num_workers"] == 1
    assert ds.manifest.target.vocab_size == len(tok)
    assert result.summary[f"draft vocab {len(tok)} covers"] == "100.00%"  # capped at the target vocab
    for key in ("tokens", "loss tokens", "conversations/s", "tokens/s"):
        assert key in result.summary


def test_parallel_workers_give_the_same_set_as_one(tmp_path, tiny_target_dir):
    records = [_conv(f"question {i} " * (i % 5 + 1), f"answer {i} " * (i % 3 + 1)) for i in range(100)]
    records[17] = {"id": "bad"}
    data = _write_json(tmp_path / "d.json", records)
    one = run(
        PrepareConfig(
            data=[str(data)], target=str(tiny_target_dir), output=tmp_path / "a", num_workers=1, shard_samples=10
        )
    )
    two = run(
        PrepareConfig(
            data=[str(data)], target=str(tiny_target_dir), output=tmp_path / "b", num_workers=2, shard_samples=10
        )
    )
    assert one.summary["conversations"] == two.summary["conversations"] == 99
    a, b = open_prepared(tmp_path / "a"), open_prepared(tmp_path / "b")
    assert a.manifest.skipped == b.manifest.skipped == {"no conversations": 1}
    assert len(a.manifest.shards) == 10
    for i in range(len(a)):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["loss_mask"], b[i]["loss_mask"])


def test_max_samples_and_formats(tmp_path, tiny_target_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("\n".join(json.dumps(GOOD[2]) for _ in range(3)) + "\n")
    pq.write_table(pa.Table.from_pylist([_conv()] * 4), tmp_path / "p.parquet")
    result = _prepare(tmp_path, tiny_target_dir, [jsonl, tmp_path / "p.parquet"], max_samples=5)
    assert result.summary["conversations"] == 5 and result.summary["records read"] == 5
    ds = open_prepared(tmp_path / "out")
    assert ds.manifest.sources == [str(jsonl), str(tmp_path / "p.parquet")]


def test_overflow_drop_and_truncate(tmp_path, tiny_target_dir):
    long = _conv("Hi?", "Explain in three sentences, please. " * 40)
    data = _write_json(tmp_path / "d.json", [long, _conv()])
    dropped = _prepare(tmp_path, tiny_target_dir, [data], max_length=64, overflow="drop")
    assert dropped.summary["conversations"] == 1 and dropped.summary["skipped: longer than max_length"] == 1
    kept = _prepare(tmp_path, tiny_target_dir, [data], max_length=64, overflow="truncate")
    ds = open_prepared(tmp_path / "out")
    assert kept.summary["truncated"] == 1 and ds.manifest.num_truncated == 1
    assert ds.lengths.tolist()[0] == 64 and bool(ds[0]["loss_mask"][-1])


def test_chat_template_file_overrides_the_tokenizer(tmp_path, tiny_target_dir):
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    _prepare(tmp_path, tiny_target_dir, [_write_json(tmp_path / "d.json", [_conv()])], chat_template=template)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    ds = open_prepared(tmp_path / "out")
    assert tok.decode(ds[0]["input_ids"]).startswith("user: What is")
    assert [tok.decode(r) for r in masked_spans(ds[0]["input_ids"], ds[0]["loss_mask"])] == [
        "Paris is the capital of France.<|im_end|>"
    ]


def test_target_without_chat_template_is_a_clear_error(tmp_path):
    target = build_tiny_target(tmp_path / "base", chat_template=None)
    with pytest.raises(DraftsmithError, match="no chat template; pass one with --chat-template"):
        _prepare(tmp_path, target, [_write_json(tmp_path / "d.json", [_conv()])])


# ------------------------------------------------------------------ bad input: counted skips

BAD_RECORDS = {
    "no conversations": {"id": "x", "text": "hello"},
    "unknown role": {"conversations": [{"from": "narrator", "value": "Once"}, {"from": "gpt", "value": "upon"}]},
    "empty turn": {"conversations": [{"from": "human", "value": " \n\t"}, {"from": "gpt", "value": "hi"}]},
    "no assistant turn": {"conversations": [{"from": "human", "value": "anyone?"}]},
    "starts with the assistant": {
        "conversations": [
            {"from": "gpt", "value": "I start."},
            {"from": "human", "value": "ok"},
            {"from": "gpt", "value": "yes"},
        ]
    },
}


@pytest.mark.parametrize("reason", sorted(BAD_RECORDS))
def test_bad_record_is_a_counted_skip_in_summary_and_manifest(tmp_path, tiny_target_dir, reason):
    data = _write_json(tmp_path / "d.json", [_conv(), BAD_RECORDS[reason], _conv()])
    result = _prepare(tmp_path, tiny_target_dir, [data])
    assert result.summary["conversations"] == 2
    assert result.summary[f"skipped: {reason}"] == 1 and result.summary["skipped"] == 1
    manifest = open_prepared(tmp_path / "out").manifest
    assert manifest.skipped == {reason: 1}
    assert manifest.skip_examples[reason].startswith(f"{data} record 1: ")


def test_invalid_json_line_is_a_counted_skip(tmp_path, tiny_target_dir):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_conv()) + '\n{"conversations": [\n' + json.dumps(_conv()) + "\n")
    result = _prepare(tmp_path, tiny_target_dir, [data])
    assert result.summary["conversations"] == 2 and result.summary["skipped: invalid JSON"] == 1
    assert open_prepared(tmp_path / "out").manifest.skip_examples["invalid JSON"].startswith(f"{data} record 1: line 2")


def test_invalid_json_in_an_array_is_a_one_line_error_and_leaves_no_output(tmp_path, tiny_target_dir):
    data = tmp_path / "d.json"
    data.write_text("[" + json.dumps(_conv()) + ', {"conversations": oops}]')
    with pytest.raises(DraftsmithError, match=r"d.json: record 1: invalid JSON") as info:
        _prepare(tmp_path, tiny_target_dir, [data])
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_non_utf8_bytes_are_a_counted_skip(tmp_path, tiny_target_dir):
    data = tmp_path / "d.json"
    bad = json.dumps(_conv("caf\u00e9 ?")).encode().replace(b"\\u00e9", b"\xe9")
    data.write_bytes(b"[" + json.dumps(_conv()).encode() + b"," + bad + b"]")
    result = _prepare(tmp_path, tiny_target_dir, [data])
    assert result.summary["conversations"] == 1 and result.summary["skipped: not valid UTF-8"] == 1


def test_cut_off_file_keeps_complete_records_and_reports_the_damaged_tail(tmp_path, tiny_target_dir):
    data = tmp_path / "d.json"
    data.write_text(json.dumps([_conv(), _conv(), _conv()])[:-30])
    result = _prepare(tmp_path, tiny_target_dir, [data])
    assert result.summary["conversations"] == 2
    assert result.summary["skipped: damaged tail (file cut off mid-record)"] == 1
    assert "d.json record 2" in result.summary["damaged input"]
    manifest = open_prepared(tmp_path / "out").manifest
    assert len(manifest.damaged) == 1
    assert manifest.damaged[0].startswith(f"{data} record 2: cut off by the end of the file")


def test_nothing_usable_is_an_error_and_leaves_no_output(tmp_path, tiny_target_dir):
    data = _write_json(tmp_path / "d.json", [BAD_RECORDS["no assistant turn"]] * 3)
    with pytest.raises(
        DraftsmithError, match=r"d.json: 0 of 3 records usable: no assistant turn 3 \(first: record 0: "
    ):
        _prepare(tmp_path, tiny_target_dir, [data])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ bad input: one-line errors


def test_missing_input_file_is_a_one_line_error(tmp_path, tiny_target_dir):
    with pytest.raises(DraftsmithError, match=r"missing.json: input file does not exist"):
        _prepare(tmp_path, tiny_target_dir, [tmp_path / "missing.json"])
    assert not (tmp_path / "out").exists()


def test_directory_of_mixed_formats_is_a_one_line_error(tmp_path, tiny_target_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    _write_json(tmp_path / "data" / "a.json", [_conv()])
    pq.write_table(pa.Table.from_pylist([_conv()]), tmp_path / "data" / "b.parquet")
    with pytest.raises(DraftsmithError, match=r"data: directory mixes formats"):
        _prepare(tmp_path, tiny_target_dir, [tmp_path / "data"])


def test_output_that_is_not_a_prepared_set_is_not_replaced(tmp_path, tiny_target_dir):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("x")
    with pytest.raises(DraftsmithError, match="refusing to replace"):
        _prepare(tmp_path, tiny_target_dir, [_write_json(tmp_path / "d.json", [_conv()])])
    assert (tmp_path / "out" / "mine.txt").exists()


# ------------------------------------------------------------------ the real default


@pytest.mark.slow
def test_prepare_200_real_sharegpt_conversations_for_the_real_default_target(
    tmp_path, default_target_dir, sharegpt_file
):
    from draftsmith.core.targets import load_tokenizer
    from draftsmith.prepare.messages import Skip, normalize_conversation
    from draftsmith.prepare.readers import Source, iter_source

    result = run(PrepareConfig(output=tmp_path / "out", max_samples=200, num_workers=2))
    assert result.summary["conversations"] == 200
    ds = open_prepared(tmp_path / "out", verify=True)
    assert len(ds) == 200 and ds.manifest.target.vocab_size == 49152 and ds.manifest.target.num_layers == 30
    assert ds.manifest.sources == [str(sharegpt_file)]
    assert ds.manifest.skipped.get("starts with the assistant", 0) > 0  # real ShareGPT has such records
    assert int(ds.lengths.max()) <= 2048 and ds.manifest.num_loss_tokens > 0.3 * ds.manifest.num_tokens

    # the same conversations, in the same order, rebuilt from the source: masked spans are the assistant turns
    conversations = []
    for record in iter_source(Source(sharegpt_file, "json")):
        try:
            conversations.append(normalize_conversation(record.data).messages)
        except Skip:
            continue
        if len(conversations) == 40:
            break
    tok = load_tokenizer(default_target_dir)
    checked = i = 0
    for messages in conversations:
        if i >= len(ds):
            break
        sample = ds[i]
        if messages[0 if messages[0]["role"] == "user" else 1]["content"][:40] not in tok.decode(sample["input_ids"]):
            continue  # this one was skipped while encoding (e.g. no assistant token within max_length)
        i += 1
        answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        spans = [tok.decode(r) for r in masked_spans(sample["input_ids"], sample["loss_mask"])]
        if len(sample["input_ids"]) < 2048:
            assert spans == answers
            checked += 1
        else:  # truncated: the last span is cut short
            assert spans[:-1] == answers[: len(spans) - 1] and answers[len(spans) - 1].startswith(spans[-1])
    assert checked >= 15


def test_killed_run_resumes_from_its_last_shard(tmp_path, tiny_target_dir, monkeypatch):
    from draftsmith.prepare import chat

    records = [_conv(f"question {i}", f"answer {i}") for i in range(40)]
    records[5] = BAD_RECORDS["unknown role"]
    records[33] = BAD_RECORDS["empty turn"]
    data = _write_json(tmp_path / "d.json", records)
    run(
        PrepareConfig(
            data=[str(data)], target=str(tiny_target_dir), output=tmp_path / "ref", num_workers=1, shard_samples=8
        )
    )

    calls = {"n": 0, "die_at": 30}
    real_encode = chat.ChatEncoder.encode

    def dying_encode(self, messages):
        calls["n"] += 1
        if calls["n"] == calls["die_at"]:
            raise KeyboardInterrupt  # as a kill in the middle of the run
        return real_encode(self, messages)

    monkeypatch.setattr(chat.ChatEncoder, "encode", dying_encode)
    cfg = PrepareConfig(
        data=[str(data)], target=str(tiny_target_dir), output=tmp_path / "out", num_workers=1, shard_samples=8
    )
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    assert not (tmp_path / "out").exists() and (tmp_path / ".out.resume").is_dir()
    saved_shards = len(list((tmp_path / ".out.resume").glob("shard-*.safetensors")))
    assert saved_shards >= 1
    calls.update(n=0, die_at=-1)
    result = run(cfg)
    assert calls["n"] == 38 - 8 * saved_shards  # only the conversations after the complete shards are encoded again
    assert result.summary["resumed after records"] == 8 * saved_shards + 1  # record 5 was skipped
    ds, ref = open_prepared(tmp_path / "out", verify=True), open_prepared(tmp_path / "ref")
    assert ds.manifest.skipped == ref.manifest.skipped == {"unknown role": 1, "empty turn": 1}
    assert ds.manifest.num_tokens == ref.manifest.num_tokens and len(ds) == len(ref) == 38
    assert ds.manifest.stats["records"] == 40
    for i in range(len(ds)):
        assert torch.equal(ds[i]["input_ids"], ref[i]["input_ids"])
        assert torch.equal(ds[i]["loss_mask"], ref[i]["loss_mask"])


def test_changed_options_start_over_instead_of_resuming(tmp_path, tiny_target_dir, monkeypatch):
    from draftsmith.prepare import chat

    data = _write_json(tmp_path / "d.json", [_conv(f"q {i}", f"a {i}") for i in range(20)])
    real_encode = chat.ChatEncoder.encode
    calls = {"n": 0}

    def dying_encode(self, messages):
        calls["n"] += 1
        if calls["n"] == 15:
            raise KeyboardInterrupt
        return real_encode(self, messages)

    monkeypatch.setattr(chat.ChatEncoder, "encode", dying_encode)
    with pytest.raises(KeyboardInterrupt):
        _prepare(tmp_path, tiny_target_dir, [data], shard_samples=4)
    monkeypatch.setattr(chat.ChatEncoder, "encode", real_encode)
    result = _prepare(tmp_path, tiny_target_dir, [data], shard_samples=4, max_length=512)
    assert "resumed after records" not in result.summary and result.summary["conversations"] == 20


def test_leading_assistant_drop_keeps_the_rest_and_counts_it(tmp_path, tiny_target_dir):
    data = _write_json(tmp_path / "d.json", [_conv(), BAD_RECORDS["starts with the assistant"]])
    result = _prepare(tmp_path, tiny_target_dir, [data], leading_assistant="drop")
    assert result.summary["conversations"] == 2 and result.summary["skipped"] == 0
    assert result.summary["leading assistant turns dropped"] == 1
    ds = open_prepared(tmp_path / "out")
    assert ds.manifest.stats["leading_assistant_turns_dropped"] == 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert [tok.decode(r) for r in masked_spans(ds[1]["input_ids"], ds[1]["loss_mask"])] == ["yes<|im_end|>"]


def test_stopping_early_with_large_batches_in_flight_does_not_hang():
    """An early stop (max_samples) while the pool's feeder thread is mid-way through sending a batch larger than
    the pipe buffer used to deadlock in Pool.terminate (a CI run sat 30 minutes on it)."""
    import threading

    from draftsmith.prepare.messages import Skip
    from draftsmith.prepare.stage import _encoded_batches

    big = "x" * 2_000_000  # Skips pass through the workers untouched: only the payload size matters here
    batches = ([(f"record {i}", Skip("test", big), 0)] for i in range(40))
    for attempt in range(3):
        encoded = _encoded_batches(batches, None, workers=2)
        assert next(encoded)[0][1].detail == big
        closer = threading.Thread(target=encoded.close, daemon=True)
        closer.start()
        closer.join(timeout=60)
        assert not closer.is_alive(), f"closing the pool hung (attempt {attempt})"
