"""The CPU scope: active only inside, undone on exit, refused where CUDA is present."""

import pytest
import torch

from higgs_megatron.cpu import CpuMegatronError, cpu_megatron, is_active


def test_cuda_requests_land_on_cpu_inside_and_nowhere_else():
    original_current_device = torch.cuda.current_device
    with cpu_megatron():
        assert is_active()
        x = torch.zeros(3, device="cuda")
        y = torch.ones(2, device=torch.cuda.current_device())
        assert x.device.type == "cpu" and y.device.type == "cpu"
        assert x.cuda() is x
        assert x.to("cuda").device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"  # Megatron's optimizers check this string
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
    assert not is_active()
    assert torch.cuda.current_device is original_current_device
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_nested_scopes_restore_only_at_the_outermost_exit():
    original = torch.cuda.synchronize
    with cpu_megatron():
        with cpu_megatron():
            pass
        assert is_active() and torch.cuda.synchronize is not original
    assert torch.cuda.synchronize is original


def test_device_rng_is_the_cpu_generator_and_tracker_forks_distinct_streams():
    from megatron.core.tensor_parallel import random as mp_random

    with cpu_megatron():
        torch.cuda.manual_seed(7)
        a = torch.rand(4)
        torch.cuda.manual_seed(7)
        assert torch.equal(torch.rand(4), a)
        tracker = mp_random.CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 1234)
        before = torch.get_rng_state()
        with tracker.fork("model-parallel-rng"):
            inside = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), before), "fork restores the outer stream"
        torch.manual_seed(1234)
        assert torch.equal(torch.rand(4), inside), "the forked stream is the tracker's seed"


def test_refused_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(CpuMegatronError, match="CUDA is available"):
        with cpu_megatron():
            pass
    assert not is_active()
