"""Per-rank shard checkpoints with a global rank map.

A checkpoint's path, save to commit in ``save.py`` -> ``state.py`` -> ``commit.py`` (+
``manifest.py``; ``optimizer_shards.py`` too with the distributed optimizer), load in
``load.py`` -> ``validation.py``:

* ``state.py``: ``TrainingState`` (what is saved and restored) and its sharded state dict;
* ``save.py``: every rank writes its shard through megatron-core's ``dist_checkpointing``
  (torch_dist) into ``iter_NNNNNNN.tmp`` (``async_save.py``: in the background);
* ``commit.py``: the protocol both front-ends share: hashes gathered, the rank map
  (``manifest.py``: ``rank_map.json``) written, the directory renamed, ``latest`` moved last;
  and the job's layout and this rank's coordinates, as the rank map records them;
* ``validation.py``: every rule checked before anything is loaded: same layout (naming
  each difference), shard coverage for a new layout, file integrity;
* ``load.py``: pick the committed checkpoint (``choose_checkpoint``, both front-ends), validate,
  load, restore; ``flags.py``, ``interval.py``: the shared flags, the wall-clock trigger.

A directory without its rank map, or still named ``.tmp``, is never loaded; the next save
removes it. All failures raise ``CheckpointError`` naming the file and rank.
"""

from .manifest import CheckpointError, Manifest  # noqa: F401
