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


class CountingStore(dist.Store):
    """A store that counts the requests made to it (over a HashStore)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.requests, self.lock = dist.HashStore(), 0, threading.Lock()

    def wait(self, keys, timeout=None):
        with self.lock:
            self.requests += 1
        return self.inner.wait(keys, timeout) if timeout is not None else self.inner.wait(keys)

    def num_keys(self):
        return self.inner.num_keys()


def _counted(name: str):
    def request(self, *args):
        with self.lock:
            self.requests += 1
        return getattr(self.inner, name)(*args)
    return request


for _name in ("set", "get", "add", "append", "check", "delete_key"):
    setattr(CountingStore, _name, _counted(_name))


def test_1024_voters_cost_a_few_requests_each_and_leave_one_attempts_keys():
    """1,024 voters (threads) on one store, three attempts, one rank dropping the second: each
    attempt costs at most six requests per voter and a few more in all (not one per pair of
    voters: a million here), and the keys left are the last attempt's five at most, whatever
    the number of voters. Prints the decision's time per attempt."""
    import time

    world = 1024
    store = CountingStore()
    votes = [StepVote(store, rank, world, timeout=60) for rank in range(world)]
    for attempt, troubled in enumerate((None, 517, None), start=1):
        results = [None] * world

        def vote(rank):
            results[rank] = votes[rank].decide(False, "rank 517: sync timed out" if rank == troubled else None)

        before, started = store.requests, time.perf_counter()
        threads = [threading.Thread(target=vote, args=(rank,)) for rank in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - started
        expected = Verdict({517: "rank 517: sync timed out"}, sync_failed=True) if troubled else Verdict({})
        assert results == [expected] * world, attempt
        requests = store.requests - before
        print(f"attempt {attempt}: {world} voters, {requests} store requests ({requests / world:.2f} per voter), "
              f"decided in {seconds:.2f}s; {store.num_keys()} keys in the store")
        assert requests <= 6 * world + 8, requests
        assert store.num_keys() <= 5  # this attempt's: the previous one's were deleted
    assert all(not store.inner.check([key]) for key in StepVote.keys(2))
