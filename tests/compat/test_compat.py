"""The compatibility boundary (``higgs_megatron.compat``): the version check, the symbol check
against the installed megatron-core, the one rebind helper. One process."""

import argparse
import ast
import logging
import sys
import types

import pytest

from higgs_megatron.compat import forks, symbols, versions
from higgs_megatron.compat.forks import Fork, fingerprint, fork_problems
from higgs_megatron.compat.groups import replace_groups
from higgs_megatron.compat.rebind import Rebinds, rebound
from higgs_megatron.compat.symbols import Symbol, check_symbols, symbol_problems
from higgs_megatron.compat.versions import UntestedMegatron, check_megatron_core, supported
from higgs_megatron.runtime.exits import UsageError
from higgs_megatron.runtime.run_config import PRETRAIN, run_config_from_args
from higgs_megatron.training.arguments import build_parser


def test_the_supported_releases_are_one_exact_and_one_series():
    assert supported("0.16.1") and supported("0.19.2") and supported("0.19.0")
    assert not supported("0.16.0") and not supported("0.17.0") and not supported("0.20.1")
    assert supported(versions.megatron_core_version()), "the installed release is one we test"


def test_an_untested_release_is_refused_naming_it_unless_asked_then_said(caplog):
    with pytest.raises(UntestedMegatron, match=r"megatron-core 0.17.1 is installed; .*0.16.1 and 0.19.x.*"
                                               r"--higgs-allow-untested-megatron"):
        check_megatron_core(version="0.17.1")
    with caplog.at_level(logging.WARNING, logger=versions.__name__):
        assert check_megatron_core(allow_untested=True, version="0.17.1") == "0.17.1"
    assert "running anyway (--higgs-allow-untested-megatron)" in caplog.text


def test_the_installed_release_has_the_bodies_we_read_of_what_we_re_implement():
    assert fork_problems() == []


def fingerprint_of_source(source: str) -> str:
    return forks.fingerprint_node(ast.parse(source).body[0])


def test_a_body_fingerprint_ignores_comments_layout_and_docstrings_not_code():
    plain = "def sync(self, force):\n    scale = 2\n    return self.reduce(scale * force)\n"
    reworded = ('def sync(self, force):\n    """Reduce."""\n    # the scale\n    scale = 2\n'
                '    return self.reduce(\n        scale * force)  # reduced\n')
    changed = "def sync(self, force):\n    scale = 2\n    self.drain()\n    return self.reduce(scale * force)\n"
    assert fingerprint_of_source(reworded) == fingerprint_of_source(plain)
    assert fingerprint_of_source(changed) != fingerprint_of_source(plain)


def test_a_release_whose_re_implemented_body_changed_is_refused_naming_it_unless_asked(monkeypatch, caplog,
                                                                                      tmp_path):
    (tmp_path / "fake_megatron_forks.py").write_text(
        "class Group:\n    def start_grad_sync(self, force_all_reduce=False):\n        self.drain()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fork = Fork("fake_megatron_forks:Group.start_grad_sync", {"0.16.1": "0" * 16}, "ddp.HiggsBucketGroup.start_grad_sync")
    monkeypatch.setattr(versions, "fork_problems", lambda: [fork.problem()])
    with pytest.raises(UntestedMegatron, match=r"fake_megatron_forks:Group.start_grad_sync is not the body of any "
                                               r"release ddp.HiggsBucketGroup.start_grad_sync follows \(0.16.1\).*"
                                               r"--higgs-allow-untested-megatron"):
        check_megatron_core(version="0.16.1")
    with caplog.at_level(logging.WARNING, logger=versions.__name__):
        assert check_megatron_core(allow_untested=True, version="0.16.1") == "0.16.1"
    assert "upstream changed what we re-implement; running anyway" in caplog.text
    read = Fork(fork.path, {"0.16.1": fingerprint(fork.installed())}, fork.ours)
    assert read.problem() is None


def test_every_private_symbol_we_rely_on_is_as_expected_in_the_installed_release():
    assert symbol_problems() == []


def test_a_missing_or_reshaped_symbol_is_named():
    module = types.ModuleType("fake_megatron_module")
    module.Group = type("Group", (), {"start_grad_sync": lambda self, other: None})
    sys.modules[module.__name__] = module
    try:
        reshaped = Symbol("fake_megatron_module:Group.start_grad_sync", ("self", "force_all_reduce"), "overridden")
        missing = Symbol("fake_megatron_module:Group.finish_grad_sync", None, "overridden too")
        problems = symbol_problems([reshaped, missing])
        assert problems == ["fake_megatron_module:Group.start_grad_sync takes (self, other); expected "
                            "(self, force_all_reduce, ...) (overridden)",
                            "fake_megatron_module:Group.finish_grad_sync is missing (overridden too)"]
        with pytest.raises(symbols.SymbolMismatch, match="finish_grad_sync is missing"):
            check_symbols([missing])
    finally:
        del sys.modules[module.__name__]


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                                      "--seq-length", "8", "--micro-batch-size", "1", *argv])


