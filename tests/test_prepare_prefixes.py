"""Prefix sharing in the prepared set (issue 52, first part): each sample's parent and shared prefix, the distinct
tokens of the set against a prefix tree built here, old sets without the prefix file, and the max_length error that
names the length the data needs.

Every check of `parent` / `shared` is against a brute-force longest common prefix over pairs of samples and a trie
built token by token in the test, not against the sorting the code uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from agentic import QWEN3_MARKERS, QWEN3_SHAPED_TEMPLATE, agentic_conversations, write_jsonl
from conftest import build_tiny_tokenizer
from rich.console import Console
from test_prepared import _target

from draftsmith import inspection
from draftsmith.config import PrepareConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import MANIFEST_NAME
from draftsmith.prepare import run as prepare_run
from draftsmith.prepare.chat import ChatEncoder
from draftsmith.prepare.dataset import PREFIXES_NAME, open_prepared, write_prepared
from draftsmith.prepare.messages import normalize_conversation

SYSTEM = "You are a careful assistant. Answer in one short line, and say so when you do not know."


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _trie_size(samples: list[list[int]]) -> int:
    root: dict = {}
    nodes = 0
    for ids in samples:
        node = root
        for token in ids:
            if token not in node:
                node[token] = {}
                nodes += 1
            node = node[token]
    return nodes


def _check_prefixes(ds) -> list[list[int]]:
    """Every sample's (parent, shared) against the brute force: `shared` is the longest prefix it has in common
    with any sample extracted before it, `parent` one such sample; the distinct tokens are a trie's size."""
    ids = [ds[i]["input_ids"].tolist() for i in range(len(ds))]
    order = ds.prefixes[0].tolist()
    assert sorted(order) == list(range(len(ds)))
    position = {sample: k for k, sample in enumerate(order)}
    for i in range(len(ds)):
        parent, shared = ds.prefix(i)
        before = [j for j in range(len(ds)) if position[j] < position[i]]
        assert shared == max((_lcp(ids[i], ids[j]) for j in before), default=0), i
        if shared:
            assert position[parent] < position[i] and ids[parent][:shared] == ids[i][:shared], i
        else:
            assert parent == -1, i
    distinct = _trie_size(ids)
    assert ds.manifest.num_distinct_tokens == distinct
    assert ds.manifest.num_tokens == sum(map(len, ids))
    assert ds.manifest.tokens_per_distinct_token == round(sum(map(len, ids)) / distinct, 2)
    return ids


