"""The data stages' configs: prepare, regenerate, extract."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from draftsmith.config.base import ChatTemplateKwargs, Split, StageConfig

# the chat template file of prepare and regenerate
ChatTemplate = Annotated[
    Path | None,
    Field(
        description="A Jinja chat template file to use instead of the target tokenizer's own (e.g. for a base model)."
    ),
]


class PrepareConfig(StageConfig):
    data: Split[list[str]] = Field(
        default_factory=list,
        description=(
            "Input conversations: ShareGPT JSON, messages JSONL (agentic ones too: tools, tool calls, reasoning), or "
            "anything `datasets` reads locally (json/jsonl/parquet/arrow files or directories); bfcl-multi-turn: the "
            "Berkeley Function Calling Leaderboard's 200 multi-turn tool-use tasks as conversations "
            "(bfcl-multi-turn-long-context: its 200 with long tool results). Comma-separated. "
            "Default: the embedded ShareGPT."
        ),
    )
    target: str | None = Field(
        None,
        description=(
            "Target model: an HF directory, a hub id in the local HF cache, or a .gguf file. "
            "Default: the embedded SmolLM2-135M-Instruct."
        ),
    )
    output: Path = Field(Path("runs/prepared"), description="Directory to write the prepared token shards to.")
    max_length: int = Field(2048, ge=16, description="Longest tokenised conversation kept, in tokens.")
    overflow: Literal["truncate", "drop"] = Field(
        "truncate", description="What to do with a conversation longer than --max-length: cut it, or skip it (counted)."
    )
    leading_assistant: Literal["skip", "drop"] = Field(
        "skip",
        description=(
            "A conversation whose first turn (after any system turn) is the assistant's: skip it (counted), or drop "
            "its assistant turns before the first user turn and keep the rest (counted in the summary)."
        ),
    )
    max_samples: int | None = Field(None, ge=1, description="Stop after this many good conversations.")
    num_workers: int = Field(0, ge=0, description="Tokeniser processes; 0 means one per CPU core.")
    shard_samples: int = Field(2048, ge=1, description="Conversations per output shard.")
    chat_template: ChatTemplate = None
    chat_template_kwargs: ChatTemplateKwargs = Field(
        default_factory=dict,
        description=(
            "Options the server passes to the chat template, as a JSON object (vLLM's --chat-template-kwargs): "
            "'{\"thinking\": true}' for Kimi-K2.5, '{\"enable_thinking\": false}' for Qwen3 without reasoning."
        ),
    )
    trust_remote_code: bool = Field(False, description="Allow the target's own tokenizer code to run.")
    check_with_vllm: int = Field(
        0,
        ge=0,
        description=(
            "Render the first N conversations' prompts with the installed vLLM's own chat code too (no engine) and "
            "stop, naming the record, turn and first differing token, where its token ids differ from draftsmith's."
        ),
    )
    resume: bool = Field(
        True, description="Continue an interrupted run with the same inputs and options from its last complete shard."
    )


class RegenerateConfig(StageConfig):
    data: Split[list[str]] = Field(
        default_factory=list,
        description=(
            "Conversations whose assistant turns the target answers anew: whatever `draftsmith prepare` reads. "
            "Comma-separated. Default: the embedded ShareGPT."
        ),
    )
    target: str | None = Field(
        None,
        description=(
            "Target model that writes the answers: an HF directory, a hub id in the local HF cache, or a .gguf file. "
            "Default: the embedded SmolLM2-135M-Instruct."
        ),
    )
    output: Path = Field(
        Path("runs/regenerated"),
        description=(
            "Directory to write the regenerated conversations to (messages JSONL shards that `draftsmith prepare "
            "--data` reads, and a manifest)."
        ),
    )
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description=(
            "Engine that generates: transformers `generate`, or vLLM's batched generation; auto: vLLM when it is "
            "installed."
        ),
    )
    max_new_tokens: int = Field(
        512, ge=1, description="Longest answer per assistant turn, in tokens; an answer cut there is marked truncated."
    )
    max_length: int = Field(
        2048,
        ge=16,
        description=(
            "Longest conversation in tokens (prompt + answer); a later turn whose prompt already fills it ends the "
            "conversation before that turn (counted)."
        ),
    )
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling: keep the smallest set of tokens whose probability adds up to top_p.",
    )
    seed: int = Field(
        0, description="Random seed for sampling (temperature > 0): vLLM seeds each answer, transformers each batch."
    )
    think: Literal["keep", "drop"] = Field(
        "keep",
        description=(
            "Keep the reasoning in the answers (<think> inline, or reasoning_content with --reasoning-parser) or drop "
            "it (no parser: an answer cut off before its reasoning ends is then skipped, counted)."
        ),
    )
    leading_assistant: Literal["skip", "drop"] = Field(
        "skip",
        description=(
            "A conversation whose first turn (after any system turn) is the assistant's: skip it (counted), or drop "
            "its assistant turns before the first user turn and answer the rest."
        ),
    )
    max_samples: int | None = Field(None, ge=1, description="Stop after this many regenerated conversations.")
    shard_samples: int = Field(
        128,
        ge=1,
        description=(
            "Conversations per output shard; a killed run keeps its complete shards. Twice as many are generated at "
            "once (raise it on a GPU)."
        ),
    )
    chat_template: ChatTemplate = None
    chat_template_kwargs: ChatTemplateKwargs = Field(
        default_factory=dict, description="As for prepare: vLLM's --chat-template-kwargs."
    )
    tool_call_parser: str | None = Field(
        None,
        description=(
            "vLLM's --tool-call-parser name (hermes: Qwen3, kimi_k2: Kimi-K2.5; needs vLLM): tool loops are answered "
            "with their tools declared, calls read back as tool_calls, the recorded results after calls of the recorded "
            "names (tools are not run); a diverging loop ends there, counted. Without it, tool chats are skipped."
        ),
    )
    reasoning_parser: str | None = Field(
        None,
        description=(
            "vLLM's --reasoning-parser name (qwen3, kimi_k2, deepseek_r1 ...): reasoning stored as reasoning_content."
        ),
    )
    device: str = Field("auto", description="Device for the hf engine: auto, cpu, cuda, cuda:1 ...")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto: bfloat16 on GPU, float32 on CPU."
    )
    hf_batch_size: int = Field(16, ge=1, description="hf engine: answers per `generate` call.")
    vllm_kv_cache_gb: int | None = Field(None, ge=1, description="vLLM on CPU: KV cache GiB; default: env's, else 2.")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel size.")
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling/tokenizer code to run.")
    resume: bool = Field(
        True, description="Continue an interrupted run with the same inputs and options from its last complete shard."
    )


class ExtractConfig(StageConfig):
    prepared: Path = Field(Path("runs/prepared"), description="A prepared data set (output of `draftsmith prepare`).")
    output: Path = Field(Path("runs/store"), description="Hidden-state store directory (created or resumed).")
    backend: Literal["hf", "vllm"] = Field("hf", description="Engine that runs the target: transformers or vLLM.")
    target: str | None = Field(None, description="Target model; default: the one the prepared set was made for.")
    aux_layer_ids: Split[list[int] | None] = Field(
        None,
        description=(
            "Aux layers in vLLM's convention (0 = embeddings, k = output of decoder layer k-1). Default: 2,N//2,N-3."
        ),
    )
    dtype: Literal["bf16", "fp8"] = Field("bf16", description="Storage dtype of hidden states (fp8: e4m3 + scales).")
    device: str = Field("auto", description="Device for the hf backend: auto, cpu, cuda, cuda:1 ...")
    token_budget: int = Field(8192, ge=1, description="Tokens per forward batch (samples are bucketed by length).")
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "dtype the target runs in; auto = bfloat16 on a GPU and on a CPU that computes bf16 natively (AVX512-BF16 "
            "or AMX), float32 on other CPUs; with --backend vllm on a CPU, bfloat16 only where that vLLM has a bfloat16 "
            "attention kernel for the target here (else float32; where it cannot tell, a failed start falls back to "
            "float32 once), and a resumed store keeps its dtype. The choice is printed and recorded in the store's "
            "manifest."
        ),
    )
    shard_size_mb: float = Field(
        256.0, gt=0, description="Store shard size in MiB; a crash loses at most one unwritten shard per worker."
    )
    shard: str = Field("0/1", description="Process only slice i of n of the samples (i/n), for parallel workers.")
    max_samples: int | None = Field(None, ge=1, description="Extract only the first N samples of the prepared set.")
    vllm_strategy: Literal["auto", "connector", "direct", "taps"] = Field(
        "auto",
        description=(
            "vLLM extraction strategy: connector (vLLM's extract_hidden_states), direct (vLLM's EAGLE-3 aux states read "
            "in the model runner) or taps (draftsmith's own hooks on the decoder layers: any architecture); auto picks "
            "the first the installed vLLM supports for the target (see `draftsmith doctor`)."
        ),
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "vLLM tensor parallel size (one store writer per engine: rank 0). On CPU, draftsmith splits the allowed "
            "CPUs among the ranks (VLLM_CPU_OMP_THREADS_BIND) unless that is set."
        ),
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "vLLM data parallel size: engines in one vLLM, each its own store writer (or run --shard i/n per engine "
            "and `draftsmith store merge` the stores)."
        ),
    )
    vllm_compile: bool = Field(
        True,
        description=(
            "Let vLLM compile the target (connector strategy; slow start-up on CPU). The direct and taps strategies "
            "always run uncompiled."
        ),
    )
    vllm_max_model_len: int | None = Field(
        None, ge=16, description="vLLM context length; default: the longest prepared sample + 1."
    )
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling code to run.")

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
