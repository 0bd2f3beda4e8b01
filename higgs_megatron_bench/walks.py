"""Follow one gradient, one save and one load through our files, as control enters them.

``docs/architecture.md`` names three walks and how many of our files each passes through.
This module measures them instead of reading them off the code: a profiling hook
(``sys.setprofile``) sees every Python call on the training thread, and a call counts as
*entering* a file of ours (``higgs_megatron/``, ``patches/``) when the frame that made it is
in another file, ours or Megatron's. Returns are not entries: a function that calls two
files in turn enters each once. Entries of one file in a row (a loop over buckets calling
the same helper) count once. A file *entered twice* is one entered again after control
went into another file of ours in between: a callback back up, or a second trip to a file
already done with. A generator resumed is not a call. ``cpu.py`` is not counted: its wrappers
of Megatron's CUDA-only calls are installed on a machine without CUDA only.

    walks = measure_walks(argv)   # on 2 gloo ranks: rank 0's walks
    walks["save"].files, walks["save"].reentered

The walks (our pretrain script, two ranks, one model chunk):

* ``gradient``: from the first bucket's ``start_grad_sync`` (Megatron's hook) to the end of
  the optimizer's ``step``; and its two legs, as Megatron calls them: ``gradient: launch``
  (``start_grad_sync``, at the hook) and ``gradient: finish`` (from ``finish_grad_sync``, as
  the step begins, to the end of the step);
* ``save``: the loop's call of ``save_checkpoint``, synchronous, to ``latest``;
* ``load``: the loop's call of ``load_checkpoint`` of that save, in a new ``Trainer``.

The loop (``training/loop.py``) is where each walk starts; it is counted as its first file.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .ranks import REPO_ROOT, run_ranks

OURS = (REPO_ROOT / "higgs_megatron", REPO_ROOT / "patches")
NOT_COUNTED = ("higgs_megatron/cpu.py",)  # see the module docstring
LOOP = "higgs_megatron/training/loop.py"
# The walks' run: a tiny GPT, every bucket compressed from the first step, the sync overlapped.
WALK_ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--train-iters", "10", "--log-interval", "1000", "--eval-iters", "0",
             "--num-threads", "1", "--use-higgs", "--higgs-sync", "sparse", "--higgs-dense-iters", "0",
             "--higgs-density-warmup-iters", "0", "--higgs-min-bucket-numel", "1", "--overlap-grad-reduce"]


@dataclass
class Walk:
    """The files of ours a walk entered, in order (a file entered again appears again)."""

    entries: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(self.entries))

    @property
    def reentered(self) -> list[str]:
        return [name for name in self.files if self.entries.count(name) > 1]

    def describe(self) -> str:
        return " -> ".join(self.entries)


def _ours(filename: str) -> str | None:
    path = Path(filename)
    for root in OURS:
        if path.is_relative_to(root):
            name = str(path.relative_to(REPO_ROOT))
            return None if name in NOT_COUNTED else name
    return None


class Tracer:
    """Records entries into our files while ``active``; see the module docstring."""

    def __init__(self, start: str | None = None) -> None:
        self.walk = Walk([start] if start else [])
        self.active = False
        self._cache: dict[str, str | None] = {}

    def _file(self, filename: str) -> str | None:
        if filename not in self._cache:
            self._cache[filename] = _ours(filename)
        return self._cache[filename]

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.active:
            return
        mine = self._file(frame.f_code.co_filename)
        if mine is None:
            return
        if frame.f_code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE) and frame.f_lasti > 0:
            return  # a generator resumed
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename == frame.f_code.co_filename:
            return  # within one file
        if not self.walk.entries or self.walk.entries[-1] != mine:
            self.walk.entries.append(mine)

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with this tracer recording."""
        previous = sys.getprofile()
        sys.setprofile(self)
        self.active = True
        try:
            return fn()
        finally:
            self.active = False
            sys.setprofile(previous)


def _traced(tracer: Tracer, fn: Callable) -> Callable:
    def traced(*args: Any, **kwargs: Any) -> Any:
        return tracer.run(lambda: fn(*args, **kwargs))

    return traced


def _walk_worker(argv: list[str], directory: str) -> dict[str, list[str]]:
    """One rank: two iterations, then the gradient walk of a third, a save, and a load."""
    import higgs_megatron.training.loop as loop
    from higgs_megatron.ddp import HiggsBucketGroup
    from higgs_megatron.optimizer import HiggsOptimizer
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment

    argv = [*argv, "--save", directory]
    args = parse_args(argv)
    walks = {name: Tracer(LOOP) for name in ("gradient", "save", "load")}
    legs = {"gradient: launch": Tracer(), "gradient: finish": Tracer()}  # the two calls Megatron makes into ddp.py
    gradient, launch, finish = walks["gradient"], legs["gradient: launch"], legs["gradient: finish"]
    originals = (HiggsBucketGroup.start_grad_sync, HiggsOptimizer.step, loop.save_checkpoint, loop.load_checkpoint,
                 HiggsBucketGroup.finish_grad_sync)

    def start_grad_sync(group: Any, *a: Any, **k: Any) -> Any:
        first = gradient.walk.entries == [LOOP]  # the first bucket's hook, in the traced iteration
        gradient.active = gradient.active or first
        launch.active = first
        try:
            return originals[0](group, *a, **k)
        finally:
            launch.active = False

    def finish_grad_sync(group: Any, *a: Any, **k: Any) -> Any:
        finish.active = gradient.active
        return originals[4](group, *a, **k)

    def step(optimizer: Any) -> Any:
        try:
            return originals[1](optimizer)
        finally:
            gradient.active = finish.active = False

    def profile(frame: Any, event: str, arg: Any) -> None:
        for tracer in (gradient, launch, finish):
            tracer(frame, event, arg)

    with training_environment(args):
        trainer = loop.Trainer(args)
        for _ in range(2):
            trainer.train_step()
            trainer.iteration += 1
        HiggsBucketGroup.start_grad_sync, HiggsOptimizer.step = start_grad_sync, step
        HiggsBucketGroup.finish_grad_sync = finish_grad_sync
        loop.save_checkpoint = _traced(walks["save"], loop.save_checkpoint)
        loop.load_checkpoint = _traced(walks["load"], loop.load_checkpoint)
        try:
            previous = sys.getprofile()
            sys.setprofile(profile)
            try:
                trainer.train_step()
            finally:
                sys.setprofile(previous)
            trainer.iteration += 1
            trainer.save()
            trainer.close()
            loop.Trainer(parse_args([*argv, "--load", directory])).close()
        finally:
            (HiggsBucketGroup.start_grad_sync, HiggsOptimizer.step, loop.save_checkpoint,
             loop.load_checkpoint, HiggsBucketGroup.finish_grad_sync) = originals
    return {name: tracer.walk.entries for name, tracer in {**walks, **legs}.items()}


def measure_walks(argv: list[str], directory: str, timeout: float = 300.0) -> dict[str, Walk]:
    """The three walks of rank 0 of a 2-rank run of ``argv`` (our pretrain script's flags)."""
    results = run_ranks(_walk_worker, world_size=2, args=(argv, directory), timeout=timeout)
    return {name: Walk(entries) for name, entries in results[0].items()}
