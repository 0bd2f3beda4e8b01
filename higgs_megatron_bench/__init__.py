"""The test and benchmark kit of the repository, shared by ``tests/`` and ``scripts/``: run a
function on N gloo ranks (``ranks``), run the pretrain script and read its metrics (``runs``).

Not part of the installed package: a training job never imports it. Tests and scripts find
it at the repository's root (pytest's rootdir; the scripts put the root on ``sys.path``).
"""
