"""Stability for Megatron-LM's pretrain_gpt.py: our pretrain script's, through its ``train_step``.

The same ``Resilience`` as our loop (``higgs_megatron.runtime.resilience``), so the flags
(``--higgs-step-timeout``, ``--higgs-restart-timeout``, ``--inject-fault``), the events and
the exit statuses are the same. It is built when ``get_megatron_optimizer`` returns (process
groups, model chunks and the wrapped optimizer exist then), and ``StepRunner`` takes
Megatron-LM's ``train_step`` place:

1. ``begin``: phase ``forward-backward``, then this rank's injected fault, if any;
2. Megatron-LM's own ``train_step``, its ``optimizer.step()`` being ``HiggsOptimizer``'s, which
   takes the step's one decision; a vote that runs out, or groups that cannot be rebuilt, end
   the rank with the restart status (``Resilience.bounded``);
3. a step every rank dropped because a sync was given up on is a progress alignment: the
   groups are rebuilt by then, and Megatron-LM's ``train_step`` runs again on the same
   micro-batches (``_Replay`` hands the forward step what it fetched the first time), so
   Megatron-LM never sees the dropped attempt: its iteration count, schedule and skipped
   iterations stay those of an undisturbed run.

Megatron-LM's own exit flags (``--exit-signal-handler``, ``--exit-duration-in-mins``,
``--exit-interval``) need nothing here: their saves go through ``save_checkpoint``, which the
patches already route through the rank map (``rank_map.RankMapHooks``), and Megatron-LM
finishes an async save before it exits.
"""

from __future__ import annotations

import atexit
from typing import Any, Callable, Iterator

import torch.distributed as dist
from megatron.core.utils import get_model_config

from higgs_megatron.stability.flags import check_stability, restart_timeout
from higgs_megatron.runtime.metrics import MetricsLogger
from higgs_megatron.runtime.resilience import Resilience


class _Replay:
    """What the forward step fetched in the first attempt of an iteration, handed out again in
    the next. Megatron-LM's own data iterator (and the rerun state machine's view of it) is
    left alone: only the forward step sees the proxy."""

    def __init__(self) -> None:
        self.fetched: dict[int, list[Any]] = {}  # id(source iterator) -> items, in order
        self.replaying = False
        self._position: dict[int, int] = {}

    def rewind(self) -> None:
        self.replaying, self._position = True, {}

    def _items(self, source: Iterator[Any]) -> Iterator[Any]:
        key = id(source)
        fetched = self.fetched.setdefault(key, [])
        while True:
            position = self._position.get(key, 0)
            if self.replaying and position < len(fetched):
                item = fetched[position]
            else:
                try:
                    item = next(source)
                except StopIteration:
                    return
                fetched.append(item)
            self._position[key] = position + 1
            yield item

    def forward_step(self, forward_step_func: Callable, poison: bool) -> Callable:
        proxies: dict[int, Iterator[Any]] = {}

        def step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            if data_iterator is not None:
                data_iterator = proxies.setdefault(id(data_iterator), self._items(data_iterator))
            output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
            return output, (_poisoned(loss_func) if poison else loss_func)

        return step


def _poisoned(loss_func: Callable) -> Callable:
    """The ``nan`` fault: this rank's loss, and so its gradients, NaN (after Megatron-LM's own
    checks of the loss, which would stop the run first)."""

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        loss, *rest = loss_func(*args, **kwargs)
        return (loss * float("nan"), *rest)

    return poisoned


class StepRunner:
    """Megatron-LM's ``train_step`` under ``Resilience`` (see the module docstring)."""

    def __init__(self, resilience: Resilience) -> None:
        self.resilience = resilience
        self.iteration = 0

    def __call__(self, original: Callable, forward_step_func: Callable, data_iterator: Any, model: list,
                 optimizer: Any, *args: Any, **kwargs: Any) -> tuple:
        from megatron.training import get_args

        self.iteration = get_args().curr_iteration + 1
        config = get_model_config(model[0])
        if not getattr(config.finalize_model_grads_func, "higgs_watched", False):
            self.resilience.watch_grad_sync(config, lambda: self.iteration)
        replay = _Replay()
        while True:
            fault = self.resilience.begin(self.iteration)
            step = replay.forward_step(forward_step_func, poison=fault is not None and fault.kind == "nan")
            with self.resilience.bounded():
                result = original(step, data_iterator, model, optimizer, *args, **kwargs)
            if not self.resilience.realigned(self.iteration, optimizer.take_verdict(), optimizer.regroup_seconds):
                return result
            replay.rewind()

    def checkpoint_phase(self) -> None:
        self.resilience.phase(self.iteration, "checkpoint")


def build_resilience(args: Any, model_chunks: list, optimizer: Any) -> StepRunner:
    """The Resilience for this run, once the wrapped optimizer exists; logs from the last rank,
    as Megatron-LM does. Its watchdog stops, and every rank says it is done, at exit."""
    logger = MetricsLogger(is_writer=dist.get_rank() == dist.get_world_size() - 1)
    faults = check_stability(args, dist.get_world_size(), use_higgs=True)  # checked in translate_args already
    runner = StepRunner(Resilience(args.higgs_step_timeout, restart_timeout(args), faults, logger,
                                   model_chunks, optimizer))
    atexit.register(lambda: runner.resilience.close(runner.iteration))
    return runner

