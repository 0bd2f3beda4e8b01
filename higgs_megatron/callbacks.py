"""Where a run's iterations and events go besides the log: a small hook interface.

Every iteration record and every event (progress alignments, stalls, injected faults,
checkpoints saved and loaded, skipped steps, the sync plan) reaches each callback's
``on_iteration`` / ``on_event`` with the same fields as the ``--log-json`` record, on the
logging rank only. Two implementations: TensorBoard (``--tensorboard-dir``) and Weights &
Biases (``--wandb-project``, offline unless told otherwise, so it needs no account or network).
A user's own callback subclasses ``Callback`` and is passed to ``Trainer(args, callbacks=[...])``.
"""

from __future__ import annotations

import argparse
from typing import Any


def scalars(fields: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in fields.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("iteration", "time")}


class Callback:
    """Override what you need; every method is a no-op here."""

    def on_iteration(self, iteration: int, fields: dict[str, Any]) -> None:
        pass

    def on_event(self, name: str, fields: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardCallback(Callback):
    """Iteration fields as scalars by name; an event's numbers as ``EVENT/FIELD`` at its iteration."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def on_iteration(self, iteration: int, fields: dict[str, Any]) -> None:
        for key, value in scalars(fields).items():
            self.writer.add_scalar(key, value, iteration)

    def on_event(self, name: str, fields: dict[str, Any]) -> None:
        if "iteration" in fields:
            for key, value in scalars(fields).items():
                self.writer.add_scalar(f"{name}/{key}", value, fields["iteration"])

    def close(self) -> None:
        self.writer.close()


class WandbCallback(Callback):
    """One W&B run; events logged as ``EVENT/FIELD`` (their counts too, so alignments chart)."""

    def __init__(self, project: str, mode: str = "offline", directory: str | None = None,
                 config: dict | None = None) -> None:
        import wandb

        self.run = wandb.init(project=project, mode=mode, dir=directory, config=config or {})
        self.counts: dict[str, int] = {}

    def on_iteration(self, iteration: int, fields: dict[str, Any]) -> None:
        self.run.log(scalars(fields), step=iteration)

    def on_event(self, name: str, fields: dict[str, Any]) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1
        values = {f"{name}/{key}": value for key, value in scalars(fields).items()}
        values[f"{name}/count"] = self.counts[name]
        self.run.log(values, step=fields["iteration"]) if "iteration" in fields else self.run.log(values)

    def close(self) -> None:
        self.run.finish()


def callbacks_from_args(args: argparse.Namespace) -> list[Callback]:
    """The callbacks the pretrain script's flags ask for (--tensorboard-dir, --wandb-project)."""
    callbacks: list[Callback] = []
    if args.tensorboard_dir:
        callbacks.append(TensorBoardCallback(args.tensorboard_dir))
    if args.wandb_project:
        callbacks.append(WandbCallback(args.wandb_project, mode=args.wandb_mode, directory=args.wandb_dir,
                                       config={k: v for k, v in vars(args).items()
                                               if isinstance(v, (int, float, str, bool, type(None)))}))
    return callbacks
