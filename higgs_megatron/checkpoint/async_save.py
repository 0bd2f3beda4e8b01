"""Asynchronous saves: the loop pays for the planning; the host copy, writing, hashing and commit happen later.

Protocol (every rank, the same calls at the same iterations):

1. ``start`` (after ``wait`` for the previous save: one in flight at most), in the loop's time:
   ``save.begin`` (the ``.tmp`` directory), the sharded state dict, and megatron-core's save
   planning (in full for a run's first save; later saves reuse its validated plan, as
   Megatron-LM's ``--ckpt-assume-constant-structure``).
2. A writer **thread** makes the **host copy** (``device.HostCopy``: every tensor to be
   written copied to private host memory: into pinned buffers on a side stream on GPUs,
   ordered after an event the loop recorded when the save started; a clone on CPU), then
   writes this rank's files from those copies and hashes them. The copy runs while the next
   forward and backward do, since they change no saved tensor in place: parameters and
   optimizer state change only in the optimizer step, and HiggsDDP's error-feedback residual
   of this step is read, not written, by the next one (the step after writes the other
   buffer). So the loop calls ``before_update`` before its next optimizer step (or before the
   memory manager moves state): the host waits until the copy is issued, and the device's
   next work waits on the copy's event, never on a device-wide synchronize. A
   thread, not megatron-core's forked process: a fork shares the training state
   copy-on-write, and every page the next steps update is then copied by a page fault, which
   on CPU cost the overlapped steps more than the whole synchronous save. The writer does no
   collective.
3. ``poll`` (after every step): one all-reduce says whether every rank's writer is done. When
   it is: megatron-core's finalization (``.metadata``; a write error on any rank is raised on
   every rank as ``CheckpointError``), then ``save.commit`` (rank map, rename, ``latest``).
4. ``close`` at the end of training waits for the save in flight and commits it.

A crash before step 3's commit leaves ``latest`` on the previous checkpoint, as for a
synchronous save.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller, AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from ..compat.checkpointing import async_save_options
from ..device import HostCopy, request_event
from .manifest import CheckpointError
from .outcome import first_line, same_outcome_everywhere
from .save import (PendingCheckpoint, SaveResult, begin, commit, common_files, hash_files,
                   megatron_writer_args, pending_checkpoint, thread_results_queue, write_buckets)
from .state import TrainingState, saved_state


class _ThreadCaller(AsyncCaller):
    """megatron-core's ``AsyncCaller`` contract (schedule; collective done-check), run by a
    thread of this process."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None

    def schedule_async_call(self, async_req) -> None:
        if async_req.async_fn is None:
            return
        self.thread = threading.Thread(target=self._copy_then_write, args=(async_req,),
                                       name="higgs-checkpoint-writer", daemon=True)
        self.thread.start()

    @staticmethod
    def _copy_then_write(async_req) -> None:
        args = list(async_req.async_fn_args)  # (rank, write buckets, results queue)
        if async_req.preload_fn:
            try:
                args[1] = async_req.preload_fn()  # the host copy
            except Exception as error:  # noqa: BLE001 - reported by megatron-core's finalization, on every rank
                args[-1].put(error)
                return
        async_req.async_fn(*args, **async_req.async_fn_kwargs)

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if blocking:
            self.close()
        alive = int(self.thread is not None and self.thread.is_alive())
        done = not alive if no_dist else self.sync_all_async_calls(alive)
        if done:
            self.close()
        return done

    def close(self, abort: bool = False) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def __del__(self) -> None:  # megatron-core's base raises here; the writer thread is a daemon
        pass


class _ThreadCallsQueue(AsyncCallsQueue):
    def _get_async_caller(self) -> AsyncCaller:
        return _ThreadCaller()


def _host_copies(write_buckets: list, live: set[int], requested, device: int | None) -> tuple[HostCopy, list]:
    """Issue the host copy of the write plan: every tensor that is still the training state's
    own memory (device tensors, and host tensors in ``live``; megatron-core already cloned the
    rest). Returns the copy in flight and a function giving the plan over the host copies."""
    tensors = [tensor for _, _, (_, tensor_data) in write_buckets for _, tensor in tensor_data
               if not tensor.is_cpu or tensor.data_ptr() in live]
    copy = HostCopy(tensors, requested=requested, device=device)

    def copied_plan() -> list:
        copies = iter(copy.host_ready())
        plan = []
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            tensor_data = [(item, next(copies) if not tensor.is_cpu or tensor.data_ptr() in live else tensor)
                           for item, tensor in tensor_data]
            plan.append((file_name, storage_key, (bytes_data, tensor_data)))
        return plan

    return copy, copied_plan


