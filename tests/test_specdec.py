"""Reference speculative decoding: lossless greedy decoding, exact rejection sampling, the draft's KV cache."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import parallel_round

from draftsmith.core import layers, targets
from draftsmith.evaluate.specdec import (
    DecodeStats,
    DraftRunner,
    TargetRunner,
    plain_generate,
    speculative_generate,
    verify_chain,
)
from draftsmith.methods.dflash.modeling import DFlashDraft
from draftsmith.methods.eagle3.modeling import Eagle3Draft
from draftsmith.methods.spec import DraftSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def aux_ids(num_layers: int) -> list[int]:
    """The default aux layers, each once (a shallow target's defaults collide), as the trainer picks them."""
    return layers.resolve_layer_ids(None, num_layers)[:-1]


def random_draft(
    target_dir, target_model, draft_vocab_size=None, seed=0, head_scale=1.0, parallel=False
) -> Eagle3Draft:
    """A random draft of the target (its embedding); parallel: a P-EAGLE one (random mask_hidden, the pad token
    as its mask token)."""
    config = json.loads((target_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    dvs = draft_vocab_size or vocab
    dc = DraftSpec.from_target_config(config, dvs, 1, aux_ids(config["num_hidden_layers"]))
    if parallel:
        dc = dc.model_copy(update={"method": "peagle", "mask_token_id": config["pad_token_id"]})
    ids = torch.linspace(0, vocab - 1, dvs).round().long().unique()
    assert len(ids) == dvs
    draft = Eagle3Draft.from_target(dc, target_model, ids, lm_head_init="random", seed=seed)
    with torch.no_grad():
        draft.lm_head.weight.mul_(head_scale)
    return draft.eval().requires_grad_(False)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 3.09 is p = 0.001."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic, merging bins with expected count < min_expected into one; returns (stat, df)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].sum().double()[None]])
    exp = torch.cat([expected[big].double(), expected[~big].sum().double()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    model = targets.load_target(tiny_target_dir)
    n = model.config.num_hidden_layers
    return tiny_target_dir, model, TargetRunner(model, aux_ids(n))


PROMPTS = [[1, 5, 9, 33, 7, 100, 20], [3, 44, 12], list(range(40, 90))]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_with_random_draft_is_lossless(tiny, k):
    target_dir, model, runner = tiny
    draft = DraftRunner(random_draft(target_dir, model, draft_vocab_size=200))
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        base = plain_generate(runner, ids, 30)
        spec = speculative_generate(runner, draft, ids, k, 30)
        assert spec.tokens == base.tokens
        assert len(spec.tokens) == 30
        assert spec.stats.num_rounds >= 1 and spec.stats.num_draft_tokens == k * spec.stats.num_rounds


class NoisyOracle(DraftRunner):
    """Proposes the target's own greedy continuation, wrong with probability `error` (a deterministic RNG).

    Exercises every acceptance length, so the target's K/V cropping and the statistics are tested beyond the
    all-rejected rounds a random draft gives."""

    def __init__(self, draft, full_sequence: list[int], error: float, seed: int = 0):
        super().__init__(draft)
        self.full = full_sequence
        self.error = error
        self.rng = torch.Generator().manual_seed(seed)

    def step(self, ids, hidden):
        _, last = super().step(ids, hidden)
        position = self.length - 1  # the last position just read predicts the token at position + 2
        vocab = self.draft.spec.draft_vocab_size
        want = self.full[position + 2] if position + 2 < len(self.full) else 0
        if float(torch.rand((), generator=self.rng)) < self.error:
            want = (want + 1 + int(torch.randint(0, vocab - 1, (), generator=self.rng))) % vocab
        logits = torch.full((vocab,), -10.0)
        logits[want] = 10.0
        return logits, last


@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_with_partly_right_draft_is_lossless_and_counts_acceptance(tiny, k):
    target_dir, model, runner = tiny
    draft = random_draft(target_dir, model)  # full vocabulary: draft id == target id
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        base = plain_generate(runner, ids, 40)
        oracle = NoisyOracle(draft, prompt + base.tokens, error=0.3, seed=k)
        spec = speculative_generate(runner, oracle, ids, k, 40)
        assert spec.tokens == base.tokens
        s = spec.stats
        assert s.tau > 1.3  # most proposals are right
        assert s.num_accepted == sum(s.accepted_per_pos)
        assert all(
            a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False)
        )  # prefix acceptance
        # every round adds accepted + 1 tokens; only the last round may be cut at max_new_tokens
        assert s.num_accepted + s.num_rounds >= len(spec.tokens) - 1


@pytest.mark.parametrize("k", [1, 3])
def test_a_path_decodes_as_its_engine_did_whatever_this_target_would_choose(tiny, k):
    """The gate's replay (`path`: another engine's greedy output): along this target's own output it is the free
    decoding, round for round; along a path that parts from it, the output is the path, rounds accept what matches the
    path (a draft proposing the path is accepted everywhere, where free decoding rejects it at the parting), and it
    stops at the path's end."""
    target_dir, model, runner = tiny
    draft = random_draft(target_dir, model)  # full vocabulary: draft id == target id
    prompt = PROMPTS[0]
    ids = torch.tensor(prompt)
    own = plain_generate(runner, ids, 40).tokens
    free = speculative_generate(runner, NoisyOracle(draft, prompt + own, error=0.3, seed=k), ids, k, 40)
    along = speculative_generate(runner, NoisyOracle(draft, prompt + own, 0.3, seed=k), ids, k, 40, path=own)
    assert along.tokens == free.tokens == own and along.rounds == free.rounds
    assert along.stats.accepted_per_pos == free.stats.accepted_per_pos and free.stats.num_accepted > 0
    parted = own[:10] + [(t + 7) % 300 for t in own[10:20]] + own[20:35]  # another engine's, ending first
    assert parted != own[:35]
    replayed = speculative_generate(runner, NoisyOracle(draft, prompt + parted, 0.0), ids, k, 40, path=parted)
    assert replayed.tokens == parted
    s = replayed.stats
    assert s.accepted_per_pos[-1] >= s.num_rounds - 1  # every round but the path's last accepted all k
    unforced = speculative_generate(runner, NoisyOracle(draft, prompt + parted, 0.0), ids, k, 40)
    assert unforced.tokens == own and unforced.stats.tau < s.tau  # this target rejects the parted proposals


def test_perfect_draft_accepts_everything(tiny):
    target_dir, model, runner = tiny
    draft = random_draft(target_dir, model)
    ids = torch.tensor(PROMPTS[0])
    base = plain_generate(runner, ids, 41)
    spec = speculative_generate(runner, NoisyOracle(draft, PROMPTS[0] + base.tokens, error=0.0), ids, 4, 41)
    assert spec.tokens == base.tokens
    assert spec.stats.num_rounds == 8 and spec.stats.tau == 5.0  # 1 + 8 rounds x 5 tokens
    assert spec.stats.acceptance_per_pos == [1.0] * 4


def test_draft_kv_cache_matches_full_forward(tiny):
    """Feeding the draft piecewise (with a crop and re-feed, as rounds do) equals one full decode-mode forward."""
    target_dir, model, _ = tiny
    draft = random_draft(target_dir, model, seed=3)
    torch.manual_seed(0)
    t = 12
    ids = torch.randint(0, draft.spec.vocab_size, (t,))
    hidden = torch.randn(t, draft.spec.hidden_size)
    full_logits, full_hidden = draft(ids[None], hidden[None], torch.arange(t)[None])
    runner = DraftRunner(draft)
    runner.step(ids[:5], hidden[:5])
    runner.step(torch.tensor([7]), torch.randn(1, draft.spec.hidden_size))  # a speculative step ...
    runner.crop(5)  # ... forgotten again
    logits, last = runner.step(ids[5:9], hidden[5:9])
    torch.testing.assert_close(logits, full_logits[0, 8].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(last, full_hidden[0, 8], rtol=1e-4, atol=1e-5)
    logits, last = runner.step(ids[9:], hidden[9:])
    torch.testing.assert_close(logits, full_logits[0, -1].float(), rtol=1e-4, atol=1e-5)


def test_target_runner_aux_states_follow_vllm_layer_ids(tiny):
    target_dir, model, _ = tiny
    n = model.config.num_hidden_layers
    runner = TargetRunner(model, [0, 2, n])
    ids = torch.tensor([4, 8, 15, 16, 23])
    logits, aux, _ = runner.forward(ids, runner.new_cache(), want_aux=True)
    h = model.config.hidden_size
    out = model(input_ids=ids[None], output_hidden_states=True)
    torch.testing.assert_close(aux[:, :h], out.hidden_states[0][0])  # id 0 = embeddings
    torch.testing.assert_close(aux[:, h : 2 * h], out.hidden_states[2][0])  # id 2 = output of layer 1
    # id N = the last layer's raw output: the final norm of it gives HF's (normalised) last hidden state
    torch.testing.assert_close(
        targets.final_norm(model)(aux[:, 2 * h :]), out.hidden_states[n][0], rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(logits, out.logits[0].float())


@pytest.mark.parametrize("k", [1, 2])
def test_rejection_sampling_reproduces_target_distribution(k):
    """verify_chain's first emitted token is distributed exactly as the target's p_0, whatever the draft's q."""
    vocab = 6
    p_rows = torch.tensor(
        [[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.1, 0.1, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]]
    )
    q_rows = torch.tensor([[0.05, 0.05, 0.1, 0.2, 0.3, 0.3], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    logits = p_rows.log()[: k + 1]  # temperature 1 -> softmax(log p) = p
    gen = torch.Generator().manual_seed(0)
    n = 8000
    counts = torch.zeros(vocab)
    for _ in range(n):
        chain = [int(torch.multinomial(q_rows[i], 1, generator=gen)) for i in range(k)]
        accepted, nxt = verify_chain(logits, chain, [q_rows[i] for i in range(k)], 1.0, gen)
        first = chain[0] if accepted >= 1 else nxt
        counts[first] += 1
    stat, df = chi2_stat(counts, p_rows[0])
    assert stat < chi2_critical(df), (counts / n, p_rows[0])


def test_speculative_sampling_matches_target_next_token_distribution(tmp_path):
    """End to end on a tiny target: the 2nd generated token under speculative sampling (k=2, a random draft
    whose proposals are often rejected) follows the target's own marginal distribution (chi-square, p=0.001)."""
    from conftest import build_tiny_target

    target_dir = build_tiny_target(tmp_path / "peaky", seed=1)
    model = targets.load_target(target_dir)
    with torch.no_grad():  # a peaky target so the test has power; the draft disagrees with it
        targets.lm_head(model).weight.mul_(60.0)
    runner = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    draft = DraftRunner(random_draft(target_dir, model, seed=5, head_scale=200.0))
    prompt = torch.tensor([1, 5, 9, 33, 7])
    temperature = 1.0
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=prompt[None]).logits[0, -1].float() / temperature, -1)
        vocab = p1.numel()
        batch = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        p2 = torch.softmax(model(input_ids=batch).logits[:, -1].float() / temperature, -1)
    marginal = (p1[:, None] * p2).sum(0)
    gen = torch.Generator().manual_seed(0)
    n = 600
    counts = torch.zeros(vocab)
    rejected = 0
    for _ in range(n):
        out = speculative_generate(runner, draft, prompt, 2, 2, temperature=temperature, generator=gen)
        counts[out.tokens[1]] += 1
        rejected += out.stats.accepted_per_pos[0] == 0
    assert rejected > n // 10  # the residual distribution was exercised
    stat, df = chi2_stat(counts, marginal)
    assert df >= 5
    assert stat < chi2_critical(df)


# ---------------------------------------------------------------------------------------------- P-EAGLE


def count_forwards(module) -> list[int]:
    """A one-element counter of the module's forward calls."""
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("k", [1, 3, 5])
def test_parallel_greedy_with_random_draft_is_lossless(tiny, k):
    target_dir, model, runner = tiny
    draft = DraftRunner(random_draft(target_dir, model, draft_vocab_size=200, parallel=True))
    assert draft.method.name == "peagle"
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        base = plain_generate(runner, ids, 30)
        spec = speculative_generate(runner, draft, ids, k, 30)
        assert spec.tokens == base.tokens
        assert spec.stats.num_rounds >= 1 and spec.stats.num_draft_tokens == k * spec.stats.num_rounds


def test_parallel_round_is_one_draft_forward(tiny):
    """P-EAGLE's point: a round of k proposals costs one draft forward (EAGLE-3: k)."""
    target_dir, model, runner = tiny
    ids = torch.tensor(PROMPTS[0])
    k = 4
    for parallel, per_round in ((True, 1), (False, k)):
        draft = random_draft(target_dir, model, draft_vocab_size=200, parallel=parallel)
        calls = count_forwards(draft)
        spec = speculative_generate(runner, DraftRunner(draft), ids, k, 20)
        assert calls[0] == per_round * spec.stats.num_rounds, parallel


def test_parallel_draft_without_mask_token_is_one_line(tiny):
    from draftsmith.core.errors import DraftsmithError

    target_dir, model, _ = tiny
    draft = random_draft(target_dir, model, draft_vocab_size=200, parallel=True)
    draft.spec = draft.spec.model_copy(update={"mask_token_id": None})
    with pytest.raises(DraftsmithError, match="mask_token_id"):
        DraftRunner(draft)


class ParallelNoisyOracle(DraftRunner):
    """NoisyOracle for a P-EAGLE draft: after its real parallel forward, slot d proposes the target's greedy token
    at its position, wrong with probability `error`."""

    def __init__(self, draft, full_sequence: list[int], error: float, seed: int = 0):
        super().__init__(draft)
        self.full = full_sequence
        self.error = error
        self.rng = torch.Generator().manual_seed(seed)

    def forward_slots(self, ids, hidden, keep):  # P-EAGLE's one forward of a round: ids end with keep - 1 masks
        k = keep
        _, last = super().forward_slots(ids, hidden, keep)
        first = self.length - k  # the last real position: its slot predicts the token at first + 2
        vocab = self.draft.spec.draft_vocab_size
        logits = torch.full((k, vocab), -10.0)
        for d in range(k):
            want = self.full[first + d + 2] if first + d + 2 < len(self.full) else 0
            if float(torch.rand((), generator=self.rng)) < self.error:
                want = (want + 1 + int(torch.randint(0, vocab - 1, (), generator=self.rng))) % vocab
            logits[d, want] = 10.0
        return logits, last


@pytest.mark.parametrize("k", [1, 3, 4])
def test_parallel_greedy_with_partly_right_draft_is_lossless_and_counts_acceptance(tiny, k):
    target_dir, model, runner = tiny
    draft = random_draft(target_dir, model, parallel=True)  # full vocabulary: draft id == target id
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        base = plain_generate(runner, ids, 40)
        spec = speculative_generate(runner, ParallelNoisyOracle(draft, prompt + base.tokens, 0.3, seed=k), ids, k, 40)
        assert spec.tokens == base.tokens
        s = spec.stats
        assert s.tau > 1.3 and s.num_accepted == sum(s.accepted_per_pos)
        assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))
        assert s.num_accepted + s.num_rounds >= len(spec.tokens) - 1
    perfect = ParallelNoisyOracle(draft, PROMPTS[0] + plain_generate(runner, torch.tensor(PROMPTS[0]), 41).tokens, 0.0)
    spec = speculative_generate(runner, perfect, torch.tensor(PROMPTS[0]), k, 41)
    assert spec.stats.acceptance_per_pos == [1.0] * k and spec.stats.tau == k + 1


class RecordingDraft(DraftRunner):
    """Records each round's parallel proposals with the last real position they were drafted from."""

    def __init__(self, draft):
        super().__init__(draft)
        self.rounds: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def forward_slots(self, ids, hidden, keep):  # P-EAGLE's one forward of a round
        logits, last = super().forward_slots(ids, hidden, keep)
        self.rounds.append((self.length - keep, logits, last))
        return logits, last


def test_parallel_rounds_propose_what_a_fresh_draft_proposes_from_the_whole_prefix(tiny_target_dir):
    """Across rounds (the draft's cache cropped, the parallel slots' positions rewritten from the target's states),
    each round's proposals equal one parallel forward of a fresh draft over the whole prefix (float64)."""
    model = targets.load_target(tiny_target_dir).double()
    target = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    draft = random_draft(tiny_target_dir, model, draft_vocab_size=200, parallel=True).double()
    k = 3
    recorder = RecordingDraft(draft)
    base = plain_generate(target, torch.tensor(PROMPTS[0]), 40)
    # a partly right oracle would bypass the logits checked here: take the rounds' real proposals as they come
    spec = speculative_generate(target, recorder, torch.tensor(PROMPTS[0]), k, 40)
    assert spec.tokens == base.tokens and len(recorder.rounds) == spec.stats.num_rounds > 1
    seq = torch.tensor(PROMPTS[0] + spec.tokens)
    _, aux, _ = target.forward(seq, target.new_cache(), want_aux=True)
    fresh = DraftRunner(draft)
    fused = fresh.fuse(aux)
    for t, logits, last in recorder.rounds:
        fresh.reset()
        want_logits, want_last = parallel_round(fresh, seq[1 : t + 2], fused[: t + 1], k)
        torch.testing.assert_close(last, want_last, rtol=1e-9, atol=1e-9, msg=f"t={t}")
        torch.testing.assert_close(logits, want_logits, msg=f"t={t}")


class TargetFirstSlot(DraftRunner):
    """A P-EAGLE draft whose first slot proposes from the target's own distribution (so it is always accepted and
    every round reaches the parallel slot's proposal), its second from half the draft's own distribution, half the
    target's after the first slot's likeliest token (so the parallel proposal is accepted now and then, and
    rejected now and then). For temperature 1."""

    def __init__(self, draft, model, first_token: int):
        super().__init__(draft)
        self.model, self.first = model, first_token
        self.read: list[int] = []  # the token read at each position of the draft's cache

    def reset(self):
        super().reset()
        self.read = []

    def crop(self, length):
        super().crop(length)
        self.read = self.read[:length]

    def forward_slots(self, ids, hidden, keep):  # P-EAGLE's one forward of a round: ids end with k - 1 masks
        k = keep
        logits, last = super().forward_slots(ids, hidden, keep)
        self.read += ids[: len(ids) - k + 1].tolist() + [-1] * (k - 1)
        prefix = torch.tensor([self.first] + self.read[: len(self.read) - k + 1])
        logits = logits.clone()
        logits[0] = self.model(input_ids=prefix[None]).logits[0, -1].float()
        after = torch.cat([prefix, logits[0].argmax()[None]])
        target_next = torch.softmax(self.model(input_ids=after[None]).logits[0, -1].float(), -1)
        logits[1] = (0.5 * torch.softmax(logits[1], -1) + 0.5 * target_next).log()
        return logits, last


def test_parallel_speculative_sampling_matches_target_distribution(tmp_path):
    """End to end at temperature 1 (k=2): the 3rd generated token, which the parallel slot proposes each round
    (accepted or rejected: the draft's half disagrees with the target), follows the target's own marginal distribution
    (chi-square, p=0.001)."""
    from conftest import build_tiny_target

    target_dir = build_tiny_target(tmp_path / "peaky", seed=1)
    model = targets.load_target(target_dir)
    with torch.no_grad():
        targets.lm_head(model).weight.mul_(60.0)
    runner = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    prompt = [1, 5, 9, 33, 7]
    draft = TargetFirstSlot(random_draft(target_dir, model, seed=5, head_scale=200.0, parallel=True), model, prompt[0])
    with torch.no_grad():  # p(x3) = sum over (x1, x2) of p(x1) p(x2 | x1) p(x3 | x1, x2), pairs of mass < 1e-7 left out
        p1 = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
        x1 = (p1 > 1e-7).nonzero()[:, 0]
        p2 = (
            torch.softmax(
                model(input_ids=torch.cat([torch.tensor(prompt).repeat(len(x1), 1), x1[:, None]], 1))
                .logits[:, -1]
                .double(),
                -1,
            )
            * p1[x1, None]
        )
        pairs = (p2 > 1e-7).nonzero()
        rows = torch.cat([torch.tensor(prompt).repeat(len(pairs), 1), x1[pairs[:, 0], None], pairs[:, 1:]], 1)
        p3 = torch.softmax(model(input_ids=rows).logits[:, -1].double(), -1)
        marginal = (p2[pairs[:, 0], pairs[:, 1], None] * p3).sum(0).float()
    assert abs(float(marginal.sum()) - 1.0) < 1e-4
    gen = torch.Generator().manual_seed(0)
    n = 600
    counts = torch.zeros(marginal.numel())
    rejected = 0
    for _ in range(n):
        out = speculative_generate(runner, draft, torch.tensor(prompt), 2, 3, temperature=1.0, generator=gen)
        counts[out.tokens[2]] += 1
        assert out.stats.accepted_per_pos[0] == out.stats.num_rounds == 1  # the first slot: the target's own p
        rejected += out.stats.accepted_per_pos[1] == 0
    assert n // 10 < rejected < n - n // 10  # the parallel slot's proposal was accepted, and its residual sampled
    stat, df = chi2_stat(counts, marginal)
    assert df >= 5
    assert stat < chi2_critical(df)


def test_decode_stats_tau_and_merge():
    a = DecodeStats(
        k=3,
        num_prompts=1,
        num_new_tokens=10,
        elapsed_s=1.0,
        num_rounds=4,
        num_draft_tokens=12,
        num_accepted=6,
        accepted_per_pos=[3, 2, 1],
    )
    b = DecodeStats(
        k=3,
        num_prompts=1,
        num_new_tokens=5,
        elapsed_s=1.0,
        num_rounds=4,
        num_draft_tokens=12,
        num_accepted=0,
        accepted_per_pos=[0, 0, 0],
    )
    assert a.tau == 2.5 and a.acceptance_per_pos == [0.75, 0.5, 0.25]
    a.add(b)
    assert a.tau == 1.75 and a.tokens_per_s == 7.5 and a.accepted_per_pos == [3, 2, 1]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_lossless_on_default_target_with_random_draft(default_target_dir, k):
    from draftsmith.evaluate.prompts import load_prompts

    model = targets.load_target(default_target_dir)
    tokenizer = targets.load_tokenizer(default_target_dir)
    runner = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    draft = DraftRunner(random_draft(default_target_dir, model, draft_vocab_size=4096))
    for prompt in load_prompts("mt-bench", tokenizer, num_prompts=2):
        ids = torch.tensor(prompt.token_ids)
        base = plain_generate(runner, ids, 24)
        spec = speculative_generate(runner, draft, ids, k, 24)
        assert spec.tokens == base.tokens


# ---------------------------------------------------------------------------------------------- DFlash


def random_dflash(target_dir, target_model, block_size: int = 4, seed: int = 0, layers: int = 1) -> DFlashDraft:
    """A random DFlash draft of the target (its embedding and lm_head), the pad token as its mask token."""
    config = json.loads((target_dir / "config.json").read_text())
    spec = DraftSpec.from_target_config(config, config["vocab_size"], layers, aux_ids(config["num_hidden_layers"]))
    spec = spec.model_copy(
        update={"method": "dflash", "block_size": block_size, "mask_token_id": config["pad_token_id"]}
    )
    return DFlashDraft.from_target(spec, target_model, seed).eval().requires_grad_(False)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_dflash_greedy_with_random_draft_is_lossless_one_forward_a_round(tiny, k):
    target_dir, model, runner = tiny
    dflash = random_dflash(target_dir, model, block_size=k + 1)
    draft = DraftRunner(dflash)
    assert draft.method.name == "dflash"
    calls, rounds = count_forwards(dflash), 0
    for prompt in PROMPTS:
        base = plain_generate(runner, torch.tensor(prompt), 30)
        spec = speculative_generate(runner, draft, torch.tensor(prompt), k, 30)
        assert spec.tokens == base.tokens
        assert spec.stats.num_draft_tokens == k * spec.stats.num_rounds
        rounds += spec.stats.num_rounds
    assert calls[0] == rounds > 0  # one draft forward a round, whatever k


class RecordingBlocks(DraftRunner):
    """Records each DFlash round's proposals (its method's `block_round`) with the position of its anchor."""

    def __init__(self, draft):
        super().__init__(draft)
        self.rounds: list[tuple[int, int, torch.Tensor]] = []
        method, block_round = copy.copy(self.method), self.method.block_round

        def recording(runner, features, anchor, k):
            logits = block_round(runner, features, anchor, k)
            self.rounds.append((runner.length, anchor, logits))
            return logits

        method.block_round = recording
        self.method = method


def test_dflash_rounds_propose_what_a_fresh_draft_proposes_from_the_whole_prefix(tiny_target_dir):
    """Across rounds (the context cache cropped to the verified positions, the rejected positions' features read
    again from the target), each round's proposals equal one block of a fresh draft over the whole prefix (float64)."""
    model = targets.load_target(tiny_target_dir).double()
    target = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    draft = random_dflash(tiny_target_dir, model, block_size=4, layers=2).double()
    k = 3
    recorder = RecordingBlocks(draft)
    base = plain_generate(target, torch.tensor(PROMPTS[0]), 40)
    spec = speculative_generate(target, recorder, torch.tensor(PROMPTS[0]), k, 40)
    assert spec.tokens == base.tokens and len(recorder.rounds) == spec.stats.num_rounds > 1
    seq = torch.tensor(PROMPTS[0] + spec.tokens)
    _, aux, _ = target.forward(seq, target.new_cache(), want_aux=True)
    fresh = DraftRunner(draft)
    fused = fresh.fuse(aux)
    for t, anchor, logits in recorder.rounds:
        assert anchor == int(seq[t])  # the anchor: the last token, at the position after the context
        fresh.reset()
        torch.testing.assert_close(logits, fresh.method.block_round(fresh, fused[:t], anchor, k), msg=f"t={t}")


def test_dflash_speculative_sampling_matches_target_next_token_distribution(tmp_path):
    """At temperature 1 (k=2): the 2nd generated token under DFlash rounds (a random block drafter, often
    rejected) follows the target's own marginal distribution (chi-square, p=0.001)."""
    from conftest import build_tiny_target

    target_dir = build_tiny_target(tmp_path / "peaky", seed=1)
    model = targets.load_target(target_dir)
    with torch.no_grad():
        targets.lm_head(model).weight.mul_(60.0)
    runner = TargetRunner(model, aux_ids(model.config.num_hidden_layers))
    draft = DraftRunner(random_dflash(target_dir, model, block_size=3, seed=5))
    prompt = torch.tensor([1, 5, 9, 33, 7])
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=prompt[None]).logits[0, -1].float(), -1)
        vocab = p1.numel()
        batch = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        p2 = torch.softmax(model(input_ids=batch).logits[:, -1].float(), -1)
    marginal = (p1[:, None] * p2).sum(0)
    gen = torch.Generator().manual_seed(0)
    n = 600
    counts = torch.zeros(vocab)
    rejected = 0
    for _ in range(n):
        out = speculative_generate(runner, draft, prompt, 2, 2, temperature=1.0, generator=gen)
        counts[out.tokens[1]] += 1
        rejected += out.stats.accepted_per_pos[0] == 0
    assert rejected > n // 10  # the residual distribution was exercised
    stat, df = chi2_stat(counts, marginal)
    assert df >= 5
    assert stat < chi2_critical(df)
