"""Run an unmodified Megatron-LM checkout's ``pretrain_gpt.py`` with higgs-megatron underneath.

``patches/run_pretrain_gpt.py`` is the entry point: it checks the checkout
(``checkout.py``), makes ``megatron.training`` importable from it on top of the installed
megatron-core, installs the patches (``install.py``), and on a machine without CUDA enters
``cpu.megatron_lm_on_cpu()``; then it runs the checkout's ``pretrain_gpt.py`` as ``__main__``,
unchanged. ``arguments.py`` holds the flags and their checks, ``rank_map.py`` the rank map
added to Megatron-LM's own checkpoints. Nothing here imports Megatron-LM at import time
except ``install``, ``cpu`` and ``rank_map``'s users, so the flag logic is testable without a
checkout.
"""
