"""Evaluation prompt sets, rendered with the target's chat template into token ids.

    mt-bench           the 80 MT-bench questions shipped with draftsmith's default assets (first turn of each)
    humaneval          HumanEval's 164 Python function stubs, each asked as "complete this function"
    jee-math           the 434 JEE Advanced mathematics questions of OpenAI's evals registry, with their reasoning
                       system prompt
    bfcl-multi-turn    the Berkeley Function Calling Leaderboard's multi-turn tool-use tasks (prepare/bfcl.py): the
                       first request of each, its tools declared
    suite              one evaluation over the domains a target serves: chat (mt-bench), code (humaneval), math
                       (jee-math) and agentic (bfcl-multi-turn); `suite:code,math` (domain or set names) picks some.
                       --num-prompts counts per domain. Each domain is a pinned, checksummed asset like the above.
    FILE               ShareGPT JSON / messages JSONL (anything `draftsmith prepare` reads, agentic records too): the
                       conversation up to its first assistant turn, rendered with the record's `tools` and the
                       server's template options; records with `turns` (MT-bench style) or `prompt` work too
    held-out           the held-out split of the draft's own training data (below), where it is on this machine
    DIR (prepared)     a prepared data set: the samples of its held-out split (`prepared.split_indices`, the same
                       split the trainer holds out: its eval fraction and split seed are read from the draft's
                       training record unless given), cut before the first assistant token

Every prompt ends with the template's generation prompt, so the target starts its answer.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core import assets
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.manifest import MANIFEST_NAME, TargetIdentity, read_manifest_json
from draftsmith.prepare import bfcl
from draftsmith.prepare.dataset import open_prepared, split_indices
from draftsmith.prepare.messages import Skip, normalize_conversation, role_of
from draftsmith.prepare.readers import NAMED_BFCL, expand_sources, iter_source

MTBENCH, HUMANEVAL, JEE_MATH, SUITE, HELD_OUT = "mt-bench", "humaneval", "jee-math", "suite", "held-out"
SUITE_DOMAINS = {"chat": MTBENCH, "code": HUMANEVAL, "math": JEE_MATH, "agentic": NAMED_BFCL}  # the report's order
CODE_ASK = "Complete the following Python function. Answer with the whole function in one Python code block.\n\n"


@dataclass
class Prompt:
    id: str
    token_ids: list[int]


@dataclass
class Domain:
    """One domain of an evaluation: its name (a suite's domain, else the prompt set as given), the prompt set it is
    read from, and its prompts."""

    name: str
    source: str
    prompts: list[Prompt]


def _prompt_of(record: object) -> tuple[list[dict], list[dict] | None] | None:
    """(the chat messages before the first assistant turn, the tools the record declares), or None if the record
    holds no usable prompt. Conversations are read as `prepare` reads them (agentic ones included)."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("turns"), list) and record["turns"] and isinstance(record["turns"][0], str):
        return [{"role": "user", "content": record["turns"][0]}], None
    if isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return [{"role": "user", "content": record["prompt"]}], None
    key = next((k for k in ("conversations", "conversation", "messages") if k in record), None)
    turns = record.get(key)
    if not isinstance(turns, list):
        return None
    first = next((i for i, t in enumerate(turns) if role_of(t) == "assistant"), len(turns))
    if isinstance(record.get("recorded"), dict) and turns and role_of(turns[-1]) == "assistant":
        first = len(turns) - 1  # a recorded request (serve --record): its prompt is all the client sent
    try:  # only the turns before the first answer are read: what comes after does not make the prompt unusable
        chat = normalize_conversation({**record, key: turns[:first]}, leading_assistant="keep", keep_trailing=True)
    except Skip:
        return None
    if not any(m["role"] == "user" and m["content"].strip() for m in chat.messages):
        return None
    return chat.messages, chat.tools


def render(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> list[int]:
    """Chat template + generation prompt -> token ids (the template supplies any BOS itself), with the declared
    tools and the server's template options."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError("the target's tokenizer has no chat template; evaluation prompts need one")
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=False,
        **dict(template_kwargs or {}, **({"tools": tools} if tools else {})),
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _file_records(path: Path) -> Iterator[tuple[str, object]]:
    return (
        (str(record.data.get("question_id", record.data.get("id", record.index))), record.data)
        for source in expand_sources([path])
        for record in iter_source(source)
        if record.bad is None and isinstance(record.data, dict)
    )


def _humaneval() -> Iterator[tuple[str, object]]:
    with gzip.open(assets.fetch(assets.HUMANEVAL), "rt", encoding="utf-8") as lines:
        tasks = [json.loads(line) for line in lines if line.strip()]
    return ((t["task_id"], {"prompt": f"{CODE_ASK}```python\n{t['prompt']}```"}) for t in tasks)


def _jee_math() -> Iterator[tuple[str, object]]:
    lines = assets.fetch(assets.JEE_MATH).read_text(encoding="utf-8").splitlines()
    return ((f"jee-{i}", {"messages": json.loads(line)["input"]}) for i, line in enumerate(lines) if line.strip())


def _records(spec: str) -> Iterator[tuple[str, object]]:
    """(id, record) of a named prompt set or a conversations file, as written."""
    named = spec.strip()
    if named.lower() in (MTBENCH, "mtbench", "mt_bench"):
        return _file_records(assets.mtbench_path())
    if named == HUMANEVAL:
        return _humaneval()
    if named == JEE_MATH:
        return _jee_math()
    if named == NAMED_BFCL:
        return _file_records(bfcl.conversations_path())
    path = Path(spec).expanduser()
    if not path.exists():
        raise DraftsmithError(
            f"--prompts {spec}: no such file or directory (use mt-bench, humaneval, jee-math, bfcl-multi-turn, "
            "suite, a ShareGPT/JSONL file, or a prepared data set directory)"
        )
    return _file_records(path)


def requests(spec: str, limit: int | None = None) -> list[tuple[str, list[dict], list[dict] | None, dict]]:
    """A prompt set as the chat requests a client sends: (id, messages, tools, the record's own template options),
    at most `limit` of them (benchmarks/improve.py sends them to a server)."""
    out = []
    for rid, data in _records(spec):
        prompt = _prompt_of(data)
        if prompt is not None:
            own = data.get("chat_template_kwargs") if isinstance(data, dict) else None
            out.append((rid, *prompt, own if isinstance(own, dict) else {}))
        if limit is not None and len(out) >= limit:
            break
    return out


def _from_prepared(
    path: Path, target: TargetIdentity | None, limit: int | None, eval_fraction: float, split_seed: int
) -> list[Prompt]:
    dataset = open_prepared(path)
    if target is not None:
        problem = dataset.manifest.target.mismatch(target)
        if problem:
            raise DraftsmithError(
                f"{path}: prepared for another target ({problem}); use a prepared set of the draft's target"
            )
    _, held_out = split_indices(len(dataset), eval_fraction, split_seed)
    if not held_out:
        raise DraftsmithError(f"{path}: no held-out samples with --eval-fraction {eval_fraction}; raise it")
    prompts: list[Prompt] = []
    for i in held_out:
        sample = dataset[i]
        mask = sample["loss_mask"]
        if not bool(mask.any()):
            continue
        first = int(mask.nonzero()[0])
        if first == 0:
            continue
        prompts.append(Prompt(id=f"sample-{i}", token_ids=sample["input_ids"][:first].tolist()))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DraftsmithError(f"{path}: the held-out split has no sample with an assistant turn")
    return prompts


def held_out_split(eval_fraction: float | None, split_seed: int | None, training: dict[str, Any]) -> dict[str, Any]:
    """The held-out split to evaluate on: what the user passed, else what the draft was trained with (its manifest's
    `training` record: every checkpoint, and the exports made from it), else draftsmith's defaults (0.02, seed 0)."""
    return {
        "eval_fraction": eval_fraction if eval_fraction is not None else training.get("eval_fraction", 0.02),
        "split_seed": split_seed if split_seed is not None else training.get("split_seed", 0),
    }


def training_prompts(training: Mapping[str, object]) -> tuple[str | None, str]:
    """The prepared set a draft was trained from (`evaluate --gate` decodes its held-out split by default): the run's
    data, or the prepared set its store was extracted from. (None, why) where the draft records none or it is not on
    this machine."""
    data = training.get("data")
    if not data:
        return None, "the draft records no training data"
    path = Path(str(data))
    try:
        manifest = read_manifest_json(path)
    except DraftsmithError:
        return None, f"its training data {data} is not on this machine"
    if manifest.get("kind") == "store":
        prepared = Path(str((manifest.get("prepared") or {}).get("path", "")))
        if not (prepared / MANIFEST_NAME).is_file():
            return None, f"the prepared set of its training store {data} ({prepared}) is not on this machine"
        return str(prepared), f"the held-out split of {prepared}, the prepared set of its training store"
    return str(path), f"the held-out split of {path}, its training data"


def load_prompts(
    spec: str,
    tokenizer: Any,
    *,
    target: TargetIdentity | None = None,
    num_prompts: int | None = None,
    eval_fraction: float = 0.02,
    split_seed: int = 0,
    template_kwargs: dict | None = None,
) -> list[Prompt]:
    """The prompt set named by `spec` (see the module docstring), at most `num_prompts` of them, each rendered with
    the server's template options and its record's own (a recorded request's)."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        return _from_prepared(path, target, num_prompts, eval_fraction, split_seed)
    prompts = [
        Prompt(id=rid, token_ids=render(tokenizer, messages, tools, {**(template_kwargs or {}), **own}))
        for rid, messages, tools, own in requests(spec, num_prompts)
    ]
    if not prompts:
        raise DraftsmithError(
            f"{spec}: no usable prompt (expected ShareGPT `conversations`, `messages`, MT-bench "
            "`turns` or `prompt` records with a user turn)"
        )
    return prompts


def suite_domains(spec: str) -> list[str] | None:
    """The domains `suite` / `suite:NAME,NAME` names (domain or prompt-set names, in the suite's order); None where
    `spec` is no suite."""
    spec = spec.strip()
    if spec != SUITE and not spec.startswith(SUITE + ":"):
        return None
    names = [n.strip() for n in spec.removeprefix(SUITE).removeprefix(":").split(",") if n.strip()]
    by_set = {source: name for name, source in SUITE_DOMAINS.items()}
    unknown = [n for n in names if n not in SUITE_DOMAINS and n not in by_set]
    if unknown:
        offered = ", ".join(f"{name} ({source})" for name, source in SUITE_DOMAINS.items())
        raise DraftsmithError(f"--prompts {spec}: the suite has no domain {unknown[0]!r} (its domains: {offered})")
    picked = {by_set.get(n, n) for n in names}
    return [name for name in SUITE_DOMAINS if not names or name in picked]


def load_domains(spec: str, tokenizer: Any, **options: Any) -> list[Domain]:
    """The domains an evaluation runs: a suite's (each its prompt set, `num_prompts` of each), else the one prompt
    set `spec` names (load_prompts' options)."""
    names = suite_domains(spec)
    if names is None:
        return [Domain(spec, spec, load_prompts(spec, tokenizer, **options))]
    return [Domain(n, SUITE_DOMAINS[n], load_prompts(SUITE_DOMAINS[n], tokenizer, **options)) for n in names]
