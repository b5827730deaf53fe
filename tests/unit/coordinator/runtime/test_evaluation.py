"""The evaluation's arithmetic: held-out batches, their split, the forward-only lists, the means, when.

The means are checked against one computation over all the samples at once: the per-sample
losses' and metric values' plain means, whatever the batches and microbatches were.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.planning.config import EvalConfig
from coordinator.planning.data import split_batch
from coordinator.runtime.evaluation import (
    Evaluation,
    HeldOutSums,
    eval_batches,
    forward_actions,
    pad_eval_split,
    split_eval_batch,
)
from services.compute.actions import validate_stage


def test_the_held_out_set_is_read_in_order_the_last_batch_short() -> None:
    batches = eval_batches(37, 16)
    assert [len(b) for b in batches] == [16, 16, 5]
    assert [i for b in batches for i in b] == list(range(37))
    assert eval_batches(32, 16) == [list(range(16)), list(range(16, 32))]
    assert eval_batches(5, 16) == [list(range(5))]


@pytest.mark.parametrize(("n", "replicas", "microbatches", "sizes"), [
    (16, 2, 2, [[4, 4], [4, 4]]),
    (5, 2, 1, [[3], [2]]),
    (5, 2, 2, [[2, 1], [1, 1]]),
    (7, 1, 4, [[2, 2, 2, 1]]),
    (1, 2, 2, [[1], []]),  # a replica without a sample sits the batch out
    (3, 1, 4, [[1, 1, 1]]),  # no empty microbatch
])
def test_a_batch_splits_contiguously_into_shares_that_differ_by_one(n: int, replicas: int, microbatches: int,
                                                                    sizes: list[list[int]]) -> None:
    indices = list(range(100, 100 + n))
    split = split_eval_batch(indices, replicas, microbatches)
    assert [[len(mb) for mb in share] for share in split] == sizes
    assert [i for share in split for mb in share for i in mb] == indices


def test_zero3_pads_every_replica_to_the_most_microbatches_with_one_sample_ones() -> None:
    split = split_eval_batch([30, 31, 32, 33, 34], 2, 4)  # 3 and 2 samples: 3 and 2 microbatches
    assert pad_eval_split(split) == [[[30], [31], [32]], [[33], [34], [30]]]
    sat_out = split_eval_batch([36], 4, 1)  # one sample over 4 replicas: 3 without any
    assert sat_out == [[[36]], [], [], []] and pad_eval_split(sat_out) == [[[36]]] * 4
    even = split_eval_batch(list(range(8)), 2, 2)
    assert pad_eval_split(even) == even


def test_an_even_batch_splits_as_a_training_batch() -> None:
    indices = list(range(24))
    assert split_eval_batch(indices, 2, 3) == split_batch(indices, 2, 3)


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 3), (3, 2)])
def test_every_stage_forwards_each_microbatch_once_and_never_backward(stages: int, microbatches: int) -> None:
    lists = forward_actions(stages, microbatches)
    assert len(lists) == stages
    for s, acts in enumerate(lists):
        assert validate_stage(acts, stage=s, num_stages=stages, num_microbatches=microbatches) is False
        assert [a.microbatch for a in acts if a.kind == "F"] == list(range(microbatches))


def test_a_middle_stage_receives_forwards_and_sends_each_microbatch_in_turn() -> None:
    assert [str(a) for a in forward_actions(3, 2)[1]] == [
        "1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1"]


def test_the_means_are_over_the_samples_whatever_the_split() -> None:
    g = torch.Generator().manual_seed(0)
    per_sample_loss = torch.rand(37, generator=g, dtype=torch.float64)
    per_sample_metric = torch.rand(37, generator=g, dtype=torch.float64)
    sums = HeldOutSums()
    for batch in eval_batches(37, 16):
        for share in split_eval_batch(batch, 2, 4):
            if share:  # what a last stage reports: each microbatch's mean loss and its metric's sum
                sums.add(share, [float(per_sample_loss[mb].mean()) for mb in share],
                         [float(per_sample_metric[mb].sum()) for mb in share])
    record = sums.record(step=4, seconds=0.5)
    assert (record.step, record.num_samples, record.seconds) == (4, 37, 0.5)
    assert abs(record.loss - float(per_sample_loss.mean())) < 1e-15
    assert record.metric is not None and abs(record.metric - float(per_sample_metric.mean())) < 1e-15


def test_without_a_metric_there_is_none_and_a_reply_of_another_size_is_refused() -> None:
    sums = HeldOutSums()
    sums.add([[0, 1], [2]], [1.0, 4.0], [])
    assert sums.record(1, 0.0).metric is None and sums.record(1, 0.0).loss == 2.0
    with pytest.raises(ValueError, match="an evaluation of 2 microbatches was answered with 1 losses and 0"):
        sums.add([[0], [1]], [1.0], [])
    with pytest.raises(ValueError, match="with 2 losses and 1 metric sums"):
        sums.add([[0], [1]], [1.0, 2.0], [3.0])


@pytest.mark.parametrize(("every", "end", "evaluated"), [
    (2, 5, [2, 4, 5]), (None, 5, [5]), (5, 5, [5]), (3, 10, [3, 6, 9, 10])])
def test_an_evaluation_is_due_every_n_steps_and_at_the_end_of_a_fit(every: int | None, end: int,
                                                                   evaluated: list[int]) -> None:
    evaluation = Evaluation(EvalConfig(factory="a:b", every_steps=every), num_samples=10, global_batch=4)
    assert [k for k in range(1, end + 1) if evaluation.due(k, end)] == evaluated
    assert [len(b) for b in evaluation.batches] == [4, 4, 2]  # the data's global batch by default
    assert [len(b) for b in Evaluation(EvalConfig(factory="a:b", global_batch=6), 10, 4).batches] == [6, 4]
