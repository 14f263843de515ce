"""Shared fixtures: one tiny random target for fast unit tests, the real default assets for slow ones.

The tiny target is a real Llama (transformers) with a real byte-level BPE tokenizer and a ChatML chat
template, built from a config in a second, so unit tests exercise the same code paths as the real model.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with the target.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "def add(a, b):\n    return a + b\n",
    "system user assistant: Paris is the capital of France. 1 2 3 4 5 6 7 8 9 10",
    "What is the meaning of life? Explain in three sentences, please.",
] * 20


def build_tiny_tokenizer(chat_template: str = CHATML_TEMPLATE, vocab_size: int = 320, added_tokens: tuple = ()):
    """A real byte-level BPE fast tokenizer trained on a tiny corpus (no download); `added_tokens` are whole tokens
    beside it (as Qwen3's `<think>` and `<tool_call>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<pad>", unk_token=None
    )
    fast.chat_template = chat_template
    if added_tokens:
        fast.add_tokens(list(added_tokens))
    return fast


def build_tiny_target(
    path: Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    chat_template: str = CHATML_TEMPLATE,
    tie_word_embeddings: bool = False,
    added_tokens: tuple = (),
) -> Path:
    """Save a tiny random Llama target with its tokenizer as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer(chat_template, added_tokens=added_tokens)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_random_prepared(path: Path, target_dir: Path, count: int, lo: int, hi: int, seed: int = 0) -> Path:
    """A prepared set of `count` random samples for the tiny target, lengths in [lo, hi), the last two thirds of
    each loss-masked (the "assistant" part)."""
    import numpy as np

    from draftsmith.core.targets import target_identity
    from draftsmith.prepare.dataset import write_prepared

    rng = np.random.default_rng(seed)
    samples = []
    for n in rng.integers(lo, hi, count):
        mask = np.zeros(n, dtype=np.int64)
        mask[n // 3 :] = 1
        samples.append({"input_ids": rng.integers(4, 300, n), "loss_mask": mask})
    write_prepared(path, samples, target_identity(target_dir), chat_template_hash="t", max_length=64)
    return path


def as_a_user(*args: str | Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`draftsmith ARGS` as a user runs it in this environment: this python's draftsmith in a process of its own,
    with every default (`auto` follows this CPU and this vLLM), its console wide enough that no line wraps."""
    return subprocess.run(
        [sys.executable, "-m", "draftsmith", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "400"},
    )


def random_eagle3_export(target_dir: Path, out: Path, aux_layer_ids: tuple[int, ...] = (1, 2, 4), **options) -> Path:
    """An EAGLE-3 draft of a tiny target with random weights (its keys, shapes and config are what count; draft vocab
    128: every other token id), exported vllm at `out`; `options` go to export.write_export (dtype, special_tokens)."""
    import json

    from draftsmith import export
    from draftsmith.core import targets
    from draftsmith.methods.eagle3.modeling import Eagle3Draft
    from draftsmith.methods.layers import draft_tensors
    from draftsmith.methods.spec import DraftSpec

    config = json.loads((target_dir / "config.json").read_text())
    spec = DraftSpec.from_target_config(config, 128, 1, list(aux_layer_ids))
    draft = Eagle3Draft.from_target(spec, targets.load_target(target_dir), torch.arange(0, 256, 2))
    export.write_export(
        out,
        draft_tensors(draft.state_dict()),
        spec,
        "vllm",
        target=targets.target_identity(target_dir),
        verifier_architectures=["LlamaForCausalLM"],
        **options,
    )
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A tiny random Llama target (4 layers, hidden 64, ChatML) as an HF directory."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_block_data(tiny_target_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(prepared, store): a prepared set of the tiny target and its store (transformers, float32 states) of the layer
    a two-layer block draft reads (DFlash's, DSpark's: layer 2), shared by the block methods' training tests."""
    from draftsmith.config import ExtractConfig
    from draftsmith.core.layers import dflash_aux_layer_ids
    from draftsmith.extract import stage as extract

    root = tmp_path_factory.mktemp("tiny-block-data")
    prepared = write_random_prepared(root / "prepared", tiny_target_dir, 24, 20, 48)
    layers = dflash_aux_layer_ids(4, 2)
    extract.run(
        ExtractConfig(
            prepared=prepared, output=root / "store", aux_layer_ids=layers, compute_dtype="float32", device="cpu"
        ),
        show_progress=False,
    )
    return prepared, root / "store"


