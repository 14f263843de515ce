"""Reference speculative decoding in PyTorch: the target (transformers, KV cache) verifies chains of k draft tokens.

One round, with the sequence S = prompt + generated tokens and the target's KV cache holding positions
0..L-1 (every token but the last, L = len(S) - 1):

    draft    the draft's own KV cache holds the positions already fed with the target's features; it reads the
             pending positions p (embedding of S[p+1], fc(aux states of the target at p)), then runs k-1 more
             steps on its own output (embedding of its previous token, its own pre-norm hidden state), proposing
             d_1..d_k. Its speculative K/V entries are dropped again after the round.
             The round is the draft's method's (`DraftMethod.propose`, draftsmith.methods): P-EAGLE (vLLM's
             parallel drafting) reads k-1 parallel slots of the mask token behind the pending positions, DFlash
             (vLLM's dflash method) the block [S[-1], mask x k] after them, each in one forward instead of k, so
             no proposal waits for the one before it; neither keeps those slots' K/V: next round the target's
             own features of those positions are read there instead.
    verify   the target reads [S[-1], d_1..d_k] at positions L..L+k in one forward: k+1 next-token
             distributions p_0..p_k and the aux states of those positions.
    accept   greedy: d_i is accepted while it equals argmax p_{i-1}; then the target's own token follows
             (a correction, or the bonus token when all k were accepted). temperature > 0: exact rejection
             sampling (accept d_i with probability min(1, p(d_i) / q(d_i)), else sample from
             norm(max(p - q, 0))), so the output has exactly the target's distribution.
    crop     the target keeps K/V for S[-1], d_1..d_a; the draft is fed the target's aux states of those
             a + 1 positions next round. A cache that cannot be cut back (a hybrid target's linear-attention
             state) is copied before the verify forward, and the copy reads S[-1], d_1..d_a instead.

τ (mean acceptance length) = 1 + accepted / rounds, the accepted draft tokens plus the one token the target adds
per round -- the same definition as vLLM's `mean acceptance length`; acceptance at position i is the fraction of
rounds whose i-th draft token was accepted. Like vLLM, every round proposes k tokens and counts what the
verifier accepts, even when the output is cut at --max-new-tokens or an end-of-sequence token.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pydantic import model_validator
from transformers import DynamicCache, PreTrainedModel

from draftsmith.core import targets
from draftsmith.evaluate.report import DecodeCounts
from draftsmith.methods import method_of
from draftsmith.methods.attention import KVCache
from draftsmith.methods.base import Draft


class DecodeStats(DecodeCounts):
    """Counts of one decoding run, taken round by round or run by run, and what they give."""

    @model_validator(mode="after")
    def _one_count_per_position(self) -> DecodeStats:
        if len(self.accepted_per_pos) < self.k:
            self.accepted_per_pos = list(self.accepted_per_pos) + [0] * (self.k - len(self.accepted_per_pos))
        return self

    @property
    def tau(self) -> float:
        """Mean acceptance length: accepted draft tokens + 1 per round."""
        return 1.0 + self.num_accepted / self.num_rounds if self.num_rounds else 1.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / self.num_rounds if self.num_rounds else 0.0 for a in self.accepted_per_pos]

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def tau_interval(self, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
        """A `level` bootstrap interval of τ over the prompts (resampled with replacement, τ of each resample as
        the whole run's: total accepted over total rounds); None with fewer than two prompts' counts."""
        if len(self.per_prompt) < 2:
            return None
        counts = torch.tensor(self.per_prompt, dtype=torch.float64)
        picks = torch.randint(len(counts), (resamples, len(counts)), generator=torch.Generator().manual_seed(seed))
        rounds, accepted = counts[picks].sum(dim=1).unbind(-1)
        taus = (1.0 + accepted / rounds.clamp(min=1)).sort().values
        tail = (1.0 - level) / 2
        return float(taus[int(tail * (resamples - 1))]), float(taus[int((1 - tail) * (resamples - 1))])

    def add_round(self, accepted: int) -> None:
        """Count one round of k proposals whose first `accepted` were accepted."""
        self.num_rounds += 1
        self.num_draft_tokens += self.k
        self.num_accepted += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def add(self, other: DecodeStats) -> None:
        """Count another run in; a one-prompt run without per-prompt counts is one prompt."""
        self.per_prompt += other.per_prompt or (
            [(other.num_rounds, other.num_accepted)] if other.num_prompts <= 1 and other.num_rounds else []
        )
        self.num_prompts += other.num_prompts
        self.num_new_tokens += other.num_new_tokens
        self.elapsed_s += other.elapsed_s
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos, other.accepted_per_pos, strict=False)]

    def to_dict(self) -> dict:
        interval = self.tau_interval()
        return {
            **self.model_dump(),
            "tau": self.tau,
            "acceptance_per_pos": self.acceptance_per_pos,
            "tokens_per_s": self.tokens_per_s,
            "tau_95": list(interval) if interval else None,
        }


@dataclass
class Measured:
    """One engine's runs over one domain: each k's stats (0: the target alone) and outputs, the dtype it ran in, each
    k's rounds by segment where the engine tells them (the reference decoder; vLLM with per-step counts), and what only
    one engine tells (the reference decoder: losslessness; vLLM: its version, and why it gave no split)."""

    stats: dict[int, DecodeStats]
    outputs: dict[int, list[list[int]]]
    dtype: str
    by_segment: dict[int, dict[str, DecodeStats]] = field(default_factory=dict)
    lossless: dict[str, str] | None = None
    vllm_version: str | None = None
    segments_note: str | None = None


def lossless(outputs: dict[int, list[list[int]]], ks: list[int]) -> dict[str, str]:
    """Per k, how many greedy outputs are the target alone's."""
    same = {k: sum(a == b for a, b in zip(outputs[k], outputs[0], strict=False)) for k in ks}
    return {f"k={k}": f"{same[k]}/{len(outputs[0])} prompts" for k in ks}


def merged(parts: list[Measured]) -> Measured:
    """Several domains' runs as one (a suite's whole): each k's counts added, the outputs in the domains' order."""
    first = parts[0]
    if len(parts) == 1:
        return first

    def total(k: int, counts: list[DecodeStats]) -> DecodeStats:
        whole = DecodeStats(k=k)
        for c in counts:
            whole.add(c)
        return whole

    stats = {k: total(k, [p.stats[k] for p in parts]) for k in first.stats}
    outputs = {k: [o for p in parts for o in p.outputs[k]] for k in first.outputs}
    by_segment = {
        k: {name: total(k, [p.by_segment[k][name] for p in parts]) for name in segments}
        for k, segments in first.by_segment.items()
    }
    same = lossless(outputs, [k for k in stats if k]) if first.lossless is not None else None
    return Measured(stats, outputs, first.dtype, by_segment, same, first.vllm_version, first.segments_note)


class TargetRunner:
    """A transformers causal LM with a KV cache that also returns the aux states (vLLM layer ids) it computed."""

    def __init__(self, model: PreTrainedModel, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        layers = targets.decoder_layers(model)
        self.num_layers = len(layers)
        self._last: torch.Tensor | None = None
        # transformers 4.x (no past recording in its caches) restarts a stateful model's recurrent state on any
        # chunk longer than one token after the prefill: there a cached sequence continues one token at a time
        self.stepwise = not hasattr(DynamicCache, "activate_past_recording") and getattr(model, "_is_stateful", False)
        if self.num_layers in self.aux_layer_ids:
            # HF's hidden_states[N] is after the final norm; vLLM's id N is the last layer's raw output.
            layers[-1].register_forward_hook(self._grab_last)

    def _grab_last(self, module, args, output) -> None:
        self._last = output[0] if isinstance(output, tuple) else output

    def _grabbed(self) -> torch.Tensor:
        assert self._last is not None  # _grab_last ran in this forward
        return self._last

    def new_cache(self) -> DynamicCache | None:
        """A cache for one sequence that a rejected draft's entries can be cut from, or None where the model builds
        its own on the first forward (`forward` returns it).

        Sliding-window layers keep their past (`activate_past_recording`, transformers 5). transformers 4.x has no
        such switch and its sliding layers refuse a cut once the window is full, so there every layer keeps all its
        entries and the attention mask alone keeps the window; its stateful models (Qwen3-Next's gated delta-net
        cache) build a cache class of their own (and continue one token at a time: `stepwise`)."""
        if self.stepwise:
            return None
        cache = DynamicCache(config=self.model.config)
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
            return cache
        return DynamicCache() if any(getattr(cache, "is_sliding", ())) else cache

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache, want_aux: bool, last_logits_only: bool = False):
        """ids [T] -> (logits float32 [T or 1, V], aux [T, n_aux * H] or None, the cache). The cache grows by T;
        given None, the model builds one."""
        if self.stepwise and cache is not None and len(ids) > 1:
            steps = [self.forward(ids[i : i + 1], cache, want_aux) for i in range(len(ids))]
            logits = torch.cat([step[0] for step in steps])
            aux = torch.cat([step[1] for step in steps]) if want_aux else None
            return (logits[-1:] if last_logits_only else logits), aux, steps[-1][2]
        out = self.model(
            input_ids=ids[None],
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=want_aux,
            logits_to_keep=1 if last_logits_only else 0,
        )
        logits = out.logits[0].float()
        cache = out.past_key_values
        if not want_aux:
            return logits, None, cache
        states = [self._grabbed() if i == self.num_layers else out.hidden_states[i] for i in self.aux_layer_ids]
        return logits, torch.cat(states, dim=-1)[0], cache


class DraftRunner:
    """The draft decoding with its own KV cache, one position at a time or many; its method's round (`propose`)
    decides how a round proposes (EAGLE-3: k forwards; P-EAGLE, DFlash: one)."""

    def __init__(self, draft: Draft):
        self.draft = draft
        self.method = method_of(draft.spec)
        self.method.check_spec(draft.spec)
        self.draft_to_target = draft.draft_to_target
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache(len(self.draft.layers))
        self.length = 0

    def crop(self, length: int) -> None:
        """Forget every K/V entry from position `length` on."""
        self.cache.crop(length)
        self.length = min(self.length, length)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T], hidden [T, H] at positions length..length+T-1 -> (draft logits of the last position [Vd],
        pre-norm hidden state of the last position [H])."""
        logits, h = self.forward_slots(ids, hidden, keep=1)
        return logits[-1], h[-1]

    @torch.inference_mode()
    def propose(self, ids: torch.Tensor, features: torch.Tensor, last: int, k: int, choose) -> list[int]:
        """One round: the pending positions' ids [T] and fused features [T, H], then k proposals (target ids, each
        picked by `choose` from its logits), as the draft's method drafts them."""
        return self.method.propose(self, ids, features, last, k, choose)

    def forward_slots(self, ids: torch.Tensor, hidden: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward of ids [T], hidden [T, H] at positions length..length+T-1 (the cache grows by T) ->
        (float32 logits [keep, Vd], pre-norm hidden states [keep, H]) of the last `keep` positions."""
        positions = torch.arange(self.length, self.length + len(ids), device=ids.device)[None]
        logits, h = self.draft(ids[None], hidden[None], positions, self.cache, mode="decode", logits_to_keep=keep)
        self.length += len(ids)
        return logits[0].float(), h[0, -keep:]

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.draft.fuse(aux.to(self.draft.fc.weight.dtype))


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.softmax(logits / temperature, dim=-1)


def verify_chain(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: list[torch.Tensor] | None,
    temperature: float,
    generator: torch.Generator | None,
    path: list[int] | None = None,
) -> tuple[int, int]:
    """Accept a prefix of the draft chain. target_logits [k+1, V] (row i predicts the slot of d_{i+1}).

    Returns (a = number of accepted draft tokens, the token the target adds after them).
    Greedy when temperature == 0; otherwise exact rejection sampling against draft_probs[i] ([V], the
    distribution d_{i+1} was drawn from, in target-vocabulary space). A greedy `path` (the tokens another engine's
    target chose at these slots, as many as it has) stands for the target's choice where it has a token.
    """
    k = len(draft_tokens)
    if temperature == 0:
        forced = (path or [])[: k + 1]
        best = forced + target_logits.argmax(dim=-1).tolist()[len(forced) :]
        a = 0
        while a < k and draft_tokens[a] == best[a]:
            a += 1
        return a, best[a]
    assert draft_probs is not None
    for i, token in enumerate(draft_tokens):
        p = target_probs(target_logits[i], temperature)
        q = draft_probs[i]
        ratio = float(p[token]) / max(float(q[token]), 1e-30)
        u = float(torch.rand((), generator=generator))
        if u < min(1.0, ratio):
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        return i, _sample(residual / total if total > 0 else p, generator)
    return k, _sample(target_probs(target_logits[k], temperature), generator)


def _crop_cache(cache, keep: int) -> None:
    """Drop the target's K/V entries from position `keep` on (transformers wants a negative count)."""
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def _croppable(cache) -> bool:
    """Whether `cache` can be cut back after a verify forward (a linear-attention layer's recurrent state cannot)."""
    return bool(getattr(cache, "is_croppable", hasattr(cache, "crop")))


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats
    # each round of speculative decoding: (index in `tokens` of the first token it added, accepted draft tokens)
    rounds: list[tuple[int, int]] = field(default_factory=list)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut at the first end-of-sequence token (kept) or at max_new_tokens; True when generation is over."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: min(i + 1, max_new_tokens)], True
    if len(tokens) >= max_new_tokens:
        return tokens[:max_new_tokens], True
    return tokens, False


def plain_generate(
    target: TargetRunner,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: set[int] | frozenset = frozenset(),
    generator: torch.Generator | None = None,
) -> Generation:
    """The target alone, one token per forward, with its KV cache (the baseline for the speed-up)."""
    start = time.perf_counter()
    logits, _, cache = target.forward(prompt, target.new_cache(), want_aux=False, last_logits_only=True)
    out: list[int] = []
    while True:
        row = logits[-1]
        out.append(int(row.argmax()) if temperature == 0 else _sample(target_probs(row, temperature), generator))
        out, done = _finish(out, max_new_tokens, set(eos_ids))
        if done:
            break
        logits, _, cache = target.forward(torch.tensor([out[-1]], device=prompt.device), cache, want_aux=False)
    stats = DecodeStats(k=0, num_prompts=1, num_new_tokens=len(out), elapsed_s=time.perf_counter() - start)
    return Generation(out, stats)


def speculative_generate(  # noqa: PLR0913 - the decoding settings of one prompt, and the path it follows
    target: TargetRunner,
    draft: DraftRunner,
    prompt: torch.Tensor,
    k: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_ids: set[int] | frozenset = frozenset(),
    generator: torch.Generator | None = None,
    path: list[int] | None = None,
) -> Generation:
    """Speculative decoding of one prompt (ids [n]); lossless against `plain_generate` at the same settings.

    With a greedy `path` (another engine's output for this prompt) the draft is scored along it: the target's choice
    at each position is the path's token, so the rounds, their proposals' context and what is accepted are those the
    other engine's decoding went through (paired with it, whatever the two targets' numerics), and decoding stops at
    the path's end."""
    start = time.perf_counter()
    device = prompt.device
    stats = DecodeStats(k=k, num_prompts=1)
    rounds: list[tuple[int, int]] = []
    eos = set(eos_ids)
    if path is not None:
        assert temperature == 0 and path, "a path is followed greedily"
        max_new_tokens = len(path)
    logits, aux, cache = target.forward(prompt, target.new_cache(), want_aux=True, last_logits_only=True)
    row = logits[-1]
    first = int(row.argmax()) if temperature == 0 else _sample(target_probs(row, temperature), generator)
    first = path[0] if path else first
    out, done = _finish([first], max_new_tokens, eos)
    draft.reset()
    seq = prompt.tolist() + out
    pending_start = 0  # first position whose target features the draft has not read yet
    pending_aux = aux  # [L - pending_start, n_aux * H]
    vocab = logits.shape[-1]
    while not done:
        length = len(seq) - 1  # positions in the target's cache
        # 1) draft: read the pending positions with the target's features, then run on its own output
        #    (P-EAGLE: read them and the k-1 parallel slots in one forward, a proposal from each of the last k).
        draft.crop(pending_start)
        ids = torch.tensor(seq[pending_start + 1 :], device=device)
        chain_probs: list[torch.Tensor] | None = [] if temperature > 0 else None

        def choose(draft_logits: torch.Tensor, probs: list[torch.Tensor] | None = chain_probs) -> int:
            if temperature == 0:
                return int(draft.draft_to_target[int(draft_logits.argmax())])
            q_draft = F.softmax(draft_logits / temperature, dim=-1)
            q = torch.zeros(vocab, device=q_draft.device)
            q[draft.draft_to_target] = q_draft
            assert probs is not None  # a list when temperature > 0
            probs.append(q)
            return int(draft.draft_to_target[_sample(q_draft, generator)])

        chain = draft.propose(ids, draft.fuse(pending_aux), seq[-1], k, choose)
        # 2) verify all k in one target forward.
        verify_ids = torch.tensor([seq[-1]] + chain, device=device)
        before = None if _croppable(cache) else copy.deepcopy(cache)
        target_logits, verify_aux, cache = target.forward(verify_ids, cache, want_aux=True)
        ahead = path[len(out) :] if path else []
        accepted, next_token = verify_chain(target_logits, chain, chain_probs, temperature, generator, ahead)
        stats.add_round(accepted)
        # 3) keep what was accepted; the draft reads the target's features of those positions next round.
        if before is None:
            _crop_cache(cache, length + accepted + 1)
        elif accepted < k:  # no cut back: the copy from before the verify reads the kept tokens
            _, _, cache = target.forward(verify_ids[: accepted + 1], before, want_aux=False, last_logits_only=True)
        pending_start, pending_aux = length, verify_aux[: accepted + 1]
        new = chain[:accepted] + [next_token]
        rounds.append((len(out), accepted))
        out, done = _finish(out + new, max_new_tokens, eos)
        seq = prompt.tolist() + out
    stats.num_new_tokens = len(out)
    stats.elapsed_s = time.perf_counter() - start
    return Generation(out, stats, rounds)
