"""Typed configs for every stage: a YAML file, then CLI overrides, validated by pydantic.

The CLI builds each sub-command's options from these models (cli.py), so a field added here with a
`description` is a documented `--option` at once, and docs/cli.md is generated from the same source.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.fsio import atomic_write_text
from draftsmith.core.spool_address import check_spool

RESOLVED_CONFIG_NAME = "config.yaml"


class StageConfig(BaseModel):
    """Base of every stage config: unknown keys are errors, so a typo in YAML is caught."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _split_list(value: Any) -> Any:
    """Accept "2,15,27" from the command line as well as a YAML list."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _json_object(value: Any) -> Any:
    """Accept '{"thinking": true}' from the command line as well as a YAML mapping."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as err:
            raise ValueError(f"not a JSON object: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("a JSON object is needed, like '{\"thinking\": true}'")
    return value


class PrepareConfig(StageConfig):
    data: list[str] = Field(default_factory=list, description=(
        "Input conversations: ShareGPT JSON, messages JSONL (agentic ones too: tools, tool calls, reasoning), or "
        "anything `datasets` reads locally (json/jsonl/parquet/arrow files or directories); bfcl-multi-turn: the "
        "Berkeley Function Calling Leaderboard's 200 multi-turn tool-use tasks as conversations. Comma-separated. "
        "Default: the embedded ShareGPT."))
    target: str | None = Field(None, description=(
        "Target model: an HF directory, a hub id in the local HF cache, or a .gguf file. "
        "Default: the embedded SmolLM2-135M-Instruct."))
    output: Path = Field(Path("runs/prepared"), description="Directory to write the prepared token shards to.")
    max_length: int = Field(2048, ge=16, description="Longest tokenised conversation kept, in tokens.")
    overflow: Literal["truncate", "drop"] = Field("truncate", description=(
        "What to do with a conversation longer than --max-length: cut it, or skip it (counted)."))
    leading_assistant: Literal["skip", "drop"] = Field("skip", description=(
        "A conversation whose first turn (after any system turn) is the assistant's: skip it (counted), or drop "
        "its assistant turns before the first user turn and keep the rest (counted in the summary)."))
    max_samples: int | None = Field(None, ge=1, description="Stop after this many good conversations.")
    num_workers: int = Field(0, ge=0, description="Tokeniser processes; 0 means one per CPU core.")
    shard_samples: int = Field(2048, ge=1, description="Conversations per output shard.")
    chat_template: Path | None = Field(None, description=(
        "A Jinja chat template file to use instead of the target tokenizer's own (e.g. for a base model)."))
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, json_schema_extra={"json_flag": True},
                                                 description=(
        "Options the server passes to the chat template, as a JSON object (vLLM's --chat-template-kwargs): "
        "'{\"thinking\": true}' for Kimi-K2.5, '{\"enable_thinking\": false}' for Qwen3 without reasoning."))
    trust_remote_code: bool = Field(False, description="Allow the target's own tokenizer code to run.")
    check_with_vllm: int = Field(0, ge=0, description=(
        "Render the first N conversations' prompts with the installed vLLM's own chat code too (no engine) and "
        "stop, naming the record, turn and first differing token, where its token ids differ from draftsmith's."))
    resume: bool = Field(True, description=(
        "Continue an interrupted run with the same inputs and options from its last complete shard."))

    _split = field_validator("data", mode="before")(_split_list)
    _kwargs = field_validator("chat_template_kwargs", mode="before")(_json_object)


