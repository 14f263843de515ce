"""Every target family (tests/families.py) through every extraction path, each store checked against another.

Per family: prepare with the family's chat template; the hf store against transformers' own output_hidden_states;
then in real vLLM the connector store (the whole set) and the direct store (written as two data-parallel shards,
`--shard 0/2` and `1/2`, by two engines, merged with `store merge`), each against the hf store: identical
input_ids, cosine >= 0.999 per token and layer (float32 compute on both sides; both stores keep bf16). Tensor
parallelism: TP=2 stores of Kimi-K2.5 (connector) and Qwen3-MoE (direct) against the TP=1 stores.

Engine start-up is most of a vLLM test's time on a CPU, so the TP=1 engines run in this process (vLLM's own
VLLM_ENABLE_V1_MULTIPROCESSING=0, a few seconds each instead of ~45 s); TP=2 needs worker processes and runs as
users run it. tests/test_extract_vllm.py covers the multi-process layout for TP=1 on the real default target.

With DRAFTSMITH_COMPAT_RESULTS=FILE set, the cells measured here (worst cosine, strategy used) are written to FILE
as JSON: docs/vllm-compat.md's architecture table is filled from it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from families import FAMILIES, MLA_FAMILIES, PUBLISHED, TINY_OVERRIDES, target_dir

from draftsmith import extract
from draftsmith.config import ExtractConfig, PrepareConfig
from draftsmith.core import targets
from draftsmith.extract import store

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MIN_COSINE = 0.999
NUM_CONVERSATIONS = 10
MAX_LENGTH = 192
CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."},
     {"role": "user", "content": "And 1 2 3 4 5?"},
     {"role": "assistant", "content": "6 7 8 9 10"}],
    [{"role": "user", "content": "def add(a, b):"},
     {"role": "assistant", "content": "    return a + b\n"}],
    [{"role": "user", "content": "Explain speculative decoding in three sentences, please."},
     {"role": "assistant", "content": "<think>short</think>Speculative decoding drafts tokens with a small model and "
                                      "verifies them with the target."}],
    [{"role": "user", "content": "Hello! How can I help you today?"},
     {"role": "assistant", "content": "The quick brown fox jumps over the lazy dog."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "What is the meaning of life?"},
     {"role": "assistant", "content": "I am a helpful assistant: 42."}],
]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    rows = [CONVERSATIONS[i % len(CONVERSATIONS)] for i in range(NUM_CONVERSATIONS)]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


@pytest.fixture(autouse=True)
def _tiny_models_on_one_thread(one_thread):
    """Tiny models: one torch thread (two threads spin against each other on a busy 2-core machine)."""
    yield


def engines_in_process(name: str) -> bool:
    """Whether `name`'s TP=1 engines can run in this process. vLLM 0.32's in-process worker start scans every
    loaded module for Triton kernels to override and fails on llvmlite's objects, which vLLM's Kimi-K2.5 image
    processor loads (through numba): Kimi-K2.5's engines, and any engine after llvmlite is loaded here, run in
    worker processes instead (vLLM's default, ~45 s a start on this CPU)."""
    return name != "kimi_k25" and "llvmlite.binding.ffi" not in sys.modules


@contextlib.contextmanager
def in_process_vllm(on: bool = True):
    """TP=1 engines inside the test process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0), OpenMP threads left unbound
    (the process's CPU affinity stays as it is), a 1 GiB KV cache; `on=False`: vLLM's worker processes."""
    env = ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}
           if on else {"VLLM_ENABLE_V1_MULTIPROCESSING": None, "VLLM_CPU_OMP_THREADS_BIND": None,
                       "VLLM_CPU_KVCACHE_SPACE": "1"})
    saved = {k: os.environ.get(k) for k in env}
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Matrix:
    """Prepared sets, stores and results per family, built once per module and shared by its tests."""

    def __init__(self, root: Path, chats: Path):
        self.root, self.chats = root, chats
        self.results: dict[str, dict[str, dict]] = {}
        self._made: dict[tuple, Path] = {}

    def prepared(self, name: str) -> Path:
        key = ("prepared", name)
        if key not in self._made:
            from draftsmith.prepare import stage as prepare

            out = self.root / name / "prepared"
            prepare.run(PrepareConfig(data=[str(self.chats)], target=str(target_dir(name)), max_length=MAX_LENGTH,
                                      output=out, num_workers=1))
            self._made[key] = out
        return self._made[key]

    def hf(self, name: str) -> Path:
        key = ("hf", name)
        if key not in self._made:
            out = self.root / name / "hf"
            extract.run(ExtractConfig(prepared=self.prepared(name), output=out, device="cpu", token_budget=512),
                        show_progress=False)
            self._made[key] = out
        return self._made[key]

    def vllm(self, name: str, strategy: str, *, shard: str = "0/1", tp: int = 1, output: Path | None = None) -> Path:
        from draftsmith.extract.vllm import run

        key = ("vllm", name, strategy, shard, tp)
        if key not in self._made:
            out = output or self.root / name / f"{strategy}-tp{tp}-{shard.replace('/', 'of')}"
            with in_process_vllm(tp == 1 and engines_in_process(name)):
                result = run(ExtractConfig(prepared=self.prepared(name), output=out, backend="vllm",
                                           vllm_compile=False, vllm_strategy=strategy, compute_dtype="float32",
                                           shard=shard, tensor_parallel_size=tp), show_progress=False)
            assert result.summary["samples this run"] > 0 and f"({strategy}," in result.summary["backend"]
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


