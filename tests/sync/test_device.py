"""Device bugs caught without a GPU.

Two stand-ins for a device that is not the host, both raising as a GPU would when a host
tensor meets a device tensor, and on any read of a device value (``.item()``, ``bool``), so
these paths are checked for host synchronisations too:

* torch's ``FakeTensorMode`` holds tensors on a fake ``cuda`` device on a CPU-only build
  (the vote, the checkpoint's host copy, the offload tier: code that asks whether a tensor
  is on CUDA);
* the ``meta`` device, for the data path, the compressor and the sparse reduction: on a
  CPU-only build the fake CUDA device refuses ``copy_`` and Python indexing between its own
  tensors (module initialisation included), which those paths are made of.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from higgs_megatron import cpu as cpu_scope
from higgs_megatron.compress.compressor import (
    BucketPlan, ParamSlot, ResidualBuffer, SampledTopK, TopK, compress_with_feedback)
from higgs_megatron.reduce.sparse_allreduce import PendingSparseReduce

CUDA = torch.device("cuda", 0)


@contextlib.contextmanager
def fake_cuda():
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


def _cpu_batch(rows: int = 2, length: int = 8) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 32, (rows, length + 1))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(rows, length),
            "position_ids": torch.arange(length).expand(rows, length),
            "attention_mask": torch.ones(rows, 1, length, length, dtype=torch.bool)}


class _TinyLM(torch.nn.Module):
    """GPTModel's call signature; every input takes part in the arithmetic."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 4, device=device)
        self.position = torch.nn.Embedding(8, 4, device=device)
        self.head = torch.nn.Linear(4, 32, device=device)

    def forward(self, tokens, position_ids, attention_mask, labels=None):
        hidden = self.embedding(tokens) + self.position(position_ids)
        hidden = hidden * attention_mask[:, 0, :, :1].to(hidden.dtype)
        logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def test_the_training_step_moves_host_batches_to_the_models_device():
    from higgs_megatron.training.loop import forward_step

    meta = torch.device("meta")
    model = _TinyLM(meta)
    output, loss_fn = forward_step(iter([_cpu_batch()]), model)
    loss, tokens, _ = loss_fn(output)
    assert output.device == meta and loss.device == meta and tokens.device == meta


# Densities: 16-bit offsets (1%), a bitmap (20%), every coordinate without positions (1.0).
@pytest.mark.parametrize("payload,density", [("wide", 0.01), ("bf16", 0.01), ("int8", 0.01), ("bf16", 0.2),
                                             ("int8", 0.2), ("int4", 0.2), ("int8", 1.0), ("int4", 1.0)])
@pytest.mark.parametrize("selector", [TopK(), SampledTopK(seed=0)], ids=["topk", "sampled-topk"])
def test_the_compressor_and_the_sparse_reduction_stay_on_the_gradients_device(selector, payload, density):
    n, meta = 140_000, torch.device("meta")
    acc = torch.randn(n, device=meta)
    plan = BucketPlan(n, [ParamSlot(0, 100), ParamSlot(100, 30_000), ParamSlot(30_000, n)],
                      min_param_numel=1024, device=meta, payload=payload)
    residual = ResidualBuffer(n, acc.dtype, meta)
    for _ in range(2):  # the second step adds the first step's residual
        sparse = compress_with_feedback(acc, plan, density, selector, residual, key="bucket")
    assert {sparse.values.device, residual.current.device} == {meta}
    assert sparse.positions is None if density == 1.0 else sparse.positions.device == meta
    payload = plan.payload.pack(sparse, plan.layout(density))
    assert payload.device == meta
    target = torch.empty(n, device=meta)
    PendingSparseReduce(work=None, gathered=torch.cat([payload, payload]), world=2, payload=plan.payload,
                        layout=plan.layout(density), target=target).finish()
    assert target.device == meta


def _chunk_with_flag(flag: torch.Tensor):
    """A HiggsDDP holding only what the optimizer wrapper's vote reads."""
    from higgs_megatron.config import HiggsConfig
    from higgs_megatron.ddp import HiggsDDP
    from higgs_megatron.reduce.wire import StepWaits

    chunk = object.__new__(HiggsDDP)
    grad = torch.zeros(8, device=flag.device)
    chunk.__dict__.update(_higgs=SimpleNamespace(check_nonfinite=False, waits=StepWaits(), ledger=None),
                          higgs_config=HiggsConfig(),
                          bucket_groups=[SimpleNamespace(higgs_nonfinite=flag,
                                                         buckets=[SimpleNamespace(grad_data=grad)])],
                          expert_parallel_bucket_groups=[])
    return chunk


