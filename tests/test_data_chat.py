"""Assistant loss masks for differently shaped chat templates, checked by decoding the masked spans."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CHATML_TEMPLATE, build_tiny_tokenizer

from draftsmith.prepare.chat import ChatEncoder, masked_spans
from draftsmith.prepare.messages import Skip, normalize_conversation

# A SmolLM2-like ChatML template: a default system prompt when the conversation brings none.
SMOL_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama-3 shaped: begin-of-text, header tokens around the role, trimmed content, <|eot_id|> ends every turn.
LLAMA3_STYLE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nToday is a test day.<|eot_id|>' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen3 shaped: ChatML, and a <think> block that is kept only for assistant turns after the last user turn
# (the reasoning of earlier turns is dropped from the history).
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And 2 + 3?"},
    {"role": "assistant", "content": "It is 5.\nAnything else?"},
]


def _tokenizer(template: str):
    tok = build_tiny_tokenizer(template)
    if template is LLAMA3_STYLE:
        tok.add_tokens(
            ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True
        )
        tok.bos_token = "<|begin_of_text|>"
    if template is QWEN3_STYLE:
        tok.add_tokens(["<think>", "</think>"])
    return tok


def _decoded_spans(tok, template: str, messages: list[dict], samples: int = 1) -> list[str]:
    """The supervised text of every sample, in order (one sample unless the template rewrites the history)."""
    encoded = ChatEncoder(tok, template).encode(messages).samples
    assert len(encoded) == samples
    # the last sample's ids are exactly the target's own tokenisation of the rendered conversation
    text = tok.apply_chat_template(messages, tokenize=False)
    assert encoded[-1].input_ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    spans = []
    for enc in encoded:
        assert enc.input_ids.dtype == np.int32 and enc.loss_mask.dtype == np.uint8 and not enc.truncated
        spans += [
            tok.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for run in masked_spans(enc.input_ids, enc.loss_mask)
        ]
    return spans


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("template", [CHATML_TEMPLATE, SMOL_CHATML], ids=["chatml", "chatml-default-system"])
def test_chatml_masks_assistant_turns_and_im_end(template, system):
    messages = ([SYSTEM] if system else []) + TURNS
    spans = _decoded_spans(_tokenizer(template), template, messages)
    assert spans == [t["content"] + "<|im_end|>" for t in TURNS if t["role"] == "assistant"]


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_llama3_style_masks_trimmed_content_and_eot(system):
    turns = [dict(t) for t in TURNS]
    turns[1]["content"] = "  Paris is the capital of France.\n"  # the template trims it
    messages = ([SYSTEM] if system else []) + turns
    spans = _decoded_spans(_tokenizer(LLAMA3_STYLE), LLAMA3_STYLE, messages)
    assert spans == ["Paris is the capital of France.<|eot_id|>", "It is 5.\nAnything else?<|eot_id|>"]


@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_qwen3_style_trains_each_turn_with_the_think_block_it_wrote(system):
    messages = ([SYSTEM] if system else []) + [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "<think>\nThe user asks about France.\n</think>\n\nParis."},
        {"role": "user", "content": "And 2 + 3?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nIt is 5."},
    ]
    spans = _decoded_spans(_tokenizer(QWEN3_STYLE), QWEN3_STYLE, messages, samples=2)
    # the earlier turn's reasoning is dropped from the history once the next user turn comes, but the model wrote
    # it when it answered: that answer is trained in the text it was generated after (its own sample), the later
    # one in the final render
    assert spans == [
        "<think>\nThe user asks about France.\n</think>\n\nParis.<|im_end|>",
        "<think>\nAdd them.\n</think>\n\nIt is 5.<|im_end|>",
    ]


def test_qwen3_style_consecutive_assistant_turns_after_last_user():
    messages = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "<think>\nstart\n</think>\n\n1"},
        {"role": "assistant", "content": "2"},
    ]
    spans = _decoded_spans(_tokenizer(QWEN3_STYLE), QWEN3_STYLE, messages)
    assert spans == ["<think>\nstart\n</think>\n\n1<|im_end|>", "<think>\n\n</think>\n\n2<|im_end|>"]


def test_truncate_and_drop_at_max_length():
    tok = _tokenizer(CHATML_TEMPLATE)
    [full] = ChatEncoder(tok, CHATML_TEMPLATE).encode(TURNS).samples
    n = len(full.input_ids)
    [cut] = ChatEncoder(tok, CHATML_TEMPLATE, max_length=n - 3).encode(TURNS).samples
    assert cut.truncated and cut.input_ids.tolist() == full.input_ids[: n - 3].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[: n - 3].tolist()
    with pytest.raises(Skip) as info:
        ChatEncoder(tok, CHATML_TEMPLATE, max_length=n - 1, overflow="drop").encode(TURNS)
    assert info.value.reason == "longer than max_length"
    first_masked = int(np.argmax(full.loss_mask))
    with pytest.raises(Skip) as info:
        ChatEncoder(tok, CHATML_TEMPLATE, max_length=first_masked).encode(TURNS)
    assert info.value.reason == "no assistant tokens within max_length"


def test_template_error_is_a_counted_skip():
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(Skip) as info:
        ChatEncoder(_tokenizer(strict), strict).encode([SYSTEM] + TURNS)
    assert info.value.reason == "chat template error" and "no system" in info.value.detail


def test_slow_tokenizer_path_matches_offsets_path():
    tok = _tokenizer(CHATML_TEMPLATE)
    [fast] = ChatEncoder(tok, CHATML_TEMPLATE).encode(TURNS).samples
    pieces = ChatEncoder(tok, CHATML_TEMPLATE)
    pieces._backend = None  # as for a tokenizer without offsets
    [slow] = pieces.encode(TURNS).samples
    assert [tok.decode(r) for r in masked_spans(slow.input_ids, slow.loss_mask)] == [
        tok.decode(r) for r in masked_spans(fast.input_ids, fast.loss_mask)
    ]


# ------------------------------------------------------------------ normalisation


def test_sharegpt_roles_are_normalised_and_trailing_user_turn_dropped():
    record = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "Be nice."},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
            {"from": "user", "value": "and?"},
            {"from": "chatgpt", "value": "more"},
            {"from": "human", "value": "bye"},
        ],
    }
    assert normalize_conversation(record).messages == [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "more"},
    ]


def test_messages_format_with_content_blocks():
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "yo"},
        ]
    }
    assert normalize_conversation(record).messages[0] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"id": 1}, "no conversations"),
        ({"conversations": []}, "no conversations"),
        ([1, 2], "not a JSON object"),
        ({"conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown role"),
        ({"conversations": [{"from": "human", "value": "  \n"}, {"from": "gpt", "value": "y"}]}, "empty turn"),
        ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": ""}]}, "empty turn"),
        ({"conversations": [{"from": "human", "value": "x"}, {"from": "human", "value": "y"}]}, "no assistant turn"),
        (
            {
                "conversations": [
                    {"from": "gpt", "value": "x"},
                    {"from": "human", "value": "y"},
                    {"from": "gpt", "value": "z"},
                ]
            },
            "starts with the assistant",
        ),
        (
            {"conversations": [{"from": "human", "value": "bad \udcff byte"}, {"from": "gpt", "value": "y"}]},
            "not valid UTF-8",
        ),
        ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]}, "turn without text"),
    ],
)
def test_unusable_records_are_skipped_with_a_reason(record, reason):
    with pytest.raises(Skip) as info:
        normalize_conversation(record)
    assert info.value.reason == reason


def test_leading_assistant_turns_can_be_dropped_instead_of_skipping():
    from draftsmith.prepare.messages import leading_assistant_turns

    record = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "gpt", "value": "a0"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a2"},
        ]
    }
    with pytest.raises(Skip):
        normalize_conversation(record)
    assert normalize_conversation(record, "drop").messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a2"},
    ]
    assert leading_assistant_turns(normalize_conversation(record, "keep").messages) == 2
    only_assistant_then_user = {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]}
    with pytest.raises(Skip) as info:
        normalize_conversation(only_assistant_then_user, "drop")
    assert info.value.reason == "no assistant turn"
