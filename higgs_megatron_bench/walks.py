"""Follow one gradient, one save and one load through our files, as control enters them.

``docs/architecture.md`` names three walks and how many of our files each passes through.
This module measures them instead of reading them off the code: a profiling hook
(``sys.setprofile``) sees every Python call on the training thread, and a call counts as
*entering* a file of ours (``higgs_megatron/``, ``patches/``) when the frame that made it is
in another file, ours or not. Returns are not entries: a function that calls two files in
turn enters each once. Entries of one file in a row (a loop over buckets calling the same
helper) count once. A generator resumed is not a call. ``cpu.py`` is not counted: its
wrappers of Megatron's CUDA-only calls are installed on a machine without CUDA only.

A walk is made of *legs*: a leg begins where Megatron calls into our files (its backward
hook's ``start_grad_sync``, its ``finish_grad_sync`` and the handle's ``wait`` there, its
``dist_checkpointing`` asking our objects) or where the loop does (``optimizer.step()``,
``save_checkpoint``): each is a call we do not make and cannot merge. A file *entered twice*
is one that our own code enters again within a leg, after control went to another file of
ours in between: a callback back up, or a second trip to a file already done with.

    walks = measure_walks(argv)   # on 2 gloo ranks: rank 0's walks
    walks["save"].files, walks["save"].reentered

The walks (our pretrain script, two ranks, one model chunk, whose gradients fit one bucket:
a model of several buckets repeats the gradient's descent once per bucket):

* ``gradient``: one gradient from Megatron's hook to the end of the optimizer's ``step``:
  what runs inside Megatron's calls of the bucket groups' ``start_grad_sync`` (at the hook)
  and ``finish_grad_sync`` (as the step begins) in one iteration, and inside the loop's call
  of ``optimizer.step()``; what the loop does between them (its phase marks) is not the
  gradient's;
* ``save``: the loop's call of ``save_checkpoint``, synchronous, to ``latest``;
* ``load``: the loop's call of ``load_checkpoint`` of that save, in a new ``Trainer``.

The loop (``training/loop.py``) is where a save and a load start; it is counted as their
first file.
"""

from __future__ import annotations

import importlib.util
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
    """The files of ours a walk entered, in order, leg by leg (see the module docstring)."""

    legs: list[list[str]] = field(default_factory=list)

    @property
    def entries(self) -> list[str]:
        return [name for leg in self.legs for name in leg]

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(self.entries))

    @property
    def reentered(self) -> list[str]:
        again = {name for leg in self.legs for name in leg if leg.count(name) > 1}
        return [name for name in self.files if name in again]

    def describe(self) -> str:
        return " | ".join(" -> ".join(leg) for leg in self.legs)


def _root(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _ours(filename: str, roots: tuple[Path, ...]) -> str | None:
    """``filename`` as counted (relative to the folder holding its root), or None: not ours."""
    path = Path(filename)
    for root in roots:
        if path.is_relative_to(root):
            name = str(path.relative_to(root.parent))
            return None if name in NOT_COUNTED else name
    return None


class Tracer:
    """Records entries into our files while ``active``; see the module docstring."""

    def __init__(self, start: str | None = None, ours: tuple[Path, ...] = OURS,
                 leg_callers: tuple[Path, ...] | None = None) -> None:
        """``ours``: the folders whose files count; ``leg_callers``: the folders whose calls into
        ours begin a leg (Megatron's, and this harness's, which stands in for the calls it wraps)."""
        self.walk = Walk([[start]] if start else [])
        self.active = False
        self._entered = False  # the first entry continues the start's leg
        self._ours = ours
        self._cache: dict[str, str | None] = {}
        self._leg_callers = leg_callers if leg_callers is not None else tuple(
            root for root in (_root("megatron"), Path(__file__).parent) if root is not None)

    def _file(self, filename: str) -> str | None:
        if filename not in self._cache:
            self._cache[filename] = _ours(filename, self._ours)
        return self._cache[filename]

    def _begins_leg(self, caller: Any) -> bool:
        """Whether a call from ``caller`` is Megatron's or the loop's (this harness stands in for
        the loop and for Megatron's calls it wraps)."""
        return caller is None or any(Path(caller.f_code.co_filename).is_relative_to(root)
                                     for root in self._leg_callers)

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
        legs = self.walk.legs
        if not legs or (self._begins_leg(caller) and self._entered):
            legs.append([mine])
        elif legs[-1][-1] != mine:
            legs[-1].append(mine)
        self._entered = True

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


def _walk_worker(argv: list[str], directory: str) -> dict[str, list[list[str]]]:
    """One rank: two iterations, then the gradient walk of a third, a save, and a load."""
    import higgs_megatron.training.loop as loop
    from higgs_megatron.ddp import HiggsBucketGroup
    from higgs_megatron.optimizer import HiggsOptimizer
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment

    argv = [*argv, "--save", directory]
    args = parse_args(argv)
    walks = {"gradient": Tracer(), "save": Tracer(LOOP), "load": Tracer(LOOP)}
    gradient = walks["gradient"]
    # The gradient's calls: Megatron's two into each bucket group, and the loop's optimizer step.
    calls = {(HiggsBucketGroup, "start_grad_sync"): HiggsBucketGroup.start_grad_sync,
             (HiggsBucketGroup, "finish_grad_sync"): HiggsBucketGroup.finish_grad_sync,
             (HiggsOptimizer, "step"): HiggsOptimizer.step}

    def recorded(fn: Callable) -> Callable:
        def call(*a: Any, **k: Any) -> Any:
            was, gradient.active = gradient.active, True
            try:
                return fn(*a, **k)
            finally:
                gradient.active = was
        return call

    with training_environment(args):
        trainer = loop.Trainer(args)
        for _ in range(2):
            trainer.train_step()
            trainer.iteration += 1
        saving = loop.save_checkpoint, loop.load_checkpoint
        loop.save_checkpoint = _traced(walks["save"], loop.save_checkpoint)
        loop.load_checkpoint = _traced(walks["load"], loop.load_checkpoint)
        try:
            for (owner, name), fn in calls.items():
                setattr(owner, name, recorded(fn))
            previous = sys.getprofile()
            sys.setprofile(gradient)
            try:
                trainer.train_step()
            finally:
                sys.setprofile(previous)
                for (owner, name), fn in calls.items():
                    setattr(owner, name, fn)
            trainer.iteration += 1
            trainer.save()
            trainer.close()
            loop.Trainer(parse_args([*argv, "--load", directory])).close()
        finally:
            loop.save_checkpoint, loop.load_checkpoint = saving
    return {name: tracer.walk.legs for name, tracer in walks.items()}


def measure_walks(argv: list[str], directory: str, timeout: float = 300.0) -> dict[str, Walk]:
    """The three walks of rank 0 of a 2-rank run of ``argv`` (our pretrain script's flags)."""
    results = run_ranks(_walk_worker, world_size=2, args=(argv, directory), timeout=timeout)
    return {name: Walk(legs) for name, legs in results[0].items()}
