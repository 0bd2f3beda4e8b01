"""Where megatron-core's bucket group differs between the supported releases, decided once.

From 0.19 a parameter whose weight gradient a local CUDA graph's replay writes carries
``_cudagraph_wgrad_ready_event``, and megatron-core's ``start_grad_sync`` makes the current
stream wait for it before reading the bucket. ``HiggsBucketGroup`` replaces that method, so it
does the same, but only under a release whose own method does: whether it does is read from
that method's code once, not looked for on every parameter at every hook of a release that
never sets it.
"""

from __future__ import annotations

from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

GRAPH_REPLAY_EVENT = "_cudagraph_wgrad_ready_event"
WAITS_FOR_GRAPH_REPLAYS = GRAPH_REPLAY_EVENT in _ParamAndGradBucketGroup.start_grad_sync.__code__.co_consts
