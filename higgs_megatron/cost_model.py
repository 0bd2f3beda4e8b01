"""Which path a gradient bucket should take: dense, flat sparse, sharded or hierarchical.

Compression pays only where the link is slow relative to the cost of compressing
(Agarwal et al., MLSys 2022). The model predicts, per bucket and density, the seconds each
path keeps this rank busy, from costs measured once at start-up on the real groups
(``reduce.link_probe``) or assumed from a bandwidth given by the user:

* dense:        ``dense(B)``, Megatron's own all-reduce (reduce-scatter with the
                distributed optimizer) of the bucket's B bytes;
* sparse:       ``compress(N) + gather(P) + W decode(N)``: error feedback, top-k and packing
                over the bucket's N elements, the all-gather of a P-byte payload over the W
                ranks of the DP group, then every rank's payload decoded into the bucket;
* sharded:      ``compress(N) + all_to_all(W R) + decode(N) + gather(R) + compress(N / W)
                + decode(N) + dense(A)``: each rank's top-k of each of the W shards, rows of R
                bytes, to their owners, who decode W rows of N / W into their sum; the owners'
                top-k of their sums gathered back and decoded (not with the distributed
                optimizer, whose shard is the sum); the small parameters' A bytes all-reduced
                (priced as a dense step of that size);
* hierarchical: ``node_scatter(B) + compress(N / L) + cross_gather(P') + M decode(N / L)
                + node_gather(B / L)``: reduce-scatter inside the node of L ranks, top-k on
                this rank's slice, the slice's payload P' gathered across the M nodes and
                decoded, the slices gathered inside the node.

Decoding is priced because it grows with W on the all-gather: on a CPU, at a quarter of the
coordinates in int4, decoding one payload costs about what compressing it does, so two
ranks already decode twice what they compress. A dense step sent in int8 through a form
(``--higgs-dense-int8``) is priced with the costs of that payload, every coordinate in int8.

Each collective's cost is ``latency + bytes * seconds_per_byte`` with the bytes being
what one rank hands the collective (so ring factors are inside the measured slope). The
model adds the parts: it does not credit overlap with backward, which favours neither side
much (dense and sparse collectives both overlap; compression does not, on CPU, and it is
counted). Pure arithmetic: every rank holds the same agreed costs, so every rank picks the
same path, which the collectives require.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

PATHS = ("dense", "sparse", "sharded", "hierarchical")


@dataclass(frozen=True)
class CollectiveCost:
    """Seconds for one collective as a function of the bytes each rank hands it."""

    latency_s: float
    seconds_per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    @classmethod
    def fit(cls, sizes: tuple[int, int], seconds: tuple[float, float]) -> "CollectiveCost":
        """The line through two measurements (small, large), clamped to be non-negative."""
        (b0, b1), (t0, t1) = sizes, seconds
        slope = max(0.0, (t1 - t0) / (b1 - b0))
        return cls(latency_s=max(0.0, t0 - slope * b0), seconds_per_byte=slope)

    @property
    def gbps(self) -> float:
        """The slope as Gbit/s of bytes handed to the collective (inf for a free link)."""
        return math.inf if self.seconds_per_byte == 0 else 8e-9 / self.seconds_per_byte


@dataclass(frozen=True)
class CodecCost:
    """Seconds per bucket element to compress (error feedback, selection, packing) and to
    decode one payload (unpacking and adding it), measured at one density and payload."""

    compress_seconds_per_element: float
    decode_seconds_per_element: float = 0.0


@dataclass(frozen=True)
class LinkCosts:
    """The agreed costs of one data-parallel group (identical on all of its ranks)."""

    dense: CollectiveCost
    gather: CollectiveCost
    compress_seconds_per_element: float
    source: str  # "measured" or "assumed 1.0 Gbit/s"
    node_scatter: CollectiveCost | None = None  # with more than one node and rank per node
    cross_gather: CollectiveCost | None = None
    node_gather: CollectiveCost | None = None
    all_to_all: CollectiveCost | None = None  # over the whole group; None: the sharded form is not priced
    decode_seconds_per_element: float = 0.0  # one payload decoded, per element of what it covers
    dense_int8: CodecCost | None = None  # a dense step in int8 through a form (None: as the compressed steps)

    def codec(self, dense_int8: bool = False) -> CodecCost:
        """The compression and decoding costs of a compressed step, or of a dense int8 one."""
        if dense_int8 and self.dense_int8 is not None:
            return self.dense_int8
        return CodecCost(self.compress_seconds_per_element, self.decode_seconds_per_element)

    @classmethod
    def assumed(cls, gbps: float, dp_size: int, ranks_per_node: int, distributed_optimizer: bool,
                compress_seconds_per_element: float, node_gbps: float | None = None,
                hierarchy: bool | None = None, decode_seconds_per_element: float = 0.0,
                dense_int8: CodecCost | None = None) -> "LinkCosts":
        """Costs of ideal rings with no latency: links between nodes of ``gbps`` (the flat
        collectives over the whole group run at that pace), links inside a node of
        ``node_gbps`` (default ``gbps``). A dense all-reduce moves 2(n-1)/n of the bucket per
        rank (a reduce-scatter half of that), an all-gather (n-1) payloads. ``hierarchy``: price
        the two levels (default: when there are several nodes of several ranks)."""
        n, nodes = dp_size, dp_size // ranks_per_node

        def ring(factor: float, link_gbps: float) -> CollectiveCost:
            return CollectiveCost(0.0, factor * 8e-9 / link_gbps)

        node_gbps = node_gbps or gbps
        dense_factor = (n - 1) / n * (1 if distributed_optimizer else 2)
        hierarchical = nodes > 1 and ranks_per_node > 1 if hierarchy is None else hierarchy
        label = f"assumed {gbps:g} Gbit/s" + (f", {node_gbps:g} Gbit/s inside a node" if hierarchical else "")
        return cls(dense=ring(dense_factor, gbps), gather=ring(n - 1, gbps), all_to_all=ring((n - 1) / n, gbps),
                   compress_seconds_per_element=compress_seconds_per_element, source=label,
                   decode_seconds_per_element=decode_seconds_per_element, dense_int8=dense_int8,
                   node_scatter=ring((ranks_per_node - 1) / ranks_per_node, node_gbps) if hierarchical else None,
                   cross_gather=ring(nodes - 1, gbps) if hierarchical else None,
                   node_gather=ring(ranks_per_node - 1, node_gbps) if hierarchical else None)

    @property
    def has_hierarchy(self) -> bool:
        return self.node_scatter is not None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the start-up log."""
        names = {"dense": "dense", "gather": "all-gather", "all_to_all": "all-to-all",
                 "node_scatter": "node reduce-scatter",
                 "cross_gather": "cross-node all-gather", "node_gather": "node all-gather"}
        parts = [f"{label} {cost.gbps:.2f} Gbit/s + {cost.latency_s * 1e3:.2f} ms"
                 for name, label in names.items() if (cost := getattr(self, name)) is not None]
        return (f"{self.source}: " + ", ".join(parts)
                + f"; compression {self.compress_seconds_per_element * 1e9:.1f} ns/element, decoding "
                + f"{self.decode_seconds_per_element * 1e9:.1f} ns/element a payload")