class RegenerateConfig(StageConfig):
    data: list[str] = Field(default_factory=list, description=(
        "Conversations whose assistant turns the target answers anew: whatever `draftsmith prepare` reads. "
        "Comma-separated. Default: the embedded ShareGPT."))
    target: str | None = Field(None, description=(
        "Target model that writes the answers: an HF directory, a hub id in the local HF cache, or a .gguf file. "
        "Default: the embedded SmolLM2-135M-Instruct."))
    output: Path = Field(Path("runs/regenerated"), description=(
        "Directory to write the regenerated conversations to (messages JSONL shards that `draftsmith prepare "
        "--data` reads, and a manifest)."))
    engine: Literal["auto", "hf", "vllm"] = Field("auto", description=(
        "Engine that generates: transformers `generate`, or vLLM's batched generation; auto: vLLM when it is "
        "installed."))
    max_new_tokens: int = Field(512, ge=1, description=(
        "Longest answer per assistant turn, in tokens; an answer cut there is marked truncated."))
    max_length: int = Field(2048, ge=16, description=(
        "Longest conversation in tokens (prompt + answer); a later turn whose prompt already fills it ends the "
        "conversation before that turn (counted)."))
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set of tokens "
                         "whose probability adds up to top_p.")
    seed: int = Field(0, description=(
        "Random seed for sampling (temperature > 0): vLLM seeds each answer, transformers each batch."))
    think: Literal["keep", "drop"] = Field("keep", description=(
        "Keep the reasoning in the answers (<think> inline, or reasoning_content with --reasoning-parser) or drop "
        "it (no parser: an answer cut off before its reasoning ends is then skipped, counted)."))
    leading_assistant: Literal["skip", "drop"] = Field("skip", description=(
        "A conversation whose first turn (after any system turn) is the assistant's: skip it (counted), or drop "
        "its assistant turns before the first user turn and answer the rest."))
    max_samples: int | None = Field(None, ge=1, description="Stop after this many regenerated conversations.")
    shard_samples: int = Field(128, ge=1, description=(
        "Conversations per output shard; a killed run keeps its complete shards. Twice as many are generated at "
        "once (raise it on a GPU)."))
    chat_template: Path | None = Field(None, description=(
        "A Jinja chat template file to use instead of the target tokenizer's own (e.g. for a base model)."))
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, json_schema_extra={"json_flag": True},
                                                 description="As for prepare: vLLM's --chat-template-kwargs.")
    tool_call_parser: str | None = Field(None, description=(
        "vLLM's --tool-call-parser name (hermes: Qwen3, kimi_k2: Kimi-K2.5; needs vLLM): tool loops are answered "
        "with their tools declared, calls read back as tool_calls, the recorded results after calls of the recorded "
        "names (tools are not run); a diverging loop ends there, counted. Without it, tool chats are skipped."))
    reasoning_parser: str | None = Field(None, description=(
        "vLLM's --reasoning-parser name (qwen3, kimi_k2, deepseek_r1 ...): reasoning stored as reasoning_content."))
    device: str = Field("auto", description="Device for the hf engine: auto, cpu, cuda, cuda:1 ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Compute dtype; auto: bfloat16 on GPU, float32 on CPU."))
    hf_batch_size: int = Field(16, ge=1, description="hf engine: answers per `generate` call.")
    vllm_kv_cache_gb: int | None = Field(None, ge=1, description="vLLM on CPU: KV cache GiB; default: env's, else 2.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel size.")
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling/tokenizer code to run.")
    resume: bool = Field(True, description=(
        "Continue an interrupted run with the same inputs and options from its last complete shard."))

    _split = field_validator("data", mode="before")(_split_list)
    _kwargs = field_validator("chat_template_kwargs", mode="before")(_json_object)


class ExtractConfig(StageConfig):
    prepared: Path = Field(Path("runs/prepared"), description="A prepared data set (output of `draftsmith prepare`).")
    output: Path = Field(Path("runs/store"), description="Hidden-state store directory (created or resumed).")
    backend: Literal["hf", "vllm"] = Field("hf", description="Engine that runs the target: transformers or vLLM.")
    target: str | None = Field(None, description="Target model; default: the one the prepared set was made for.")
    aux_layer_ids: list[int] | None = Field(None, description=(
        "Aux layers in vLLM's convention (0 = embeddings, k = output of decoder layer k-1). Default: 2,N//2,N-3."))
    dtype: Literal["bf16", "fp8"] = Field("bf16", description="Storage dtype of hidden states (fp8: e4m3 + scales).")
    device: str = Field("auto", description="Device for the hf backend: auto, cpu, cuda, cuda:1 ...")
    token_budget: int = Field(8192, ge=1, description="Tokens per forward batch (samples are bucketed by length).")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "dtype the target runs in; auto = bfloat16 on a GPU and on a CPU that computes bf16 natively (AVX512-BF16 "
        "or AMX), float32 on other CPUs; with --backend vllm on a CPU, bfloat16 only where that vLLM has a bfloat16 "
        "attention kernel for the target here (else float32; where it cannot tell, a failed start falls back to "
        "float32 once), and a resumed store keeps its dtype. The choice is printed and recorded in the store's "
        "manifest."))
    shard_size_mb: float = Field(256.0, gt=0, description=(
        "Store shard size in MiB; a crash loses at most one unwritten shard per worker."))
    shard: str = Field("0/1", description="Process only slice i of n of the samples (i/n), for parallel workers.")
    max_samples: int | None = Field(None, ge=1, description="Extract only the first N samples of the prepared set.")
    vllm_strategy: Literal["auto", "connector", "direct", "taps"] = Field("auto", description=(
        "vLLM extraction strategy: connector (vLLM's extract_hidden_states), direct (vLLM's EAGLE-3 aux states read "
        "in the model runner) or taps (draftsmith's own hooks on the decoder layers: any architecture); auto picks "
        "the first the installed vLLM supports for the target (see `draftsmith doctor`)."))
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "vLLM tensor parallel size (one store writer per engine: rank 0). On CPU, draftsmith splits the allowed "
        "CPUs among the ranks (VLLM_CPU_OMP_THREADS_BIND) unless that is set."))
    data_parallel_size: int = Field(1, ge=1, description=(
        "vLLM data parallel size: engines in one vLLM, each its own store writer (or run --shard i/n per engine "
        "and `draftsmith store merge` the stores)."))
    vllm_compile: bool = Field(True, description=(
        "Let vLLM compile the target (connector strategy; slow start-up on CPU). The direct and taps strategies "
        "always run uncompiled."))
    vllm_max_model_len: int | None = Field(None, ge=16, description=(
        "vLLM context length; default: the longest prepared sample + 1."))
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling code to run.")

    _split = field_validator("aux_layer_ids", mode="before")(_split_list)

    @field_validator("shard")
    @classmethod
    def _check_shard(cls, value: str) -> str:
        parse_shard(value)
        return value


