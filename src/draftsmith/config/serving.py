"""The configs after training: export, evaluate, serve, and the quickstart that runs the whole path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from draftsmith.config.base import ChatTemplateKwargs, Split, StageConfig
from draftsmith.methods import DEFAULT_METHOD, MethodName


class ExportConfig(StageConfig):
    checkpoint: Path = Field(
        Path("runs/draft"),
        description=(
            "A draft checkpoint: a `draftsmith train` run directory (its best/, else newest step) or a checkpoint dir."
        ),
    )
    format: Literal["vllm", "sglang", "speculators"] = Field(
        "vllm",
        description=(
            "Output format: vllm (LlamaForCausalLMEagle3), sglang (same weights, SGLang's layer-id convention) "
            "or speculators (speculators_model_type eagle3)."
        ),
    )
    output: Path = Field(Path("runs/export"), description="Directory to write the exported draft to (replaced whole).")
    target: str | None = Field(
        None,
        description=(
            "Target the draft will serve with; default: the one recorded in the checkpoint. A target that differs "
            "from the checkpoint's is refused."
        ),
    )
    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="Weight dtype of model.safetensors.")
    speculative_tokens: int = Field(
        3, ge=1, le=16, description="Draft tokens per round written into the config (speculators proposal method)."
    )
    report: Path | None = Field(
        None,
        description=(
            "An evaluation report (report.json of `draftsmith evaluate`) whose measured acceptance goes in README.md."
        ),
    )


class EvaluateConfig(StageConfig):
    draft: Path = Field(
        Path("runs/export"),
        description="The draft: an exported directory (`draftsmith export`) or a training checkpoint.",
    )
    engine: Literal["hf", "vllm", "auto"] = Field(
        "hf",
        description=(
            "hf: draftsmith's reference speculative decoder (transformers); vllm: the real vLLM engine; auto: vLLM "
            "where the probe finds it can decode the draft here, else the reference decoder (saying why)."
        ),
    )
    target: str | None = Field(
        None, description="Target model; default: the one the draft was trained for. A target that differs is refused."
    )
    output: Path = Field(Path("runs/eval"), description="Directory for report.json, report.md and the PNG charts.")
    prompts: str | None = Field(
        None,
        description=(
            "Prompt set: mt-bench (the embedded 80 questions), humaneval, jee-math, bfcl-multi-turn (200 tool-use tasks, "
            "their tools declared), suite (chat, code, math and agentic in one run; suite:code,math picks), held-out "
            "(the held-out split of the draft's training data), a ShareGPT JSON / messages JSONL file, or a prepared "
            "data set directory (its held-out split is used). A file's records may declare `tools` (agentic traffic): "
            "each prompt is rendered with them, as served. "
            "Default: mt-bench; with --gate, the held-out split of the draft's training data where it is on this machine."
        ),
    )
    gate: bool = Field(
        False,
        description=(
            "Prove the draft in the installed vLLM: decode the prompts greedily with vLLM, score the same draft with "
            "the reference decoder along vLLM's output (same k and dtype) and compare acceptance per position; a gap, "
            "or a config.json key this vLLM reads changed since export, fails (exit 1) in one line naming the cause. "
            "Also reports the acceptance training predicted on its held-out split."
        ),
    )
    gate_tolerance: float = Field(
        0.03,
        gt=0.0,
        lt=1.0,
        description=(
            "--gate: the largest difference of acceptance at a position (a fraction of rounds) that still agrees; one "
            "round's worth is added for small samples. Paired along vLLM's output, a correct export agrees exactly."
        ),
    )
    concurrency: Split[list[int]] = Field(
        default_factory=list,
        description=(
            "Also measure the speed-up where it is served: `draftsmith serve` with the draft, then the target alone, "
            "loaded by vLLM's `vllm bench serve` at each of these concurrencies (e.g. 1,4,16) with the same prompts: "
            "output tokens/s, inter-token latency, the speed-up at each and where the draft stops paying (the largest "
            "k above is served)."
        ),
    )
    vllm_args: str | None = Field(
        None,
        description=(
            "--concurrency: more `vllm serve` options for both servers, in one quoted string, as `draftsmith serve "
            "--vllm-args` takes them (e.g. '--max-num-seqs 16 --enforce-eager'): the server you run."
        ),
    )
    chat_template_kwargs: ChatTemplateKwargs = Field(
        default_factory=dict,
        description=(
            "Options the server passes to the chat template when it renders a prompt file, as a JSON object (vLLM's "
            "--chat-template-kwargs), e.g. '{\"thinking\": true}' for Kimi-K2.5."
        ),
    )
    num_prompts: int | None = Field(
        None, ge=1, description="Use only the first N prompts of the set (a suite: of each)."
    )
    eval_fraction: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description=(
            "Held-out fraction of a prepared data set; default: the one the draft was trained with (else 0.02)."
        ),
    )
    split_seed: int | None = Field(
        None, description="Seed of the train / held-out split of a prepared set; default: the draft's (else 0)."
    )
    max_new_tokens: int = Field(256, ge=1, description="Tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 means greedy.")
    k: Split[list[int]] = Field(
        default_factory=lambda: [3],
        description="Draft tokens per round (num_speculative_tokens); several values are measured one after another.",
    )
    baseline: bool = Field(True, description="Also decode with the target alone, for the speed-up.")
    seed: int = Field(0, description="Random seed for sampling (temperature > 0).")
    device: str = Field("auto", description="Device for the hf engine: auto, cpu, cuda, cuda:1 ...")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description=(
            "Compute dtype; auto: float32 for the hf engine on CPU; for vLLM, as `extract --compute-dtype auto` (bfloat16 "
            "on a GPU; on a CPU where it computes bf16 natively and that vLLM has the kernels, else float32)."
        ),
    )
    max_model_len: int | None = Field(
        None, ge=16, description="vLLM context limit; default: longest prompt + max_new_tokens + k."
    )
    vllm_kv_cache_gb: int | None = Field(None, ge=1, description="vLLM on CPU: KV cache GiB; default: env's, else 2.")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "--engine vllm: tensor parallel size of the decoding engine (a target that fills a node: Kimi-K2.5 at 8)."
        ),
    )
    vllm_timeout_s: int = Field(1800, ge=10, description="Give up on the vLLM subprocess after this many seconds.")
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling/tokenizer code to run.")

    @field_validator("k")
    @classmethod
    def _check_k(cls, value: list[int]) -> list[int]:
        if not value or any(k < 1 or k > 16 for k in value):
            raise ValueError("k needs one or more values in 1..16")
        return sorted(set(value))

    @field_validator("concurrency")
    @classmethod
    def _check_concurrency(cls, value: list[int]) -> list[int]:
        if any(c < 1 for c in value):
            raise ValueError("concurrency needs values of at least 1")
        return sorted(set(value))


class QuickstartConfig(StageConfig):
    output: Path = Field(
        Path("runs/quickstart"),
        description=(
            "Run directory; each stage writes a sub-directory, and a second run continues where the first stopped."
        ),
    )
    budget: Literal["tiny", "small", "medium", "large"] = Field(
        "small",
        description=(
            "small: about 15 minutes on a 2-core CPU; medium: about 80 minutes there (8.7x the tokens); large: the "
            "whole embedded ShareGPT, for a GPU; "
            "tiny: a few-minute smoke test of the whole path."
        ),
    )
    method: MethodName = Field(
        DEFAULT_METHOD,
        description=(
            "The draft trained and evaluated: eagle3, eagle3.1, peagle (P-EAGLE: every token of a round in one draft "
            "forward, served by vLLM with parallel drafting), dflash (a block drafter: the anchor and block - 1 masks "
            "in one forward, vLLM's dflash method) or dspark (DFlash's block with the anchor row proposing too and a "
            "Markov head; vLLM serves it on a GPU only); the budget's shapes either way (peagle trains a parallel depth "
            "for every evaluated k; dflash / dspark: blocks of the evaluated k + 1 on a CPU budget, the peers' "
            "defaults on large)."
        ),
    )
    target: str | None = Field(None, description="Target model; default: the embedded SmolLM2-135M-Instruct.")
    data: Split[list[str]] = Field(
        default_factory=list, description="Training conversations; default: the embedded ShareGPT."
    )
    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto",
        description=(
            "Evaluation engine: auto uses vLLM where the probe finds it can decode the draft here (EAGLE-3 on this "
            "platform; parallel drafting for --method peagle), the reference decoder otherwise (the summary says why); "
            "vllm there is refused before the first stage."
        ),
    )
    k: Split[list[int]] = Field(
        default_factory=list,
        description=(
            "Draft lengths to evaluate, one engine start each (default per budget: tiny 3, small and medium 5, large "
            "1..5); the summary reads τ for every shorter k off the longest run's per-position acceptance (for P-EAGLE "
            "too: a parallel round's first proposals do not depend on k)."
        ),
    )
    num_prompts: int | None = Field(
        None,
        ge=1,
        description="Prompts of each domain to evaluate (chat, code, math, agentic: the suite); default per budget.",
    )
    max_new_tokens: int | None = Field(None, ge=1, description="Tokens generated per prompt; default per budget.")
    device: str = Field("auto", description="auto, cpu, cuda ...")
    online: bool = Field(
        False,
        description=(
            "Train straight from the prepared set (the target runs inside the trainer) instead of extracting a store."
        ),
    )
    regenerate: bool = Field(
        False,
        description=(
            "Train on the target's own answers: regenerate the data's assistant turns with the target first, then "
            "prepare the regenerated set (a `regenerate:` recipe section holds its options and turns it on)."
        ),
    )
    # Recipe sections (YAML only): options of one stage on top of what the budget chose, e.g. `train: {lr: 3e-4}`.
    # The paths that chain the stages together are the quickstart's and cannot be set here.
    prepare: dict[str, Any] = Field(default_factory=dict, description="YAML only: PrepareConfig options.")
    extract: dict[str, Any] = Field(default_factory=dict, description="YAML only: ExtractConfig options.")
    train: dict[str, Any] = Field(default_factory=dict, description="YAML only: TrainConfig options.")
    export: dict[str, Any] = Field(default_factory=dict, description="YAML only: ExportConfig options.")
    evaluate: dict[str, Any] = Field(default_factory=dict, description="YAML only: EvaluateConfig options.")
    regenerate_options: dict[str, Any] = Field(
        default_factory=dict, description="YAML only: RegenerateConfig options (written as the `regenerate:` section)."
    )

    @model_validator(mode="before")
    @classmethod
    def _regenerate_section(cls, data: object) -> object:
        """`regenerate: {temperature: 0.7}` in a recipe: regenerate, with these options."""
        if isinstance(data, dict) and isinstance(data.get("regenerate"), dict):
            data = {
                **data,
                "regenerate": True,
                "regenerate_options": {**data.get("regenerate_options", {}), **data["regenerate"]},
            }
        return data


class ServeConfig(StageConfig):
    draft: Path = Field(
        Path("runs/export"),
        description=(
            "The draft: an exported directory (any format), a training run or a checkpoint. One vLLM cannot load as it "
            "is (a run or checkpoint, an SGLang export) is written as a vLLM export into a temporary directory first."
        ),
    )
    target: str | None = Field(
        None,
        description=(
            "Target model; default: the one the draft was trained for. A target that differs is refused before vLLM "
            "starts."
        ),
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=16,
        description=(
            "Draft tokens per step; default: the export's own (`draftsmith export --speculative-tokens`), else 3."
        ),
    )
    target_alone: bool = Field(
        False,
        description=(
            "Serve the draft's target without it (no speculative decoding), with the same engine options: the "
            "baseline a draft is measured against (evaluate --concurrency starts both)."
        ),
    )
    host: str = Field(
        "127.0.0.1", description="Address to listen on; 0.0.0.0 serves every network interface (then set --api-key)."
    )
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")
    api_key: str | None = Field(
        None,
        description=(
            "Answer only requests that carry this key (Authorization: Bearer KEY); vLLM also reads VLLM_API_KEY."
        ),
    )
    served_model_name: str | None = Field(
        None, description="The model name clients send; default: vLLM's, the target's path."
    )
    max_model_len: int | None = Field(None, ge=16, description="Context length; default: the target's.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "Weight and compute dtype; auto: vLLM's choice on a GPU; on a CPU as `extract --compute-dtype auto` (bfloat16 "
            "where the CPU computes it natively and this vLLM has the kernels, else float32)."
        ),
    )
    kv_cache_gb: int | None = Field(
        None, ge=1, description="vLLM on CPU: KV cache size in GiB; default: what the environment gives vLLM, else 2."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (or CPU NUMA nodes) to split the target over.")
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling/tokenizer code to run.")
    vllm_args: str | None = Field(
        None,
        description=(
            "More `vllm serve` options, passed on as they are, in one quoted string, e.g. "
            "--vllm-args '--enforce-eager --max-num-seqs 8' (--vllm-args --help=all lists them)."
        ),
    )
    record: Path | None = Field(
        None,
        description=(
            "Record every request the server answers, with the target's answer, into this directory (0700, files "
            "0600): what `prepare --data DIR` and `draftsmith improve --recording DIR` train from."
        ),
    )
    record_max_gb: float | None = Field(
        None,
        gt=0,
        description="--record: the most GiB the recording may hold; reaching it stops recording, not serving.",
    )
    record_redact: list[str] = Field(
        default_factory=list,
        description="--record: replace what this regular expression matches before anything is written (repeatable).",
        json_schema_extra={"repeatable": True},
    )
    record_sample: float = Field(1.0, gt=0, le=1, description="--record: the fraction of requests recorded.")

    @field_validator("record_redact")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"--record-redact {pattern!r} is not a regular expression ({err})") from None
        return value

    @model_validator(mode="after")
    def _recording(self) -> ServeConfig:
        if self.record is None and (self.record_max_gb is not None or self.record_redact or self.record_sample < 1):
            raise ValueError("--record-max-gb, --record-redact and --record-sample need --record DIR")
        return self


class ImproveConfig(StageConfig):
    draft: Path = Field(
        Path("runs/improve/current"),
        description=(
            "The draft serving now: OUT/current, or an export (made OUT/v1 on a first round; given again, it stands "
            "for OUT/current), or one of OUT's versions."
        ),
    )
    recording: Path = Field(Path("recording"), description="What the target served: `draftsmith serve --record DIR`.")
    output: Path = Field(
        Path("runs/improve"),
        description=(
            "Versions (v1 the draft given, v2 ...), `current` (a link to the one to serve) and one directory per round; "
            "a second run of the same command continues an unfinished round."
        ),
    )
    target: str | None = Field(None, description="Target model; default: the one the draft was trained for.")
    held_out: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="The newest fraction of the recording, never trained on: both drafts are proven on it.",
    )
    select: str = Field(
        "all",
        pattern=r"^(all|worst:(0?\.\d+|1(\.0*)?))$",
        description=(
            "What to learn from: all, or worst:F, the fraction F of requests with the lowest recorded acceptance "
            "(a recording with acceptance: vLLM 0.32 on)."
        ),
    )
    backend: Literal["hf", "vllm"] = Field("hf", description="Extraction's engine for the target (extract --backend).")
    engine: Literal["hf", "vllm", "auto"] = Field(
        "auto", description="The engine both drafts are proven in (evaluate --engine); vLLM runs the gate."
    )
    max_steps: int = Field(200, ge=1, description="Training steps from the current draft (train --max-steps).")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (train --lr).")
    token_budget: int = Field(4096, ge=1, description="Tokens per training batch (train --token-budget).")
    max_length: int = Field(2048, ge=16, description="Longest conversation kept, in tokens (prepare --max-length).")
    k: int | None = Field(None, ge=1, le=16, description="Draft length proven; default: the draft's export's, else 3.")
    num_prompts: int | None = Field(None, ge=1, description="Held-out requests proven on; default: all of them.")
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per held-out request.")
    device: str = Field("auto", description="auto, cpu, cuda ...")
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling/tokenizer code to run.")
