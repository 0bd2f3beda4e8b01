"""Per-rank shard checkpoints with a global rank map.

A checkpoint's path, in four files:

* ``manifest.py``: the rank map (``rank_map.json``): parallel sizes, and for every global
  rank its host, (tp, pp, dp, cp, ep) coordinates, the files it wrote with their SHA-256,
  and the tensor shards it held; iteration, consumed samples, higgs config, versions.
* ``save.py``: every rank writes its shard through megatron-core's ``dist_checkpointing``
  (torch_dist) into ``iter_NNNNNNN.tmp``; each hashes its own files; rank 0 writes the
  rank map, renames the directory to ``iter_NNNNNNN`` and moves ``latest`` last.
* ``validation.py``: every rule checked before anything is loaded: same layout (naming
  each difference), shard coverage for a new layout, file integrity.
* ``load.py``: pick the committed checkpoint, validate, load, restore.

A directory without its rank map, or still named ``.tmp``, is never loaded; the next save
removes it. All failures raise ``CheckpointError`` naming the file and rank.
"""

from .manifest import CheckpointError, Manifest  # noqa: F401