def parse_shard(value: str) -> tuple[int, int]:
    """'i/n' -> (i, n) with 0 <= i < n."""
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise ValueError(f"shard must look like i/n (e.g. 0/4), got {value!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"shard {value!r}: need 0 <= i < n")
    return i, n


def load_config(cls: type[StageConfig], config_file: Path | None, overrides: dict[str, Any]) -> StageConfig:
    """YAML file first, then the CLI flags that were given (None means not given).

    Every mistake is one line: the file and the line / column of a YAML error, the file and the key of a value
    from the file that is unknown or wrong, the `--option` of a wrong flag."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    if config_file is None:
        return validate_config(cls, flags)
    loaded = _read_yaml(Path(config_file))
    try:
        return cls.model_validate({**loaded, **flags})
    except ValidationError as err:
        first = err.errors()[0]
        if first["loc"] and str(first["loc"][0]) in flags:  # the flag's value is wrong, not the file's
            raise _one_line(cls, err, "") from None
        key = ".".join(str(p) for p in first["loc"]) or "(the whole file)"
        if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
            close = difflib.get_close_matches(key, list(cls.model_fields), n=1)
            raise DraftsmithError(f"{config_file}: key {key}: not an option of `draftsmith "
                                  f"{cls.__name__.removesuffix('Config').lower()}`"
                                  + (f"; did you mean {close[0]}?" if close else "")) from None
        raise DraftsmithError(f"{config_file}: key {key}: {_reason(err)}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise DraftsmithError(f"{path}: is a directory, not a YAML config file (--config)")
    if not path.is_file():
        raise DraftsmithError(f"{path}: config file does not exist (--config)")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise DraftsmithError(f"{path}: not UTF-8 text (byte {err.start}); a config is a YAML file") from None
    except OSError as err:
        raise DraftsmithError(f"{path}: cannot read the config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise DraftsmithError(f"{path}: {where}not valid YAML ({problem})".replace("\n", " ")) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise DraftsmithError(f"{path}: expected a mapping of option: value at the top level, found a "
                              f"{type(loaded).__name__}")
    return loaded


def _reason(err: ValidationError) -> str:
    """`Input should be a valid integer (got 'abc')`, and how many more problems there are."""
    first = err.errors()[0]
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    more = len(err.errors()) - 1
    return f"{first['msg']} (got {got})" + (f"; and {more} more" if more else "")


def _one_line(cls: type[StageConfig], err: ValidationError, where: str) -> DraftsmithError:
    first = err.errors()[0]
    option = ".".join(str(p) for p in first["loc"]) or "config"
    option = f"--{option.replace('_', '-')}" if option in cls.model_fields else option
    return DraftsmithError(f"{where}option {option}: {_reason(err)}")


def validate_config(cls: type[StageConfig], data: dict[str, Any], where: str = "") -> StageConfig:
    """`cls(**data)`, or a one-line error naming the option; `where` prefixes it (file, recipe section)."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise _one_line(cls, err, where) from None


def save_resolved_config(cfg: StageConfig, directory: Path) -> None:
    """Every stage writes the config it actually ran with beside its output."""
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    atomic_write_text(Path(directory) / RESOLVED_CONFIG_NAME, text)


class ExportConfig(StageConfig):
    checkpoint: Path = Field(Path("runs/draft"), description=(
        "A draft checkpoint: a `draftsmith train` run directory (its best/, else newest step) or a checkpoint dir."))
    format: Literal["vllm", "sglang", "speculators"] = Field("vllm", description=(
        "Output format: vllm (LlamaForCausalLMEagle3), sglang (same weights, SGLang's layer-id convention) "
        "or speculators (speculators_model_type eagle3)."))
    output: Path = Field(Path("runs/export"), description="Directory to write the exported draft to (replaced whole).")
    target: str | None = Field(None, description=(
        "Target the draft will serve with; default: the one recorded in the checkpoint. A target that differs "
        "from the checkpoint's is refused."))
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Weight dtype of model.safetensors.")
    speculative_tokens: int = Field(3, ge=1, le=16, description=(
        "Draft tokens per round written into the config (speculators proposal method)."))
    report: Path | None = Field(None, description=(
        "An evaluation report (report.json of `draftsmith evaluate`) whose measured acceptance goes in README.md."))


class EvaluateConfig(StageConfig):
    draft: Path = Field(Path("runs/export"), description=(
        "The draft: an exported directory (`draftsmith export`) or a training checkpoint."))
    engine: Literal["hf", "vllm"] = Field("hf", description=(
        "hf: draftsmith's reference speculative decoder (transformers); vllm: the real vLLM engine."))
    target: str | None = Field(None, description=(
        "Target model; default: the one the draft was trained for. A target that differs is refused."))
    output: Path = Field(Path("runs/eval"), description="Directory for report.json, report.md and the PNG charts.")
    prompts: str = Field("mt-bench", description=(
        "Prompt set: mt-bench (the embedded 80 questions), bfcl-multi-turn (200 tool-use tasks, their tools "
        "declared), a ShareGPT JSON / messages JSONL file, or a prepared data set directory (its held-out split is "
        "used). A file's records may declare `tools` (agentic traffic): each prompt is rendered with them, as served."))
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, json_schema_extra={"json_flag": True},
                                                 description=(
        "Options the server passes to the chat template when it renders a prompt file, as a JSON object (vLLM's "
        "--chat-template-kwargs), e.g. '{\"thinking\": true}' for Kimi-K2.5."))
    num_prompts: int | None = Field(None, ge=1, description="Use only the first N prompts of the set.")
    eval_fraction: float | None = Field(None, ge=0.0, lt=1.0, description=(
        "Held-out fraction of a prepared data set; default: the one the draft was trained with (else 0.02)."))
    split_seed: int | None = Field(None, description=(
        "Seed of the train / held-out split of a prepared set; default: the draft's (else 0)."))
    max_new_tokens: int = Field(256, ge=1, description="Tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    k: list[int] = Field(default_factory=lambda: [3], description=(
        "Draft tokens per round (num_speculative_tokens); several values are measured one after another."))
    baseline: bool = Field(True, description="Also decode with the target alone, for the speed-up.")
    seed: int = Field(0, description="Random seed for sampling (temperature > 0).")
    device: str = Field("auto", description="Device for the hf engine: auto, cpu, cuda, cuda:1 ...")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "Compute dtype; auto: float32 for the hf engine on CPU; for vLLM, as `extract --compute-dtype auto` (bfloat16 "
        "on a GPU; on a CPU where it computes bf16 natively and that vLLM has the kernels, else float32)."))
    max_model_len: int | None = Field(None, ge=16, description=(
        "vLLM context limit; default: longest prompt + max_new_tokens + k."))
    vllm_kv_cache_gb: int | None = Field(None, ge=1, description="vLLM on CPU: KV cache GiB; default: env's, else 2.")
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "--engine vllm: tensor parallel size of the decoding engine (a target that fills a node: Kimi-K2.5 at 8)."))
    vllm_timeout_s: int = Field(1800, ge=10, description="Give up on the vLLM subprocess after this many seconds.")
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling/tokenizer code to run.")

    _split = field_validator("k", mode="before")(_split_list)

    @field_validator("k")
    @classmethod
    def _check_k(cls, value: list[int]) -> list[int]:
        if not value or any(k < 1 or k > 16 for k in value):
            raise ValueError("k needs one or more values in 1..16")
        return sorted(set(value))

    _kwargs = field_validator("chat_template_kwargs", mode="before")(_json_object)


