"""Every target family (tests/families.py) through every stage, each result checked against another.

Extraction, per family: prepare with the family's chat template; the hf store against transformers' own
output_hidden_states; then in real vLLM a store per strategy the probe offers (connector, direct and the layer
taps; Llama's direct store written as two data-parallel shards, `--shard 0/2` and `1/2`, by two engines, merged
with `store merge`), each against the hf store: identical input_ids, cosine >= 0.999 per token and layer (float32
compute on both sides; both stores keep bf16). Qwen3-Next, which vLLM's CPU build runs only in bfloat16: the
float32 refusal is one line with vLLM's own error, and the bf16 stores are compared. Tensor parallelism: TP=2
stores of Kimi-K2.5 (connector) and Qwen3-MoE (taps) against the TP=1 stores.

Drafts, per family: a few training steps offline (from the hf store) and online (from the prepared set), exports
in the vllm and speculators formats, the reference decoder (evaluate/specdec.py) lossless with the draft, and
real vLLM EAGLE-3 speculative decoding at temperature 0 in float32: the output token ids identical to the same
engine settings without the draft (and to the reference decoder's target alone), vLLM's spec-decode counters > 0
and its acceptance per draft position equal to the reference decoder's (the same proposals: the draft's RoPE,
aux layers and vocabulary mapping read the same in both). The targets' heads are sharpened
(`families.build(..., head_scale=HEAD_SCALE)`), so greedy tokens are decisive and no kernel's last bits flip them.

Engine start-up is most of a vLLM test's time on a CPU, so the TP=1 engines run in this process (vLLM's own
VLLM_ENABLE_V1_MULTIPROCESSING=0, a few seconds each instead of ~45 s); TP=2 needs worker processes and runs as
users run it. tests/test_extract_vllm.py covers the multi-process layout for TP=1 on the real default target.

With DRAFTSMITH_COMPAT_RESULTS=FILE set, the cells measured here (worst cosine, strategy used, τ, or why a cell
cannot pass and the fallback) are written to FILE as JSON: docs/vllm-compat.md's architecture table is filled
from it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from families import (
    FAMILIES,
    MLA_FAMILIES,
    PUBLISHED,
    TINY_OVERRIDES,
    target_dir,
    tiny_config,
)

from draftsmith import export
from draftsmith.config import ExportConfig, ExtractConfig, PrepareConfig, TrainConfig
from draftsmith.core import capture, targets, vllm_launch
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.layers import default_aux_layer_ids
from draftsmith.evaluate.vllm_worker import GenerationResult, SpecCounts
from draftsmith.extract import hf, store
from draftsmith.extract import stage as extract
from draftsmith.train import stage as train

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MIN_COSINE = 0.999
NUM_CONVERSATIONS = 10
MAX_LENGTH = 192
HEAD_SCALE = 50.0  # lm_head x 50: greedy tokens far from ties
TRAIN_STEPS = 20  # per draft: enough that the drafts get tokens accepted on these targets
SPEC_K = 3  # draft tokens per round
NUM_PROMPTS = 3  # decoding: the first assistant turn's prompt of the first prepared samples
NEW_TOKENS = 24
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "And 1 2 3 4 5?"},
        {"role": "assistant", "content": "6 7 8 9 10"},
    ],
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b\n"}],
    [
        {"role": "user", "content": "Explain speculative decoding in three sentences, please."},
        {
            "role": "assistant",
            "content": "<think>short</think>Speculative decoding drafts tokens with a small model and "
            "verifies them with the target.",
        },
    ],
    [
        {"role": "user", "content": "Hello! How can I help you today?"},
        {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the meaning of life?"},
        {"role": "assistant", "content": "I am a helpful assistant: 42."},
    ],
]


def write_chats(path: Path, count: int = NUM_CONVERSATIONS) -> Path:
    """A chat file of `count` conversations, CONVERSATIONS in turn."""
    path.write_text(
        "".join(json.dumps({"messages": CONVERSATIONS[i % len(CONVERSATIONS)]}) + "\n" for i in range(count))
    )
    return path


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    """Tiny models: one torch thread (two threads spin against each other on a busy 2-core machine)."""
    yield


def family_target(name: str) -> Path:
    """The tiny `name` target every test here uses: built once per session, its head sharpened (HEAD_SCALE)."""
    return target_dir(name, head_scale=HEAD_SCALE)


@contextlib.contextmanager
def _kernel_scan_safe():
    """vLLM 0.32's in-process worker start rebinds its Triton kernels by scanning the namespace of every loaded
    module and fails on llvmlite's `binding.ffi.lib` (a lazy library whose every attribute, `__dict__` included, is
    a function wrapper), which vLLM's Kimi-K2.5 image processor loads through numba. numba is imported first (the
    engine would load it half-way through its start) and `llvmlite.binding.ffi` is kept out of sys.modules while the
    engine runs; the module itself, and everything holding it, are untouched."""
    if importlib.util.find_spec("numba") is not None:
        import numba  # noqa: F401 - loaded now, not during the engine's start

    hidden = sys.modules.pop("llvmlite.binding.ffi", None)
    try:
        yield
    finally:
        if hidden is not None:
            sys.modules["llvmlite.binding.ffi"] = hidden


@contextlib.contextmanager
def in_process_vllm(on: bool = True):
    """TP=1 engines inside the test process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0), OpenMP threads left unbound
    (the process's CPU affinity stays as it is), a 1 GiB KV cache; `on=False`: vLLM's worker processes."""
    env = (
        {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if on
        else {"VLLM_ENABLE_V1_MULTIPROCESSING": None, "VLLM_CPU_OMP_THREADS_BIND": None, "VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    with vllm_launch.environment(env), _kernel_scan_safe() if on else contextlib.nullcontext():
        yield


class Matrix:
    """Prepared sets, stores and results per family, built once per module and shared by its tests. A subclass
    trains drafts of another method by its `draft_options` (its method and that method's options, over the options
    every method shares here)."""

    draft_options: dict[str, Any] = dict(ttt_steps=SPEC_K, draft_vocab_size=256)

    def __init__(self, root: Path, chats: Path):
        self.root, self.chats = root, chats
        self.results: dict[str, dict[str, dict]] = {}
        self.summaries: dict[tuple, dict] = {}
        self._made: dict[tuple, Any] = {}

    def prepared(self, name: str) -> Path:
        key = ("prepared", name)
        if key not in self._made:
            from draftsmith.prepare import stage as prepare

            out = self.root / name / "prepared"
            prepare.run(
                PrepareConfig(
                    data=[str(self.chats)],
                    target=str(family_target(name)),
                    max_length=MAX_LENGTH,
                    output=out,
                    num_workers=1,
                )
            )
            self._made[key] = out
        return self._made[key]

    def hf(self, name: str) -> Path:
        key = ("hf", name)
        if key not in self._made:
            out = self.root / name / "hf"
            # float32 named: the reference of every vLLM store here, compared with transformers' fp32 forward
            extract.run(
                ExtractConfig(
                    prepared=self.prepared(name), output=out, device="cpu", token_budget=512, compute_dtype="float32"
                ),
                show_progress=False,
            )
            self._made[key] = out
        return self._made[key]

    def vllm(
        self,
        name: str,
        strategy: str,
        *,
        shard: str = "0/1",
        tp: int = 1,
        output: Path | None = None,
        dtype: str = "float32",
    ) -> Path:
        from draftsmith.extract.vllm.backend import run

        key = ("vllm", name, strategy, shard, tp, dtype)
        if key not in self._made:
            out = output or self.root / name / f"{strategy}-tp{tp}-{shard.replace('/', 'of')}-{dtype}"
            with in_process_vllm(tp == 1):
                result = run(
                    ExtractConfig(
                        prepared=self.prepared(name),
                        output=out,
                        backend="vllm",
                        vllm_compile=False,
                        vllm_strategy=strategy,
                        compute_dtype=dtype,
                        shard=shard,
                        tensor_parallel_size=tp,
                    ),
                    show_progress=False,
                )
            assert result.result is not None
            assert result.result.samples_this_run > 0 and f"({strategy}," in result.result.backend
            self._made[key] = out
        return self._made[key]

    def draft(self, name: str, data: str) -> Path:
        """A draft trained TRAIN_STEPS steps: `data` "store" (offline, from the hf store) or "prepared" (online, the
        target in the trainer). Its run summary is in `self.summaries`."""
        key = ("draft", name, data)
        if key not in self._made:
            out = self.root / name / f"draft-{data}-{self.draft_options.get('method', 'eagle3')}"
            source = self.hf(name) if data == "store" else self.prepared(name)
            result = train.run(
                TrainConfig(
                    **{
                        **dict(
                            data=source,
                            output=out,
                            max_steps=TRAIN_STEPS,
                            lr=3e-3,
                            warmup_steps=0,
                            schedule="constant",
                            token_budget=2048,
                            eval_fraction=0.0,
                            save_every=10**6,
                            device="cpu",
                            precision="fp32",
                            seed=0,
                        ),
                        **self.draft_options,
                    }
                )
            )
            self.summaries[key] = result.summary
            self._made[key] = out
        return self._made[key]

    def export(self, name: str, fmt: str, data: str = "store") -> Path:
        """The `data`-trained draft exported in format `fmt`, float32 weights (vLLM runs exactly these)."""
        key = ("export", name, fmt, data)
        if key not in self._made:
            out = self.root / name / f"export-{fmt}-{data}"
            export.run(
                ExportConfig(
                    checkpoint=self.draft(name, data), format=fmt, output=out, dtype="fp32", speculative_tokens=SPEC_K
                )
            )
            self._made[key] = out
        return self._made[key]

    def prompts(self, name: str) -> list[list[int]]:
        """The prompt of the first assistant turn (the generation prompt included) of the first NUM_PROMPTS samples."""
        from draftsmith.prepare.dataset import open_prepared

        ds = open_prepared(self.prepared(name))
        out = []
        for k in range(NUM_PROMPTS):
            ids, mask = ds[k]["input_ids"], ds[k]["loss_mask"]
            out.append(ids[: int(mask.nonzero()[0])].tolist())
        return out

    def reference(self, name: str, fmt: str = "vllm", data: str = "store") -> dict:
        """The reference decoder (transformers, float32) with an exported draft: the target's own greedy tokens,
        the speculative ones, and the acceptance counts, over `prompts(name)`."""
        key = ("reference", name, fmt, data)
        if key not in self._made:
            from draftsmith.evaluate import build_draft_module
            from draftsmith.evaluate.specdec import (
                DraftRunner,
                TargetRunner,
                plain_generate,
                speculative_generate,
            )
            from draftsmith.methods.artefact import load_draft

            source = load_draft(self.export(name, fmt, data))
            model = targets.load_target(family_target(name))
            draft = build_draft_module(source, model, torch.device("cpu"), torch.float32)
            runner, drafter = TargetRunner(model, source.spec.aux_layer_ids), DraftRunner(draft)
            out = {"plain": [], "spec": [], "rounds": 0, "accepted_per_pos": [0] * SPEC_K}
            for ids in self.prompts(name):
                prompt = torch.tensor(ids)
                out["plain"].append(plain_generate(runner, prompt, NEW_TOKENS).tokens)
                gen = speculative_generate(runner, drafter, prompt, SPEC_K, NEW_TOKENS)
                out["spec"].append(gen.tokens)
                out["rounds"] += gen.stats.num_rounds
                out["accepted_per_pos"] = [
                    a + b for a, b in zip(out["accepted_per_pos"], gen.stats.accepted_per_pos, strict=False)
                ]
            self._made[key] = out
        return self._made[key]

    def record(self, name: str, column: str, **cell) -> None:
        self.results.setdefault(name, {})[column] = cell


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, chats):
    m = Matrix(tmp_path_factory.mktemp("families"), chats)
    yield m
    out = os.environ.get("DRAFTSMITH_COMPAT_RESULTS")
    if out and m.results:
        old = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
        for name, cells in m.results.items():
            old.setdefault(name, {}).update(cells)
        Path(out).write_text(json.dumps(old, indent=2, sort_keys=True))


def cosines(ours: Path, ref: Path) -> tuple[list[int], torch.Tensor]:
    """(layer ids, every token's cosine at each of them [tokens, L]) of two stores of the same samples, after checking
    that they hold the same samples, token ids, masks and layer ids, and that the reference's states are not zero."""
    a, b = store.open(ours), store.open(ref)
    assert a.sample_ids.tolist() == b.sample_ids.tolist() and len(a) > 0
    assert a.layer_ids == b.layer_ids
    rows = []
    for k in range(len(a)):
        x, y = a[k], b[k]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"]), k
        hx, hy = x["hidden_states"].double(), y["hidden_states"].double()  # [T, L, H]
        assert hy.norm(dim=-1).min() > 0, k
        rows.append(torch.nn.functional.cosine_similarity(hx, hy, dim=-1))
    return list(a.layer_ids), torch.cat(rows)


def compare(ours: Path, ref: Path) -> float:
    """Worst per-token, per-layer cosine of two stores of the same samples."""
    return cosines(ours, ref)[1].min().item()


def per_layer_cosine(ours: Path, ref: Path) -> dict[int, float]:
    """Worst per-token cosine at each layer id of two stores of the same samples."""
    layer_ids, cos = cosines(ours, ref)
    return dict(zip(layer_ids, cos.min(dim=0).values.tolist(), strict=False))


# ------------------------------------------------------------------------------------------ the builders


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_targets_keep_the_published_structure(name):
    path = family_target(name)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == PUBLISHED[name]["architectures"]
    text, published = targets.text_config(config), targets.text_config(PUBLISHED[name])
    shrunk = set(TINY_OVERRIDES[name].get("text_config", TINY_OVERRIDES[name])) | {"vocab_size"}
    for key in (
        "kv_lora_rank",
        "qk_rope_head_dim",
        "topk_method",
        "scoring_func",
        "n_shared_experts",
        "norm_topk_prob",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "decoder_sparse_step",
        "mlp_only_layers",
        "tie_word_embeddings",
    ):
        if key in published and key not in shrunk:
            assert text[key] == published[key], key  # the structure is the real model's
    model = targets.load_target(path)
    names = {n for n, _ in model.named_modules()}
    if name in MLA_FAMILIES:
        assert text["kv_lora_rank"] == 512 and text["qk_rope_head_dim"] == 64
        layers = targets.decoder_layers(model)
        dense = text["first_k_dense_replace"]
        assert not hasattr(layers[0].mlp, "experts") and all(
            hasattr(layers[i].mlp, "shared_experts") for i in range(dense, len(layers))
        )
    if name.startswith("qwen3"):
        assert any(n.endswith("self_attn.q_norm") for n in names) and any(n.endswith("self_attn.k_norm") for n in names)
    if name == "qwen3_moe":
        assert any(n.endswith("mlp.experts") for n in names) and not any("shared_expert" in n for n in names)
    if name == "kimi_k25":
        assert type(model).__name__ == "Kimi_K25ForConditionalGeneration" and "model.vision_tower" in names


@pytest.mark.parametrize("name", FAMILIES)
def test_prepare_renders_each_familys_chat_template(matrix, name):
    from draftsmith.prepare.dataset import open_prepared

    ds = open_prepared(matrix.prepared(name))
    assert ds.manifest.stats["conversations"] == NUM_CONVERSATIONS
    # gpt-oss ends a final answer with <|return|> when it writes it, and its history shows <|end|> there: an earlier
    # answer is trained in the text it was generated in (a sample of its own); the other templates keep their past
    assert (len(ds) > NUM_CONVERSATIONS) == (name == "gpt_oss"), len(ds)
    tokenizer = targets.load_tokenizer(family_target(name))
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    for k in range(len(ds)):
        ids, mask = ds[k]["input_ids"], ds[k]["loss_mask"]
        assert 0 < int(mask.sum()) < len(ids)  # assistant turns only
        if len(ids) < MAX_LENGTH:
            assert eos in ids[mask].tolist()  # the end-of-turn marker is learnt too


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_store_equals_transformers_and_layer_n_is_the_unnormalised_last_layer(matrix, name):
    """The hf store against transformers' own output_hidden_states (ids k < N) and, for id N, the last layer's
    output: through the final norm and the head it gives the model's logits."""
    st = store.open(matrix.hf(name))
    model = targets.load_target(family_target(name))
    N = len(targets.decoder_layers(model))
    assert st.layer_ids[-1] == N and st.manifest.target.architecture == PUBLISHED[name]["architectures"][0]
    for k in range(3):
        item = st[k]
        with torch.no_grad():
            out = model(input_ids=item["input_ids"][None], output_hidden_states=True)
        states = item["hidden_states"]  # [T, L, H]
        for j, layer in enumerate(st.layer_ids[:-1]):
            torch.testing.assert_close(states[:, j], out.hidden_states[layer][0], rtol=2**-7, atol=1e-4)
        logits = targets.lm_head(model)(targets.final_norm(model)(states[:, -1]))
        cos = torch.nn.functional.cosine_similarity(logits, out.logits[0], dim=-1)
        assert cos.min() > 0.999  # bf16 storage of the state, float32 model
    matrix.record(name, "hf extract", ok=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_samples_sharing_a_prefix_run_on_one_cache_as_each_runs_whole(name):
    """Extraction's prefix chains (extract/hf.py): a sample's forward after its parent's, on the parent's cache
    cropped to what they share, gives the states its whole forward gives; a family whose layers forget (a sliding
    window, linear attention) runs each sample whole instead."""
    model = targets.load_target(family_target(name))
    cache = hf._new_cache(model.config)
    if name in ("gpt_oss", "qwen3_next"):
        assert cache is None
        return
    ids = torch.randint(
        0, model.config.get_text_config().vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)
    )
    layer_ids = default_aux_layer_ids(len(targets.decoder_layers(model))) + [len(targets.decoder_layers(model))]
    whole = capture.capture_hidden_states(model, ids, None, layer_ids)
    parent = capture.capture_hidden_states(model, ids[:, :30], None, layer_ids, past_key_values=cache)
    cache.crop(20 - 30)
    child = capture.capture_hidden_states(model, ids[:, 20:], None, layer_ids, past_key_values=cache)
    assert whole.abs().amax() > 0.1 and cache.get_seq_length() == 40
    torch.testing.assert_close(torch.cat([parent[:, :20], child], 1), whole, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ vLLM, TP=1


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", ["deepseek_v3"])  # Kimi-K2.5 runs the same DeepSeek stack
def test_layer_id_0_on_mla_targets_falls_back_to_direct(matrix, tmp_path, name):
    """vLLM's DeepSeek-V2/V3 stack (Kimi-K2.5's too) has no aux state for the embeddings: auto takes direct, which
    taps them itself; the forced connector is refused in one line before vLLM starts."""
    from draftsmith.core.errors import DraftsmithError
    from draftsmith.extract.vllm.backend import run

    prepared = matrix.prepared(name)
    hf = tmp_path / "hf"
    extract.run(
        ExtractConfig(
            prepared=prepared, output=hf, device="cpu", aux_layer_ids=[0, 2], max_samples=4, compute_dtype="float32"
        ),
        show_progress=False,
    )
    cfg = dict(
        prepared=prepared,
        backend="vllm",
        vllm_compile=False,
        compute_dtype="float32",
        aux_layer_ids=[0, 2],
        max_samples=4,
    )
    with pytest.raises(DraftsmithError, match="connector: not possible.*do not include layer id 0"):
        run(ExtractConfig(output=tmp_path / "forced", vllm_strategy="connector", **cfg), show_progress=False)
    with in_process_vllm():
        result = run(ExtractConfig(output=tmp_path / "auto", **cfg), show_progress=False)
    assert result.result is not None and "(direct," in result.result.backend
    cos = compare(tmp_path / "auto", hf)
    assert cos >= MIN_COSINE, cos
    matrix.record(name, "aux id 0", ok=True, worst_cosine=round(cos, 6), strategy="direct (auto)")


# vLLM 0.32's CPU build runs Qwen3-Next's gated delta-net only in bfloat16 (vllm/model_executor/layers/mamba/ops/cpu/
# gdn_attention.py: `assert mixed_qkv.dtype == torch.bfloat16, "CPU GDN attention requires BF16."`): the probe reads
# that assert, extraction in float32 is refused in one line with vLLM's words before an engine starts, and the
# family's states are compared in bfloat16 where the CPU computes it natively.
FLOAT32_REFUSED = {"qwen3_next": "AssertionError: CPU GDN attention requires BF16."}


def refusal_words(name: str) -> str:
    """The message of vLLM's assert that refuses the family in float32 (without the exception's name)."""
    return FLOAT32_REFUSED[name].split(": ", 1)[1]


BF16_MIN_COSINE = 0.98  # bfloat16 compute against the float32 hf store: rounding that grows with depth


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_stores_of_every_offered_strategy_equal_the_hf_store(matrix, tmp_path, name):
    """Each strategy the probe offers for the family (connector, direct, taps: all three on every family in vLLM
    0.32) fills a store equal to the hf store; direct, for Llama, as two data-parallel workers (--shard 0/2, 1/2:
    two engines) merged into one store."""
    from draftsmith.extract.vllm import probe

    report = probe.probe(architecture=PUBLISHED[name]["architectures"][0], resolve_config=False)
    offered = [s for s in probe.STRATEGIES if report.usable[s]]
    assert offered == ["connector", "direct", "taps"] and report.strategy == "connector", report.reason
    if name in FLOAT32_REFUSED:
        _float32_refused_then_bf16(matrix, name, report)
        return
    hf = matrix.hf(name)
    for strategy in offered:
        if strategy == "direct" and name == "llama":
            halves = [matrix.vllm(name, "direct", shard=f"{i}/2") for i in range(2)]
            assert {s.writer for s in store.open(halves[1]).manifest.shards} == {"s1of2"}
            store.merge_stores(halves, tmp_path / "merged")
            assert store.verify_store(tmp_path / "merged").ok
            ours = tmp_path / "merged"
        else:
            ours = matrix.vllm(name, strategy)
            assert {s.writer for s in store.open(ours).manifest.shards} == {"s0of1"}
        assert len(store.open(ours)) == len(store.open(hf))
        cos = compare(ours, hf)
        assert cos >= MIN_COSINE, (name, strategy, cos)
        matrix.record(name, f"vLLM extract ({strategy})", ok=True, worst_cosine=round(cos, 6))
        if ours == tmp_path / "merged":
            matrix.record(name, "data parallel (--shard i/n, merged)", ok=True, worst_cosine=round(cos, 6))


def _float32_refused_then_bf16(matrix, name: str, report) -> None:
    """A family vLLM's CPU build cannot run in float32: extraction stops in one line naming vLLM's own error; in
    bfloat16 (where this CPU computes it natively) the taps store agrees with the connector's (both vLLM's own
    computation, read two ways) and both follow the float32 hf store as closely as bf16 allows."""
    from draftsmith.core import hardware

    words = refusal_words(name)
    assert report.facts.cpu_bfloat16_only.startswith(repr(words)), report.facts.cpu_bfloat16_only
    assert any(words in note for note in report.support.notes)  # doctor's architecture row says it
    with pytest.raises(DraftsmithError) as err:
        matrix.vllm(name, "taps")
    message = str(err.value)
    assert "\n" not in message and f"on a CPU in bfloat16 only (it asserts {words!r}" in message, message
    assert message.endswith("not in float32; use --compute-dtype bfloat16, or --backend hf"), message
    matrix.record(name, "vLLM extract (float32)", ok=False, reason=FLOAT32_REFUSED[name], fallback="hf backend")
    if not hardware.probe().native_bf16:
        return  # this CPU has no native bf16 for the bf16 half (vLLM's auto dtype would be float32)
    # Two engines in bfloat16 are not one computation: the kernels' rounding follows how a step's batch is laid
    # out, and where it tips a near-tie of the router the token takes other experts (measured on an AMX CPU: 3 % of
    # rows under 0.9999, the worst 0.983, now in one strategy's store, now in the other's, each as far from the
    # float32 hf store). So: almost every row the same, and the worst no further than bf16 against float32.
    taps, connector = matrix.vllm(name, "taps", dtype="bfloat16"), matrix.vllm(name, "connector", dtype="bfloat16")
    same = cosines(taps, connector)[1]
    agree = (same >= 0.9999).double().mean().item()
    assert agree >= 0.9 and same.min().item() >= BF16_MIN_COSINE, (agree, same.min().item())
    cos = min(compare(taps, matrix.hf(name)), compare(connector, matrix.hf(name)))
    assert cos >= BF16_MIN_COSINE, cos
    matrix.record(
        name,
        "vLLM extract (bf16: taps, connector)",
        ok=True,
        rows_alike=round(agree, 4),
        worst_taps_vs_connector=round(same.min().item(), 6),
        worst_cosine_vs_hf_fp32=round(cos, 6),
    )


FULL_CONTEXT = 256  # the target's max_position_embeddings and the prepared set's max_length alike


@pytest.fixture(scope="module")
def full_context(tmp_path_factory) -> dict[str, Path]:
    """A Qwen3 target declaring a context of FULL_CONTEXT positions, prepared with --max-length FULL_CONTEXT from
    conversations longer than that (truncated there), and its hf store."""
    from families import build

    from draftsmith.prepare import stage as prepare

    root = tmp_path_factory.mktemp("full-context")
    target = build("qwen3", root / "target", head_scale=HEAD_SCALE)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = FULL_CONTEXT
    (target / "config.json").write_text(json.dumps(config, indent=2))
    long_answer = " ".join(f"step {i}: add {i} and {i + 1}." for i in range(60))
    chats = root / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"messages": m}) + "\n"
            for m in [
                [{"role": "user", "content": "Count for me."}, {"role": "assistant", "content": long_answer}],
                CONVERSATIONS[0],
                [{"role": "user", "content": "Again."}, {"role": "assistant", "content": long_answer}],
            ]
        )
    )
    prepared = root / "prepared"
    prepare.run(
        PrepareConfig(data=[str(chats)], target=str(target), max_length=FULL_CONTEXT, output=prepared, num_workers=1)
    )
    hf = root / "hf"
    extract.run(
        ExtractConfig(prepared=prepared, output=hf, device="cpu", token_budget=512, compute_dtype="float32"),
        show_progress=False,
    )
    return {"target": target, "prepared": prepared, "hf": hf}


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("strategy", ["connector", "direct"])
def test_vllm_extracts_samples_that_fill_the_targets_whole_context(full_context, tmp_path, strategy):
    """Prepared samples as long as the target's declared context (a 2,048-context model prepared with the default
    --max-length 2048): each prompt goes to vLLM with max_tokens=1, one position past the context that is sampled
    and never fed back; both strategies take them and the stores equal the hf store."""
    from draftsmith.extract.vllm.backend import run
    from draftsmith.prepare.dataset import open_prepared

    ds = open_prepared(full_context["prepared"])
    lengths = [len(ds[k]["input_ids"]) for k in range(len(ds))]
    assert max(lengths) == FULL_CONTEXT and min(lengths) < FULL_CONTEXT, lengths
    with in_process_vllm():
        result = run(
            ExtractConfig(
                prepared=full_context["prepared"],
                output=tmp_path / strategy,
                backend="vllm",
                vllm_compile=False,
                vllm_strategy=strategy,
                compute_dtype="float32",
            ),
            show_progress=False,
        )
    assert result.result is not None and result.result.samples_this_run == len(ds)
    cos = compare(tmp_path / strategy, full_context["hf"])
    assert cos >= MIN_COSINE, (strategy, cos)


