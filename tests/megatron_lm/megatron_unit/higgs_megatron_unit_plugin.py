"""A pytest plugin that runs Megatron-LM's own distributed unit tests with HiggsDDP.

Loaded with ``-p higgs_megatron_unit_plugin`` (this folder on ``PYTHONPATH``, the checkout in
``MEGATRON_LM_PATH``, higgs_megatron installed) in every rank of a
torchrun job that runs a copy of one of Megatron-LM's test files (``tests/megatron_lm/drill_megatron_unit.py``
copies it out of the checkout, so that the checkout's conftest, which fetches data sets, stays
out). It:

* runs the session inside ``cpu_megatron()`` on a machine without CUDA, over gloo: Megatron's
  ``Utils.initialize_distributed`` asks for NCCL and a device;
* gives the test module ``HiggsDDP`` with ``HiggsConfig(compressor="none")`` where it names
  megatron-core's ``DistributedDataParallel``: compression off, our bucket groups, the test's
  own assertions.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # The checkout's tests/ package, after the installed packages: megatron.core stays the pinned one.
    sys.path.append(os.environ["MEGATRON_LM_PATH"])
    from tests.unit_tests.test_utilities import Utils

    if not torch.cuda.is_available():
        from higgs_megatron.cpu import cpu_megatron

        config._higgs_cpu_scope = cpu_megatron()
        config._higgs_cpu_scope.__enter__()

        def initialize_distributed() -> None:
            if not torch.distributed.is_initialized():
                torch.distributed.init_process_group("gloo")  # env:// as torchrun sets it
            Utils.inited = True

        Utils.initialize_distributed = staticmethod(initialize_distributed)


def pytest_unconfigure(config: pytest.Config) -> None:
    scope = getattr(config, "_higgs_cpu_scope", None)
    if scope is not None:
        scope.__exit__(None, None, None)


_BUILT: list[str] = []


@pytest.fixture(autouse=True)
def _higgs_ddp(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    from higgs_megatron import HiggsConfig, HiggsDDP

    def build(*args, **kwargs) -> HiggsDDP:
        model = HiggsDDP(*args, higgs_config=HiggsConfig(compressor="none"), **kwargs)
        _BUILT.append(type(model.bucket_groups[0]).__name__)
        return model

    if hasattr(request.module, "DistributedDataParallel"):
        monkeypatch.setattr(request.module, "DistributedDataParallel", build)


def pytest_terminal_summary(terminalreporter) -> None:
    """What the test asserts: the models were ours."""
    terminalreporter.write_line(f"higgs plugin: {len(_BUILT)} models built, bucket groups {sorted(set(_BUILT))}")