class TrainConfig(StageConfig):
    data: Path = Field(Path("runs/store"), description=(
        "Training data: a hidden-state store (trains offline) or a prepared data set (trains online: the target "
        "runs inside the trainer, nothing is written to disk)."))
    output: Path = Field(Path("runs/draft"), description="Run directory: checkpoints, metrics.jsonl, config.yaml.")
    target: str | None = Field(None, description="Target model; default: the one the data was made for.")
    aux_layer_ids: list[int] | None = Field(None, description=(
        "Aux layers in vLLM's convention. Offline: must match the store (default: the store's). Online: "
        "default 2,N//2,N-3."))
    draft_vocab_size: int = Field(32000, ge=2, description=(
        "Draft vocabulary: the most frequent loss-masked target ids (clipped to the target's vocabulary)."))
    num_layers: int | None = Field(None, ge=1, description=(
        "Decoder layers in the draft (default: 1 for eagle3 / peagle, 5 for dflash)."))
    method: Literal["eagle3", "peagle", "dflash"] = Field("eagle3", description=(
        "eagle3: the draft proposes one token per forward, each reading its own previous output (TTT); peagle: "
        "P-EAGLE parallel drafting, all k tokens of a round in one forward (served by vLLM with parallel_drafting); "
        "dflash: a block drafter, the anchor and block-size - 1 mask tokens denoised in one forward (vLLM's dflash "
        "method), reading --num-layers target layers spread over the stack (default aux layers)."))
    ttt_steps: int = Field(7, ge=1, description=(
        "Training-time-test steps unrolled per position (peagle: the parallel depths trained, the most tokens a "
        "round is meant to propose; dflash: block-size - 1, set from it)."))
    step_weight: float = Field(0.8, gt=0, description=(
        "Loss weight of TTT step k is step_weight**k (dflash: exp(-1 / loss-decay), set from it)."))
    block_size: int = Field(16, ge=2, le=64, description=(
        "dflash: positions per block, the anchor and block-size - 1 mask tokens; vLLM proposes block-size - 1 "
        "tokens a round."))
    anchors_per_sample: int = Field(512, ge=1, description=(
        "dflash: blocks trained per sample, their anchors drawn at random among the answer's tokens (fewer on a "
        "CPU: each costs block-size queries over the sample's context)."))
    loss_decay: float = Field(7.0, gt=0, description=(
        "dflash: block position j (1 .. block-size - 1) weighs exp(-(j - 1) / loss-decay) in the loss."))
    cod_ratio: float = Field(0.8, gt=0, le=1, description=(
        "peagle: COD sampling, depth k >= 1 scores about ratio**k of its positions (1: every position)."))
    cod_floor: float = Field(0.2, ge=0, le=1, description=(
        "peagle: COD sampling keeps at least this fraction of each depth's positions."))
    lr: float = Field(2e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    epochs: int = Field(1, ge=1, description="Passes over the training split.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    token_budget: int = Field(4096, ge=16, description=(
        "Tokens per micro-batch per process (batch size x longest sample, padding included)."))
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    warmup_steps: int = Field(50, ge=0, description="Linear warm-up steps of the learning rate.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of --lr.")
    clip: float = Field(0.5, ge=0, description="Gradient-norm clipping (0 disables).")
    noise_std: float = Field(0.0, ge=0, description="Std of Gaussian noise added to the target features.")
    eval_fraction: float = Field(0.02, ge=0, lt=1, description="Held-out fraction of samples evaluated each epoch.")
    split_seed: int = Field(0, description=(
        "Seed of the train / held-out split (by sample id; recorded in the checkpoint, so `draftsmith evaluate "
        "--prompts PREPARED` holds out the same samples)."))
    eval_every: int | None = Field(None, ge=1, description="Also evaluate every N optimizer steps.")
    save_every: int = Field(500, ge=1, description="Write a checkpoint every N optimizer steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Step checkpoints kept on disk (best/ is kept apart).")
    log_every: int = Field(10, ge=1, description="Write a metrics.jsonl line every N optimizer steps.")
    max_samples: int | None = Field(None, ge=1, description="Use only the first N samples of the data.")
    seed: int = Field(0, description="Seed for initialisation, data order and feature noise.")
    distributed: Literal["auto", "ddp", "fsdp2"] = Field("auto", description=(
        "Data parallelism under torchrun: ddp (every rank holds the draft), fsdp2 (sharded), or auto: fsdp2 only "
        "for a draft whose weights, gradients and AdamW state pass 16 GiB or whose head has 128k+ tokens."))
    num_workers: int | None = Field(None, ge=0, description=(
        "DataLoader worker processes per rank that read and pad batches ahead; default: a few on a GPU, 0 on a CPU."))
    compile: bool = Field(False, description="torch.compile the draft's decoder layers (forward and backward).")
    attention_kernel: Literal["auto", "flex", "chunked"] = Field("auto", description=(
        "The TTT attention's causal part: flex (fused, CUDA), chunked (anywhere), auto: flex on a GPU."))
    activation_checkpointing: bool = Field(False, description=(
        "Recompute each TTT step's layer activations in the backward instead of keeping them (less memory, "
        "about a third more compute)."))
    resume: bool = Field(True, description="Continue from the latest checkpoint in --output when there is one.")
    force: bool = Field(False, description="Resume even if hyper-parameters differ (prints what changed).")
    init_from: Path | None = Field(None, description=(
        "Start from an existing draft (an exported directory in any format, or a training checkpoint) instead of a "
        "fresh one, e.g. to adapt a released draft to your data. Its layers, draft vocabulary and aux layers are kept "
        "(--draft-vocab-size and --lm-head-init do not apply); it must be a draft for this target."))
    lm_head_init: Literal["target", "random"] = Field("target", description=(
        "Initialise the draft's lm_head from the target's rows for the draft vocabulary, or randomly."))
    device: str = Field("auto", description="auto, cpu, cuda, cuda:1 ... (torchrun: each rank uses its local GPU).")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description=(
        "auto: bf16 autocast on a GPU and on a CPU that computes bf16 natively (AVX512-BF16 or AMX), fp32 on other "
        "CPUs. The choice is printed and recorded in OUTPUT/config.yaml."))
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling code to run.")
    engine: Literal["hf", "vllm"] = Field("hf", description=(
        "Online training (--data is a prepared set): hf runs the target inside the trainer (transformers); vllm "
        "starts vLLM engines that extract the hidden states the trainer needs next into a bounded spool."))
    spool: str | None = Field(None, description=(
        "--engine vllm: where the engines hand over the states: a directory on local disk or /dev/shm (under "
        "torchrun on several nodes, a path every rank sees; default OUTPUT/spool), or a Mooncake store: mooncake "
        "(draftsmith starts a master on loopback) or mooncake://HOST:PORT/RUN (a running master; RUN, optional, "
        "names the run's keys; no shared filesystem needed)."))
    _spool = field_validator("spool")(check_spool)
    remote_engines: bool = Field(False, description=(
        "--engine vllm: the engines run elsewhere, started there by `draftsmith feed --spool SPOOL` (the engine "
        "node's command); the trainer starts none and waits for them."))
    stall_timeout_s: float = Field(1800.0, gt=0, description=(
        "--engine vllm: end the run, naming the side and its log, when the engines (waited for by the trainer) or "
        "the trainer (waited for by the engines) report no progress for this many seconds."))
    spool_gb: float = Field(1.0, gt=0, description=(
        "--engine vllm: the most the spool may hold (on disk, or in Mooncake), in GiB; the engines wait when it is full "
        "(`draftsmith doctor --online-rate` says what a rate needs)."))
    spool_dtype: Literal["bf16", "fp8"] = Field("bf16", description=(
        "--engine vllm: storage dtype of the spooled hidden states (and of the --keep-epoch0 store)."))
    keep_epoch0: Path | None = Field(None, description=(
        "--engine vllm: also keep epoch 0's hidden states (and the held-out split's) in this hidden-state store; "
        "later epochs read them from there instead of the engines, and `train --data` can use it offline later."))
    engine_tensor_parallel_size: int = Field(1, ge=1, description="--engine vllm: vLLM tensor parallel size.")
    engine_data_parallel_size: int = Field(1, ge=1, description=(
        "--engine vllm: vLLM data parallel size (engines in one vLLM, each writing its share of every chunk)."))
    engine_devices: list[int] | None = Field(None, description=(
        "--engine vllm: on GPUs, the GPU ids the engines use (CUDA_VISIBLE_DEVICES numbering), disjoint from the "
        "trainer's (default: the GPUs after those the trainer's processes on this node use); on a CPU, the cores "
        "the engines are bound to while the trainer keeps the others (default: the first half of the cores)."))
    vllm_strategy: Literal["auto", "connector", "direct", "taps"] = Field("auto", description=(
        "--engine vllm: how vLLM hands over the states, as `extract --vllm-strategy` (see `draftsmith doctor`)."))
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "--engine vllm: dtype the target runs in inside vLLM, as `extract --compute-dtype` (auto: bfloat16 on GPUs "
        "and on CPUs with bf16 instructions where that vLLM has bf16 attention kernels for the target, else float32)."))
    vllm_compile: bool = Field(True, description=(
        "--engine vllm: let vLLM compile the target (CUDA graphs / inductor); off: eager, faster start."))

    _split = field_validator("aux_layer_ids", "engine_devices", mode="before")(_split_list)

    @model_validator(mode="after")
    def _method_shapes(self) -> "TrainConfig":
        """The per-method defaults: --num-layers (1, DFlash 5); a DFlash run's TTT steps are its block positions
        and its step weight exp(-1 / loss-decay) (refused when set to something else)."""
        if self.num_layers is None:
            object.__setattr__(self, "num_layers", 5 if self.method == "dflash" else 1)
        if self.method == "dflash":
            steps, weight = self.block_size - 1, math.exp(-1.0 / self.loss_decay)
            if "ttt_steps" in self.model_fields_set and self.ttt_steps != steps:
                raise ValueError(f"--method dflash trains block-size - 1 = {steps} positions; drop --ttt-steps "
                                 f"{self.ttt_steps} or set --block-size {self.ttt_steps + 1}")
            if "step_weight" in self.model_fields_set and abs(self.step_weight - weight) > 1e-12:
                raise ValueError("--method dflash weighs its block positions by --loss-decay; drop --step-weight")
            object.__setattr__(self, "ttt_steps", steps)
            object.__setattr__(self, "step_weight", weight)
        return self


