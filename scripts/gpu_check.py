"""One check of every GPU path, on a machine with 1 to 8 GPUs; small, over gloo, without one.

Each stage trains megatron-core's GPTModel through this project's own loop (``Trainer``) on
as many ranks as there are GPUs (two CPU ranks without CUDA), and reports one row:

* ``ddp-oracle``: parameters after 5 steps, Megatron's DDP against ``--use-higgs
  --higgs-compressor none``, bitwise (one GPU: one rank; the multi-rank oracle needs two or
  more, since NCCL refuses two ranks on one GPU);
* ``optimizer-instances``: with an even number of ranks, two distributed-optimizer instances
  (Megatron's hierarchical DP, whose sync runs on Megatron's communication stream on CUDA):
  compressor none bitwise equal to Megatron's DDP, DP replicas equal at 1%;
* ``one-percent-<selector>``: ``--use-higgs`` at 1% on a model of about 1B parameters in
  bf16 (a tiny one on CPU): the loss falls, bytes sent against dense, compression time as a
  share of the step, for the exact and the sampled selector;
* ``compressor-throughput``: exact against sampled top-k at 100M elements (4M on CPU);
* ``onebit``: what ``--use-higgs`` derives (1-bit Adam's exchange) on a model of about 100M
  parameters in bf16 (the tiny one on CPU), with and without the distributed optimizer, every
  call of the gradient and parameter sync run under ``torch.cuda.set_sync_debug_mode("error")``
  (a host sync there fails the stage): the loss falls, DP replicas equal, wire bytes against
  dense; and the codec of one bucket of 100M elements (4M on CPU) for 8 ranks (each rank's
  share of the moment, its sign rows, the owner's sum of 8 rows re-signed, 8 rows decoded)
  timed as a share of that model's step;
* ``async-save-resume``: an asynchronous save, then a run resumed from it, bitwise equal to
  the uninterrupted run; the loop's stall as a share of a synchronous save;
* ``offload``: optimizer state leaves above the threshold and returns (on CUDA the caching
  allocator's probe, pushed over the threshold by a ballast tensor for a few steps; on CPU
  a scripted probe), parameters bitwise equal to a run without offload; ``offload.png``;
* ``megatron-lm``: with ``MEGATRON_LM_PATH``, Megatron-LM's ``pretrain_gpt.py`` with the
  patches and ``--use-higgs`` trains;
* ``transformer-engine``: with TE importable and CUDA, the TE layer spec trains, saves,
  resumes bitwise and (with two or more GPUs) reshards to TP=2.

Writes ``gpu_check.md`` and ``gpu_check.json`` (and ``offload.png`` with matplotlib) into
``--out``; exits non-zero if a row FAILs.

    scripts/gpu_check.sh [--out runs/gpu_check] [--only ddp-oracle,offload]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from higgs_megatron_bench.ranks import run_ranks  # noqa: E402

log = logging.getLogger("gpu_check")
CUDA = torch.cuda.is_available()
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--log-interval", "1000",
         "--eval-interval", "1000", "--eval-iters", "0", "--num-threads", "1"]
# About 100M parameters: 12 x 12 x 768^2 in the layers, and the embedding.
MID = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "1024",
       "--max-position-embeddings", "1024", "--micro-batch-size", "4", "--lr", "1e-4", "--min-lr", "1e-5",
       "--bf16", "--eval-iters", "0", "--eval-interval", "1000"]
# About 1B parameters: 12 x layers x hidden^2 = 12 x 20 x 2048^2.
LARGE = ["--num-layers", "20", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "1024",
         "--max-position-embeddings", "1024", "--micro-batch-size", "2", "--lr", "1e-4", "--min-lr", "1e-5",
         "--bf16", "--eval-iters", "0", "--eval-interval", "1000"]


def _model(layers: int | None = None) -> list[str]:
    """The model flags of this machine's check (``layers`` overrides the large model's depth)."""
    if not CUDA:
        return list(SMALL)
    flags = list(LARGE)
    if layers is not None:
        flags[flags.index("--num-layers") + 1] = str(layers)
    return flags


@dataclass
class Row:
    stage: str
    status: str  # PASS, FAIL or SKIP
    figures: str
    values: dict = field(default_factory=dict)


# --- what each rank runs (module level: spawn imports them by name) ---------------------

def _parameters(trainer) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.detach().float().cpu() for i, chunk in enumerate(trainer.model)
            for name, p in chunk.module.named_parameters()}


def train_variants(variants: dict[str, list[str]], ballast: dict | None = None) -> dict:
    """Each variant trained in turn in one set of process groups: final parameters, losses,
    the logging rank's JSONL records, and (with ``ballast``) the offload probe's readings."""
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    out = {"params": {}, "losses": {}, "records": {}, "readings": {}, "rank": int(os.environ["RANK"])}
    with training_environment(parse_args(next(iter(variants.values())))):
        for name, argv in variants.items():
            args = parse_args(argv)  # here, not before: a --load directory is written by an earlier variant
            trainer = Trainer(args)
            if trainer.runtime.memory is not None and ballast is not None:
                out["readings"][name] = _with_ballast(trainer, **ballast)
            result = trainer.train()
            out["params"][name] = _parameters(trainer)
            out["losses"][name] = result.losses
            trainer.close()
            if args.log_json and trainer.log.is_writer:
                out["records"][name] = [json.loads(line) for line in Path(args.log_json).read_text().splitlines()]
    return out


def train_variants_without_host_syncs(variants: dict[str, list[str]]) -> dict:
    """``train_variants`` with every call of the gradient sync (start and finish) and of the
    parameter all-gather run under ``torch.cuda.set_sync_debug_mode("error")``: a host sync
    there raises. On CPU there is nothing to sync with, and it trains as it is."""
    from higgs_megatron.ddp import HiggsBucketGroup

    if CUDA:
        for name in ("start_grad_sync", "finish_grad_sync", "start_param_sync"):
            setattr(HiggsBucketGroup, name, _erroring_on_host_sync(getattr(HiggsBucketGroup, name)))
    return train_variants(variants)


def _erroring_on_host_sync(method):
    def checked(self, *args, **kwargs):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return checked


def _with_ballast(trainer, during: tuple[int, int], nbytes: int) -> list:
    """On CUDA: hold ``nbytes`` of device memory through the forward and backward of the
    steps in ``during`` (so the allocator's peak crosses a threshold set between the model's
    own peak and that peak plus the ballast) and record every probe reading."""
    readings = []
    memory, original_step, original_read = trainer.runtime.memory, trainer.train_step, trainer.runtime.memory.probe.read

    def read():
        reading = original_read()
        readings.append((trainer.iteration + 1, reading.used_bytes, reading.total_bytes,
                         memory.config.threshold, memory.resident_bytes()))
        return reading

    def train_step():
        iteration = trainer.iteration + 1
        if iteration == 2 and CUDA:  # the model's own peak is known after the first step
            peak = readings[-1][1] if readings else torch.cuda.max_memory_allocated()
            total = torch.cuda.mem_get_info()[1]
            memory.config.threshold = (peak + nbytes / 2) / total
            memory.config.hysteresis = nbytes / 4 / total
        held = (torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                if CUDA and during[0] <= iteration <= during[1] else None)
        try:
            return original_step()
        finally:
            del held

    memory.probe.read, trainer.train_step = read, train_step
    return readings


# --- the stages ---------------------------------------------------------------------------

def _world() -> int:
    return torch.cuda.device_count() if CUDA else 2


def _per_rank_equal(outs: list[dict], a: str, b: str) -> tuple[bool, str]:
    for out in outs:
        for name, value in out["params"][a].items():
            if not torch.equal(value, out["params"][b][name]):
                return False, f"rank {out['rank']}: {name} differs"
    return True, ""


def _last_stage_losses(outs: list[dict], variant: str) -> list[float]:
    losses = max((out["losses"][variant] for out in outs), key=len)
    return [losses[i] for i in sorted(losses)]


def _records(outs: list[dict], variant: str, kind: str) -> list[dict]:
    rows = next(out["records"][variant] for out in outs if variant in out["records"])
    return [r for r in rows if r["type"] == kind]


def stage_ddp_oracle(out_dir: Path) -> Row:
    base = SMALL + ["--train-iters", "5", "--global-batch-size", str(8 * _world()), "--overlap-grad-reduce",
                    "--ddp-bucket-size", "20000"]
    outs = run_ranks(train_variants, _world(), args=({"megatron": base, "none": base + [
        "--use-higgs", "--higgs-compressor", "none"]},), timeout=400)
    equal, why = _per_rank_equal(outs, "megatron", "none")
    note = "" if _world() > 1 else "; one rank: the multi-rank oracle needs 2+ GPUs (NCCL refuses two ranks per GPU)"
    return Row("ddp-oracle", "PASS" if equal else "FAIL",
               f"DP={_world()}, 5 steps: parameters {'bitwise equal' if equal else 'differ: ' + why}{note}",
               {"dp": _world(), "bitwise_equal": equal})


def stage_optimizer_instances(out_dir: Path) -> Row:
    """Megatron's hierarchical DP (two distributed-optimizer instances): on CUDA the sync runs on
    Megatron's communication stream, which only this stage exercises."""
    world = _world()
    if world < 2 or world % 2:
        return Row("optimizer-instances", "SKIP", f"needs an even number of GPUs, 2 or more; {world} here", {})
    base = SMALL + ["--train-iters", "6", "--global-batch-size", str(8 * world), "--overlap-grad-reduce",
                    "--ddp-bucket-size", "20000", "--use-distributed-optimizer", "--num-distributed-optimizer-instances",
                    "2"]
    compressed = base + ["--use-higgs", "--higgs-sync", "sparse", "--higgs-compression-ratio", "0.01",
                         "--higgs-min-bucket-numel", "0"]
    outs = run_ranks(train_variants, world, args=({"megatron": base, "none": base + [
        "--use-higgs", "--higgs-compressor", "none"], "compressed": compressed},), timeout=400)
    equal, why = _per_rank_equal(outs, "megatron", "none")
    replicas = all(torch.equal(value, out["params"]["compressed"][name]) for out in outs[1:]
                   for name, value in outs[0]["params"]["compressed"].items())
    ok = equal and replicas
    return Row("optimizer-instances", "PASS" if ok else "FAIL",
               f"DP={world} as 2 instances, 6 steps: compressor none {'bitwise equal to' if equal else 'differs from'} "
               f"Megatron DDP{'' if equal else ' (' + why + ')'}; at 1% the DP replicas "
               f"{'are equal' if replicas else 'differ'}", {"bitwise_equal": equal, "replicas_equal": replicas})


