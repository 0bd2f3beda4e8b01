"""HiggsConfig: what the compressed data-parallel sync does, from Python or from flags.

``HiggsConfig`` is validated on construction (``ValueError`` naming the field and the
allowed range). ``add_higgs_args(parser)`` adds the same settings as command-line flags
(``--use-higgs``, ``--higgs-compression-ratio``...), and ``higgs_config_from_args(args)``
builds the config from the parsed flags, naming the flag when a value is out of range.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

from .given_flags import flags_given

COMPRESSORS = ("topk", "sampled-topk", "none")
SYNC_MODES = ("auto", "dense", "sparse", "hierarchical")


@dataclass
class HiggsConfig:
    compression_ratio: float = 0.01
    """Density: the fraction of each bucket's coordinates sent per step, in (0, 1]."""

    compressor: str = "topk"
    """'topk' (exact), 'sampled-topk' (threshold from a sample, DGC-style), or 'none'
    (dense, through the same machinery: Megatron's own collective on every bucket)."""

    error_feedback: bool = True
    """Add what was not sent to the next step's gradient (keeps top-k converging)."""

    density_warmup_iters: int = 0
    """Go from dense to ``compression_ratio`` geometrically over N steps (after ``dense_iters``)."""

    dense_iters: int = 0
    """Sync dense, through Megatron's own collective, for the first N steps; compress after
    them. Error feedback delays gradient mass; a dense start lets the model and Adam's moments
    settle before the delays begin (1-bit Adam's warm-up stage)."""

    freeze_adam_variance: bool = False
    """With ``dense_iters``: freeze Adam's second moment as the dense stage ends, so that the
    update is linear in the gradient and error feedback's delayed bursts arrive in full
    (``frozen_variance``, 1-bit Adam's remedy). Needs torch's AdamW."""

    min_param_numel: int = 1024
    """Parameters smaller than this (biases, layer norms) are sent in full every step."""

    min_bucket_numel: int = 16384
    """Buckets smaller than this stay dense (Megatron's own collective)."""

    sync: str = "auto"
    """Per bucket: 'sparse' always compresses; 'dense' never; 'hierarchical' reduces densely
    inside each node and compresses only across nodes (``reduce.hierarchical``); 'auto' takes
    whichever of dense, sparse and hierarchical ``cost_model`` predicts fastest, from link
    costs measured at start-up."""

    link_gbps: float | None = None
    """Under 'auto': skip the start-up measurement of the links and assume ideal rings at
    this many Gbit/s (compression is still timed). For tests and what-if planning."""

    node_link_gbps: float | None = None
    """With ``link_gbps``: the links inside a node, when the group spans nodes (default: the same)."""

    def __post_init__(self) -> None:
        if not (0.0 < self.compression_ratio <= 1.0) or math.isnan(self.compression_ratio):
            raise ValueError(f"compression_ratio must be in (0, 1], got {self.compression_ratio}")
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)}; got {self.compressor!r}")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {', '.join(SYNC_MODES)}; got {self.sync!r}")
        for name in ("link_gbps", "node_link_gbps"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of Gbit/s, got {value}")
        if self.node_link_gbps is not None and self.link_gbps is None:
            raise ValueError("node_link_gbps needs link_gbps (the links between nodes) too")
        if self.link_gbps is not None and self.sync != "auto":
            raise ValueError(f"link_gbps is what sync='auto' plans with; sync is {self.sync!r}")
        for name in ("density_warmup_iters", "dense_iters", "min_param_numel", "min_bucket_numel"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.freeze_adam_variance and self.dense_iters == 0:
            raise ValueError("freeze_adam_variance needs dense_iters > 0: the frozen second moment is "
                             "the one Adam learned in the dense stage")

    def dense_stage(self, step: int) -> bool:
        """Whether ``step`` (0-based) is in the dense stage (``dense_iters``)."""
        return step < self.dense_iters

    def density(self, step: int) -> float:
        """The density in force at ``step`` (0-based): 1 in the dense stage, then from 1 to the
        target over the warm-up."""
        if self.dense_stage(step):
            return 1.0
        step -= self.dense_iters
        if step >= self.density_warmup_iters:
            return self.compression_ratio
        return self.compression_ratio ** (step / self.density_warmup_iters)

    def to_dict(self) -> dict:
        return asdict(self)


_FLAG_OF_FIELD = {
    "compression_ratio": "--higgs-compression-ratio",
    "compressor": "--higgs-compressor",
    "density_warmup_iters": "--higgs-density-warmup-iters",
    "dense_iters": "--higgs-dense-iters",
    "freeze_adam_variance": "--higgs-freeze-adam-variance",
    "min_param_numel": "--higgs-min-param-numel",
    "min_bucket_numel": "--higgs-min-bucket-numel",
    "sync": "--higgs-sync",
    "link_gbps": "--higgs-link-gbps",
    "node_link_gbps": "--higgs-node-link-gbps",
}


def add_higgs_args(parser: argparse.ArgumentParser, weight_hash_check: bool = True) -> argparse.ArgumentParser:
    """Add the flags; ``weight_hash_check=False`` leaves out the replica hash check for a parser
    that defines it already (Megatron-LM's, with the same meaning)."""
    defaults = HiggsConfig()
    g = parser.add_argument_group("higgs: compressed data-parallel gradient sync")
    g.add_argument("--use-higgs", action="store_true",
                   help="replace Megatron's DP gradient reduction with top-k + error feedback")
    g.add_argument("--higgs-compression-ratio", type=float, default=defaults.compression_ratio,
                   help="density in (0, 1]: fraction of each bucket sent per step")
    g.add_argument("--higgs-compressor", choices=COMPRESSORS, default=defaults.compressor)
    g.add_argument("--no-higgs-error-feedback", dest="higgs_error_feedback", action="store_false",
                   help="drop what is not sent instead of carrying it to the next step")
    g.add_argument("--higgs-density-warmup-iters", type=int, default=defaults.density_warmup_iters,
                   help="go from dense to the target density over N iterations (after --higgs-dense-iters)")
    g.add_argument("--higgs-dense-iters", type=int, default=defaults.dense_iters,
                   help="sync dense for the first N iterations, then compress")
    g.add_argument("--higgs-freeze-adam-variance", action="store_true",
                   help="freeze Adam's second moment when the dense iterations end (1-bit Adam's remedy)")
    g.add_argument("--higgs-min-param-numel", type=int, default=defaults.min_param_numel,
                   help="parameters smaller than this are sent in full")
    g.add_argument("--higgs-min-bucket-numel", type=int, default=defaults.min_bucket_numel,
                   help="buckets smaller than this stay dense")
    g.add_argument("--higgs-sync", choices=SYNC_MODES, default=defaults.sync,
                   help="auto: per bucket, the path a cost model of the measured links predicts fastest")
    g.add_argument("--higgs-link-gbps", type=float, default=defaults.link_gbps,
                   help="with --higgs-sync auto: assume links of this many Gbit/s instead of measuring them")
    g.add_argument("--higgs-node-link-gbps", type=float, default=defaults.node_link_gbps,
                   help="with --higgs-link-gbps: the links inside a node (default: the same)")
    if weight_hash_check:
        g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                       help="every N iterations verify that all DP replicas hold identical parameters")
    return parser


def compression_flags_given(args: argparse.Namespace) -> list[str]:
    """``add_higgs_args``' flags given in ``args`` that only mean something with ``--use-higgs``."""
    return flags_given(args, add_higgs_args(argparse.ArgumentParser(), weight_hash_check=False), skip=("use_higgs",))


def higgs_config_from_args(args: argparse.Namespace) -> HiggsConfig:
    """Build the config; a ValueError names the offending flag."""
    values = dict(
        compression_ratio=args.higgs_compression_ratio,
        compressor=args.higgs_compressor,
        error_feedback=args.higgs_error_feedback,
        density_warmup_iters=args.higgs_density_warmup_iters,
        dense_iters=args.higgs_dense_iters,
        freeze_adam_variance=args.higgs_freeze_adam_variance,
        min_param_numel=args.higgs_min_param_numel,
        min_bucket_numel=args.higgs_min_bucket_numel,
        sync=args.higgs_sync,
        link_gbps=args.higgs_link_gbps,
        node_link_gbps=args.higgs_node_link_gbps,
    )
    try:
        return HiggsConfig(**values)
    except ValueError as error:
        field = str(error).split(" ", 1)[0]
        raise ValueError(f"{_FLAG_OF_FIELD.get(field, field)}: {error}") from None
