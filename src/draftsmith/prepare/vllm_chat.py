"""What vLLM's chat API does to an answer, read from the installed vLLM: its tool-call and reasoning parsers.

`vllm serve --tool-call-parser NAME --reasoning-parser NAME` turns the text a model generated into the assistant
message an OpenAI client receives: the reasoning parser splits off `reasoning_content` (Qwen3's and Kimi's
`<think>` blocks), then, where the request declares tools with `tool_choice: auto`, the tool parser reads the
calls out of the rest (`<tool_call>{...}</tool_call>` for `hermes`, Kimi's `<|tool_calls_section_begin|>` for
`kimi_k2`). `AnswerParser` applies the same two parsers, by the same names, to the answers `draftsmith regenerate`
generates, so a regenerated conversation holds what the server would have returned: `reasoning_content`,
`content` and `tool_calls` (arguments a JSON string, as OpenAI sends them).

The parsers live in vLLM (`vllm.tool_parsers` since 0.13, `vllm.entrypoints.openai.tool_parsers` before;
`vllm.reasoning`), so naming one needs vLLM installed, whichever engine generates.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.prepare.messages import Message

_TOOL_PARSER_HOMES = ("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers")
_REQUEST_HOMES = ("vllm.entrypoints.openai.chat_completion.protocol", "vllm.entrypoints.openai.protocol")


def _first_module(names: tuple[str, ...], attribute: str) -> Any:
    for name in names:
        try:
            return getattr(importlib.import_module(name), attribute)
        except (ImportError, AttributeError):
            continue
    raise DraftsmithError(
        f"this vLLM has no {attribute} (looked in {', '.join(names)}); --tool-call-parser and "
        "--reasoning-parser need vLLM 0.11 or newer"
    )


def _registered(manager: Any) -> list[str]:
    names = set(getattr(manager, "tool_parsers", {}) or {}) | set(getattr(manager, "reasoning_parsers", {}) or {})
    return sorted(names | set(getattr(manager, "lazy_parsers", {}) or {}))


def _load(manager: Any, getter: str, name: str, flag: str) -> Any:
    try:
        return getattr(manager, getter)(name)
    except KeyError:
        known = _registered(manager)
        raise DraftsmithError(
            f"{flag} {name}: vLLM knows no parser of that name" + (f" (it knows: {', '.join(known)})" if known else "")
        ) from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """vLLM's parsers log a traceback for a call that is not JSON; here that is a counted outcome, not an error."""
    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(before)


class AnswerParser:
    """A generated answer -> the assistant message vLLM's chat API returns for it (reasoning, content, calls)."""

    def __init__(
        self,
        tokenizer: Any,
        tool_call_parser: str | None,
        reasoning_parser: str | None,
        template_kwargs: dict | None = None,
    ):
        self.tokenizer = tokenizer
        try:
            importlib.import_module("vllm")
        except ImportError:
            raise DraftsmithError(
                "--tool-call-parser / --reasoning-parser: these are vLLM's parsers and vLLM is not "
                "installed; install it beside draftsmith (see README)"
            ) from None
        self._request_cls = _first_module(_REQUEST_HOMES, "ChatCompletionRequest")
        self._tool_cls = None
        if tool_call_parser:
            manager = _first_module(_TOOL_PARSER_HOMES, "ToolParserManager")
            self._tool_cls = _load(manager, "get_tool_parser", tool_call_parser, "--tool-call-parser")
        self._reasoning = None
        if reasoning_parser:
            manager = _first_module(("vllm.reasoning",), "ReasoningParserManager")
            cls = _load(manager, "get_reasoning_parser", reasoning_parser, "--reasoning-parser")
            try:  # newer parsers read the template options (e.g. whether thinking is on)
                self._reasoning = cls(tokenizer, chat_template_kwargs=dict(template_kwargs or {}))
            except TypeError:
                self._reasoning = cls(tokenizer)
        self._tools_probe = self._tool_cls(tokenizer) if self._tool_cls is not None else None

    def request(self, tools: list[dict] | None) -> Any:
        """The chat request the answer came from, as the parsers see it: the tools, `tool_choice: auto`."""
        options = {"tools": tools, "tool_choice": "auto"} if tools else {}
        request = self._request_cls(model="draftsmith", messages=[{"role": "user", "content": "-"}], **options)
        if tools and self._tools_probe is not None:
            request = self._tools_probe.adjust_request(request)
        return request

    def decode(self, tokens: list[int], tools: list[dict] | None, request: Any = None) -> str:
        """The answer's text as vLLM detokenises it for this request (a tool parser may keep special tokens)."""
        request = request if request is not None else self.request(tools)
        return self.tokenizer.decode(tokens, skip_special_tokens=request.skip_special_tokens)

    def read(self, tokens: list[int], tools: list[dict] | None) -> Message:
        """The answer `tokens` as the server returns it: `decode`, then `parse`, for one request."""
        request = self.request(tools)
        return self.parse(self.decode(tokens, tools, request), tools, request)

    def parse(self, text: str, tools: list[dict] | None, request: Any = None) -> Message:
        """`text` (one answer) -> {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?}, the calls
        in OpenAI form; a call's id is the one the model wrote where its format carries one (Kimi's
        `functions.NAME:K`), else left out (the caller names it)."""
        request = request if request is not None else self.request(tools)
        reasoning, content = None, text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.extract_reasoning(text, request=request)
        calls: list[dict] = []
        if self._tool_cls is not None and tools:
            with _quiet():
                info = self._tool_cls(self.tokenizer).extract_tool_calls(content or "", request=request)
            if info.tools_called:
                content = info.content
                for call in info.tool_calls:
                    entry = {
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments or "{}"},
                    }
                    if getattr(call, "id", None) and call.id in text:  # written by the model, not made up
                        entry = {"id": call.id, **entry}
                    calls.append(entry)
        message: Message = {"role": "assistant", "content": content or ""}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message