class FeedConfig(StageConfig):
    spool: str = Field("mooncake://127.0.0.1:50051", description=(
        "The trainer's --spool: mooncake://HOST:PORT/RUN (its Mooncake master and run; /RUN optional), or a "
        "directory both nodes see."))
    _spool = field_validator("spool")(check_spool)
    prepared: Path | None = Field(None, description=(
        "This node's copy of the trainer's prepared set (default: the path in the trainer's job); checked to be "
        "the same set."))
    target: str | None = Field(None, description=(
        "This node's path of the target (default: the one in the trainer's job)."))
    scratch: Path | None = Field(None, description=(
        "Local directory the engine writes each chunk into before publishing it (default: a directory in TMPDIR)."))
    segment_gb: float | None = Field(None, gt=0, description=(
        "GiB of this node's memory the engine lends Mooncake for the chunks (default: the trainer's --spool-gb "
        "with room under Mooncake's eviction watermark)."))
    stall_timeout_s: float = Field(1800.0, gt=0, description=(
        "Stop, naming the trainer, when it reports no progress for this many seconds while the engine waits "
        "(also how long to wait for the trainer's job)."))


class QuickstartConfig(StageConfig):
    output: Path = Field(Path("runs/quickstart"), description=(
        "Run directory; each stage writes a sub-directory, and a second run continues where the first stopped."))
    budget: Literal["tiny", "small", "medium", "large"] = Field("small", description=(
        "small: about 15 minutes on a 2-core CPU; medium: about 80 minutes there (8.7x the tokens); large: the "
        "whole embedded ShareGPT, for a GPU; "
        "tiny: a few-minute smoke test of the whole path."))
    method: Literal["eagle3", "peagle", "dflash"] = Field("eagle3", description=(
        "The draft trained and evaluated: eagle3, peagle (P-EAGLE: every token of a round in one draft forward, "
        "served by vLLM with parallel_drafting) or dflash (a block drafter: the anchor and block - 1 masks in one "
        "forward, vLLM's dflash method); the budget's shapes either way (peagle trains a parallel depth for every "
        "evaluated k; dflash: blocks of the evaluated k + 1 on a CPU budget, the peers' defaults on large)."))
    target: str | None = Field(None, description="Target model; default: the embedded SmolLM2-135M-Instruct.")
    data: list[str] = Field(default_factory=list, description="Training conversations; default: the embedded ShareGPT.")
    engine: Literal["auto", "hf", "vllm"] = Field("auto", description=(
        "Evaluation engine: auto uses vLLM where the probe finds it can decode the draft here (EAGLE-3 on this "
        "platform; parallel drafting for --method peagle), the reference decoder otherwise (the summary says why); "
        "vllm there is refused before the first stage."))
    k: list[int] = Field(default_factory=list, description=(
        "Draft lengths to evaluate, one engine start each (default per budget: tiny 3, small and medium 5, large "
        "1..5); the summary reads τ for every shorter k off the longest run's per-position acceptance (for P-EAGLE "
        "too: a parallel round's first proposals do not depend on k)."))
    num_prompts: int | None = Field(None, ge=1, description="MT-bench prompts to evaluate; default per budget.")
    max_new_tokens: int | None = Field(None, ge=1, description="Tokens generated per prompt; default per budget.")
    device: str = Field("auto", description="auto, cpu, cuda ...")
    online: bool = Field(False, description=(
        "Train straight from the prepared set (the target runs inside the trainer) instead of extracting a store."))
    regenerate: bool = Field(False, description=(
        "Train on the target's own answers: regenerate the data's assistant turns with the target first, then "
        "prepare the regenerated set (a `regenerate:` recipe section holds its options and turns it on)."))
    # Recipe sections (YAML only): options of one stage on top of what the budget chose, e.g. `train: {lr: 3e-4}`.
    # The paths that chain the stages together are the quickstart's and cannot be set here.
    prepare: dict[str, Any] = Field(default_factory=dict, description="YAML only: PrepareConfig options.")
    extract: dict[str, Any] = Field(default_factory=dict, description="YAML only: ExtractConfig options.")
    train: dict[str, Any] = Field(default_factory=dict, description="YAML only: TrainConfig options.")
    export: dict[str, Any] = Field(default_factory=dict, description="YAML only: ExportConfig options.")
    evaluate: dict[str, Any] = Field(default_factory=dict, description="YAML only: EvaluateConfig options.")
    regenerate_options: dict[str, Any] = Field(default_factory=dict, description=(
        "YAML only: RegenerateConfig options (written as the `regenerate:` section)."))

    _split = field_validator("data", "k", mode="before")(_split_list)

    @model_validator(mode="before")
    @classmethod
    def _regenerate_section(cls, data: Any) -> Any:
        """`regenerate: {temperature: 0.7}` in a recipe: regenerate, with these options."""
        if isinstance(data, dict) and isinstance(data.get("regenerate"), dict):
            data = {**data, "regenerate": True,
                    "regenerate_options": {**data.get("regenerate_options", {}), **data["regenerate"]}}
        return data


