"""One bucket's gradient -> the fixed-size sparse payload it sends: which coordinates, and error feedback.

The plan (``BucketPlan``): how many coordinates each bucket sends, and from which parameters.
A Megatron gradient bucket is a flat tensor holding several parameters. Its plan splits it:

* ``always``: parameters smaller than ``min_param_numel`` (biases, layer norms) send every
  coordinate every step, as values only: their positions are in every peer's plan (DGC
  keeps such layers dense too);
* every other parameter is its own selection unit and sends ``ceil(density * numel)`` of its
  coordinates (layer-wise top-k, as in DGC). Selecting per parameter keeps every layer
  moving (a bucket-wide top-k starves layers whose gradients are small in scale), and it
  keeps tensor-parallel replicas consistent: a parameter replicated across TP ranks has the
  same gradient on each of them, so its own top-k picks the same coordinates everywhere,
  whatever the TP-sharded parameters beside it in the bucket hold.

The counts are fixed for a given density, so every DP peer hands the collective a payload of
the same size.

The compression (``compress(acc, plan, density, selector, key)``) returns a ``SparseGrad``:

* ``always``: the values of ``plan.always_positions`` (sent in full; their positions are
  known to every peer from the plan, so they are not sent);
* ``positions`` / ``values``: the selected coordinates of the other parts, a fixed number of
  them; a padding slot (the selector came up short) carries value 0, so adding the payload
  at its positions is right whatever position the slot names.

Error feedback (``ResidualBuffer``, ``compress_with_feedback``): what a rank did not send
this step is added to its next step's gradient. Per bucket, per step: ``acc = grad +
residual``; send ``acc`` at the selected positions; ``residual' = acc - sent``: zero at every
position sent (``x - x`` is exactly 0), ``acc`` elsewhere. So ``sent + residual' == acc``
exactly, which is what keeps top-k converging (Stich et al. 2018). The subtraction is
written as an ``index_add_`` of the sent values: padding slots carry 0 and add nothing, so
the payload's shape never depends on the data.

The new residual is *staged*, not committed: if every rank then agrees to skip the step
(non-finite gradients somewhere, or an abandoned sync), ``rollback()`` drops it and the
residual is as it was before the step. The next sync settles it as it adds the residual in
(``accumulate(grad, kept)``): committed if the optimizer took the step, else dropped
(``ddp.HiggsBucketGroup`` says which); ``settled(kept)`` is what a checkpoint must save. The
price is a second buffer the size of the bucket.

The payload format (``compress.payload``, ``--higgs-payload``) is part of the plan: its
``round`` runs inside ``compress``, before the residual is staged, so what a lower-precision
format drops stays in the residual too.

Shapes depend only on the plan and the density: nothing here reads a device value back to
the host.

Which coordinates (the selectors: exact top-k and a sampled-threshold top-k).

Both take the magnitudes of the accumulated gradient (``|grad + residual|``) and a fixed
``k`` and return a ``Selection``: exactly ``k`` int64 positions, and which of them are real.
Every data-parallel peer must hand the collective a payload of the same size, so a selector
that finds fewer than ``k`` coordinates pads: a padding slot holds some position of the
tensor and must carry value 0 (``Selection.valid`` is False there).

Neither selector synchronises the host with the device: every shape is a function of ``n``
and ``k`` only, the threshold stays a device tensor, and nothing is read back (no
``.item()``, no ``torch.nonzero``, no boolean-mask indexing). On a GPU this is what keeps
the selection inside a backward hook from stalling the launch queue. Indexing is written as
``narrow`` / ``index_select`` rather than ``t[...]``: the same kernels, and the form that
torch's fake CUDA tensors accept on a CPU-only build, where the device tests run.

* ``TopK``: ``torch.topk``; the reference, and slow on large tensors.
* ``SampledTopK`` (DGC, Lin et al. 2018): estimate the k-th largest magnitude from a sample,
  keep the coordinates above a slightly lower threshold (one pass), then take the exact top-k
  among those candidates. The candidates are gathered into a fixed number of slots
  (``capacity``, a few times ``k``) without ``nonzero``: a running count of the coordinates
  above the threshold (``cumsum``) is searched for the 1st, 2nd, ... of them
  (``searchsorted``). Whenever at least ``k`` and at most ``capacity`` coordinates pass, the
  result is the exact top-k; fewer than ``k`` leaves padding (the selection's shortfall);
  more than ``capacity`` and the slots take an even subsample of them (``overflow``), whose
  top-k is close to but not the exact one. ``SelectionStats`` counts both, on the device.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .payload import Packed, Payload, SlotLayout, SparseGrad, payload_format, position_encoding, scale_span

MIN_RANK = 32  # the sample's rank of the estimated threshold, at least
# A prime larger than any bucket: i -> (i * prime + offset) mod n visits distinct coordinates
# spread over the whole tensor (a strided sample would alias with a matrix's row length).
_SAMPLE_PRIME = 2_654_435_761


@dataclass
class Selection:
    positions: torch.Tensor  # int64 [k]
    valid: torch.Tensor | None = None  # bool [k], False at padding slots; None: all real


class SelectionStats:
    """How the selector did: calls, coordinates asked for, and (device counts, summed without
    being read back) the coordinates it missed, the calls short of k, the calls that overflowed.
    Reading ``missed``, ``short_calls``, ``overflow_calls`` or ``shortfall`` synchronises: do
    it at a log line or in a benchmark, not per bucket."""

    def __init__(self) -> None:
        self.calls = 0
        self.requested = 0
        self._counts: torch.Tensor | None = None  # [missed, short calls, overflowed calls]

    def record(self, k: int, valid: torch.Tensor | None = None, overflow: torch.Tensor | None = None) -> None:
        self.calls += 1
        self.requested += k
        if valid is None:  # an exact selection finds all k
            return
        missed = k - valid.sum()
        counts = torch.stack([missed, (missed > 0).long(), overflow.long()])
        self._counts = counts if self._counts is None else self._counts + counts

    def _read(self, index: int) -> int:
        return 0 if self._counts is None else int(self._counts[index].item())

    @property
    def missed(self) -> int:
        return self._read(0)

    @property
    def short_calls(self) -> int:
        return self._read(1)

    @property
    def overflow_calls(self) -> int:
        return self._read(2)

    @property
    def shortfall(self) -> float:
        """Fraction of the requested coordinates not found (0 for exact top-k)."""
        return self.missed / max(1, self.requested)


class Selector:
    name = "base"

    def __init__(self) -> None:
        self.stats = SelectionStats()

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        """Exactly ``k`` positions of ``magnitudes`` (1-D); ``key`` names the bucket's unit."""
        raise NotImplementedError

    def select_rows(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        """``select`` of each row of ``magnitudes`` ([rows, n], units of one size): positions
        [rows, k] within each row. Row by row here; a selector that can does it in one call."""
        chosen = [self.select(row, k, key=(key, index)) for index, row in enumerate(magnitudes.unbind(0))]
        valid = None
        if any(c.valid is not None for c in chosen):
            valid = torch.stack([torch.ones(k, dtype=torch.bool, device=magnitudes.device) if c.valid is None
                                 else c.valid for c in chosen])
        return Selection(torch.stack([c.positions for c in chosen]), valid)

    def _topk_rows(self, magnitudes: torch.Tensor, k: int) -> Selection:
        for _ in range(magnitudes.shape[0]):
            self.stats.record(k)
        return Selection(torch.topk(magnitudes, k, dim=1, sorted=False).indices)


class TopK(Selector):
    name = "topk"

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        self.stats.record(k)
        return Selection(torch.topk(magnitudes, k, sorted=False).indices)

    def select_rows(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        return self._topk_rows(magnitudes, k)


class SampledTopK(Selector):
    name = "sampled-topk"

    def __init__(self, sample_fraction: float = 0.01, min_sample: int = 1024, oversample: float = 2.0,
                 capacity: float = 2.0, seed: int = 0) -> None:
        """``oversample``: the threshold aims at ``oversample * k`` candidates; ``capacity``:
        slots for ``capacity * oversample * k`` of them. ``seed`` seeds the host generator that
        places the sample (a different one per rank is fine: selection is per rank)."""
        super().__init__()
        if capacity * oversample < 1:
            raise ValueError(f"capacity x oversample must be at least 1 (slots for k candidates); got "
                             f"{capacity} x {oversample}")
        self.sample_fraction = sample_fraction
        self.min_sample = min_sample
        self.oversample = oversample
        self.capacity = capacity
        self.offsets = random.Random(seed)

    def _threshold(self, magnitudes: torch.Tensor, k: int) -> torch.Tensor:
        """The estimated ``oversample * k``-th largest magnitude (a 0-d device tensor)."""
        n = magnitudes.numel()
        # Large enough that the threshold is about the MIN_RANK-th of the sample, not the 3rd:
        # a small k would otherwise leave it to chance whether k candidates pass.
        size = min(n, max(self.min_sample, int(n * self.sample_fraction),
                          math.ceil(MIN_RANK * n / (self.oversample * k))))
        sample_at = (torch.arange(size, device=magnitudes.device) * _SAMPLE_PRIME + self.offsets.randrange(n)) % n
        rank = min(size, max(1, math.ceil(size * self.oversample * k / n)))
        return torch.topk(magnitudes.index_select(0, sample_at), rank, sorted=False).values.min()

    def select_rows(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        if k * 4 >= magnitudes.shape[1]:  # as ``select``: exact, and in one call
            return self._topk_rows(magnitudes, k)
        return super().select_rows(magnitudes, k, key)

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        n = magnitudes.numel()
        if k * 4 >= n:  # sampling does not pay when most coordinates are sent
            self.stats.record(k)
            return Selection(torch.topk(magnitudes, k, sorted=False).indices)
        capacity = min(n, math.ceil(self.capacity * self.oversample * k))
        # Zeros never pass (sending one changes nothing): a gradient with fewer than k nonzero
        # coordinates sends all of them and pads, instead of overflowing with zeros. The floor
        # is the dtype's smallest positive value, subnormals included.
        finfo = torch.finfo(magnitudes.dtype)
        threshold = self._threshold(magnitudes, k).clamp(min=finfo.tiny * finfo.eps)
        count_dtype = torch.int32 if n < 2 ** 31 else torch.int64
        above = torch.cumsum(magnitudes >= threshold, 0, dtype=count_dtype)
        found = above.narrow(0, n - 1, 1).long()
        # Slot j (1-based) takes the ceil(j * found / capacity)-th coordinate above the threshold
        # when more than capacity passed (an even subsample), else the j-th: integer arithmetic.
        slots = torch.arange(1, capacity + 1, device=magnitudes.device, dtype=torch.int64)
        wanted = torch.where(found > capacity, (slots * found + capacity - 1) // capacity, slots).to(count_dtype)
        candidates = torch.searchsorted(above, wanted).clamp_(max=n - 1)
        real = wanted <= found
        scores = torch.where(real, magnitudes.index_select(0, candidates), -1.0)
        best = torch.topk(scores, k, sorted=False).indices
        valid = real.index_select(0, best)
        self.stats.record(k, valid, overflow=found.squeeze(0) > capacity)
        return Selection(candidates.index_select(0, best), valid)


def make_selector(name: str, seed: int = 0) -> Selector:
    if name == "topk":
        return TopK()
    if name == "sampled-topk":
        return SampledTopK(seed=seed)
    raise ValueError(f"unknown selector {name!r}; expected 'topk' or 'sampled-topk'")


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient sits in its bucket; ``whole``: it is sent whole, whatever
    its size (a parameter replicated across tensor-parallel ranks: its gradient is the same on
    each, and a scale shared with a tensor-parallel shard's coordinates, which differ, would
    round it differently on each, so its replicas would drift apart)."""

    start: int
    end: int
    whole: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start

    def sent_whole(self, min_param_numel: int) -> bool:
        """Whether it goes whole every step (small, or ``whole``) rather than compressed."""
        return self.whole or self.numel < min_param_numel


def k_of(numel: int, density: float) -> int:
    """Coordinates a selection unit of ``numel`` sends at ``density``: at least one, at most all."""
    return min(numel, math.ceil(density * numel))


class BucketPlan:
    """The selection units of one bucket (see module docstring)."""

    def __init__(self, numel: int, slots: list[ParamSlot], min_param_numel: int, device: torch.device,
                 payload: Payload | str = "wide") -> None:
        self.numel = numel
        self.device = device
        self.payload = payload_format(payload) if isinstance(payload, str) else payload
        always = sorted((s.start, s.end) for s in slots if s.sent_whole(min_param_numel))
        self.units = sorted((s for s in slots if not s.sent_whole(min_param_numel)), key=lambda s: s.start)
        self.units_numel = sum(unit.numel for unit in self.units)
        # A tensor-parallel replica must not share a scale with coordinates that differ across
        # the tensor-parallel ranks: at density 1 it stays in the always section, not in the implicit run.
        self.keeps_replicas_apart = any(s.whole for s in slots)
        self.always_positions = (
            torch.cat([torch.arange(s, e, dtype=torch.long, device=device) for s, e in always])
            if always else torch.empty(0, dtype=torch.long, device=device))
        self._layout: SlotLayout | None = None
        self._layout_density: float | None = None

    @property
    def n_always(self) -> int:
        return self.always_positions.numel()

    def k_unit(self, unit: ParamSlot, density: float) -> int:
        return k_of(unit.numel, density)

    def k_selected(self, density: float) -> int:
        """Selected coordinates sent per step at ``density`` (fixed for a given density)."""
        return sum(self.k_unit(unit, density) for unit in self.units)

    def payload_bytes(self, density: float, dtype: torch.dtype, payload: Payload | None = None) -> int:
        """Bytes one peer hands the all-gather per step, in the plan's payload format (or ``payload``)."""
        return (payload or self.payload).nbytes(self.layout(density), dtype)

    def layout(self, density: float) -> SlotLayout:
        """The payload's sections at ``density`` (the last one is kept: a density ramp changes
        it every step). Where every coordinate of every unit is selected, a blocked format
        sends the whole bucket in order (the implicit encoding): the always-sent parameters
        become slots too, unless one of them is a tensor-parallel replica (``ParamSlot.whole``)."""
        if self._layout_density != density:
            k = self.k_selected(density)
            every = self.payload.blocked and 0 < self.units_numel == k and not self.keeps_replicas_apart
            self._layout = SlotLayout(self.numel, self.always_positions, self.numel if every else k,
                                      position_encoding(self.payload.name, self.numel, k, every),
                                      scale_span(density))
            self._layout_density = density
        return self._layout


class ResidualBuffer:
    """The committed residual of one bucket plus the one staged by the step in flight.

    A residual known to be zero (never set, or after a dense step) is only flagged, not
    written or added: a bucket that goes dense costs no passes over its residual."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.committed = torch.zeros(numel, dtype=dtype, device=device)
        self.staged = torch.zeros(numel, dtype=dtype, device=device)
        self.has_staged = False
        self.committed_zero = self.staged_zero = True

    def commit(self) -> None:
        if self.has_staged:
            self.committed, self.staged = self.staged, self.committed
            self.committed_zero, self.staged_zero = self.staged_zero, self.committed_zero
            self.has_staged = False

    def rollback(self) -> None:
        self.has_staged = False

    def settle(self, kept: bool) -> None:
        """End the last step: what it staged is the residual (``kept``) or is dropped."""
        self.commit() if kept else self.rollback()

    def settled(self, kept: bool) -> torch.Tensor:
        """The residual in force once the last step is settled (what a resumed run must start from)."""
        if self.has_staged and kept:
            if self.staged_zero:
                self.staged.zero_()
            return self.staged
        if self.committed_zero:
            self.committed.zero_()
        return self.committed

    @property
    def current(self) -> torch.Tensor:
        """The residual a resumed run must start from, the last step taken: staged if any."""
        return self.settled(True)

    def load(self, value: torch.Tensor) -> None:
        self.committed.copy_(value.reshape(-1))
        self.committed_zero = False
        self.has_staged = False

    def accumulate(self, grad: torch.Tensor, kept: bool = True) -> None:
        """``grad += residual`` in place (grad becomes acc), after settling the last step:
        ``kept`` says whether the optimizer took it (``ddp.HiggsBucketGroup``). ``grad`` may be
        shorter than the buffer when the buffer's tail is padding (always 0)."""
        self.settle(kept)
        if not self.committed_zero:
            grad.add_(self.committed.narrow(0, 0, grad.numel()))

    def stage(self, acc: torch.Tensor, sent) -> None:
        """Residual after sending ``sent`` (a ``SparseGrad``) out of ``acc``."""
        if sent.positions is None:  # every coordinate sent (the implicit encoding)
            self.stage_rounded(acc, sent.values)
            return
        left_after(acc, sent, self.staged)
        self.staged_zero = False
        self.has_staged = True

    def stage_rounded(self, acc: torch.Tensor, sent: torch.Tensor) -> None:
        """Residual after sending all of ``acc`` rounded to ``sent`` (a dense step in a lower
        precision): the rounding error, exact (each value is within a factor of two of its
        rounding, Sterbenz)."""
        torch.sub(acc, sent, out=self.staged.narrow(0, 0, acc.numel()))
        self.staged_zero = False
        self.has_staged = True

    def stage_replacing(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Stage the committed residual with ``values`` written at ``positions`` (an owner's
        rounding of the sums it hands back, ``reduce.agreed_reduce``; the positions it did not
        send keep what they held)."""
        if self.committed_zero:
            self.staged.zero_()
        else:
            self.staged.copy_(self.committed)
        self.staged.index_copy_(0, positions, values.to(self.staged.dtype))
        self.staged_zero = False
        self.has_staged = True

    def staging(self) -> torch.Tensor:
        """The staged buffer, for a caller that writes the new residual itself (every
        coordinate of it: the sharded form, ``compress.sharded``)."""
        self.staged_zero = False
        self.has_staged = True
        return self.staged

    def stage_all_sent(self) -> None:
        """The whole of ``acc`` went out (a dense step): nothing remains."""
        self.staged_zero = True
        self.has_staged = True


def left_after(acc: torch.Tensor, sent: SparseGrad, out: torch.Tensor) -> torch.Tensor:
    """``out`` (as long as ``acc``) = what is left of ``acc`` after sending ``sent`` out of it
    (``sent`` as ``compress`` made it: exact, see ``ResidualBuffer``); returns ``out``."""
    if sent.positions is None:  # every coordinate: the rounding is what is left
        return torch.sub(acc, sent.values, out=out)
    out.copy_(acc)
    if sent.always.numel():
        out.index_add_(0, sent.always_positions, sent.always, alpha=-1)
    return out.index_add_(0, sent.positions, sent.values, alpha=-1)


def compress(acc: torch.Tensor, plan: BucketPlan, density: float, selector: Selector,
             key: object = None, payload: Payload | None = None) -> SparseGrad:
    """The payload of ``acc`` at ``density``, its values rounded as the plan's format sends them.
    Under 16-bit offsets the positions come sorted: units are disjoint and ordered by start,
    so the sort keeps each unit's slots together (a bitmap takes them in any order). Where the
    layout sends every coordinate (``implicit``), nothing is selected: the values are the whole
    of ``acc``."""
    layout, payload = plan.layout(density), payload or plan.payload
    if layout.encoding == "implicit":  # every coordinate, in order: nothing to select
        empty = acc.new_empty(0)
        return payload.round(SparseGrad(empty, empty.long(), None, acc), layout)
    always = acc.index_select(0, plan.always_positions)
    selections = [selector.select(acc.narrow(0, unit.start, unit.numel).abs(), plan.k_unit(unit, density), key=(key, unit.start))
                  for unit in plan.units]
    if not selections:
        empty = torch.empty(0, dtype=torch.long, device=acc.device)
        return payload.round(SparseGrad(always, plan.always_positions, empty, acc.index_select(0, empty)), layout)
    positions = torch.cat([s.positions + unit.start for s, unit in zip(selections, plan.units)])
    valid = None
    if any(s.valid is not None for s in selections):
        valid = torch.cat([torch.ones_like(s.positions, dtype=torch.bool) if s.valid is None else s.valid
                           for s in selections])
    if layout.encoding == "offsets":
        positions, order = torch.sort(positions)
        valid = valid.index_select(0, order) if valid is not None else None
    values = acc.index_select(0, positions)
    if valid is not None:  # zero the padding slots
        values = torch.where(valid, values, 0)
    return payload.round(SparseGrad(always, plan.always_positions, positions, values), layout)


def compress_with_feedback(acc: torch.Tensor, plan: BucketPlan, density: float, selector: Selector,
                           residual: ResidualBuffer | None, key: object = None,
                           payload: Payload | None = None, kept: bool = True) -> SparseGrad:
    """``acc`` (the gradient, in place) += residual, the last step settled (``kept``); compress
    (in the plan's format, or ``payload``); stage the new residual."""
    if residual is not None:
        residual.accumulate(acc, kept)
    sparse = compress(acc, plan, density, selector, key=key, payload=payload)
    if residual is not None:
        residual.stage(acc, sparse)
    return sparse


def pack_with_feedback(acc: torch.Tensor, plan: BucketPlan, density: float, selector: Selector,
                       residual: ResidualBuffer | None, key: object = None, payload: Payload | None = None,
                       kept: bool = True) -> Packed:
    """``compress_with_feedback``, packed in the plan's format (or ``payload``): what one rank
    hands the all-gather, made in one pass through this module."""
    payload = payload or plan.payload
    sparse = compress_with_feedback(acc, plan, density, selector, residual, key=key, payload=payload, kept=kept)
    layout = plan.layout(density)
    return Packed(payload.pack(sparse, layout), payload, layout)