def openai_message(message: Message) -> Message:
    """A normalised message in OpenAI form, as a client sends it: a call's arguments a JSON string, the content of
    a turn that only calls tools null."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {
            **c,
            "function": {
                "name": c["function"]["name"],
                "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
            },
        }
        for c in message["tool_calls"]
    ]
    return {**message, "content": message["content"] or None, "tool_calls": calls}


class VllmRendering:
    """A chat request's prompt as vLLM's OpenAI server builds it, without starting an engine: the messages parsed
    as the server parses them (`parse_chat_messages`: arguments to objects, reasoning passed as `reasoning`, tool
    turns by `tool_call_id`), the template applied with the options vLLM resolves for it, the text tokenised
    without special tokens added (the chat endpoint's default).

    The functions moved between releases: `vllm.renderers` (0.16+: `safe_apply_chat_template`; its
    `parse_chat_messages` since 0.19) and `vllm.entrypoints.chat_utils` (0.11: `apply_hf_chat_template`)."""

    _parse: Callable[..., Any]  # parse_chat_messages, whose parameters differ between releases

    def __init__(self, target_dir: Any, tokenizer: Any, chat_template: str | None, trust_remote_code: bool = False):
        import vllm
        from vllm.config import ModelConfig

        self.version = vllm.__version__
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        with _quiet():
            self.model_config = ModelConfig(
                model=str(target_dir), tokenizer=str(target_dir), trust_remote_code=trust_remote_code
            )
        try:
            from vllm.renderers.chat_utils import parse_chat_messages  # 0.19+
        except ImportError:
            from vllm.entrypoints.chat_utils import (  # type: ignore[import-not-found, no-redef]  # before 0.19
                parse_chat_messages,
            )
        try:
            from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

            def apply(conversation: list, tools: list | None, **options: Any) -> str:
                return safe_apply_chat_template(
                    self.model_config,
                    tokenizer,
                    conversation,
                    tools=tools,
                    chat_template=chat_template,
                    tokenize=False,
                    **options,
                )
        except ImportError:  # 0.11 - 0.15
            from vllm.entrypoints.chat_utils import (  # type: ignore[no-redef]  # 0.11 - 0.15
                apply_hf_chat_template,
                resolve_chat_template_content_format,
            )

            def apply(conversation: list, tools: list | None, **options: Any) -> str:
                return apply_hf_chat_template(
                    tokenizer, conversation, chat_template, tools, model_config=self.model_config, **options
                )  # text

        self._parse, self._apply, self._format = parse_chat_messages, apply, resolve_chat_template_content_format
        # 0.11 - 0.15 take the tokenizer too
        self._parse_args = (tokenizer,) if "tokenizer" in inspect.signature(parse_chat_messages).parameters else ()

    def _content_format(self, tools: list | None) -> str:
        return self._format(self.chat_template, tools, "auto", self.tokenizer, model_config=self.model_config)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None, template_kwargs: dict) -> list[int]:
        """The token ids vLLM's server feeds the engine for a chat request of `messages` (normalised) and `tools`."""
        request = []
        for m in map(openai_message, messages):
            if m.get("reasoning_content") is not None:  # the request field vLLM reads (0.16+ ignores the other)
                m = {("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()}
            request.append(m)
        conversation = self._parse(request, self.model_config, *self._parse_args, self._content_format(tools))[0]
        with _quiet():
            text = self._apply(conversation, tools, add_generation_prompt=True, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)