def test_a_front_end_refuses_an_untested_release_before_anything_else(monkeypatch):
    breaks_a_rule = _args("--use-higgs", "--higgs-link-gbps", "10", "--higgs-sync", "sparse")
    with pytest.raises(UsageError, match="--higgs-link-gbps"):
        run_config_from_args(breaks_a_rule, PRETRAIN, 2, 10, 0)  # a supported release: the rule speaks
    monkeypatch.setattr(versions, "megatron_core_version", lambda: "0.18.0")
    with pytest.raises(UsageError, match=r"megatron-core 0.18.0 is installed"):
        run_config_from_args(breaks_a_rule, PRETRAIN, 2, 10, 0)
    assert run_config_from_args(_args("--use-higgs", "--higgs-allow-untested-megatron"), PRETRAIN, 2, 10, 0)


def test_the_flag_never_skips_the_symbol_check(monkeypatch):
    monkeypatch.setattr(symbols, "MEGATRON_CORE", (Symbol("megatron.core.distributed:NoSuchClass", None, "needed"),))
    with pytest.raises(UsageError, match=r"megatron.core.distributed:NoSuchClass is missing \(needed\)"):
        run_config_from_args(_args("--use-higgs", "--higgs-allow-untested-megatron"), PRETRAIN, 2, 10, 0)


def test_rebinds_keep_the_first_original_and_restore_everything():
    owner = types.SimpleNamespace(run=lambda: "original", build="plain")
    first = owner.run
    rebinds = Rebinds()
    rebinds.rebind(owner, "run", lambda: "wrapped")
    rebinds.rebind(owner, "run", lambda: "wrapped again")
    rebinds.rebind(owner, "build", "patched")
    assert owner.run() == "wrapped again" and rebinds.original(owner, "run") is first
    rebinds.restore()
    assert owner.run is first and owner.build == "plain"
    rebinds.rebind(owner, "run", lambda: "again")  # restored means forgotten: the next original is the current one
    assert rebinds.original(owner, "run") is first
    rebinds.restore()
    assert owner.run is first


def test_a_rebound_block_puts_the_names_back_whatever_ends_it():
    owner = types.SimpleNamespace(run="original", build="plain")
    with pytest.raises(KeyError):
        with rebound((owner, "run", "patched"), (owner, "build", "patched")):
            assert owner.run == owner.build == "patched"
            raise KeyError("the block fails")
    assert owner.run == "original" and owner.build == "plain"


def test_group_references_are_replaced_by_identity():
    old, new, other = object(), object(), object()
    holder = types.SimpleNamespace(dp=old, alias=old, tp=other, name="dp")
    replace_groups([holder], {id(old): (old, new)})
    assert holder.dp is new and holder.alias is new and holder.tp is other and holder.name == "dp"



def test_the_graph_replay_wait_follows_the_installed_releases_own_bucket_group():
    """0.19's start_grad_sync waits for CUDA-graph replays, 0.16.1's does not: ours does where it does."""
    from higgs_megatron.compat.buckets import WAITS_FOR_GRAPH_REPLAYS

    assert WAITS_FOR_GRAPH_REPLAYS == (versions.series(versions.MEGATRON_CORE_VERSION) != "0.16")


def _ddp_option(field: str):
    """A DDP option, tested where the installed megatron-core has it (0.16.1 lacks the fp32 local accumulation)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return pytest.param(field, marks=pytest.mark.skipif(
        not hasattr(DistributedDataParallelConfig(), field),
        reason=f"megatron-core {versions.MEGATRON_CORE_VERSION} has no DistributedDataParallelConfig.{field}"))


@pytest.mark.parametrize("field", [_ddp_option("reduce_scatter_with_fp32_accumulation"),
                                   _ddp_option("param_name_patterns_for_fp32_local_accumulation")])
def test_higgs_ddp_refuses_a_ddp_option_that_changes_megatrons_own_reduction(field):
    from megatron.core.distributed import DistributedDataParallelConfig

    from higgs_megatron.ddp import UNSUPPORTED_DDP_OPTIONS, HiggsConfigurationError, HiggsDDP

    ddp_config = DistributedDataParallelConfig()
    setattr(ddp_config, field, True if field.startswith("reduce") else ["*.weight"])
    with pytest.raises(HiggsConfigurationError, match=rf"DistributedDataParallelConfig.{field} \(Megatron-LM's "
                                                      rf"{UNSUPPORTED_DDP_OPTIONS[field]}\)"):
        HiggsDDP(None, ddp_config, None)  # refused before Megatron's DDP is built: no process group needed
