"""Elastic data-parallel replicas over torchft: the groundwork (``docs/experiments/torchft.md``
says what torchft offers and what that decides here).

* ``collectives``: the gradient sync's collectives issued on a torchft process group, the
  group that spans the replicas and is rebuilt at every change of membership.
"""
