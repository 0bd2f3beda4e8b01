"""Per-bucket path planning (``sync_plan``): pure code, one process, no process group."""

import pytest
import torch

from higgs_megatron.compress.compressor import ParamSlot
from higgs_megatron.config import HiggsConfig
from higgs_megatron.cost_model import LinkCosts
from higgs_megatron.sync_plan import NodeShape, choose_form, path_at, plan_bucket

CPU = torch.device("cpu")
SLOTS = [ParamSlot(0, 100), ParamSlot(100, 60_100), ParamSlot(60_100, 100_100)]  # a bias, two weights
NUMEL = 100_100
ONE_NODE = NodeShape(nodes=1, ranks_per_node=4, local_index=0)
TWO_NODES = NodeShape(nodes=2, ranks_per_node=4, local_index=3)


def _plan(nodes=None, **config):
    return plan_bucket("group0.bucket0", NUMEL, torch.float32, SLOTS, HiggsConfig(**config), nodes, CPU)


@pytest.mark.parametrize("config", [dict(compressor="none"), dict(sync="dense"), dict(min_bucket_numel=NUMEL + 1),
                                    dict(sync="hierarchical")], ids=["none", "dense", "small-bucket", "one-node"])
def test_buckets_that_always_stay_dense_have_no_form(config):
    paths = _plan(ONE_NODE, **config)
    assert paths.form is None and paths.plan is None and path_at(paths, 0.01, None) == "dense"


def test_sparse_plans_the_whole_bucket_with_small_parameters_sent_whole():
    paths = _plan(None, sync="sparse")
    assert paths.form == "sparse" and paths.slice is None and path_at(paths, 0.01, None) == "sparse"
    assert paths.plan.numel == NUMEL and paths.plan.n_always == 100
    assert paths.plan.k_selected(0.01) == 600 + 400


def test_hierarchical_plans_this_ranks_slice_of_the_node_reduced_bucket():
    paths = _plan(TWO_NODES, sync="hierarchical")
    size = -(-NUMEL // 4)  # 25,025 per rank; the last rank's slice runs past the bucket's end
    assert paths.form == "hierarchical" and paths.slice == (3 * size, NUMEL)
    assert paths.plan.numel == size
    assert [(u.start, u.end) for u in paths.plan.units] == [(0, NUMEL - 3 * size)]  # the second weight's tail


def test_auto_plans_both_forms_only_across_nodes_with_several_ranks_each():
    assert set(_plan(ONE_NODE).candidates) == {"sparse"}
    assert set(_plan(TWO_NODES).candidates) == {"sparse", "hierarchical"}


def test_choose_form_keeps_the_cheaper_form_and_paths_follow_the_link():
    slow = LinkCosts.assumed(0.1, dp_size=8, ranks_per_node=4, distributed_optimizer=False,
                             compress_seconds_per_element=0.0, node_gbps=100.0)
    paths = _plan(TWO_NODES)
    entry = choose_form(paths, slow, 0.01)
    assert set(paths.candidates) == {"hierarchical"} and paths.slice is not None  # slow across, fast inside
    assert entry["path"] == "hierarchical" and set(entry["predicted_ms"]) == {"dense", "sparse", "hierarchical"}
    assert path_at(paths, 0.01, slow) == "hierarchical"

    fast = LinkCosts.assumed(400.0, 8, 8, False, compress_seconds_per_element=1e-8)
    flat = _plan(ONE_NODE)
    entry = choose_form(flat, fast, 0.01)
    assert flat.form == "sparse" and entry["path"] == "dense"  # the form is kept, the path is dense
    assert path_at(flat, 0.01, fast) == "dense" and path_at(flat, 1.0, fast) == "dense"
    assert flat.paths == {0.01: "dense", 1.0: "dense"}  # decided once per density


def test_a_payload_larger_than_the_bucket_never_takes_the_sparse_path_under_auto():
    costs = LinkCosts.assumed(1.0, 2, 2, False, compress_seconds_per_element=0.0)
    paths = _plan(NodeShape(1, 2, 0))
    choose_form(paths, costs, 0.01)
    assert path_at(paths, 0.01, costs) == "sparse"
    assert path_at(paths, 0.9, costs) == "dense"  # int32 position + value per coordinate: larger than dense