@pytest.fixture(scope="session")
def default_target_dir() -> Path:
    """The real SmolLM2-135M-Instruct (fetched and converted into the draftsmith cache on first use)."""
    from draftsmith.core import assets

    return assets.default_target_dir()


@pytest.fixture(scope="session")
def trained_run(default_target_dir) -> Path:
    """A small draft for the default target that benchmarks/specdec.py trains once per machine (120 ShareGPT
    conversations, 30 online steps, cached under $DRAFTSMITH_CACHE/bench/): a training run directory."""
    spec = importlib.util.spec_from_file_location(
        "bench_specdec", Path(__file__).parents[1] / "benchmarks" / "specdec.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.quick_trained_draft()


# What a memorising draft learns: the first MEMORISED_PROMPTS MT-bench prompts and the target's greedy answers.
MEMORISED_PROMPTS, MEMORISED_TOKENS = 4, 40


@pytest.fixture(scope="session")
def memorised_prepared(default_target_dir, tmp_path_factory) -> Path:
    """A prepared set of the default target: the first MEMORISED_PROMPTS MT-bench prompts (what `evaluate --prompts
    mt-bench --num-prompts 4` decodes), each followed by the target's own greedy answer (MEMORISED_TOKENS tokens,
    loss-masked), four times over. A draft trained on it is accepted deep into a round on those prompts, so tests
    comparing per-position acceptance between engines compare more than position 1 (where a wrong slot or mask
    layout still agrees)."""
    import numpy as np

    from draftsmith.core import targets
    from draftsmith.evaluate.prompts import load_prompts
    from draftsmith.evaluate.specdec import TargetRunner, plain_generate
    from draftsmith.prepare.dataset import write_prepared

    tokenizer = targets.load_tokenizer(default_target_dir)
    runner = TargetRunner(targets.load_target(default_target_dir, dtype=torch.float32), [])
    samples = []
    for prompt in load_prompts("mt-bench", tokenizer, num_prompts=MEMORISED_PROMPTS):
        ids = np.asarray(prompt.token_ids, dtype=np.int64)
        answer = plain_generate(runner, torch.from_numpy(ids), MEMORISED_TOKENS).tokens
        mask = np.r_[np.zeros(len(ids), dtype=np.int64), np.ones(len(answer), dtype=np.int64)]
        samples.extend([{"input_ids": np.r_[ids, answer], "loss_mask": mask}] * 4)
    out = tmp_path_factory.mktemp("memorised") / "prepared"
    write_prepared(
        out, samples, targets.target_identity(default_target_dir), chat_template_hash="mt-bench", max_length=512
    )
    return out


@pytest.fixture(scope="session")
def memorised_store(memorised_prepared, tmp_path_factory) -> Path:
    """memorised_prepared's hidden states (transformers, float32) with the aux layers of both EAGLE-3 / P-EAGLE
    (extract's default) and a one-layer DFlash: the drafts that memorise it train from it offline, on the features
    online training would compute, without a target forward at every step."""
    from draftsmith.config import ExtractConfig
    from draftsmith.core.layers import dflash_aux_layer_ids, resolve_layer_ids
    from draftsmith.extract import stage as extract
    from draftsmith.prepare.dataset import open_prepared

    layers = open_prepared(memorised_prepared).manifest.target.num_layers
    aux = sorted(set(resolve_layer_ids(None, layers)[:-1]) | set(dflash_aux_layer_ids(layers, 1)))
    out = tmp_path_factory.mktemp("memorised-store") / "store"
    extract.run(
        ExtractConfig(
            prepared=memorised_prepared,
            output=out,
            backend="hf",
            aux_layer_ids=aux,
            compute_dtype="float32",
            device="cpu",
        )
    )
    return out


def memorise(store_dir: Path, root: Path, *, speculative_tokens: int | None = None, **options) -> Path:
    """Train a draft that memorises memorised_store (offline, float32, constant lr, no checkpoint but the last) with
    `options` naming its method, layers and shape; export it vllm in float32 at root / "export" (the training run at
    root / "run"). The drafts the vLLM-against-reference tests decode (EAGLE-3, P-EAGLE, DFlash) differ only there."""
    from draftsmith import export
    from draftsmith.config import ExportConfig, TrainConfig
    from draftsmith.train import stage as train

    common = dict(max_steps=60, token_budget=1024, lr=3e-3, warmup_steps=5, schedule="constant", eval_fraction=0.0)
    train.run(
        TrainConfig(
            **{**common, **options},
            data=store_dir,
            output=root / "run",
            save_every=10**6,
            device="cpu",
            precision="fp32",  # named: both engines decode it in float32
            seed=0,
        )
    )
    out = root / "export"
    written = dict(speculative_tokens=speculative_tokens) if speculative_tokens else {}
    export.run(ExportConfig(checkpoint=root / "run", format="vllm", output=out, dtype="fp32", **written))
    return out


@pytest.fixture(scope="session")
def sharegpt_file() -> Path:
    from draftsmith.core import assets

    return assets.sharegpt_path()


@pytest.fixture(scope="session")
def online_reference(tmp_path_factory, sharegpt_file, default_target_dir) -> dict:
    """The online-training tests' reference (tests/online.py): the default target's prepared set, its vLLM store
    and the offline run on it, shared by the directory-spool and the Mooncake tests."""
    from online import reference

    return reference(tmp_path_factory.mktemp("online-reference"), sharegpt_file)


@pytest.fixture(scope="session")
def mtbench_file() -> Path:
    from draftsmith.core import assets

    return assets.mtbench_path()


@pytest.fixture
def one_thread():
    """Tiny models: one thread is ~20x faster than two on a busy 2-core machine (no OpenMP spinning)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _quiet_threads():
    """Keep tests deterministic and polite on a 2-core machine (OMP_NUM_THREADS, where set, is the count: .ci/run
    gives each of two suites run side by side one thread, as two spinning OpenMP pools on two cores are many times
    slower). A vLLM engine started in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) leaves it one torch thread,
    `torch.set_num_threads` a no-op and its own variables in os.environ (LD_PRELOAD, LOCAL_WORLD_SIZE, ...), which
    every later test, and every process one starts, would inherit: each test ends with what it began with."""
    env, set_num_threads = dict(os.environ), torch.set_num_threads
    set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, os.cpu_count() or 1))))
    yield
    torch.set_num_threads = set_num_threads
    os.environ.clear()
    os.environ.update(env)


def parallel_round(runner, ids, fused, k):
    """A P-EAGLE round of `runner` as its method drafts it: what its one forward returned (DraftRunner.forward_slots:
    logits [k, Vd], pre-norm hidden [k, H] of the last real position and the k - 1 parallel slots)."""
    seen = []

    def spy(i, h, keep):
        seen.append(type(runner).forward_slots(runner, i, h, keep))
        return seen[-1]

    runner.forward_slots = spy
    try:
        assert len(runner.propose(ids, fused, 0, k, lambda row: 0)) == k
    finally:
        del runner.forward_slots
    return seen[0]


@pytest.fixture(scope="session")
def qwen3_shaped_target(tmp_path_factory):
    """A tiny random target whose tokenizer carries a Qwen3-shaped, tool-aware chat template (tests/agentic.py)."""
    from agentic import QWEN3_MARKERS, QWEN3_SHAPED_TEMPLATE

    return build_tiny_target(
        tmp_path_factory.mktemp("qwen3-shaped"),
        chat_template=QWEN3_SHAPED_TEMPLATE.read_text(),
        added_tokens=QWEN3_MARKERS,
    )