def test_the_optimizer_wrappers_vote_runs_on_the_gradients_device(monkeypatch):
    import torch.distributed as dist

    from higgs_megatron.optimizer import HiggsOptimizer

    reduced = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        reduced.append(tensor.device)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with fake_cuda():
        optimizer = HiggsOptimizer(SimpleNamespace(), [_chunk_with_flag(torch.zeros((), dtype=torch.bool,
                                                                                   device=CUDA))])
        # The fake device cannot say what the flag holds: the one read of the decision raises,
        # which is the point: it is the only read, and it comes after the collective.
        with pytest.raises(Exception, match="aten._local_scalar_dense"):
            optimizer._decide()
    assert reduced == [CUDA]


class _RecordingStream(cpu_scope._Stream):
    waited: list

    def __init__(self, *args, **kwargs) -> None:
        self.waited = []

    def wait_event(self, event) -> None:
        self.waited.append(event)


def _stand_in_streams(monkeypatch) -> _RecordingStream:
    """CUDA streams and events for a CPU-only build (the fake device has no runtime behind it);
    returns the caller's "current stream", which records what it is told to wait on."""
    current = _RecordingStream()
    monkeypatch.setattr(torch.cuda, "Stream", _RecordingStream)
    monkeypatch.setattr(torch.cuda, "Event", cpu_scope._Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: current)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a device-wide synchronize"))
    return current


def test_the_async_checkpoint_copies_device_state_to_host_memory_ordered_by_an_event(monkeypatch):
    from higgs_megatron.checkpoint.async_save import _host_copies
    from higgs_megatron.device import request_event

    host_live, host_copied = torch.randn(5), torch.randn(6)  # real host tensors: fake ones share one data_ptr
    with fake_cuda():
        current = _stand_in_streams(monkeypatch)
        weight, moment = torch.randn(4, 3, device=CUDA), torch.randn(12, device=CUDA)
        plan = [("__0_0.distcp", "key", ([], [("w", weight), ("m", moment), ("live", host_live),
                                              ("cloned", host_copied)]))]
        requested = request_event()
        copy, copied_plan = _host_copies(plan, {host_live.data_ptr()}, requested, device=None)
        assert copy.stream.waited == [requested]  # the side stream reads the state as it was at the request
        copy.order_before()
        assert current.waited == [copy.done]  # the next step waits on the copy's event, on the device
        written = dict(copied_plan()[0][2][1])
        assert {t.device.type for t in written.values()} == {"cpu"}
        assert written["w"].shape == weight.shape and written["m"].shape == moment.shape
        assert written["live"] is not host_live  # the training state's own host memory is copied
        assert written["cloned"] is host_copied  # megatron-core's own clone is not copied again


def test_the_offload_tier_moves_device_state_to_host_memory_and_back(monkeypatch):
    from higgs_megatron.memory.tiers import HostTier

    copies = []
    original_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        copies.append((self.device.type, src.device.type, non_blocking))
        return original_copy(self, src, non_blocking)

    with fake_cuda():
        tier = HostTier(pin_memory=True)
        tier.pin_memory = True  # as on a GPU machine; the fake device has no pinned allocator
        state = torch.randn(64, 8, device=CUDA)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch, "empty", _unpinned(torch.empty))
        away = tier.send("unit.t0", state)
        monkeypatch.undo()
        assert copies == [("cpu", "cuda", True)]  # a device-to-host copy the host does not wait for
        assert away.host.device.type == "cpu" and state.device == CUDA and state.numel() == 0
        tier.bring(away, state)
        assert state.device == CUDA and state.shape == (64, 8)


def _unpinned(empty):
    """``torch.empty`` that accepts ``pin_memory=True`` on a CPU-only build (and ignores it)."""
    def call(*args, pin_memory=False, **kwargs):
        return empty(*args, **kwargs)
    return call
