"""The engines `draftsmith regenerate` asks for answers: vLLM in a child process (regenerate_worker.py, because
vLLM spawns; requests enter its continuous batching as they come, so a conversation with 20 turns does not hold up
the others) or transformers `generate` in this process (the waiting requests, `hf_batch_size` at a time).

Both take rendered, tokenised prompts, so they see exactly the same tokens and agree on greedy answers up to
floating-point ties. An engine has `submit(key, prompt ids, limit, seed)`, `results()` (waits for at least one
answer: `(key, answer ids without the end token, hit its limit)`) and `close()`.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from pydantic import BaseModel
from transformers import GenerationConfig, PreTrainedTokenizerBase

from draftsmith.config import RegenerateConfig
from draftsmith.core import processes, targets, vllm_launch
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import load_target
from draftsmith.prepare import regenerate_worker as worker

LOG_NAME = "vllm.log"


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, target_dir: Path) -> list[int]:
    """The ids that end an answer (`targets.eos_ids`); refused when the target names none."""
    ids = targets.eos_ids(tokenizer, target_dir)
    if not ids:
        raise DraftsmithError(
            f"{target_dir}: the target names no end-of-sequence token (tokenizer eos_token, "
            "generation_config.json eos_token_id); answers would never end"
        )
    return sorted(ids)


def engine_choice(cfg: RegenerateConfig) -> tuple[str, str]:
    """(engine, version) for the run; the version goes into the job's fingerprint and the manifest."""
    version = vllm_launch.vllm_version() if cfg.engine in ("auto", "vllm") else None
    if version is not None:
        return "vllm", f"vllm {version}"
    if cfg.engine == "vllm":
        raise DraftsmithError("--engine vllm: vLLM is not installed; install it (see README) or use --engine hf")
    return "hf", f"transformers {transformers.__version__}, torch {torch.__version__}"


def dtype_name(cfg: RegenerateConfig, device: torch.device) -> worker.Dtype:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


Answer = tuple[int, list[int], bool]  # (request key, answer token ids without the end token, hit its limit)


class HFEngine:
    """transformers `generate` in this process: the requests waiting, `hf_batch_size` at a time, left-padded."""

    def __init__(
        self, target_dir: Path, cfg: RegenerateConfig, device: torch.device, dtype: str, eos: list[int], pad_id: int
    ):
        self.model = load_target(target_dir, getattr(torch, dtype), device, cfg.trust_remote_code)
        self.device = device
        self.batch_size = cfg.hf_batch_size
        self.eos = set(eos)
        self.pad_id = pad_id
        self.sampled = cfg.temperature > 0
        # Only these settings: not the target's generation_config.json defaults (vLLM's worker ignores them too).
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0} if self.sampled else {}
        self.settings = dict(do_sample=self.sampled, eos_token_id=eos, pad_token_id=pad_id, **sampling)
        self.waiting: list[tuple[int, list[int], int, int]] = []

    def submit(self, key: int, prompt: list[int], limit: int, seed: int) -> None:
        self.waiting.append((key, prompt, limit, seed))

    def results(self) -> list[Answer]:
        """Answer the `hf_batch_size` requests waiting longest."""
        batch, self.waiting = self.waiting[: self.batch_size], self.waiting[self.batch_size :]
        width = max(len(prompt) for _, prompt, _, _ in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (_, prompt, _, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        gen = GenerationConfig(max_new_tokens=max(limit for _, _, limit, _ in batch), **self.settings)
        if self.sampled:
            torch.manual_seed(batch[0][3])
        with torch.no_grad():
            out = self.model.generate(  # type: ignore[operator]  # GenerationMixin's: PreTrainedModel lacks it to mypy
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=gen
            )
        answers = []
        for row, (key, _, limit, _) in enumerate(batch):
            tokens = out[row, width:].tolist()[:limit]
            end = next((j for j, t in enumerate(tokens) if t in self.eos), None)
            answers.append((key, tokens, True) if end is None else (key, tokens[:end], False))
        return answers

    def close(self) -> None:
        pass


class VLLMEngine:
    """vLLM in its child process (regenerate_worker.py), started once per run."""

    def __init__(
        self, target_dir: Path, cfg: RegenerateConfig, dtype: str, eos: list[int], max_model_len: int, log_file: Path
    ):
        self.log_file = log_file
        self.worker = processes.ChildProcess(
            [sys.executable, "-m", "draftsmith.prepare.regenerate_worker"],
            log=log_file,
            env=vllm_launch.worker_environment(cfg.vllm_kv_cache_gb),
            pipes=True,  # requests in, replies out; its stderr (vLLM's messages) into the log
        )
        proc = self.worker.proc
        assert proc.stdin is not None and proc.stdout is not None  # both pipes
        self._requests, self._replies = proc.stdin, proc.stdout
        try:
            self._send(
                worker.EngineOrder(
                    model=str(target_dir),
                    dtype=dtype,
                    max_model_len=max_model_len,
                    stop_token_ids=eos,
                    **cfg.model_dump(
                        include={"seed", "tensor_parallel_size", "trust_remote_code", "temperature", "top_p"}
                    ),
                )
            )
            worker.Ready.model_validate_json(self._receive("start"))  # once the engine is up
        except BaseException:  # a failed start, or Ctrl-C while it starts: no close() follows
            self.worker.stop()
            raise

    def _send(self, message: BaseModel, flush: bool = True) -> None:
        try:
            self._requests.write(message.model_dump_json() + "\n")
            if flush:
                self._requests.flush()
        except BrokenPipeError:
            self._failed("generate")

    def _receive(self, what: str) -> str:
        try:
            self._requests.flush()
        except BrokenPipeError:
            self._failed(what)
        line = self._replies.readline()
        if not line:
            self._failed(what)
        return line

    def _failed(self, what: str) -> None:
        code = self.worker.wait(60)
        raise DraftsmithError(
            f"vLLM failed to {what} (exit {code}): {processes.failure_line(self.log_file)} (full log: "
            f"{self.log_file}); run the same command again to resume, or use --engine hf"
        )

    def submit(self, key: int, prompt: list[int], limit: int, seed: int) -> None:
        self._send(worker.Request(id=key, prompt=prompt, max_tokens=limit, seed=seed), flush=False)

    def results(self) -> list[Answer]:
        """The answers that ended since the last call (waits for at least one)."""
        answers = []
        for out in worker.Finished.model_validate_json(self._receive("generate")).outputs:
            tokens = out.token_ids
            if out.finish_reason == "stop" and tokens:
                tokens = tokens[:-1]  # the end-of-turn token that stopped it
            answers.append((out.id, tokens, out.finish_reason == "length"))
        return answers

    def close(self) -> None:
        """The worker's stdin closed (it ends after its step), then it and its group stopped."""
        if self.worker.poll() is None:
            self._requests.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.worker.wait(30)
        self.worker.stop()


Engine = HFEngine | VLLMEngine