class AsyncCheckpointer:
    """See the module docstring."""

    def __init__(self) -> None:
        self.queue = _ThreadCallsQueue()
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1, cached_metadata=True)
        self.validated = False
        self.pending: PendingCheckpoint | None = None
        self._hashes: list | None = None
        self._committed: list[SaveResult] = []
        self._copied = threading.Event()
        self._copied.set()
        self._host_copy: HostCopy | None = None

    def start(self, training: TrainingState, save_dir: str | Path, keep_last: int | None = None) -> None:
        """Begin a save. The previous one must be finished first (``wait``): its commit is
        the caller's to report."""
        if self.pending is not None:
            raise RuntimeError("a checkpoint save is in flight: wait() for it before starting the next")
        snapshot = begin(pending_checkpoint(training, save_dir, keep_last))
        state, shards = saved_state(training)
        live = {v.data.data_ptr() for v in nested_values(state)
                if isinstance(v, ShardedBase) and isinstance(getattr(v, "data", None), torch.Tensor)}
        # A rank failing here alone would leave the others in megatron-core's planning collectives.
        with same_outcome_everywhere(f"checkpoint {snapshot.directory} not begun"), \
                thread_results_queue():  # this save's own: a failed save leaves nothing for the next
            request = dist_checkpointing.save(state, str(snapshot.directory), sharded_strategy=self.strategy,
                                              validate_access_integrity=not self.validated, async_sharded_save=True,
                                              **async_save_options())
        self.validated = True
        self._hashes = None
        if request.async_fn is not None:
            transform_list = megatron_writer_args(request)
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            request = request._replace(
                async_fn=partial(self._write_and_hash, transform_list),
                preload_fn=partial(self._copy_on_writer_thread, request.async_fn_args[1], live, request_event(),
                                   device))
            self._host_copy = None
            self._copied.clear()
        request.add_finalize_fn(partial(self._finalize, snapshot, shards))
        try:
            self.queue.schedule_async_request(request)
        except BaseException:
            self._copied.set()  # no copy will run: before_update must not wait for one
            raise
        self.pending = snapshot

    def _copy_on_writer_thread(self, write_buckets: list, live: set[int], requested, device: int | None) -> list:
        """The writer thread: issue the host copy (on a side stream, after ``requested``: the
        state as it was when the save started), let ``before_update`` order the next step after
        it, then wait for the bytes and hand megatron-core's writer the plan over them."""
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread; this rank's, not GPU 0
            self._host_copy, copied_plan = _host_copies(write_buckets, live, requested, device)
        finally:
            self._copied.set()
        return copied_plan()

    def before_update(self) -> None:
        """Order what comes next after the host copy of the save in flight: call before the
        optimizer step, or anything else that changes saved tensors in place. The host waits
        only until the writer thread has issued the copy; the device work that follows waits
        for the copy itself (an event, not a device-wide synchronize). At once when no save is
        in flight. On a CPU the copy is done when issued."""
        self._copied.wait()
        if self._host_copy is not None:
            self._host_copy.order_before()
            self._host_copy = None

    def _write_and_hash(self, transform_list, rank: int, buckets: list, results_queue) -> None:
        """The writer thread: megatron-core's per-file writer, then this rank's files' records
        (``save.write_buckets``)."""
        self._hashes = write_buckets(transform_list, buckets, results_queue)

    def _finalize(self, snapshot: PendingCheckpoint, shards: list) -> None:
        # The writer hashed the shard files; only rank 0's small common files are hashed here.
        common = hash_files(common_files(dist.get_rank(), snapshot.directory))
        self._committed.append(commit(snapshot, shards, (self._hashes or []) + common))

    def poll(self, blocking: bool = False) -> list[SaveResult]:
        """Finish the save if its writers are done on every rank (collective); what committed."""
        if self.pending is None:
            return []
        snapshot = self.pending
        try:
            self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointError:  # our commit's, already the same on every rank
            self.pending = None
            raise
        except (Exception, DcpCheckpointException) as exc:  # noqa: BLE001 - the same on every rank
            self.pending = None
            raise CheckpointError(f"checkpoint {snapshot.directory} not committed: {type(exc).__name__}: "
                                  f"{first_line(exc)}") from exc
        if self.queue.get_num_unfinalized_calls() == 0:
            self.pending = None
        done, self._committed = self._committed, []
        return done

    def wait(self) -> list[SaveResult]:
        return self.poll(blocking=True)

    def close(self) -> list[SaveResult]:
        done = self.wait()
        self.queue.close()
        return done
