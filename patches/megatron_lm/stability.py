"""Megatron-LM's ``train_step`` under the runtime, and Megatron-LM's writers as an event sink.

The runtime (``higgs_megatron.runtime.attach``) is attached when ``get_megatron_optimizer``
returns (process groups, model chunks and Megatron-LM's optimizer exist then): the same
resilience, flags (``--higgs-step-timeout``, ``--higgs-restart-timeout``, ``--inject-fault``),
events and exit statuses as our loop. ``StepRunner`` takes Megatron-LM's ``train_step`` place
and runs it through ``Runtime.step``:

1. phase ``forward-backward``, then this rank's injected fault, if any;
2. Megatron-LM's own ``train_step``, its ``optimizer.step()`` being ``HiggsOptimizer``'s, which
   takes the step's one decision; a vote that runs out, or groups that cannot be rebuilt, end
   the rank with the restart status;
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

from typing import Any, Callable, Iterator

from megatron.training import get_args
from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

from higgs_megatron.callbacks import Callback, scalars
from higgs_megatron.runtime.attach import Runtime


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

    def begin_attempt(self) -> None:
        """The first attempt fetches; every later one replays what it fetched."""
        if self.fetched:
            self.rewind()

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
    """Megatron-LM's ``train_step`` under ``Runtime.step`` (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def __call__(self, original: Callable, forward_step_func: Callable, data_iterator: Any, model: list,
                 optimizer: Any, *args: Any, **kwargs: Any) -> tuple:
        replay = _Replay()

        def attempt(fault: Any) -> tuple:
            replay.begin_attempt()
            step = replay.forward_step(forward_step_func, poison=fault is not None and fault.kind == "nan")
            return original(step, data_iterator, model, optimizer, *args, **kwargs)

        return self.runtime.step(get_args().curr_iteration + 1, attempt)


class MegatronLMWriters(Callback):
    """The runtime's events, into Megatron-LM's own TensorBoard and W&B writers (those its
    ``--tensorboard-dir`` and ``--wandb-project`` made, on the last rank): an event's numbers as
    ``higgs/EVENT/FIELD`` at its iteration. Iterations are Megatron-LM's to log."""

    def on_event(self, name: str, fields: dict[str, Any]) -> None:
        if "iteration" not in fields:
            return
        values = {f"higgs/{name}/{key}": value for key, value in scalars(fields).items()}
        tensorboard, wandb = get_tensorboard_writer(), get_wandb_writer()
        for key, value in values.items():
            if tensorboard is not None:
                tensorboard.add_scalar(key, value, fields["iteration"])
        if wandb is not None and values:
            wandb.log(values, step=fields["iteration"])