@pytest.mark.vllm
@needs_vllm
def test_vllm_extraction_refuses_samples_longer_than_the_targets_context(full_context, tmp_path):
    """A set prepared with a --max-length above the target's context: one line naming the set and the length to
    prepare with, before any engine starts."""
    from draftsmith.extract.vllm.backend import run
    from draftsmith.prepare import stage as prepare

    shrunk = tmp_path / "target"
    shutil.copytree(full_context["target"], shrunk)
    config = json.loads((shrunk / "config.json").read_text())
    (shrunk / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=FULL_CONTEXT // 2)))
    prepared = tmp_path / "prepared"
    prepare.run(
        PrepareConfig(
            data=[str(full_context["prepared"].parent / "chats.jsonl")],
            target=str(shrunk),
            max_length=FULL_CONTEXT,
            output=prepared,
            num_workers=1,
        )
    )
    with pytest.raises(
        DraftsmithError,
        match=f"{prepared}: a sample of {FULL_CONTEXT} tokens is longer than the "
        f"target's context \\({FULL_CONTEXT // 2} positions",
    ):
        run(
            ExtractConfig(
                prepared=prepared,
                output=tmp_path / "store",
                backend="vllm",
                vllm_strategy="direct",
                compute_dtype="float32",
            ),
            show_progress=False,
        )


# ------------------------------------------------------------------------------------------ drafts


def _vllm_head_sizes() -> list[int] | None:
    """The head sizes vLLM's CPU attention backend takes (the draft's layer runs on it here), or None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


@pytest.mark.parametrize("name", FAMILIES)
def test_the_draft_gets_an_attention_shape_vllm_runs(name):
    """The target's own head shape where it has one; MLA targets (no usable head_dim: 7168 / 128 heads = 56, which
    vLLM's CPU attention refuses) get 128-wide heads, hidden / 128 of them, 8 KV heads. Checked on the published
    config and on the tiny one, against the head sizes vLLM's CPU attention takes."""
    from draftsmith.methods.spec import DraftSpec

    sizes = _vllm_head_sizes()
    for config in (PUBLISHED[name], tiny_config(name, 320)):
        text = targets.text_config(config)
        spec = DraftSpec.from_target_config(config, 256, 1, [1, 2])
        assert spec.num_attention_heads % spec.num_key_value_heads == 0
        if name in MLA_FAMILIES:
            assert spec.head_dim == 128 and spec.num_attention_heads * 128 == text["hidden_size"]
            assert spec.num_key_value_heads == min(8, spec.num_attention_heads)
        else:  # the target's own
            assert (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (
                text["num_attention_heads"],
                text["num_key_value_heads"],
                text["head_dim"],
            )
        if sizes is not None:
            assert spec.head_dim in sizes, (name, spec.head_dim, sizes)
    num_layers = targets.text_config(PUBLISHED[name])["num_hidden_layers"]
    published = DraftSpec.from_target_config(PUBLISHED[name], 32000, 1, default_aux_layer_ids(num_layers))
    kv = published.num_key_value_heads  # TP=8: heads split evenly, K/V heads split or replicated
    assert published.num_attention_heads % 8 == 0 and (kv % 8 == 0 or 8 % kv == 0), published


def test_mla_drafts_refuse_aux_id_0_at_train_and_export(matrix, tmp_path):
    """vLLM takes an MLA target's aux states before each decoder layer (none before layer 0): a draft fusing id 0
    could not be served, so training (offline from such a store, online with --aux-layer-ids) and export refuse it
    in one line. Llama's vLLM stack reaches id 0: the same store trains there."""
    from draftsmith.export.formats import write_export
    from draftsmith.methods.artefact import load_draft

    cfg = dict(
        max_steps=1,
        warmup_steps=0,
        token_budget=512,
        draft_vocab_size=64,
        ttt_steps=1,
        eval_fraction=0.0,
        device="cpu",
        precision="fp32",
    )
    for name in ("deepseek_v3", "kimi_k25", "llama"):
        st = tmp_path / name / "store"
        extract.run(
            ExtractConfig(prepared=matrix.prepared(name), output=st, device="cpu", aux_layer_ids=[0, 2], max_samples=2),
            show_progress=False,
        )
        if name == "llama":
            train.run(TrainConfig(data=st, output=tmp_path / name / "run", **cfg))
            break
        arch = PUBLISHED[name]["architectures"][0]
        for data, extra in ((st, {}), (matrix.prepared(name), {"aux_layer_ids": [0, 2]})):
            with pytest.raises(
                DraftsmithError,
                match=rf"^draft: aux layer ids \[0, 2\] include 0 \(the embeddings\), "
                rf"which vLLM cannot hand an EAGLE-3 draft of {arch} .* use ids 1\.\.4",
            ) as err:
                train.run(TrainConfig(data=data, output=tmp_path / name / "run", **cfg, **extra))
            assert "\n" not in str(err.value)
        source = load_draft(matrix.draft(name, "store"))  # a draft of this target, made to fuse id 0
        spec = source.spec.model_copy(update={"aux_layer_ids": [0, 2]})
        for fmt in ("vllm", "speculators"):
            with pytest.raises(DraftsmithError, match=rf"^export {fmt}: aux layer ids \[0, 2\] include 0"):
                write_export(
                    tmp_path / name / fmt,
                    source.tensors,
                    spec,
                    fmt,
                    target=source.target,
                    verifier_architectures=[arch],
                )
            assert not (tmp_path / name / fmt).exists()


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_trains_offline_and_online_and_exports(matrix, name):
    """A few steps from the hf store (offline) and from the prepared set (online); the offline draft exported as
    vllm, the online one as speculators: each reads back as the trained tensors, and config.json describes the
    target's text backbone (Kimi-K2.5: its language model inside the wrapper)."""
    from draftsmith.methods.artefact import load_draft

    text = targets.text_config(targets.read_config(family_target(name)))
    for data in ("store", "prepared"):
        matrix.draft(name, data)
        summary = matrix.summaries[("draft", name, data)]
        assert summary["steps"] == TRAIN_STEPS and torch.isfinite(torch.tensor(summary["train loss"])), summary
    cells = {}
    for fmt, data in (("vllm", "store"), ("speculators", "prepared")):
        out = matrix.export(name, fmt, data)
        trained, exported = load_draft(matrix.draft(name, data)), load_draft(out)
        assert exported.spec == trained.spec and set(exported.tensors) == set(trained.tensors)
        assert all(torch.equal(exported.tensors[k], trained.tensors[k]) for k in trained.tensors)  # fp32 export
        config = json.loads((out / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert config["eagle_aux_hidden_state_layer_ids"] == trained.spec.aux_layer_ids
        assert layer["num_aux_hidden_states"] == len(trained.spec.aux_layer_ids)  # what vLLM sizes fc from
        assert config["target_hidden_size"] == text["hidden_size"] and layer["vocab_size"] == text["vocab_size"]
        assert layer["head_dim"] in (_vllm_head_sizes() or [layer["head_dim"]])
        if fmt == "speculators":
            verifier = config["speculators_config"]["verifier"]
            assert verifier["architectures"] == PUBLISHED[name]["architectures"]
        cells[fmt] = data
    steps = {d: matrix.summaries[("draft", name, d)]["steps"] for d in ("store", "prepared")}
    spec = load_draft(matrix.draft(name, "store")).spec
    matrix.record(
        name,
        "train",
        ok=True,
        offline_steps=steps["store"],
        online_steps=steps["prepared"],
        draft_attention=f"{spec.num_attention_heads} x {spec.head_dim}, {spec.num_key_value_heads} KV",
        rope=spec.rope_parameters.get("rope_type"),
    )
    matrix.record(name, "export", ok=True, formats=sorted(cells))


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", FAMILIES)
def test_the_drafts_rope_reads_the_same_in_vllm(matrix, name):
    """The draft's RoPE is the target's parameters (DeepSeek/Kimi: yarn with mscale/mscale_all_dim) on the draft's
    own head size. vLLM reads the exported config.json (and the speculators one) through its own config loader and
    builds its rotary table from it: cos/sin equal draftsmith's (training, reference decoder) at every position.
    (The lossless test cannot see a disagreement: acceptance would just drop.)"""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    from draftsmith.methods.artefact import load_draft
    from draftsmith.methods.layers import RotaryEmbedding

    for fmt, data in (("vllm", "store"), ("speculators", "prepared")):
        out = matrix.export(name, fmt, data)
        spec = load_draft(out).spec
        hf = get_config(str(out), trust_remote_code=False)
        assert (hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads) == (
            spec.head_dim,
            spec.num_attention_heads,
            spec.num_key_value_heads,
        )
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(
                hf.head_dim,
                max_position=hf.max_position_embeddings,
                is_neox_style=True,
                rope_parameters=hf.rope_parameters,
                dtype=torch.float32,
            )
        table = rope.cos_sin_cache[: spec.max_position_embeddings].float()  # [P, D]: cos halves, then sin halves
        cos, sin = RotaryEmbedding(spec)(torch.arange(len(table))[None], torch.float32)
        half = spec.head_dim // 2
        # float32 angles up to 2048 rad: last-bit differences of inv_freq grow to ~1e-4; a different RoPE (type,
        # frequencies, yarn ramp or attention factor) differs by far more
        torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=1e-3)
        torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=1e-3)
        assert hf.rope_parameters["rope_type"] == spec.rope_parameters["rope_type"]


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", FAMILIES)
def test_the_decoding_engine_starts_each_target_as_extraction_does(monkeypatch, name):
    """evaluate's vLLM engine gets the target's knobs from the same probe findings as the extraction engines:
    language_model_only for Kimi-K2.5's wrapper, the CPU MLA backend for MLA in float32 (not in bf16); the draft as
    EAGLE-3 speculator; one in-process worker in vLLM's in-process mode."""
    from draftsmith.evaluate import vllm_worker

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    job = vllm_worker.GenerationJob(
        target=str(family_target(name)), dtype="float32", max_model_len=64, seed=0, k=2, draft="/d"
    )
    kwargs = vllm_launch.llm_kwargs(vllm_worker.engine_launch(job)[0])
    assert kwargs["speculative_config"] == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 2}
    assert kwargs["distributed_executor_backend"] == "uni" and kwargs["dtype"] == "float32"
    assert kwargs.get("language_model_only", False) == (name == "kimi_k25")
    assert kwargs.get("attention_backend") == ("CPU_MLA" if name in MLA_FAMILIES else None)
    assert (
        "attention_backend"
        not in vllm_worker.engine_launch(job.model_copy(update={"dtype": "bfloat16", "draft": None}))[0]
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_decoder_is_lossless_with_the_trained_draft(matrix, name):
    """Greedy speculative decoding in the reference decoder gives the target's own tokens, and the trained draft
    gets some of its proposals accepted."""
    ref = matrix.reference(name)
    assert ref["spec"] == ref["plain"] and all(len(t) == NEW_TOKENS for t in ref["plain"])
    accepted = sum(ref["accepted_per_pos"])
    assert ref["rounds"] > 0 and accepted > 0, ref
    matrix.record(name, "reference decoder lossless", ok=True, k=SPEC_K, tau=round(1 + accepted / ref["rounds"], 3))


# vLLM's runs of a family's target alone (in-process), by their job (GenerationJob, the draft left out): the run a
# draft's decode is compared with does not depend on the draft, so the qwen3_moe target's is one run of the session
# for the EAGLE-3 draft here and the P-EAGLE and DFlash drafts of tests/test_peagle_vllm.py and
# tests/test_dflash_vllm.py, which decode with the same job (one in-process engine start less for each of two).
_TARGET_ALONE: dict[str, GenerationResult] = {}
# The engines' length: the longest prompt, its new tokens and room for two rounds (a block or parallel drafter's
# slots too), one length for every kind of draft so that their target-alone job is one.
ENGINE_LEN = MAX_LENGTH + NEW_TOKENS + 2 * SPEC_K + 8


def vllm_decodes_as_the_reference(matrix: Matrix, name: str, draft: Path) -> SpecCounts:
    """vLLM (in-process, float32, temperature 0) decodes the family's prompts with the exported `draft`: the same
    tokens as the same engine alone (lossless; the same job less the draft, run once a session: _TARGET_ALONE) and
    as the reference decoder's target alone; its counters show the draft ran (SPEC_K tokens a round, some accepted)
    and equal the reference decoder's rounds and acceptance per position exactly. Returns vLLM's spec-decode
    counters."""
    from draftsmith.evaluate import vllm_worker

    ref = matrix.reference(name)
    job = vllm_worker.GenerationJob(
        target=str(family_target(name)),
        prompts=matrix.prompts(name),
        k=SPEC_K,
        max_new_tokens=NEW_TOKENS,
        temperature=0.0,
        seed=0,
        dtype="float32",
        max_model_len=ENGINE_LEN,
        max_num_seqs=NUM_PROMPTS,
        ignore_eos=True,
    )
    with in_process_vllm():
        key = job.model_dump_json()
        if key not in _TARGET_ALONE:
            _TARGET_ALONE[key] = vllm_worker.run(job)
        plain = _TARGET_ALONE[key]
        spec = vllm_worker.run(job.model_copy(update={"draft": str(draft)}))
    assert spec.outputs == plain.outputs, name  # lossless
    assert plain.outputs == ref["plain"], name  # the reference decoder's target alone
    counters = spec.spec
    assert counters.num_drafts > 0 and counters.num_draft_tokens == SPEC_K * counters.num_drafts, counters
    assert counters.num_accepted_tokens > 0 and plain.spec.num_drafts == 0, counters
    assert (counters.num_drafts, counters.num_accepted_tokens_per_pos) == (
        ref["rounds"],
        ref["accepted_per_pos"],
    ), (counters, ref)
    return counters


# The KV cache block sizes of vLLM 0.32's CPU attention backends: CPU_MLA (the float32 MLA reference) only 16, the
# draft's CPU_ATTN multiples of 32. An MLA target and a Llama-style EAGLE-3 draft share one KV cache group, so no
# block size fits both: the engine stops at KV cache set-up, after the target and the draft (weights, shared
# embedding, aux layers) have loaded. On CPUs with AMX, vLLM's bf16 AMX_MLA backend takes multiples of 32.
MLA_ON_CPU = r"No common block size for \d+ \(CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]\)"


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_eagle3_decoding_with_the_draft_is_lossless(matrix, name):
    """vLLM EAGLE-3 speculative decoding with the exported draft, temperature 0, float32: the same tokens as the
    same engine settings without the draft (lossless; the batched verification of k+1 positions is a different
    computation from one token at a time, so this is the comparison that can fail) and as the reference decoder's
    target alone; vLLM's counters show the draft ran, and its acceptance per position is the reference decoder's
    exactly (vLLM computes the same proposals: RoPE, aux layers, fc, vocabulary mapping agree)."""
    from draftsmith.evaluate import vllm_worker

    draft = matrix.export(name, "vllm")
    job = vllm_worker.GenerationJob(
        target=str(family_target(name)),
        prompts=matrix.prompts(name),
        k=SPEC_K,
        max_new_tokens=NEW_TOKENS,
        temperature=0.0,
        seed=0,
        dtype="float32",
        max_model_len=MAX_LENGTH + NEW_TOKENS + SPEC_K + 8,
        max_num_seqs=NUM_PROMPTS,
        ignore_eos=True,
    )
    matrix.reference(name)  # the reference decoder's run, recorded in the matrix before vLLM's
    if name in FLOAT32_REFUSED:  # evaluate refuses before any engine starts, in vLLM's own words
        from draftsmith.evaluate import vllm_runner

        words = refusal_words(name)
        with pytest.raises(DraftsmithError, match=re.escape(f"(it asserts {words!r}")):
            vllm_runner.check_vllm_can_serve(family_target(name), "--engine vllm", dtype="float32")
        matrix.record(
            name,
            "vLLM EAGLE-3 decoding lossless",
            ok=False,
            reason=f"vLLM 0.32 on CPU in float32: {FLOAT32_REFUSED[name]}",
            fallback="reference decoder lossless (tau above); bf16 where the CPU has it, or a GPU",
        )
        return
    if name in MLA_FAMILIES:
        with in_process_vllm(), pytest.raises(ValueError, match=MLA_ON_CPU):
            vllm_worker.run(job.model_copy(update={"draft": str(draft)}))
        matrix.record(
            name,
            "vLLM EAGLE-3 decoding lossless",
            ok=False,
            reason="vLLM 0.32 on CPU in float32: CPU_MLA's KV blocks of 16 vs the draft's CPU attention "
            "(multiples of 32); the engine loads target and draft, then stops at KV cache set-up",
            fallback="reference decoder lossless (tau above); bf16 on CPUs with AMX (AMX_MLA) or a GPU",
        )
        return
    counters = vllm_decodes_as_the_reference(matrix, name, draft)
    matrix.record(
        name,
        "vLLM EAGLE-3 decoding lossless",
        ok=True,
        k=SPEC_K,
        prompts=NUM_PROMPTS,
        new_tokens=NEW_TOKENS,
        drafts=counters.num_drafts,
        accepted_per_pos=counters.num_accepted_tokens_per_pos,
        tau=round(1 + counters.num_accepted_tokens / counters.num_drafts, 3),
        same_acceptance_as_reference=True,
    )


# ------------------------------------------------------------------------------------------ vLLM, TP=2


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name, strategy", [("qwen3_moe", "taps"), ("kimi_k25", "connector")])
def test_tensor_parallel_2_store_equals_the_tp1_store(matrix, name, strategy):
    """TP=2 in worker processes (VLLM_CPU_OMP_THREADS_BIND is set by draftsmith when unset): exactly one writer,
    the same samples, states equal to TP=1's. (The layer taps run on every rank, each holding the whole stream
    after vLLM's all-reduce; only rank 0 writes.)"""
    tp1 = matrix.vllm(name, strategy)
    tp2 = matrix.vllm(name, strategy, tp=2)  # VLLM_CPU_OMP_THREADS_BIND unset: draftsmith splits the CPUs
    manifest = store.open(tp2).manifest
    assert {s.writer for s in manifest.shards} == {"s0of1"}  # rank 1 wrote nothing
    assert len(store.open(tp2)) == len(store.open(tp1))
    cos = compare(tp2, tp1)
    assert cos >= MIN_COSINE, (name, strategy, cos)
    cos_hf = compare(tp2, matrix.hf(name))
    assert cos_hf >= MIN_COSINE, (name, strategy, cos_hf)
    matrix.record(
        name, "TP=2", ok=True, strategy=strategy, worst_cosine_vs_tp1=round(cos, 6), worst_cosine_vs_hf=round(cos_hf, 6)
    )
