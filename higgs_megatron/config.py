"""HiggsConfig: what the compressed data-parallel sync does, from Python or from flags.

Each field carries its command-line flag in its metadata (name, help, choices), so the flags
are generated from the dataclass (``field_flags``): ``add_higgs_args(parser)`` adds them (``--use-higgs``,
``--higgs-compression-ratio``...) for our pretrain script and the Megatron-LM patches alike,
and ``higgs_config_from_args(args)`` builds the config back. ``HiggsConfig`` is validated on
construction: a ``ConfigError`` names the field, and from flags the field's flag.

User-facing names follow the seed: ``--higgs-compression-ratio`` is the kept fraction of each
bucket, which the code calls ``density`` (``compression_ratio`` is that density).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field

from .compat.versions import ALLOW_FLAG
from .compress.payload import PAYLOADS
from .reduce.param_gather import PARAM_PAYLOADS
from .field_flags import add_field_flags, field_flag, field_values
from .field_flags import flag_metadata as _flag
from .given_flags import flags_given
from .schedule import derived_schedule

COMPRESSORS = ("topk", "sampled-topk", "none")
PAYLOAD_CHOICES = (*PAYLOADS, "sign")  # sign: the agreed form's rows alone (compress.agreed)
SYNC_MODES = ("auto", "dense", "sparse", "agreed", "sharded", "hierarchical", "onebit")


class ConfigError(ValueError):
    """A HiggsConfig value out of range; ``field`` names the dataclass field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name

    def __reduce__(self):  # picklable, for errors that cross process boundaries
        return ConfigError, (self.field, str(self))


