"""higgs-megatron's runtime patches for Megatron-LM's own training code.

In a clone this folder is ``patches``; an installed wheel ships it as ``higgs_megatron_patches``
(``pyproject.toml`` maps the name), with ``run_pretrain_gpt.console_main`` as the
``higgs-megatron-lm`` command. The modules import each other relatively, so both names work.
"""