@dataclass(frozen=True)
class BucketShape:
    """What the model needs to know of one bucket at one density."""

    bucket_bytes: int
    numel: int
    flat_payload_bytes: int | None = None  # None: the flat sparse path is not available
    slice_numel: int = 0
    slice_payload_bytes: int | None = None  # None: the hierarchical path is not available
    ranks_per_node: int = 1
    shard_row_bytes: int | None = None  # None: the sharded form is not available
    shards: int = 1  # the group's ranks: the sharded form's rows, the payloads an all-gather decodes
    gather_row_bytes: int = 0  # the owners' rows it gathers back (at the owners' density)
    always_bytes: int = 0  # its small parameters, all-reduced
    gather_rows: bool = True  # False with the distributed optimizer: the owner's sum is its shard
    nodes: int = 1  # the hierarchical form's payloads decoded: one per node (or optimizer instance)
    dense_int8: bool = False  # the payloads are a dense step's, every coordinate in int8


def predict(costs: LinkCosts, shape: BucketShape) -> dict[str, float]:
    """Predicted seconds of every path available to this bucket."""
    codec = costs.codec(shape.dense_int8)
    compress, decode = codec.compress_seconds_per_element, codec.decode_seconds_per_element
    predicted = {"dense": costs.dense.seconds(shape.bucket_bytes)}
    if shape.flat_payload_bytes is not None:
        predicted["sparse"] = (shape.numel * compress + costs.gather.seconds(shape.flat_payload_bytes)
                               + shape.shards * shape.numel * decode)
    if shape.shard_row_bytes is not None and costs.all_to_all is not None:
        owner = shape.numel / shape.shards  # the shard this rank owns
        predicted["sharded"] = (shape.numel * (compress + decode)
                                + costs.all_to_all.seconds(shape.shards * shape.shard_row_bytes)
                                + (costs.gather.seconds(shape.gather_row_bytes) + owner * compress
                                   + shape.numel * decode if shape.gather_rows else 0.0)
                                # an all-reduce: twice the dense probe where that is a reduce-scatter
                                + ((1 if shape.gather_rows else 2) * costs.dense.seconds(shape.always_bytes)
                                   if shape.always_bytes else 0.0))
    if costs.has_hierarchy and shape.slice_payload_bytes is not None:
        predicted["hierarchical"] = (costs.node_scatter.seconds(shape.bucket_bytes)
                                     + shape.slice_numel * (compress + shape.nodes * decode)
                                     + costs.cross_gather.seconds(shape.slice_payload_bytes)
                                     + costs.node_gather.seconds(shape.bucket_bytes / shape.ranks_per_node))
    return predicted


def cheapest(predicted: dict[str, float], allowed: tuple[str, ...] = PATHS) -> str:
    """The fastest allowed path; ties go to the earlier one in ``PATHS`` (dense first)."""
    return min((path for path in PATHS if path in predicted and path in allowed), key=lambda p: predicted[p])