def compare(ours: Path, ref: Path) -> float:
    """Worst per-token, per-layer cosine of two stores of the same samples (after checking ids, masks, layers)."""
    a, b = store.open(ours), store.open(ref)
    assert a.sample_ids.tolist() == b.sample_ids.tolist() and len(a) > 0
    assert a.layer_ids == b.layer_ids
    worst = 1.0
    for k in range(len(a)):
        x, y = a[k], b[k]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"]), k
        cos = torch.nn.functional.cosine_similarity(x["hidden_states"].double(), y["hidden_states"].double(), dim=-1)
        worst = min(worst, cos.min().item())
    return worst


# ------------------------------------------------------------------------------------------ the builders


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_targets_keep_the_published_structure(name):
    path = target_dir(name)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == PUBLISHED[name]["architectures"]
    text, published = targets.text_config(config), targets.text_config(PUBLISHED[name])
    shrunk = set(TINY_OVERRIDES[name].get("text_config", TINY_OVERRIDES[name])) | {"vocab_size"}
    for key in ("kv_lora_rank", "qk_rope_head_dim", "topk_method", "scoring_func", "n_shared_experts",
                "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace", "decoder_sparse_step",
                "mlp_only_layers", "tie_word_embeddings"):
        if key in published and key not in shrunk:
            assert text[key] == published[key], key  # the structure is the real model's
    model = targets.load_target(path)
    names = {n for n, _ in model.named_modules()}
    if name in MLA_FAMILIES:
        assert text["kv_lora_rank"] == 512 and text["qk_rope_head_dim"] == 64
        layers = targets.decoder_layers(model)
        dense = text["first_k_dense_replace"]
        assert not hasattr(layers[0].mlp, "experts") and all(hasattr(layers[i].mlp, "shared_experts")
                                                             for i in range(dense, len(layers)))
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
    assert len(ds) == NUM_CONVERSATIONS
    tokenizer = targets.load_tokenizer(target_dir(name))
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
    model = targets.load_target(target_dir(name))
    N = len(targets.decoder_layers(model))
    assert st.layer_ids[-1] == N and st.manifest.target.architecture == PUBLISHED[name]["architectures"][0]
    for k in range(3):
        item = st[k]
        with torch.no_grad():
            out = model(input_ids=item["input_ids"][None], output_hidden_states=True)
        states = item["hidden_states"]  # [T, L, H]
        for j, layer in enumerate(st.layer_ids[:-1]):
            torch.testing.assert_close(states[:, j], out.hidden_states[layer][0], rtol=2 ** -7, atol=1e-4)
        logits = targets.lm_head(model)(targets.final_norm(model)(states[:, -1]))
        cos = torch.nn.functional.cosine_similarity(logits, out.logits[0], dim=-1)
        assert cos.min() > 0.999  # bf16 storage of the state, float32 model
    matrix.record(name, "hf extract", ok=True)


