"""The host-synchronisation audit on its own: each kind it must see, named with its call site."""

import torch

from tests.workers.host_sync_audit import HostSyncAudit


def test_the_audit_names_each_kind_of_host_sync_and_its_call_site():
    import tests.workers.host_sync_samples as samples

    with HostSyncAudit(package="tests") as audit:
        samples.every_kind(torch.arange(6.0))
        with audit.pause():
            samples.every_kind(torch.arange(6.0))
    kinds = {site.rsplit(": ", 1)[1] for site in audit.calls}
    assert kinds == {"Tensor.item", "Tensor.__bool__", "Tensor.tolist", "Tensor.cpu", "torch.nonzero",
                     "Tensor.__getitem__", "Tensor.to", "torch.unique", "torch.cuda.synchronize"}, kinds
    assert all(site.startswith("tests/workers/host_sync_samples.py:") and " every_kind: " in site for site in audit.calls)
    assert audit.total == 9  # the paused call counted nothing

    with HostSyncAudit(package="higgs_megatron") as other:
        samples.every_kind(torch.arange(6.0))
    assert other.total == 0  # another package's calls are not charged to this one
