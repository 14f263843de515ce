"""Draft vocabulary: the most frequent loss-masked target ids, sorted; d2t offsets and the t2d mask agree."""

from __future__ import annotations

import pytest
import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.methods.vocab import build_draft_vocab, coverage_report


def test_picks_the_most_frequent_ids_sorted_with_consistent_d2t_and_t2d():
    counts = torch.tensor([0, 50, 3, 0, 7, 100, 1, 7, 0, 2])
    vocab = build_draft_vocab(counts, 4)
    assert vocab.draft_to_target.tolist() == [1, 4, 5, 7]  # 100, 50, 7, 7
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [1, 3, 3, 4]
    # what vLLM does with d2t: target_id = draft_id + d2t[draft_id]
    assert (torch.arange(4) + vocab.d2t).tolist() == vocab.draft_to_target.tolist()
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.shape == (10,)
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 4, 5, 7]
    assert vocab.coverage == pytest.approx(164 / 170)
    assert vocab.draft_vocab_size == 4 and vocab.target_vocab_size == 10


def test_ties_go_to_the_lower_id_and_unseen_ids_fill_up_deterministically():
    counts = torch.tensor([0, 5, 5, 5, 0, 0])
    assert build_draft_vocab(counts, 2).draft_to_target.tolist() == [1, 2]
    filled = build_draft_vocab(counts, 5)
    assert filled.draft_to_target.tolist() == [0, 1, 2, 3, 4] and filled.coverage == 1.0


def test_full_vocabulary_has_zero_offsets_and_all_zero_counts_have_zero_coverage():
    full = build_draft_vocab(torch.arange(8), 8)
    assert full.d2t.tolist() == [0] * 8 and bool(full.t2d.all())
    assert build_draft_vocab(torch.zeros(8, dtype=torch.long), 3).coverage == 0.0


def test_bad_sizes_are_user_errors():
    with pytest.raises(DraftsmithError, match="between 1 and the target's vocabulary size 4"):
        build_draft_vocab(torch.ones(4, dtype=torch.long), 5)
    with pytest.raises(DraftsmithError):
        build_draft_vocab(torch.ones(4, dtype=torch.long), 0)
    with pytest.raises(DraftsmithError, match="1-D"):
        build_draft_vocab(torch.ones(2, 2, dtype=torch.long), 1)


def test_coverage_report_is_monotone_and_matches_build():
    torch.manual_seed(0)
    counts = (torch.rand(1000) ** 8 * 1000).long()
    report = coverage_report(counts, sizes=(10, 100, 500, 5000))
    assert [size for size, _ in report] == [10, 100, 500, 1000]  # capped at the vocabulary
    covers = [c for _, c in report]
    assert covers == sorted(covers) and covers[-1] == pytest.approx(1.0)
    for size, cover in report:
        assert cover == pytest.approx(build_draft_vocab(counts, size).coverage)
