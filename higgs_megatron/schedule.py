"""The compression schedule ``--use-higgs`` gives a run by itself, derived from the run.

A user should not have to compose the schedule flag by flag. Each value below is what
``--use-higgs`` takes when its flag is not given; a flag given overrides its value alone:

* density ``0.25`` with the ``int4`` payload (a bitmap and 4-bit values, with a scale per span):
  about a sixteenth of dense's wire bytes per rank per compressed step, at any P on the flat forms. At a quarter of the
  coordinates error feedback's bursts are a few steps long, and Adam can stay as it is;
* a dense stage as long as the learning-rate warm-up (``--lr-warmup-iters``): the model and
  Adam's moments settle before error feedback's delays begin (1-bit Adam's warm-up stage);
* its steps sent in int8 (``--higgs-dense-int8``): a quarter of fp32's bytes, through the
  bucket's form, where the payload has the blocked layout and error feedback keeps the
  rounding (not with ``--higgs-dense-bf16``, ``--higgs-payload wide``, no error feedback, or
  compressor ``none``);
* a ramp from dense to the density over a twentieth of ``--train-iters``.

What depends on the links and the data-parallel size P is left to ``--higgs-sync auto``, the
default: per bucket the cost model, from the links measured at start-up (or
``--higgs-link-gbps``) and P, keeps Megatron's dense reduction where compressing does not pay,
the all-gather at two ranks, and the sharded form beyond, whose wire bytes per rank do not grow
with P.

Pure: no process group, no flags.
"""

from __future__ import annotations

from typing import Any

DENSITY = 0.25
PAYLOAD = "int4"
RAMP_SHARE = 20  # the ramp: a twentieth of the run

def derived_schedule(given: dict[str, Any], train_iters: int, lr_warmup_iters: int) -> dict[str, Any]:
    """``given`` (HiggsConfig field values, None where a derived field's flag, ``derived=True``
    in its metadata, was not given) with each such None filled from the run (see the module
    docstring)."""
    values = dict(given)
    if values.get("sync") == "onebit":  # every coordinate, as a sign, from the end of the dense stage
        derived = {"compression_ratio": 1.0, "payload": "sign", "dense_iters": lr_warmup_iters,
                   "density_warmup_iters": 0}
    else:
        derived = {"compression_ratio": DENSITY, "payload": PAYLOAD, "dense_iters": lr_warmup_iters,
                   "density_warmup_iters": train_iters // RAMP_SHARE}
    for name, value in derived.items():
        if values.get(name) is None:
            values[name] = value
    if values.get("dense_int8") is None:
        values["dense_int8"] = (values["payload"] != "wide" and values.get("error_feedback", True)
                                and values.get("compressor") != "none" and not values.get("dense_bf16"))
    return values