@dataclass
class HiggsConfig:
    compression_ratio: float = field(default=0.01, metadata=_flag(
        "--higgs-compression-ratio", "density in (0, 1]: fraction of each bucket sent per step (default: 0.25)",
        derived=True, type=float))
    """Density: the fraction of each bucket's coordinates sent per step, in (0, 1]."""

    compressor: str = field(default="topk", metadata=_flag(
        "--higgs-compressor", "topk: exact top-k; sampled-topk: a sampled threshold, then exact top-k among the "
        "candidates; none: dense, through the same path", choices=COMPRESSORS))
    """'topk' (exact), 'sampled-topk' (threshold from a sample, DGC-style), or 'none'
    (dense, through the same machinery: Megatron's own collective on every bucket)."""

    error_feedback: bool = field(default=True, metadata=_flag(
        "--no-higgs-error-feedback", "drop what is not sent instead of carrying it to the next step",
        action="store_false"))
    """Add what was not sent to the next step's gradient (keeps top-k converging)."""

    density_warmup_iters: int = field(default=0, metadata=_flag(
        "--higgs-density-warmup-iters", "go from dense to the target density over N iterations (after "
        "--higgs-dense-iters; default: a twentieth of --train-iters)", derived=True, type=int))
    """Go from dense to ``compression_ratio`` geometrically over N steps (after ``dense_iters``)."""

    dense_iters: int = field(default=0, metadata=_flag(
        "--higgs-dense-iters", "sync dense for the first N iterations, then compress (default: the learning-rate "
        "warm-up)", derived=True, type=int))
    """Sync dense for the first N steps (Megatron's own collective, or every coordinate in int8
    through the bucket's form with ``dense_int8``, the default with a blocked payload); compress
    after them. Error feedback delays gradient mass; a dense start lets the model and Adam's moments
    settle before the delays begin (1-bit Adam's warm-up stage)."""

    freeze_adam_variance: bool = field(default=False, metadata=_flag(
        "--higgs-freeze-adam-variance", "freeze Adam's second moment when the dense iterations end (1-bit Adam's "
        "remedy, for low densities such as 1%%)", action="store_true"))
    """With ``dense_iters``: freeze Adam's second moment as the dense stage ends, so that the
    update is linear in the gradient and error feedback's delayed bursts arrive in full
    (``frozen_variance``, 1-bit Adam's remedy). Worth it at low density, where a burst stands
    for many steps; at a density of a quarter Adam as it is did as well or better. Needs torch's AdamW."""

    payload: str = field(default="wide", metadata=_flag(
        "--higgs-payload", "wire format of the compressed payload: wide (int32 positions, the gradient's dtype), "
        "bf16 (positions as 16-bit block offsets or a bitmap, whichever is smaller; bf16 values), int8 (the same "
        "positions, int8 values with a scale per span of coordinates), int4 (as int8, 4-bit values), sign (every "
        "coordinate as one bit with a scale per 256, through the agreed form at density 1) (default: int4)",
        derived=True, choices=PAYLOAD_CHOICES))
    """The compressed payload's wire format (``compress.payload``): 'wide' sends int32 positions
    and values in the gradient's dtype; 'bf16' positions as 16-bit offsets within 64Ki-coordinate
    blocks or as a bitmap (whichever is smaller; none at density 1) and bf16 values; 'int8' the
    same positions and int8 values with one scale per span of coordinates; 'int4' as 'int8' with
    4-bit codes; 'sign' one bit a coordinate, a scale per 256 (the agreed form's rows only:
    every rank sends the same coordinates, so a sign needs no position). The rounding goes into
    the error-feedback residual."""

    param_payload: str = field(default="dense", metadata=_flag(
        "--higgs-param-payload", "with --use-distributed-optimizer: send the parameter all-gather as each shard's change "
        "since the last step in int8, int4 or sign (a bit a parameter, a scale per 256), the rounding carried into the "
        "next step's change (default: int4 with --higgs-sync onebit, else dense: Megatron's own)",
        derived=True, choices=PARAM_PAYLOADS))
    """With the distributed optimizer: the parameter all-gather sent as each owner's change of its
    shard, in this format (``reduce.param_gather``); 'dense' keeps Megatron's. The main parameters
    keep the exact values, and the model's trail them by one step's rounding at most."""

    variance_refresh_iters: int = field(default=0, metadata=_flag(
        "--higgs-variance-refresh-iters", "with a frozen second moment: sync dense and let Adam's second moment "
        "move for N iterations from 2, 4, 8... times --higgs-dense-iters (default: with --higgs-sync onebit, 20 or "
        "a quarter of the dense stage, whichever is fewer; else 0)", derived=True, type=int))
    """With ``freeze_adam_variance``: windows of N dense iterations in which Adam's second moment
    is updated as usual, starting at 2, 4, 8... times ``dense_iters`` (0/1 Adam's refresh
    points, doubling). A second moment frozen early, at the end of the learning-rate warm-up,
    holds the gradients' scale of then; as they shrink it makes every later step too short.
    With beta2 = 0.95 about 20 iterations replace most of it; the windows cost that many dense
    steps each, a number that grows with the log of the run's length."""

    dense_bf16: bool = field(default=False, metadata=_flag(
        "--higgs-dense-bf16", "send the dense steps of compressed buckets (the dense stage, a ramp's early steps) in "
        "bf16, the rounding kept in the error-feedback residual", action="store_true"))
    """Reduce a compressed bucket's dense steps in bf16 (``reduce.cast_reduce``): half the bytes
    of an fp32 gradient. The rounding goes into the error-feedback residual; buckets without a
    residual (small ones, compressor 'none') and several optimizer instances keep the gradient's dtype."""

    dense_int8: bool = field(default=False, metadata=_flag(
        "--higgs-dense-int8", "with --higgs-payload bf16, int8 or int4: send the dense steps of compressed buckets as every "
        "coordinate in int8 (a quarter of fp32's bytes per coordinate), the rounding kept in the error-feedback "
        "residual (default: on "
        "with a blocked payload and error feedback)", derived=True, action=argparse.BooleanOptionalAction))
    """With a blocked payload (bf16, int8, int4): a compressed bucket's dense steps (the dense stage, refresh windows,
    a ramp's early steps) go as the int8 payload at density 1, every coordinate in order with
    a scale per 2,048 coordinates, gathered and summed like the sparse payload: a quarter of an
    fp32 gradient's bytes, half of bf16's. The rounding goes into the residual. Buckets without a
    residual, a hierarchical slice and several optimizer instances keep their usual dense sync."""

    min_param_numel: int = field(default=1024, metadata=_flag(
        "--higgs-min-param-numel", "parameters smaller than this are sent in full", type=int))
    """Parameters smaller than this (biases, layer norms) are sent in full every step."""

    min_bucket_numel: int = field(default=16384, metadata=_flag(
        "--higgs-min-bucket-numel", "buckets smaller than this stay dense", type=int))
    """Buckets smaller than this stay dense (Megatron's own collective)."""

    sync: str = field(default="auto", metadata=_flag(
        "--higgs-sync", "(default: onebit where the run allows it, else auto) auto: per bucket, the path (dense, sparse, sharded or hierarchical) a cost model of the measured links "
        "predicts fastest; sparse: "
        "each rank's own top-k, all-gathered (wire bytes per rank grow with the DP size); agreed: every rank sends the "
        "same blocks, chosen from block scores summed over the ranks, summed by an all-to-all (wire bytes per rank do "
        "not grow with the DP size); sharded: each rank's own top-k of each shard to its owner by an all-to-all, "
        "the owners' top-k of their sums all-gathered (wire bytes per rank do not grow with the DP size); onebit: "
        "1-bit Adam, each rank's view of Adam's first moment, every coordinate as a sign, summed by the agreed "
        "exchange, after the dense stage, with Adam's second moment frozen",
        derived=True, choices=SYNC_MODES))
    """Per bucket: 'sparse' compresses, each rank its own top-k, all-gathered (``reduce.sparse_allreduce``:
    the bytes on each rank's link grow with the DP size); 'agreed' compresses, every rank the same
    blocks, summed by an all-to-all (``compress.agreed``: they do not); 'sharded' compresses, each
    rank its own top-k of each shard, sent to the shard's owner, which sums them and sends back
    the top-k of the sum (``compress.sharded``: they do not either); 'dense' never compresses;
    'hierarchical' reduces densely inside each node and compresses only across nodes; 'auto' takes
    whichever of dense, sparse, sharded and hierarchical ``cost_model`` predicts fastest, from link
    costs measured at start-up (the all-gather at two ranks, where they put the same wire bytes per rank on the link and it
    loses less loss; the sharded form beyond; not 'agreed', which at the same density has lost
    more loss than both). 'onebit' is 1-bit Adam's exchange (``first_moment``): after the dense
    stage each rank sends its own view of Adam's first moment, every coordinate as a sign with a
    scale per 256, through the agreed form at density 1, and the optimizer takes the sum as its
    first moment, its second moment frozen (``compression_ratio`` 1, ``payload`` 'sign'; 'wide'
    sends the moments in full, the exchange's full-precision oracle). Under
    every mode a step whose form would put no fewer bytes on the link than dense goes dense.
    ``--use-higgs`` takes 'onebit' where the run allows it, else 'auto' (``schedule.why_not_onebit``)."""

    sum_density_factor: float = field(default=1.0, metadata=_flag(
        "--higgs-sum-density-factor", "sharded form without the distributed optimizer: the shard's owner sends "
        "back this many times the density of its sum (at most every coordinate)", type=float))
    """The sharded form without the distributed optimizer: the owner selects ``min(1, factor x
    density)`` of its shard's sum for the all-gather. The sum holds the union of P ranks'
    selections, which grows with P; sending back only ``density`` of it loses more as P grows."""

    link_gbps: float | None = field(default=None, metadata=_flag(
        "--higgs-link-gbps", "with --higgs-sync auto: assume links of this many Gbit/s instead of measuring them",
        type=float))
    """Under 'auto': skip the start-up measurement of the links and assume ideal rings at
    this many Gbit/s (compression is still timed). For tests and what-if planning."""

    node_link_gbps: float | None = field(default=None, metadata=_flag(
        "--higgs-node-link-gbps", "with --higgs-link-gbps: the links inside a node (default: the same)", type=float))
    """With ``link_gbps``: the links inside a node, when the group spans nodes (default: the same)."""

    def __post_init__(self) -> None:
        if not (0.0 < self.compression_ratio <= 1.0) or math.isnan(self.compression_ratio):
            raise ConfigError("compression_ratio", f"compression_ratio must be in (0, 1], got {self.compression_ratio}")
        if self.compressor not in COMPRESSORS:
            raise ConfigError("compressor",
                              f"compressor must be one of {', '.join(COMPRESSORS)}; got {self.compressor!r}")
        if self.payload not in PAYLOAD_CHOICES:
            raise ConfigError("payload", f"payload must be one of {', '.join(PAYLOAD_CHOICES)}; got {self.payload!r}")
        if self.payload == "sign" and self.sync not in ("agreed", "onebit", "dense"):
            raise ConfigError("payload", "payload 'sign' sends the agreed form's rows (every rank the same "
                              f"coordinates, so no positions): it needs sync 'agreed' or 'onebit', got sync {self.sync!r}")
        if self.sync == "onebit":
            self._check_onebit()
        if self.param_payload not in PARAM_PAYLOADS:
            raise ConfigError("param_payload", f"param_payload must be one of {', '.join(PARAM_PAYLOADS)}; got "
                              f"{self.param_payload!r}")
        if self.sync not in SYNC_MODES:
            raise ConfigError("sync", f"sync must be one of {', '.join(SYNC_MODES)}; got {self.sync!r}")
        if not self.sum_density_factor >= 1.0 or math.isinf(self.sum_density_factor):
            raise ConfigError("sum_density_factor", f"sum_density_factor must be a finite number, 1 or more, got "
                              f"{self.sum_density_factor}")
        for name in ("link_gbps", "node_link_gbps"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(name, f"{name} must be a positive number of Gbit/s, got {value}")
        if self.node_link_gbps is not None and self.link_gbps is None:
            raise ConfigError("node_link_gbps", "node_link_gbps needs link_gbps (the links between nodes) too")
        if self.link_gbps is not None and self.sync != "auto":
            raise ConfigError("link_gbps", f"link_gbps is what sync='auto' plans with; sync is {self.sync!r}")
        for name in ("density_warmup_iters", "dense_iters", "variance_refresh_iters", "min_param_numel",
                     "min_bucket_numel"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("dense_bf16", "dense_int8"):
            if getattr(self, name) and (not self.error_feedback or self.compressor == "none"):
                raise ConfigError(name, f"{name} keeps its rounding in the error-feedback residual: it needs "
                                  "error feedback and a compressor other than 'none'")
        if self.dense_int8 and (self.payload == "wide" or self.dense_bf16):
            raise ConfigError("dense_int8", "dense_int8 sends dense steps as a payload with every coordinate, which "
                              f"the blocked payloads have: it needs payload bf16, int8 or int4 (got {self.payload!r}) "
                              "and not dense_bf16")
        if self.variance_refresh_iters and not self.freezes_variance:
            raise ConfigError("variance_refresh_iters", "variance_refresh_iters refreshes a frozen second moment: it "
                              "needs freeze_adam_variance")
        if self.variance_refresh_iters > self.dense_iters:
            raise ConfigError("variance_refresh_iters", f"variance_refresh_iters ({self.variance_refresh_iters}) must "
                              f"be at most dense_iters ({self.dense_iters}): each window ends before the next starts")
        if self.freezes_variance and self.dense_iters == 0:
            raise ConfigError("freeze_adam_variance", "freeze_adam_variance needs dense_iters > 0: the frozen second "
                              "moment is the one Adam learned in the dense stage")

    def _check_onebit(self) -> None:
        """1-bit Adam's exchange sends every coordinate as a sign, after a dense stage, through
        error feedback: the fields it fixes must say so (``for_run`` fills them)."""
        if self.compression_ratio != 1.0:
            raise ConfigError("compression_ratio", "sync 'onebit' sends every coordinate: compression_ratio must be "
                              f"1 (leave its flag out), got {self.compression_ratio}")
        if self.payload not in ("sign", "wide"):
            raise ConfigError("payload", "sync 'onebit' sends each coordinate as a sign (or, as the full-precision "
                              f"oracle, wide): payload must be 'sign' (leave its flag out), got {self.payload!r}")
        if not self.error_feedback or self.compressor == "none":
            raise ConfigError("sync", "sync 'onebit' keeps each sign's error in the error-feedback residual: it "
                              "needs error feedback and a compressor other than 'none'")
        if self.dense_iters == 0:
            raise ConfigError("dense_iters", "sync 'onebit' freezes the second moment Adam learned in the dense "
                              "stage: it needs dense_iters > 0")

    @property
    def freezes_variance(self) -> bool:
        """Whether Adam's second moment is frozen after the dense stage (``frozen_variance``):
        asked for, or 1-bit Adam's exchange, whose sums are a first moment Adam must not average again."""
        return self.freeze_adam_variance or self.sync == "onebit"

    @property
    def first_moment_exchange(self) -> bool:
        """Whether the sync's compressed steps exchange Adam's first moment (``first_moment``)."""
        return self.sync == "onebit"

    @classmethod
    def for_run(cls, train_iters: int, lr_warmup_iters: int, **given) -> "HiggsConfig":
        """What ``--use-higgs`` gives a run of ``train_iters`` iterations with ``lr_warmup_iters``
        of learning-rate warm-up (``schedule.derived_schedule``), ``given`` fields overriding:
        the same schedule for a loop of one's own as for the two pretrain scripts."""
        return cls(**derived_schedule(given, train_iters, lr_warmup_iters))

    def to_dict(self) -> dict:
        return asdict(self)


def add_higgs_args(parser: argparse.ArgumentParser, weight_hash_check: bool = True) -> argparse.ArgumentParser:
    """Add the flags, one per HiggsConfig field; ``weight_hash_check=False`` leaves out the
    replica hash check for a parser that defines it already (Megatron-LM's, with the same meaning)."""
    g = parser.add_argument_group("higgs: compressed data-parallel gradient sync")
    g.add_argument("--use-higgs", action="store_true",
                   help="replace Megatron's DP gradient reduction with top-k + error feedback")
    add_field_flags(g, HiggsConfig)
    g.add_argument(ALLOW_FLAG, action="store_true",
                   help="run on a megatron-core release higgs-megatron is not tested with (a warning says so; the "
                        "private symbols it relies on are checked all the same)")
    if weight_hash_check:
        g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                       help="every N iterations verify that all DP replicas hold identical parameters")
    return parser


def compression_flags_given(args: argparse.Namespace) -> list[str]:
    """``add_higgs_args``' flags given in ``args`` that only mean something with ``--use-higgs``."""
    return flags_given(args, add_higgs_args(argparse.ArgumentParser(), weight_hash_check=False),
                       skip=("use_higgs", "higgs_allow_untested_megatron"))


def flag_of(field_name: str) -> str:
    """The command-line flag of a HiggsConfig field."""
    return field_flag(HiggsConfig, field_name)


def higgs_config_from_args(args: argparse.Namespace, train_iters: int, lr_warmup_iters: int,
                           refused: str | None = None, fallback: str = "auto") -> HiggsConfig:
    """Build the config: the flags given, and for the schedule's flags not given the values the
    run derives (``schedule.derived_schedule``, from its length and learning-rate warm-up;
    ``refused``: why the run's other flags rule out 1-bit Adam's exchange, ``fallback`` the sync
    then); a ValueError names the offending flag."""
    try:
        return HiggsConfig(**derived_schedule(field_values(args, HiggsConfig), train_iters, lr_warmup_iters,
                                              refused, fallback))
    except ConfigError as error:
        raise ValueError(f"{flag_of(error.field)}: {error}") from None
