"""The step's one decision: a reason on any rank drops the step everywhere; a rank that does
not vote is named."""

import threading

import torch.distributed as dist

from higgs_megatron.stability.alignment import StepVote, Verdict, VoteTimeout


def test_one_reason_on_any_rank_drops_the_step_on_every_rank():
    """Each rank votes its own inputs; every rank reads the same verdict: kept, or dropped with
    each rank's reason, and whether a sync was given up on (an alignment, not a skip)."""
    store = dist.HashStore()
    votes = [StepVote(store, rank, 3, timeout=10) for rank in range(3)]
    results = [None] * 3

    def vote(rank, inputs):
        results[rank] = votes[rank].decide(*inputs)

    attempts = [
        ([(False, None)] * 3, Verdict({})),
        ([(False, None), (False, "rank 1: sync timed out"), (False, None)],
         Verdict({1: "rank 1: sync timed out"}, sync_failed=True)),
        ([(True, None), (False, None), (True, "rank 2: sync timed out")],
         Verdict({0: "rank 0: non-finite gradients", 2: "rank 2: non-finite gradients; rank 2: sync timed out"},
                 sync_failed=True)),
        ([(False, None), (True, None), (False, None)], Verdict({1: "rank 1: non-finite gradients"})),
    ]
    for inputs, expected in attempts:
        threads = [threading.Thread(target=vote, args=(r, i)) for r, i in enumerate(inputs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [expected] * 3
        assert all(r.keep == (not expected.dropped) for r in results)


def test_a_rank_that_does_not_vote_is_named():
    store = dist.HashStore()
    errors = []

    def vote(rank):
        try:
            StepVote(store, rank, 3, timeout=0.5).decide(False, None)
        except VoteTimeout as error:
            errors.append(str(error))

    threads = [threading.Thread(target=vote, args=(rank,)) for rank in (0, 2)]  # rank 1 never votes
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["rank(s) [1] did not vote on step attempt 1 within 0.5s (--higgs-restart-timeout)"] * 2