class StageResult(BaseModel):
    """What a stage's `run` returns: where its output is, and a short summary the CLI prints as a table."""

    stage: str
    output: Path
    summary: dict[str, Any] = Field(default_factory=dict)
    # Shell commands for the user to copy (e.g. how to serve the draft): printed in full below the table, unwrapped.
    commands: dict[str, str] = Field(default_factory=dict)


class ServeConfig(StageConfig):
    draft: Path = Field(Path("runs/export"), description=(
        "The draft: an exported directory (any format), a training run or a checkpoint. One vLLM cannot load as it "
        "is (a run or checkpoint, an SGLang export) is written as a vLLM export into a temporary directory first."))
    target: str | None = Field(None, description=(
        "Target model; default: the one the draft was trained for. A target that differs is refused before vLLM "
        "starts."))
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description=(
        "Draft tokens per step; default: the export's own (`draftsmith export --speculative-tokens`), else 3."))
    host: str = Field("127.0.0.1", description=(
        "Address to listen on; 0.0.0.0 serves every network interface (then set --api-key)."))
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    api_key: str | None = Field(None, description=(
        "Answer only requests that carry this key (Authorization: Bearer KEY); vLLM also reads VLLM_API_KEY."))
    served_model_name: str | None = Field(None, description=(
        "The model name clients send; default: vLLM's, the target's path."))
    max_model_len: int | None = Field(None, ge=16, description="Context length; default: the target's.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Weight and compute dtype; auto: vLLM's choice on a GPU; on a CPU as `extract --compute-dtype auto` (bfloat16 "
        "where the CPU computes it natively and this vLLM has the kernels, else float32)."))
    kv_cache_gb: int | None = Field(None, ge=1, description=(
        "vLLM on CPU: KV cache size in GiB; default: what the environment gives vLLM, else 2."))
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (or CPU NUMA nodes) to split the target over.")
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling/tokenizer code to run.")
    vllm_args: str | None = Field(None, description=(
        "More `vllm serve` options, passed on as they are, in one quoted string, e.g. "
        "--vllm-args '--enforce-eager --max-num-seqs 8' (--vllm-args --help=all lists them)."))
