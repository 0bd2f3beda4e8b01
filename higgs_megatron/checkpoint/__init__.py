"""Per-rank shard checkpoints with a global rank map.

A checkpoint's path, save to commit, crosses four files: ``save.py`` -> ``state.py`` (what
is saved; ``optimizer.py`` adds the error-feedback residuals) -> ``save.py``'s ``commit``
-> ``manifest.py``. A load crosses ``load.py`` -> ``validation.py``:

* ``state.py``: ``TrainingState`` (what is saved and restored), its sharded state dict, and
  the distributed optimizer's state written by the DP ranks that hold it;
* ``save.py``: the protocol both front-ends share: every rank writes its shard through
  megatron-core's ``dist_checkpointing`` (torch_dist) into ``iter_NNNNNNN.tmp``, hashes are
  gathered, the rank map (``manifest.py``: ``rank_map.json``) written, the directory renamed,
  ``latest`` moved last; and the job's layout and this rank's coordinates, as the rank map
  records them (``async_save.py``: the writing in the background);
* ``validation.py``: every rule checked before anything is loaded: same layout (naming
  each difference), shard coverage for a new layout, file integrity;
* ``load.py``: pick the committed checkpoint (``choose_checkpoint``, both front-ends), validate,
  load, restore; ``flags.py``, ``interval.py``: the shared flags, the wall-clock trigger.

A directory without its rank map, or still named ``.tmp``, is never loaded; the next save
removes it. All failures raise ``CheckpointError`` naming the file and rank.
"""

from .manifest import CheckpointError, Manifest  # noqa: F401
