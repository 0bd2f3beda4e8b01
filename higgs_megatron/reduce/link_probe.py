"""Measuring, once at start-up, what the cost model needs: collectives on the real groups and
the time to compress and to decode.

Protocol (collective over the data-parallel group; every rank calls it with the same
arguments): for each collective the sparse or dense paths would use, a barrier on its group
then the collective, timed, at two sizes (``SMALL`` and ``LARGE`` bytes per rank), one
warm-up and the median of ``REPEATS``. Compression and decoding are timed locally on the
largest bucket's plan, twice: at the run's density and payload, and as a dense step in int8
(``--higgs-dense-int8``). On CUDA each timing ends with a device synchronize (a collective
returns once queued, not once done): this runs once at construction, never in a step. All
timings are then all-reduced with MAX over the data-parallel group, so every rank fits the
same lines and the cost model makes the same choice everywhere (the slowest rank sets the
pace of a collective anyway); the group's first rank then keeps the timings recorded for the
same setting while these are within a factor of them (``reduce.link_record``), so the same
command decides the same way, and broadcasts what it decides by. The probe moves a few tens of MB at most and takes well under
a second on a 10 Gbit/s link, about two on 1 Gbit/s.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..compress.compressor import BucketPlan, ResidualBuffer, make_selector, pack_with_feedback
from ..compress.payload import DENSE_INT8, Packed, Payload
from ..cost_model import CodecCost, CollectiveCost, LinkCosts
from ..topology import NodeGroups
from . import link_record

SMALL = 16 * 1024
LARGE = 4 * 1024 * 1024
REPEATS = 3


def _finished(device: torch.device) -> None:
    """Wait for the device: on CUDA a collective (and a kernel) returns once queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(run: Callable[[], None], device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The median of ``REPEATS`` runs after a warm-up (connections, buffers); with ``group``,
    each after a barrier on it."""
    run()
    _finished(device)
    times = []
    for _ in range(REPEATS):
        if group is not None:
            dist.barrier(group=group)
        _finished(device)
        started = time.perf_counter()
        run()
        _finished(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _collective(kind: str, nbytes: int, group: dist.ProcessGroup, device: torch.device) -> Callable[[], None]:
    n = dist.get_world_size(group)
    numel = max(n, nbytes // 4 // n * n)
    if kind == "all_reduce":
        buffer = torch.zeros(numel, device=device)
        return lambda: dist.all_reduce(buffer, group=group)
    if kind == "reduce_scatter":  # the whole buffer handed in, one 1/n piece out
        buffer = torch.zeros(numel, device=device)
        out = torch.empty(numel // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, buffer, group=group)
    if kind == "all_gather":  # nbytes is what each rank contributes
        piece = torch.zeros(numel, device=device)
        out = torch.empty(numel * n, device=device)
        return lambda: dist.all_gather_into_tensor(out, piece, group=group)
    if kind == "all_to_all":  # the whole buffer handed in, 1/n of it to each rank
        buffer = torch.zeros(numel, device=device)
        out = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, buffer, group=group)
    raise ValueError(kind)


def _codec_seconds_per_element(plan: BucketPlan | None, density: float, compressor: str, error_feedback: bool,
                               device: torch.device, payload: Payload | None = None) -> tuple[float, float]:
    """(compress, decode) per element of the largest bucket's plan: error feedback, selection
    and packing of its payload at ``density`` (in ``payload``'s format, else the plan's); then
    one payload unpacked and added into the bucket, as each peer's is on the all-gather."""
    if plan is None or compressor == "none":
        return 0.0, 0.0
    selector = make_selector(compressor, seed=0)  # a fresh one: the real selectors' state is untouched
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(plan.numel, generator=generator).to(device)  # at start-up, not in a step
    residual = ResidualBuffer(plan.numel, grad.dtype, device) if error_feedback else None
    payload, layout = payload or plan.payload, plan.layout(density)
    target = torch.zeros_like(grad)
    packed: list[Packed] = []

    def compress() -> None:
        packed[:] = [pack_with_feedback(grad, plan, density, selector, residual, key="link_probe", payload=payload)]

    def decode() -> None:
        payload.add_to(target, packed[0].buffer, layout)

    return tuple(_timed(run, device) / plan.numel for run in (compress, decode))


def _setting(dp_group: dist.ProcessGroup, distributed_optimizer: bool, hierarchy: bool,
             largest_plan: BucketPlan | None, density: float, compressor: str, error_feedback: bool,
             device: torch.device, assume_gbps: float | None, assume_node_gbps: float | None) -> dict:
    """What the timings depend on (``reduce.link_record``): the group's hosts and size, the
    device, the largest bucket's plan and what the probe was told."""
    hosts: list[str] = [""] * dist.get_world_size(dp_group)
    dist.all_gather_object(hosts, socket.gethostname(), group=dp_group)  # at start-up, not in a step
    return {"hosts": sorted(hosts), "world": len(hosts), "device": str(device.type), "torch": torch.__version__,
            "distributed_optimizer": distributed_optimizer, "hierarchy": hierarchy,
            "largest_bucket": None if largest_plan is None else [largest_plan.numel, largest_plan.payload.name],
            "density": density, "compressor": compressor, "error_feedback": error_feedback,
            "assume_gbps": assume_gbps, "assume_node_gbps": assume_node_gbps}


def measure_link_costs(dp_group: dist.ProcessGroup, nodes: NodeGroups | None, distributed_optimizer: bool,
                       largest_plan: BucketPlan | None, density: float, compressor: str, error_feedback: bool,
                       device: torch.device, assume_gbps: float | None = None,
                       assume_node_gbps: float | None = None) -> LinkCosts:
    """The agreed ``LinkCosts`` of ``dp_group`` (see the module docstring).

    With ``assume_gbps`` the collectives are not run: ideal rings at that bandwidth (and
    ``assume_node_gbps`` inside a node) are assumed (``LinkCosts.assumed``); compression is
    still timed.
    """
    probes: list[tuple[str, str, dist.ProcessGroup]] = []
    # Optimizer instances are two levels even with one rank each (the instance's collectives then move nothing).
    hierarchy = nodes is not None and nodes.nodes > 1 and (nodes.ranks_per_node > 1 or nodes.instances)
    if assume_gbps is None:
        probes = [("dense", "reduce_scatter" if distributed_optimizer else "all_reduce", dp_group),
                  ("gather", "all_gather", dp_group), ("all_to_all", "all_to_all", dp_group)]
        if hierarchy:
            probes += [("node_scatter", "reduce_scatter", nodes.intra), ("cross_gather", "all_gather", nodes.inter),
                       ("node_gather", "all_gather", nodes.intra)]
    timings = [_timed(_collective(kind, size, group, device), device, group)
               for _, kind, group in probes for size in (SMALL, LARGE)]
    timings += _codec_seconds_per_element(largest_plan, density, compressor, error_feedback, device)
    # a dense int8 step goes through a form whose layout carries int8's scales: a blocked payload's
    int8 = largest_plan is not None and largest_plan.payload.blocked
    timings += (_codec_seconds_per_element(largest_plan, 1.0, compressor, error_feedback, device, DENSE_INT8)
                if int8 else (0.0, 0.0))
    agreed = torch.tensor(timings, dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=dp_group)
    names = [f"{name}@{size}" for name, _, _ in probes for size in (SMALL, LARGE)]
    names += ["compress", "decode", "int8 compress", "int8 decode"]
    setting = _setting(dp_group, distributed_optimizer, hierarchy, largest_plan, density, compressor, error_feedback,
                       device, assume_gbps, assume_node_gbps)
    # At start-up (the probe runs once, at construction): the first rank reads the timings and the
    # record for this setting, while this run's are near it, and every rank decides by what it sends.
    if dist.get_rank(dp_group) == 0:
        checked = [not name.endswith(f"@{SMALL}") for name in names]
        agreed.copy_(torch.tensor(link_record.decide(agreed.tolist(), names, setting, checked), dtype=torch.float64))
    dist.broadcast(agreed, src=dist.get_global_rank(dp_group, 0), group=dp_group)
    values = agreed.tolist()
    compress, decode, int8_compress, int8_decode = values[-4:]
    codecs = dict(compress_seconds_per_element=compress, decode_seconds_per_element=decode,
                  dense_int8=CodecCost(int8_compress, int8_decode) if int8 else None)
    if assume_gbps is not None:
        dp_size = dist.get_world_size(dp_group)
        return LinkCosts.assumed(assume_gbps, dp_size, nodes.ranks_per_node if hierarchy else dp_size,
                                 distributed_optimizer, node_gbps=assume_node_gbps, hierarchy=hierarchy, **codecs)
    fitted = {name: CollectiveCost.fit((SMALL, LARGE), (values[2 * i], values[2 * i + 1]))
              for i, (name, _, _) in enumerate(probes)}
    return LinkCosts(source="measured", **codecs, **fitted)
