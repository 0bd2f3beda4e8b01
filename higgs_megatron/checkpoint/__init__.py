"""Per-rank shard checkpoints with a global rank map.

A save goes down through ``save.py`` -> ``state.py`` (what is saved: the model, Megatron's
optimizer, each HiggsDDP chunk's error-feedback residuals, RNG, position) -> ``manifest.py``;
a load through ``load.py`` -> ``manifest.py`` -> ``state.py``, each file once
(``docs/architecture.md``, measured by ``scripts/walks.py``):

* ``state.py``: ``TrainingState`` (what is saved and restored), its sharded state dict, and
  the distributed optimizer's state written by the DP ranks that hold it;
* ``save.py``: the protocol both front-ends share: every rank writes its shard through
  megatron-core's ``dist_checkpointing`` (torch_dist) into ``iter_NNNNNNN.tmp``, hashes are
  gathered, the rank map written, the directory renamed, ``latest`` moved last
  (``async_save.py``: the writing in the background);
* ``manifest.py``: the rank map (``rank_map.json``), the names of committed checkpoints, the
  job's layout and this rank's coordinates as the rank map records them, the files' hashes;
* ``load.py``: pick the committed checkpoint (``choose_checkpoint``, both front-ends), every
  rule checked before anything is loaded (same layout, naming each difference; the
  vocabulary's padding; shard coverage for a new layout; file integrity), load, restore;
* ``flags.py``, ``interval.py``: the shared flags, the wall-clock trigger.

A directory without its rank map, or still named ``.tmp``, is never loaded; the next save
removes it. All failures raise ``CheckpointError`` naming the file and rank.
"""

from .manifest import CheckpointError, Manifest  # noqa: F401
