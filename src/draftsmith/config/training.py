"""The training configs: train, and feed (the engine side of online training on another node)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from draftsmith.config.base import Split, StageConfig
from draftsmith.config.methods import OPTION_NAMES, fold_options, option_default, option_help
from draftsmith.core.spool_address import check_spool
from draftsmith.methods import DEFAULT_METHOD, OPTIONS, AnyMethodOptions, MethodName
from draftsmith.methods.eagle3 import Eagle3Options


class TrainConfig(StageConfig):
    data: Path = Field(
        Path("runs/store"),
        description=(
            "Training data: a hidden-state store (trains offline) or a prepared data set (trains online: the target "
            "runs inside the trainer, nothing is written to disk)."
        ),
    )
    output: Path = Field(Path("runs/draft"), description="Run directory: checkpoints, metrics.jsonl, config.yaml.")
    target: str | None = Field(None, description="Target model; default: the one the data was made for.")
    aux_layer_ids: Split[list[int] | None] = Field(
        None,
        description=(
            "Aux layers in vLLM's convention. Offline: must match the store (default: the store's). Online: "
            "default 2,N//2,N-3."
        ),
    )
    num_layers: int | None = Field(
        None, ge=1, description="Decoder layers in the draft (default: 1 for eagle3 / peagle, 5 for dflash / dspark)."
    )
    method: AnyMethodOptions = Field(
        default_factory=Eagle3Options,
        description=(
            "eagle3: the draft proposes one token per forward, each reading its own previous output (TTT); eagle3.1: "
            "EAGLE-3 with an RMSNorm on each captured layer before fc and the normed output fed back (vLLM reads "
            "fc_norm / norm_output; an EAGLE-3 draft can start it); peagle: "
            "P-EAGLE parallel drafting, all k tokens of a round in one forward (served by vLLM with parallel drafting); "
            "dflash: a block drafter, the anchor and block-size - 1 mask tokens denoised in one forward (vLLM's dflash "
            "method), reading --num-layers target layers spread over the stack (default aux layers); dspark: DFlash's "
            "block whose anchor row proposes too (block-size tokens a round), with a rank-256 Markov head applied left "
            "to right and a confidence head (vLLM's dspark method, GPU model runner V2 only). Each method takes its "
            "own options (the flags below that name it)."
        ),
    )
    lr: float = Field(2e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    epochs: int = Field(1, ge=1, description="Passes over the training split.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    token_budget: int = Field(
        4096, ge=16, description="Tokens per micro-batch per process (batch size x longest sample, padding included)."
    )
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    warmup_steps: int = Field(50, ge=0, description="Linear warm-up steps of the learning rate.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of --lr.")
    clip: float = Field(0.5, ge=0, description="Gradient-norm clipping (0 disables).")
    noise_std: float = Field(0.0, ge=0, description="Std of Gaussian noise added to the target features.")
    eval_fraction: float = Field(0.02, ge=0, lt=1, description="Held-out fraction of samples evaluated each epoch.")
    split_seed: int = Field(
        0,
        description=(
            "Seed of the train / held-out split (by sample id; recorded in the checkpoint, so `draftsmith evaluate "
            "--prompts PREPARED` holds out the same samples)."
        ),
    )
    eval_every: int | None = Field(None, ge=1, description="Also evaluate every N optimizer steps.")
    probe_every: int | None = Field(
        None,
        ge=1,
        description=(
            "Every N optimizer steps (and at the end) decode a few prompts with the current draft in a real engine "
            "(`draftsmith evaluate` in a child process) and log its τ and acceptance per position beside the held-out "
            "accuracy (metrics.jsonl, TensorBoard); training waits for it. A probe that fails is one line."
        ),
    )
    probe_prompts: str = Field(
        "held-out",
        description="The probe's prompt set (any `evaluate --prompts`); held-out: the training data's held-out split.",
    )
    probe_num_prompts: int = Field(4, ge=1, description="Prompts each probe decodes.")
    probe_max_new_tokens: int = Field(128, ge=1, description="Tokens each probe generates per prompt.")
    probe_engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="The probe's engine: auto is vLLM where it can decode the draft here, else the reference."
    )
    probe_device: str | None = Field(
        None, description="A device of the probe's own (e.g. cuda:7 beside the trainer's); default: as evaluate picks."
    )
    save_every: int = Field(500, ge=1, description="Write a checkpoint every N optimizer steps (and at the end).")
    keep_checkpoints: int = Field(2, ge=1, description="Step checkpoints kept on disk (best/ is kept apart).")
    log_every: int = Field(10, ge=1, description="Write a metrics.jsonl line every N optimizer steps.")
    max_samples: int | None = Field(None, ge=1, description="Use only the first N samples of the data.")
    seed: int = Field(0, description="Seed for initialisation, data order and feature noise.")
    distributed: Literal["auto", "ddp", "fsdp2"] = Field(
        "auto",
        description=(
            "Data parallelism under torchrun: ddp (every rank holds the draft), fsdp2 (sharded), or auto: fsdp2 only "
            "for a draft whose weights, gradients and AdamW state pass 16 GiB or whose head has 128k+ tokens."
        ),
    )
    num_workers: int | None = Field(
        None,
        ge=0,
        description=(
            "DataLoader worker processes per rank that read and pad batches ahead; default: a few on a GPU, 0 on a CPU."
        ),
    )
    compile: bool = Field(False, description="torch.compile the draft's decoder layers (forward and backward).")
    attention_kernel: Literal["auto", "flex", "chunked"] = Field(
        "auto",
        description="The TTT attention's causal part: flex (fused, CUDA), chunked (anywhere), auto: flex on a GPU.",
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each TTT step's layer activations in the backward instead of keeping them (less memory, "
            "about a third more compute)."
        ),
    )
    resume: bool = Field(True, description="Continue from the latest checkpoint in --output when there is one.")
    force: bool = Field(False, description="Resume even if hyper-parameters differ (prints what changed).")
    init_from: Path | None = Field(
        None,
        description=(
            "Start from an existing draft (an exported directory in any format, or a training checkpoint) instead of a "
            "fresh one, e.g. to adapt a released draft to your data. Its layers, draft vocabulary and aux layers are kept "
            "(--draft-vocab-size and --lm-head-init do not apply); it must be a draft for this target."
        ),
    )
    lm_head_init: Literal["target", "random"] = Field(
        "target",
        description="Initialise the draft's lm_head from the target's rows for the draft vocabulary, or randomly.",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:1 ... (torchrun: each rank uses its local GPU).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description=(
            "auto: bf16 autocast on a GPU and on a CPU that computes bf16 natively (AVX512-BF16 or AMX), fp32 on other "
            "CPUs. The choice is printed and recorded in OUTPUT/config.yaml."
        ),
    )
    trust_remote_code: bool = Field(False, description="Allow the target's own modelling code to run.")
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description=(
            "Online training (--data is a prepared set): hf runs the target inside the trainer (transformers); vllm "
            "starts vLLM engines that extract the hidden states the trainer needs next into a bounded spool."
        ),
    )
    spool: str | None = Field(
        None,
        description=(
            "--engine vllm: where the engines hand over the states: a directory on local disk or /dev/shm (under "
            "torchrun on several nodes, a path every rank sees; default OUTPUT/spool), or a Mooncake store: mooncake "
            "(draftsmith starts a master on loopback) or mooncake://HOST:PORT/RUN (a running master; RUN, optional, "
            "names the run's keys; no shared filesystem needed)."
        ),
    )
    _spool = field_validator("spool")(check_spool)
    remote_engines: bool = Field(
        False,
        description=(
            "--engine vllm: the engines run elsewhere, started there by `draftsmith feed --spool SPOOL` (the engine "
            "node's command); the trainer starts none and waits for them."
        ),
    )
    stall_timeout_s: float = Field(
        1800.0,
        gt=0,
        description=(
            "--engine vllm: end the run, naming the side and its log, when the engines (waited for by the trainer) or "
            "the trainer (waited for by the engines) report no progress for this many seconds."
        ),
    )
    spool_gb: float = Field(
        1.0,
        gt=0,
        description=(
            "--engine vllm: the most the spool may hold (on disk, or in Mooncake), in GiB; the engines wait when it is full "
            "(`draftsmith doctor --online-rate` says what a rate needs)."
        ),
    )
    spool_dtype: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="--engine vllm: storage dtype of the spooled hidden states (and of the --keep-epoch0 store).",
    )
    keep_epoch0: Path | None = Field(
        None,
        description=(
            "--engine vllm: also keep epoch 0's hidden states (and the held-out split's) in this hidden-state store; "
            "later epochs read them from there instead of the engines, and `train --data` can use it offline later."
        ),
    )
    engine_tensor_parallel_size: int = Field(1, ge=1, description="--engine vllm: vLLM tensor parallel size.")
    engine_data_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "--engine vllm: vLLM data parallel size (engines in one vLLM, each writing its share of every chunk)."
        ),
    )
    engine_devices: Split[list[int] | None] = Field(
        None,
        description=(
            "--engine vllm: on GPUs, the GPU ids the engines use (CUDA_VISIBLE_DEVICES numbering), disjoint from the "
            "trainer's (default: the GPUs after those the trainer's processes on this node use); on a CPU, the cores "
            "the engines are bound to while the trainer keeps the others (default: the first half of the cores)."
        ),
    )
    vllm_strategy: Literal["auto", "connector", "direct", "taps"] = Field(
        "auto",
        description=(
            "--engine vllm: how vLLM hands over the states, as `extract --vllm-strategy` (see `draftsmith doctor`)."
        ),
    )
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "--engine vllm: dtype the target runs in inside vLLM, as `extract --compute-dtype` (auto: bfloat16 on GPUs "
            "and on CPUs with bf16 instructions where that vLLM has bf16 attention kernels for the target, else float32)."
        ),
    )
    vllm_compile: bool = Field(
        True,
        description="--engine vllm: let vLLM compile the target (CUDA graphs / inductor); off: eager, faster start.",
    )

    @classmethod
    def flag_fields(cls) -> dict[str, FieldInfo]:
        """--method a choice of names, and after it one flag per option of any method (`fold_options` hands each to
        the chosen method's options, or refuses it)."""
        fields: dict[str, FieldInfo] = {}
        for name, field in cls.model_fields.items():
            if name != "method":
                fields[name] = field
                continue
            fields[name] = FieldInfo(annotation=MethodName, default=DEFAULT_METHOD, description=field.description)
            for key, owners in OPTION_NAMES.items():
                fields[key] = copy.copy(OPTIONS[owners[0]].model_fields[key])
                fields[key].description, fields[key].default = option_help(key), option_default(key)
        return fields

    @model_validator(mode="before")
    @classmethod
    def _method_options(cls, data: object) -> object:
        """--method and its options, flat or nested, as the method's typed options (config.methods, draftsmith.methods)."""
        return fold_options(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _num_layers(self) -> TrainConfig:
        """--num-layers' default is the method's (1; a block method 5)."""
        if self.num_layers is None:
            object.__setattr__(self, "num_layers", self.method.default_num_layers)
        return self


class FeedConfig(StageConfig):
    spool: str = Field(
        "mooncake://127.0.0.1:50051",
        description=(
            "The trainer's --spool: mooncake://HOST:PORT/RUN (its Mooncake master and run; /RUN optional), or a "
            "directory both nodes see."
        ),
    )
    _spool = field_validator("spool")(check_spool)
    prepared: Path | None = Field(
        None,
        description=(
            "This node's copy of the trainer's prepared set (default: the path in the trainer's job); checked to be "
            "the same set."
        ),
    )
    target: str | None = Field(
        None, description="This node's path of the target (default: the one in the trainer's job)."
    )
    scratch: Path | None = Field(
        None,
        description=(
            "Local directory the engine writes each chunk into before publishing it (default: a directory in TMPDIR)."
        ),
    )
    segment_gb: float | None = Field(
        None,
        gt=0,
        description=(
            "GiB of this node's memory the engine lends Mooncake for the chunks (default: the trainer's --spool-gb "
            "with room under Mooncake's eviction watermark)."
        ),
    )
    stall_timeout_s: float = Field(
        1800.0,
        gt=0,
        description=(
            "Stop, naming the trainer, when it reports no progress for this many seconds while the engine waits "
            "(also how long to wait for the trainer's job)."
        ),
    )