def _branching_samples(seed: int = 0) -> list[dict]:
    """Samples that share prefixes of every kind: across shards, duplicates, one a prefix of another, none."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 50, size=n).tolist() for n in (12, 5, 30)]
    out = []
    for k in range(20):
        stem = stems[k % 3][: int(rng.integers(0, len(stems[k % 3]) + 1))]
        ids = stem + rng.integers(0, 50, size=int(rng.integers(0 if stem else 1, 6))).tolist()
        out.append(ids)
    out += [out[3], out[7][:2], [49, 49], [0]]
    return [{"input_ids": ids, "loss_mask": [1] * len(ids)} for ids in out]


def test_write_prepared_records_each_samples_parent_and_shared_prefix(tmp_path):
    samples = _branching_samples()
    manifest = write_prepared(
        tmp_path / "p", iter(samples), _target(), chat_template_hash="h", max_length=64, shard_samples=7
    )
    assert len(manifest.shards) == 4 and manifest.prefixes_file == PREFIXES_NAME
    ds = open_prepared(tmp_path / "p", verify=True)
    ids = _check_prefixes(ds)
    assert [i["input_ids"] for i in samples] == ids
    assert ds.prefix(20) == (3, len(ids[3])) or ds.prefix(3) == (20, len(ids[3]))  # a duplicate: all shared
    assert ds.manifest.num_distinct_tokens < ds.manifest.num_tokens


def test_conversations_that_drop_reasoning_or_share_a_system_prompt_share_prefixes(
    tmp_path, qwen3_shaped_target, capsys
):
    """Conversation 0 drops its first answer's reasoning at the second question: two samples sharing what came
    before that answer; conversation 1 shares only the system prompt; the agentic ones share their tools."""
    dropped = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two make four."},
            {"role": "user", "content": "And three plus three?"},
            {"role": "assistant", "content": "Six.", "reasoning_content": "Three and three make six."},
        ]
    }
    other = {
        "messages": [
            dropped["messages"][0],
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ]
    }
    records = [dropped, other, *agentic_conversations(6)]
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    result = prepare_run(
        PrepareConfig(data=[str(data)], target=str(qwen3_shaped_target), output=tmp_path / "out", num_workers=1)
    )
    ds = open_prepared(tmp_path / "out", verify=True)
    ids = _check_prefixes(ds)
    tok = build_tiny_tokenizer(QWEN3_SHAPED_TEMPLATE.read_text(), added_tokens=QWEN3_MARKERS)

    def text(seq: list[int]) -> str:
        return tok.decode(seq, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    assert len(ds) == 2 + 1 + 6 + 2  # two of the six agentic conversations drop reasoning too
    # the two generations of conversation 0: one is the other's parent, up to the first answer
    first, second = ids[0], ids[1]
    n = _lcp(first, second)
    assert ds.prefix(1) == (0, n) or ds.prefix(0) == (1, n)
    assert text(first[:n]).startswith("<|im_start|>system\n" + SYSTEM) and "What is two plus two?" in text(first[:n])
    assert "Four." not in text(first[:n]) and "Two and two" in text(first) and "Two and two" not in text(second)
    # conversations 0 and 1 (different conversations) share the system prompt, and the agentic ones their tools
    assert SYSTEM in text(ids[2][: _lcp(ids[2], first)])
    assert "<tools>" in text(ids[3][: max(_lcp(ids[3], ids[j]) for j in range(4, len(ds)))])
    m = ds.manifest
    assert m.num_distinct_tokens < m.num_tokens
    assert result.summary["tokens"] == m.num_tokens
    assert result.summary["distinct tokens"] == (
        f"{m.num_distinct_tokens:,} (shared prefixes once; tokens / distinct: {m.tokens_per_distinct_token:.1f}x)"
    )

    # inspect still shows a sample whole, and names what it shares
    child = next(i for i in range(len(ds)) if ds.prefix(i)[1])
    console = Console(record=True, width=400)
    inspection.run(tmp_path / "out", sample=child, as_json=False, console=console)
    parent, shared = ds.prefix(child)
    shown = console.export_text()
    assert (
        f"sample {child}: {len(ids[child])} tokens, " in shown
        and f", the first {shared} those of sample {parent} (" in shown
    )
    capsys.readouterr()
    inspection.run(tmp_path / "out", sample=child, as_json=True, console=console)
    assert json.loads(capsys.readouterr().out)["input_ids"] == ids[child]


def test_a_set_without_the_prefix_file_loads_and_shares_nothing(tmp_path):
    samples = _branching_samples(1)
    write_prepared(tmp_path / "p", iter(samples), _target(), chat_template_hash="h", max_length=64)
    (tmp_path / "p" / PREFIXES_NAME).unlink()
    data = json.loads((tmp_path / "p" / MANIFEST_NAME).read_text())
    for key in ("num_distinct_tokens", "tokens_per_distinct_token", "prefixes_file", "prefixes_sha256"):
        del data[key]
    (tmp_path / "p" / MANIFEST_NAME).write_text(json.dumps(data))
    ds = open_prepared(tmp_path / "p", verify=True)
    assert [ds.prefix(i) for i in range(len(ds))] == [(-1, 0)] * len(samples)
    assert ds.prefixes[0].tolist() == list(range(len(samples))) and ds.manifest.num_distinct_tokens == 0
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == [s["input_ids"] for s in samples]
    legacy = open_prepared(Path(__file__).parent / "data" / "legacy-0.1.0" / "prepared", verify=True)
    assert legacy.prefix(0) == (-1, 0) and legacy.manifest.prefixes_file == ""


def test_a_damaged_prefix_file_is_refused_naming_it(tmp_path):
    write_prepared(tmp_path / "p", iter(_branching_samples()), _target(), chat_template_hash="h", max_length=64)
    path = tmp_path / "p" / PREFIXES_NAME
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(DraftsmithError, match=re.escape(str(path))):
        open_prepared(tmp_path / "p").prefix(0)
    with pytest.raises(DraftsmithError, match=re.escape(str(path))):
        open_prepared(tmp_path / "p").verify()
    assert torch.equal(
        open_prepared(tmp_path / "p")[0]["input_ids"], torch.tensor(_branching_samples()[0]["input_ids"])
    )


def test_the_max_length_error_names_the_length_the_data_needs(tmp_path, qwen3_shaped_target):
    """Declared tools longer than --max-length: every conversation is skipped, and the one error line names the
    input file and the --max-length that reaches the first assistant token of all of them (and of half)."""
    records = agentic_conversations(6)
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    encoder = ChatEncoder(build_tiny_tokenizer(QWEN3_SHAPED_TEMPLATE.read_text(), added_tokens=QWEN3_MARKERS))
    needed = sorted(int(np.argmax(encoder.encode(normalize_conversation(r)).samples[0].loss_mask)) + 1 for r in records)
    assert needed[0] > 100

    def prepare(max_length: int, out: str):
        return prepare_run(
            PrepareConfig(
                data=[str(data)],
                target=str(qwen3_shaped_target),
                output=tmp_path / out,
                num_workers=1,
                max_length=max_length,
            )
        )

    with pytest.raises(DraftsmithError) as err:
        prepare(needed[0] - 1, "none")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{data}: 0 of 6 records usable: ")
    assert message.endswith(
        f"; --max-length {needed[-1]:,} reaches the first assistant token of all 6 ({needed[2]:,}: half)"
    )
    # some kept: the summary names what the others need
    summary = prepare(needed[2], "some").summary
    skipped = [n for n in needed if n > needed[2]]
    assert summary["skipped: no assistant tokens within max_length"] == len(skipped)
    half = skipped[(len(skipped) - 1) // 2]
    assert summary["max_length needed"] == (
        f"--max-length {skipped[-1]:,} reaches the first assistant token of all {len(skipped)} ({half:,}: half)"
    )