# ------------------------------------------------------------------------------------------ vLLM, TP=1


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", ["deepseek_v3"])  # Kimi-K2.5 runs the same DeepSeek stack
def test_layer_id_0_on_mla_targets_falls_back_to_direct(matrix, tmp_path, name):
    """vLLM's DeepSeek-V2/V3 stack (Kimi-K2.5's too) has no aux state for the embeddings: auto takes direct, which
    taps them itself; the forced connector is refused in one line before vLLM starts."""
    from draftsmith.core.errors import DraftsmithError
    from draftsmith.extract.vllm import run

    prepared = matrix.prepared(name)
    hf = tmp_path / "hf"
    extract.run(ExtractConfig(prepared=prepared, output=hf, device="cpu", aux_layer_ids=[0, 2], max_samples=4),
                show_progress=False)
    cfg = dict(prepared=prepared, backend="vllm", vllm_compile=False, compute_dtype="float32", aux_layer_ids=[0, 2],
               max_samples=4)
    with pytest.raises(DraftsmithError, match="connector: not possible.*do not include layer id 0"):
        run(ExtractConfig(output=tmp_path / "forced", vllm_strategy="connector", **cfg), show_progress=False)
    with in_process_vllm(engines_in_process(name)):
        result = run(ExtractConfig(output=tmp_path / "auto", **cfg), show_progress=False)
    assert "(direct," in result.summary["backend"]
    cos = compare(tmp_path / "auto", hf)
    assert cos >= MIN_COSINE, cos
    matrix.record(name, "aux id 0", ok=True, worst_cosine=round(cos, 6), strategy="direct (auto)")


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_connector_and_direct_stores_equal_the_hf_store(matrix, tmp_path, name):
    from draftsmith.extract.vllm import probe

    hf = matrix.hf(name)
    report = probe.probe(architecture=PUBLISHED[name]["architectures"][0], resolve_config=False)
    strategy = report.strategy
    assert strategy == "connector"  # the probe's choice for the default layer ids, on every family
    connector = matrix.vllm(name, "connector")
    cos = compare(connector, hf)
    assert cos >= MIN_COSINE, (name, "connector", cos)
    assert {s.writer for s in store.open(connector).manifest.shards} == {"s0of1"}
    matrix.record(name, "vLLM extract (connector)", ok=True, worst_cosine=round(cos, 6))

    if not engines_in_process(name):  # engine starts cost ~45 s each here: direct over the whole set in one
        cos = compare(matrix.vllm(name, "direct"), hf)
        assert cos >= MIN_COSINE, (name, "direct", cos)
        matrix.record(name, "vLLM extract (direct)", ok=True, worst_cosine=round(cos, 6))
        return
    # direct, as two data-parallel workers (--shard 0/2, 1/2: two engines), merged into one store
    halves = [matrix.vllm(name, "direct", shard=f"{i}/2") for i in range(2)]
    assert {s.writer for s in store.open(halves[1]).manifest.shards} == {"s1of2"}
    merged = store.merge_stores(halves, tmp_path / "merged")
    assert store.verify_store(tmp_path / "merged").ok and len(merged) == len(store.open(hf))
    cos = compare(tmp_path / "merged", hf)
    assert cos >= MIN_COSINE, (name, "direct", cos)
    matrix.record(name, "vLLM extract (direct)", ok=True, worst_cosine=round(cos, 6))
    matrix.record(name, "data parallel (--shard i/n, merged)", ok=True, worst_cosine=round(cos, 6))


# ------------------------------------------------------------------------------------------ vLLM, TP=2


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name, strategy", [("qwen3_moe", "direct"), ("kimi_k25", "connector")])
def test_tensor_parallel_2_store_equals_the_tp1_store(matrix, name, strategy):
    """TP=2 in worker processes (VLLM_CPU_OMP_THREADS_BIND is set by draftsmith when unset): exactly one writer,
    the same samples, states equal to TP=1's."""
    tp1 = matrix.vllm(name, "connector") if strategy == "connector" else None
    if tp1 is None:  # the direct TP=1 store of the whole set: the two merged halves
        tp1 = matrix.root / name / "direct-tp1-merged"
        if not tp1.exists():
            store.merge_stores([matrix.vllm(name, "direct", shard=f"{i}/2") for i in range(2)], tp1)
    tp2 = matrix.vllm(name, strategy, tp=2)  # VLLM_CPU_OMP_THREADS_BIND unset: draftsmith splits the CPUs
    manifest = store.open(tp2).manifest
    assert {s.writer for s in manifest.shards} == {"s0of1"}  # rank 1 wrote nothing
    assert len(store.open(tp2)) == len(store.open(tp1))
    cos = compare(tp2, tp1)
    assert cos >= MIN_COSINE, (name, strategy, cos)
    cos_hf = compare(tp2, matrix.hf(name))
    assert cos_hf >= MIN_COSINE, (name, strategy, cos_hf)
    matrix.record(name, "TP=2", ok=True, strategy=strategy, worst_cosine_vs_tp1=round(cos, 6),
                  worst_cosine_vs_hf=round(cos_hf, 6))
