#!/usr/bin/env python
"""Run Megatron-LM's pretrain_gpt.py, unchanged, with higgs-megatron's patches.

    torchrun --nproc_per_node 8 patches/run_pretrain_gpt.py --megatron-lm-path ~/Megatron-LM \\
        <pretrain_gpt.py flags> --use-higgs --higgs-compression-ratio 0.01
    torchrun --nproc_per_node 8 --no-python higgs-megatron-lm --megatron-lm-path ~/Megatron-LM ...   (installed)
    torchrun --nproc_per_node 8 --no-python higgs-megatron-lm <pretrain_gpt.py flags> ...   (megatron-core 0.19)

Launcher flags (taken out before pretrain_gpt.py sees the rest):
  --megatron-lm-path DIR               the checkout (default: $MEGATRON_LM_PATH): tag core_v0.16.1
                                       with megatron-core 0.16.1; with 0.19, optional, core_v0.19.0
  --higgs-allow-untested-megatron-lm   run a checkout or megatron-core of another version anyway,
                                       with a warning (or HIGGS_ALLOW_UNTESTED_MEGATRON_LM=1)
  --higgs-no-patches                   run Megatron-LM without the patches (CPU harness only):
                                       the baseline that a run without --use-higgs must equal

With megatron-core 0.16.1 the checkout provides ``megatron.training`` and the script. From 0.18
on the megatron-core wheel ships ``megatron.training``: a checkout then provides only the
script, and without one ``megatron_lm.gpt_entry`` (the script's GPT path) runs in its place
(``megatron_lm.checkout``). ``megatron.core`` is always the installed megatron-core. On a machine
without CUDA the run goes through ``megatron_lm.cpu`` (gloo; see its docstring for the flags
it needs). Exit statuses are our pretrain script's (``higgs_megatron.runtime.exits``): 2 for
bad flags or checkout, 3 for a checkpoint refused, 75 for a lost peer.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from pathlib import Path

if __package__:  # installed: higgs_megatron_patches.run_pretrain_gpt (the higgs-megatron-lm command)
    _PATCHES = f"{__package__}.megatron_lm"
else:  # run as a file of a clone: patches/run_pretrain_gpt.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _PATCHES = "megatron_lm"
_checkout = importlib.import_module(f"{_PATCHES}.checkout")
CheckoutError, check_checkout, use_checkout = _checkout.CheckoutError, _checkout.check_checkout, _checkout.use_checkout


def _split_launcher_args(argv: list[str]) -> tuple[str | None, bool, bool, list[str]]:
    path, allow, rest = os.environ.get("MEGATRON_LM_PATH"), os.environ.get("HIGGS_ALLOW_UNTESTED_MEGATRON_LM") == "1", []
    patched = True
    items = iter(argv)
    for item in items:
        if item == "--megatron-lm-path":
            path = next(items, None)
        elif item.startswith("--megatron-lm-path="):
            path = item.split("=", 1)[1]
        elif item == "--higgs-allow-untested-megatron-lm":
            allow = True
        elif item == "--higgs-no-patches":
            patched = False
        else:
            rest.append(item)
    return path, allow, patched, rest


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        # Not the package's logging: importing higgs_megatron here would import megatron before
        # the checkout is on the path.
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def main(argv: list[str]) -> int:
    path, allow, patched, rest = _split_launcher_args(argv)
    asked_help = any(arg in ("-h", "--help") for arg in rest)
    if asked_help:
        _say(__doc__.strip() + "\n\npretrain_gpt.py's own flags follow (ours among them), where its training code is found.\n")
    try:
        checkout = check_checkout(path, allow)
    except CheckoutError as error:
        if asked_help:
            return 0
        _say(f"run_pretrain_gpt.py: error: {error}")
        return 2
    use_checkout(checkout)

    import torch

    exits = importlib.import_module("higgs_megatron.runtime.exits")  # after the checkout: it imports megatron
    if patched:
        symbols = importlib.import_module("higgs_megatron.compat.symbols")
        try:
            importlib.import_module(f"{_PATCHES}.install").install()
        except symbols.SymbolMismatch as error:  # named before anything is rebound or run
            _say(f"run_pretrain_gpt.py: error: {error}")
            return 2
    script = checkout / "pretrain_gpt.py" if checkout is not None else None
    sys.argv = [str(script or "pretrain_gpt.py"), *rest]

    def run_script() -> None:
        if script is not None:
            runpy.run_path(str(script), run_name="__main__")
        else:
            runpy.run_module(f"{_PATCHES}.gpt_entry", run_name="__main__", alter_sys=True)

    def run() -> None:
        if torch.cuda.is_available():
            run_script()
        else:
            with importlib.import_module(f"{_PATCHES}.cpu").megatron_lm_on_cpu():
                run_script()
    return exits.exit_status(run, prog="pretrain_gpt.py")


def console_main() -> int:
    """The ``higgs-megatron-lm`` command."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
