"""The compression schedule ``--use-higgs`` gives a run by itself, derived from the run.

A user should not have to compose the schedule flag by flag. Each value below is what
``--use-higgs`` takes when its flag is not given; a flag given overrides its value alone.

**1-bit Adam's exchange** (``--higgs-sync onebit``, ``first_moment``) is the default wherever the
run allows it (``why_not_onebit``: Adam, a learning-rate warm-up to learn the second moment in,
no elastic replicas, no optimizer state offloaded, no flag of the top-k forms); it held dense's
loss at every P measured, at about a fifteenth of its wire bytes per rank over a run (an eighth
with the distributed optimizer, its parameter all-gather counted):

* a dense stage as long as the learning-rate warm-up, its steps sent in int8 through the agreed
  form (a quarter of fp32's bytes), Adam as it is;
* then every coordinate of each rank's share of Adam's first moment as a sign with a scale per
  256, summed by the agreed exchange, Adam's second moment frozen, and thawed for windows of 20
  dense iterations (at most a quarter of the dense stage) at 2, 4, 8... times the dense stage: a
  second moment frozen at the end of the warm-up holds the gradients' scale of then, and on the
  default model over 2,400 iterations the run ended 1.038x of dense's loss without the windows,
  1.002x with them;
* with the distributed optimizer, the parameter all-gather as each shard's change in int4
  (``reduce.param_gather``).

Elsewhere, ``--higgs-sync auto`` (the top-k forms; the run's start-up log says why):

* density ``0.25`` with the ``int4`` payload (a bitmap and 4-bit values, with a scale per span):
  about a sixteenth of dense's wire bytes per rank per compressed step, at any P on the flat forms. At a quarter of the
  coordinates error feedback's bursts are a few steps long, and Adam can stay as it is;
* a dense stage as long as the learning-rate warm-up (``--lr-warmup-iters``): the model and
  Adam's moments settle before error feedback's delays begin (1-bit Adam's warm-up stage);
* its steps sent in int8 (``--higgs-dense-int8``): a quarter of fp32's bytes, through the
  bucket's form, where the payload has the blocked layout and error feedback keeps the
  rounding (not with ``--higgs-dense-bf16``, ``--higgs-payload wide``, no error feedback, or
  compressor ``none``);
* a ramp from dense to the density over a twentieth of ``--train-iters``;
* per bucket the cost model, from the links measured at start-up (or ``--higgs-link-gbps``) and
  P, keeps Megatron's dense reduction where compressing does not pay, the all-gather at two
  ranks, and the sharded form beyond, whose wire bytes per rank do not grow with P.

Pure: no process group, no flags.
"""

from __future__ import annotations

from typing import Any

DENSITY = 0.25
PAYLOAD = "int4"
PARAM_PAYLOAD = "int4"  # onebit with the distributed optimizer: the parameters' changes (signs lost 8% at P=2)
RAMP_SHARE = 20  # the ramp: a twentieth of the run
# onebit: each refresh window of the frozen second moment, in iterations (at most a quarter of the
# dense stage). About 1 / (1 - beta2) at beta2 = 0.95: most of the second moment is replaced.
REFRESH_ITERS = 20
# onebit: the shortest dense stage it is derived for. A second moment frozen after a few
# gradients is theirs (too short a warm-up diverges: DeepSpeed's 1-bit Adam, issue 753).
MIN_DENSE_ITERS = 10
# HiggsConfig fields only the top-k forms take: (flag, value when the flag is not given)
_TOPK_SETTINGS = {"compression_ratio": ("--higgs-compression-ratio", None),
                  "density_warmup_iters": ("--higgs-density-warmup-iters", None),
                  "sum_density_factor": ("--higgs-sum-density-factor", 1.0),
                  "dense_bf16": ("--higgs-dense-bf16", False),
                  "link_gbps": ("--higgs-link-gbps", None),  # what auto's cost model plans the top-k paths with
                  "node_link_gbps": ("--higgs-node-link-gbps", None)}

def why_not_onebit(given: dict[str, Any], lr_warmup_iters: int, refused: str | None = None) -> str | None:
    """Why a run that did not choose ``--higgs-sync`` does not get 1-bit Adam's exchange, the
    default (None: it does): ``refused``, what the run's other flags rule out (the optimizer,
    elastic replicas, offloading: ``runtime.run_config``), or a flag given that only the top-k
    forms take."""
    if refused:
        return refused
    for name, (flag, default) in _TOPK_SETTINGS.items():
        if given.get(name, default) != default:
            return f"{flag} is a setting of the top-k forms"
    if given.get("payload") not in (None, "sign"):
        return f"--higgs-payload {given['payload']} is a format of the top-k forms"
    if given.get("compressor") == "none":
        return "--higgs-compressor none sends every bucket dense"
    if given.get("error_feedback") is False:
        return "1-bit Adam keeps each sign's error in the error-feedback residual (--no-higgs-error-feedback)"
    dense = given.get("dense_iters") if given.get("dense_iters") is not None else lr_warmup_iters
    if dense < MIN_DENSE_ITERS:
        return (f"it freezes the second moment Adam learns in a dense stage, and this run's is {dense} "
                f"iteration(s), under {MIN_DENSE_ITERS} (--lr-warmup-iters, or --higgs-dense-iters)")
    return None


def derived_schedule(given: dict[str, Any], train_iters: int, lr_warmup_iters: int,
                     refused: str | None = None, fallback: str = "auto") -> dict[str, Any]:
    """``given`` (HiggsConfig field values, None where a derived field's flag, ``derived=True``
    in its metadata, was not given) with each such None filled from the run (see the module
    docstring); ``refused``: why the run's other flags rule 1-bit Adam's exchange out, and
    ``fallback`` the sync then (elastic replicas: 'sparse')."""
    values = dict(given)
    if values.get("sync") is None:
        values["sync"] = fallback if why_not_onebit(values, lr_warmup_iters, refused) else "onebit"
    if values.get("sync") == "onebit":  # every coordinate, as a sign, from the end of the dense stage
        derived = {"compression_ratio": 1.0, "payload": "sign", "dense_iters": lr_warmup_iters,
                   "density_warmup_iters": 0, "param_payload": PARAM_PAYLOAD}
    else:
        derived = {"compression_ratio": DENSITY, "payload": PAYLOAD, "dense_iters": lr_warmup_iters,
                   "density_warmup_iters": train_iters // RAMP_SHARE, "param_payload": "dense",
                   "variance_refresh_iters": 0}
    for name, value in derived.items():
        if values.get(name) is None:
            values[name] = value
    if values.get("variance_refresh_iters") is None:  # onebit: from the dense stage, once that is known
        values["variance_refresh_iters"] = min(REFRESH_ITERS, values["dense_iters"] // 4)
    if values.get("dense_int8") is None:
        values["dense_int8"] = (values["payload"] != "wide" and values.get("error_feedback", True)
                                and values.get("compressor") != "none" and not values.get("dense_bf16"))
    return values