def stage_one_percent(out_dir: Path) -> list[Row]:
    iters = 12 if CUDA else 20
    base = _model() + ["--train-iters", str(iters), "--global-batch-size", str(8 * _world()),
                    "--log-interval", str(iters // 2), "--overlap-grad-reduce", "--use-higgs",
                    "--higgs-compression-ratio", "0.01", "--higgs-sync", "sparse", "--higgs-min-bucket-numel", "0"]
    variants = {selector: base + ["--higgs-compressor", selector, "--log-json", str(out_dir / f"one_percent_{selector}"
                                                                                  ".jsonl")]
                for selector in ("topk", "sampled-topk")}
    outs = run_ranks(train_variants, _world(), args=(variants,), timeout=550)
    rows = []
    for selector in variants:
        losses = _last_stage_losses(outs, selector)
        last = _records(outs, selector, "iteration")[-1]
        falls = len(losses) >= 4 and sum(losses[-2:]) < sum(losses[:2])
        share = last.get("compression_time_ms", 0.0) / last["elapsed_time_per_iteration_ms"]
        ratio = last["bytes_sent"] / last["dense_bytes"]
        total_params = sum(v.numel() for v in outs[0]["params"][selector].values())
        rows.append(Row(f"one-percent-{selector}", "PASS" if falls and ratio < 1 / 20 else "FAIL",
                        f"{total_params / 1e6:,.1f}M params{' bf16' if CUDA else ''}; loss {losses[0]:.3f} -> "
                        f"{losses[-1]:.3f}; bytes sent {ratio:.4f}x of dense; compression {share:.1%} of a "
                        f"{last['elapsed_time_per_iteration_ms']:.0f} ms step",
                        {"losses": losses, "bytes_ratio": ratio, "compression_share": share,
                         "step_ms": last["elapsed_time_per_iteration_ms"], "parameters": total_params}))
    return rows


def stage_compressor_throughput(out_dir: Path) -> Row:
    from higgs_megatron.compress.compressor import BucketPlan, ParamSlot, compress, make_selector

    device = torch.device("cuda" if CUDA else "cpu")
    n = 100_000_000 if CUDA else 4_000_000
    per = n // 8
    plan = BucketPlan(n, [ParamSlot(i * per, (i + 1) * per) for i in range(8)], min_param_numel=0, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(n, generator=generator, device=device)
    times, shortfall = {}, 0.0
    for name in ("topk", "sampled-topk"):
        selector = make_selector(name)
        compress(grad, plan, 0.01, selector)  # warm-up
        if CUDA:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            compress(grad, plan, 0.01, selector)
        if CUDA:
            torch.cuda.synchronize()
        times[name] = (time.perf_counter() - started) / 5
        if name == "sampled-topk":
            shortfall = selector.stats.shortfall
    speedup = times["topk"] / times["sampled-topk"]
    return Row("compressor-throughput", "PASS",
               f"{n / 1e6:.0f}M elements at 1%: exact {times['topk'] * 1e3:.1f} ms ({n / times['topk'] / 1e9:.2f} "
               f"G/s), sampled {times['sampled-topk'] * 1e3:.1f} ms ({speedup:.2f}x), shortfall {shortfall:.4f}",
               {"elements": n, "exact_ms": times["topk"] * 1e3, "sampled_ms": times["sampled-topk"] * 1e3,
                "speedup": speedup, "shortfall": shortfall})


def _onebit_codec(n: int, world: int, device: torch.device) -> tuple[float, str | None]:
    """One rank's codec for one bucket of ``n`` elements in a group of ``world``
    (``higgs_megatron_bench.codec``: its sign rows, as the owner of one shard the rows it
    receives summed and re-signed, the gathered rows decoded into the bucket): seconds, and
    which output of the fused kernels (Triton on CUDA) differs from the reference's (None: none)."""
    from higgs_megatron.compress.agreed import AgreedPlan
    from higgs_megatron_bench.codec import bucket_slots, first_difference, one_rank_codec, time_codec

    plan = AgreedPlan(n, bucket_slots(n), 4096, world, device, "sign", scored=False)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    residual = torch.zeros(1, plan.layout(1.0).width, device=device)
    differ = first_difference(one_rank_codec(plan, grad, 0, residual), one_rank_codec(plan, grad, 0, residual, fused=False))
    return sum(time_codec(plan, grad, repeats=5).values()), differ


def stage_onebit(out_dir: Path) -> Row:
    iters, world = 20, _world()  # a dense stage of 10 (the least --use-higgs derives 1-bit Adam for), then signs
    base = (MID if CUDA else SMALL) + ["--train-iters", str(iters), "--global-batch-size", str(8 * world),
                                       "--log-interval", "5", "--overlap-grad-reduce",
                                       "--lr-warmup-iters", "10", "--use-higgs", "--higgs-min-bucket-numel", "0"]
    variants = {name: base + extra + ["--log-json", str(out_dir / f"onebit{name[6:]}.jsonl")]
                for name, extra in (("onebit", []), ("onebit-distopt", ["--use-distributed-optimizer"]))}
    outs = run_ranks(train_variants_without_host_syncs, world, args=(variants,), timeout=550)
    figures, ok, values = [], True, {}
    for name in variants:
        losses = _last_stage_losses(outs, name)
        last = _records(outs, name, "iteration")[-1]
        replicas = all(torch.equal(value, out["params"][name][key]) for out in outs[1:]
                       for key, value in outs[0]["params"][name].items())
        falls = len(losses) >= 4 and sum(losses[-2:]) < sum(losses[:2])
        wire = last["wire_bytes"] / last["dense_wire_bytes"]
        ok = ok and falls and replicas and wire < 0.2
        figures.append(f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, replicas "
                       f"{'equal' if replicas else 'DIFFER'}, wire {wire:.4f}x of dense a step")
        values[name] = {"losses": losses, "replicas_equal": replicas, "wire_ratio": wire,
                        "step_ms": last["elapsed_time_per_iteration_ms"]}
    n = 100_000_000 if CUDA else 4_000_000
    codec, differ = _onebit_codec(n, 8, torch.device("cuda" if CUDA else "cpu"))
    ok = ok and differ is None
    step_ms = values["onebit"]["step_ms"]
    values["codec"] = {"elements": n, "ms": codec * 1e3, "share_of_step": codec * 1e3 / step_ms}
    figures.append(f"fused codec {'equal to' if differ is None else f'DIFFERS ({differ}) from'} the reference")
    figures.append(f"codec at {n / 1e6:.0f}M elements for 8 ranks {codec * 1e3:.1f} ms, {codec * 1e3 / step_ms:.1%} "
                   f"of the model's {step_ms:.0f} ms step{'' if CUDA else ' (CPU: a tiny model, not comparable)'}; "
                   f"no host sync in the sync path{'' if CUDA else ' (not checked without CUDA)'}")
    return Row("onebit", "PASS" if ok else "FAIL", "; ".join(figures), values)


def stage_async_save_resume(out_dir: Path) -> Row:
    work = Path(tempfile.mkdtemp(prefix="gpu-check-ckpt-"))
    try:
        # 4 of the large model's layers on CUDA: a checkpoint of about 200M parameters
        base = _model(layers=4) + ["--train-iters", "6", "--global-batch-size", str(8 * _world()),
                                   "--use-higgs", "--higgs-sync", "sparse", "--higgs-min-bucket-numel", "0"]
        variants = {
            "sync": base + ["--save", str(work / "sync"), "--save-interval", "3",
                            "--log-json", str(work / "sync.jsonl")],
            "async": base + ["--save", str(work / "async"), "--save-interval", "3", "--async-checkpoint",
                             "--log-json", str(work / "async.jsonl")],
            "resumed": base + ["--load", str(work / "async"), "--checkpoint-version", "3"],
        }
        outs = run_ranks(train_variants, _world(), args=(variants,), timeout=550)
        equal, why = _per_rank_equal(outs, "async", "resumed")
        sync_equal, _ = _per_rank_equal(outs, "sync", "async")
        sync_seconds = [e["seconds"] for e in _records(outs, "sync", "event") if e["event"] == "checkpoint_committed"]
        stalls = [e["stall_seconds"] for e in _records(outs, "async", "event")
                  if e["event"] == "checkpoint_started_in_background"]
        share = (stalls[-1] / sync_seconds[-1]) if stalls and sync_seconds else math.nan
        ok = equal and sync_equal and len(stalls) == 2
        return Row("async-save-resume", "PASS" if ok else "FAIL",
                   f"resumed from iteration 3: parameters {'bitwise equal' if equal else 'differ: ' + why} to the "
                   f"straight run; async stall {stalls[-1] * 1e3 if stalls else math.nan:.0f} ms = {share:.1%} of a "
                   f"synchronous save ({sync_seconds[-1] if sync_seconds else math.nan:.2f} s)",
                   {"bitwise_equal": equal, "stall_seconds": stalls, "sync_save_seconds": sync_seconds,
                    "stall_share": share})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stage_offload(out_dir: Path) -> Row:
    base = _model(layers=4) + ["--train-iters", "8", "--global-batch-size", str(8 * _world())]
    offload = base + ["--higgs-offload", "--log-json", str(out_dir / "offload.jsonl")]
    if not CUDA:  # host memory is the whole machine's: a scripted probe makes the drill deterministic
        offload += ["--higgs-offload-schedule", "0.5x2,0.95x3,0.5"]
    ballast = {"during": (3, 5), "nbytes": 8 << 30 if CUDA else 0}
    outs = run_ranks(train_variants, _world(), args=({"plain": base, "offload": offload}, ballast), timeout=550)
    equal, why = _per_rank_equal(outs, "plain", "offload")
    events = [e["event"] for e in _records(outs, "offload", "event")]
    left, back = events.count("optimizer_state_offloaded"), events.count("optimizer_state_reloaded")
    readings = next(out["readings"].get("offload", []) for out in outs if out["records"].get("offload"))
    _plot_offload(readings, out_dir / "offload.png")
    probe = "CUDA allocator probe with an 8 GiB ballast in steps 3-5" if CUDA else "scripted probe (CPU)"
    ok = equal and left >= 1 and back >= 1
    return Row("offload", "PASS" if ok else "FAIL",
               f"{probe}: state offloaded {left}x and reloaded {back}x; parameters "
               f"{'bitwise equal' if equal else 'differ: ' + why} to a run without offload",
               {"offloaded": left, "reloaded": back, "bitwise_equal": equal, "readings": readings})


def _plot_offload(readings: list, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no %s", path.name)
        return
    steps = [r[0] for r in readings]
    fig, axis = plt.subplots(figsize=(7, 3.5))
    axis.plot(steps, [r[1] / r[2] for r in readings], marker="o", label="peak device use")
    axis.plot(steps, [r[3] for r in readings], linestyle="--", label="threshold")
    axis.set_xlabel("iteration")
    axis.set_ylabel("fraction of device memory")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def stage_megatron_lm(out_dir: Path) -> Row:
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if not checkout:
        return Row("megatron-lm", "SKIP", "set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1)")
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-layers", "2",
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
             "--eval-iters", "0", "--eval-interval", "1000", "--train-iters", "8", "--global-batch-size",
             str(2 * _world()), "--use-higgs", "--higgs-sync", "sparse", "--higgs-compression-ratio", "0.01"]
    if not CUDA:
        flags += ["--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
                  "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                  "--no-bias-dropout-fusion", "--no-rope-fusion"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={_world()}",
               str(REPO / "patches" / "run_pretrain_gpt.py"), "--megatron-lm-path", checkout, *flags]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=550, cwd=REPO,
                          env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"})
    losses = [float(part.split(":")[1]) for line in proc.stdout.splitlines() if " iteration " in line
              for part in line.split("|") if part.strip().startswith("lm loss:")]
    ok = proc.returncode == 0 and len(losses) == 8 and sum(losses[-2:]) < sum(losses[:2])
    tail = "" if ok else f"; exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    return Row("megatron-lm", "PASS" if ok else "FAIL",
               f"pretrain_gpt.py with the patches, --use-higgs at 1%: loss "
               f"{losses[0] if losses else math.nan:.3f} -> {losses[-1] if losses else math.nan:.3f}{tail}",
               {"losses": losses, "returncode": proc.returncode})


def stage_transformer_engine(out_dir: Path) -> Row:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return Row("transformer-engine", "SKIP", "transformer-engine not installed: the local layer spec is used")
    if not CUDA:
        return Row("transformer-engine", "SKIP", "no CUDA: the TE spec needs a GPU")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-te-"))
    try:
        base = SMALL + ["--train-iters", "10", "--global-batch-size", str(8 * _world()), "--transformer-impl",
                        "transformer_engine", "--use-higgs", "--higgs-sync", "sparse", "--higgs-min-bucket-numel", "0"]
        outs = run_ranks(train_variants, _world(), args=({
            "te": base + ["--save", str(work / "te"), "--save-interval", "5"],
            "resumed": base + ["--load", str(work / "te"), "--checkpoint-version", "5"]},), timeout=400)
        losses = _last_stage_losses(outs, "te")
        equal, why = _per_rank_equal(outs, "te", "resumed")
        ok = len(losses) == 10 and sum(losses[-2:]) < sum(losses[:2]) and equal
        figures = (f"TE spec, --use-higgs: loss {losses[0]:.3f} -> {losses[-1]:.3f}; resumed from iteration 5 "
                   f"{'bitwise equal' if equal else 'differs: ' + why}")
        values = {"losses": losses, "resume_bitwise_equal": equal}
        if _world() % 2 == 0:  # the same checkpoint resharded to TP=2 (sharded_state_dict through TE modules)
            resharded = run_ranks(train_variants, _world(), args=({"tp2": base + [
                "--tensor-model-parallel-size", "2", "--load", str(work / "te"), "--checkpoint-version", "5",
                "--recovery-mode", "reshard"]},), timeout=400)
            after = _last_stage_losses(resharded, "tp2")
            ok = ok and len(after) == 5 and after[-1] < losses[0]
            figures += f"; resharded to TP=2: loss {after[0]:.3f} -> {after[-1]:.3f}"
            values["resharded_losses"] = after
        else:
            figures += "; reshard needs an even number of GPUs"
        return Row("transformer-engine", "PASS" if ok else "FAIL", figures, values)
    finally:
        shutil.rmtree(work, ignore_errors=True)


STAGES = {"ddp-oracle": stage_ddp_oracle, "optimizer-instances": stage_optimizer_instances,
          "one-percent": stage_one_percent,
          "compressor-throughput": stage_compressor_throughput, "onebit": stage_onebit,
          "async-save-resume": stage_async_save_resume,
          "offload": stage_offload, "megatron-lm": stage_megatron_lm, "transformer-engine": stage_transformer_engine}


def describe_machine() -> str:
    if not CUDA:
        return f"CPU figures: no CUDA here; {_world()} ranks over gloo, small models (torch {torch.__version__})"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return (f"{torch.cuda.device_count()} x {', '.join(names)}; NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}; "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check")
    parser.add_argument("--only", default=None, help="comma-separated stages: " + ", ".join(STAGES))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gpu_check: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = args.only.split(",") if args.only else list(STAGES)
    unknown = sorted(set(chosen) - set(STAGES))
    if unknown:
        parser.error(f"--only: unknown stage(s) {unknown}; expected some of {', '.join(STAGES)}")
    machine = describe_machine()
    log.info("%s", machine)
    rows: list[Row] = []
    for name in chosen:
        started = time.monotonic()
        log.info("stage %s ...", name)
        try:
            result = STAGES[name](args.out)
        except Exception as error:  # noqa: BLE001 - a failed stage is a FAIL row, and the others still run
            first_line = str(error).splitlines()[0][:300] if str(error) else ""
            result = Row(name, "FAIL", f"{type(error).__name__}: {first_line}")
            log.error("stage %s failed:\n%s", name, traceback.format_exc())
        for row in result if isinstance(result, list) else [result]:
            row.values["seconds"] = round(time.monotonic() - started, 1)
            rows.append(row)
            log.info("%s %s: %s", row.status, row.stage, row.figures)
    table = "\n".join([f"GPU check: {machine}", "", "| stage | result | figures |", "|---|---|---|"]
                      + [f"| {row.stage} | {row.status} | {row.figures} |" for row in rows])
    (args.out / "gpu_check.md").write_text(table + "\n")
    (args.out / "gpu_check.json").write_text(json.dumps({"machine": machine, "cuda": CUDA,
                                                         "rows": [asdict(row) for row in rows]}, indent=1, default=str))
    print(table, flush=True)
    return 1 if any(row.status == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
