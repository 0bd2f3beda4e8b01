"""Per-bucket path planning (``sync_plan``): pure code, one process, no process group."""

import pytest
import torch

from higgs_megatron.compress.compressor import ParamSlot
from higgs_megatron.config import HiggsConfig
from higgs_megatron.cost_model import LinkCosts
from higgs_megatron.grad_paths import path_at
from higgs_megatron.sync_plan import NodeShape, choose_form, plan_bucket

CPU = torch.device("cpu")
SLOTS = [ParamSlot(0, 100), ParamSlot(100, 60_100), ParamSlot(60_100, 100_100)]  # a bias, two weights
NUMEL = 100_100
ONE_NODE = NodeShape(nodes=1, ranks_per_node=4, local_index=0)
TWO_NODES = NodeShape(nodes=2, ranks_per_node=4, local_index=3)


def _plan(nodes=None, **config):
    """The bucket's paths over the DP group ``nodes`` spans (two ranks without ``nodes``)."""
    world = 2 if nodes is None else nodes.nodes * nodes.ranks_per_node
    return plan_bucket("group0.bucket0", NUMEL, torch.float32, SLOTS, HiggsConfig(**config), nodes, CPU, world=world)


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


def test_auto_plans_the_hierarchical_form_only_across_nodes_with_several_ranks_each():
    assert set(_plan(ONE_NODE).candidates) == {"sparse", "sharded"}  # not 'agreed': auto weighs no loss
    assert set(_plan(TWO_NODES).candidates) == {"sparse", "sharded", "hierarchical"}


def test_choose_form_keeps_the_cheaper_form_and_paths_follow_the_link():
    slow = LinkCosts.assumed(0.1, dp_size=8, ranks_per_node=4, distributed_optimizer=False,
                             compress_seconds_per_element=0.0, node_gbps=100.0)
    paths = _plan(TWO_NODES)
    entry = choose_form(paths, slow, 0.01)
    assert set(paths.candidates) == {"hierarchical"} and paths.slice is not None  # slow across, fast inside
    assert entry["path"] == "hierarchical" and set(entry["predicted_ms"]) == {"dense", "sparse", "sharded",
                                                                              "hierarchical"}
    assert path_at(paths, 0.01, slow) == "hierarchical"

    fast = LinkCosts.assumed(400.0, 8, 8, False, compress_seconds_per_element=1e-8, decode_seconds_per_element=1e-8)
    flat = _plan(ONE_NODE)
    entry = choose_form(flat, fast, 0.01)
    # the form is kept (the all-gather decodes eight payloads, the sharded form two), the path is dense
    assert flat.form == "sharded" and entry["path"] == "dense"
    assert path_at(flat, 0.01, fast) == "dense" and path_at(flat, 1.0, fast) == "dense"
    assert flat.paths == {0.01: "dense", 1.0: "dense"}  # decided once per density


def test_a_form_that_would_send_more_than_dense_goes_dense_at_every_group_size():
    """Never more than dense, counted as ring wire bytes at the group's size: int32 positions
    plus fp32 values pass dense at 1/2 with two ranks; an all-gather's bytes grow with the
    ranks: (P-1) x d x 8 bytes against 2(P-1)/P x 4, equal at d = 1/P. The agreed rows, without
    positions, stay under dense at 1/2 whatever the group's size, and at density 1 (every
    coordinate, plus the scores) do not."""
    def plan(world, sync):
        return plan_bucket("b", NUMEL, torch.float32, SLOTS, HiggsConfig(sync=sync, min_bucket_numel=0,
                                                                          min_param_numel=0), None, CPU, world=world)

    assert path_at(plan(2, "sparse"), 0.49, None) == "sparse" and path_at(plan(2, "sparse"), 0.51, None) == "dense"
    assert path_at(plan(8, "sparse"), 1 / 16, None) == "sparse"
    assert path_at(plan(16, "sparse"), 1 / 16, None) == "dense"
    for world in (2, 8, 64):  # a shard of several blocks (at 1,024 ranks this bucket's is under one)
        agreed = plan(world, "agreed")
        assert path_at(agreed, 0.5, None) == "agreed" and path_at(agreed, 1.0, None) == "dense"
        assert agreed.form_wire(0.5) < agreed.dense_wire() <= agreed.form_wire(1.0)


def test_the_sharded_forms_wire_per_rank_stays_flat_as_the_group_grows():
    """Each rank's top-k of each shard goes to its owner, the owners' top-k of the sums comes
    back: two exchanges of about one flat payload each, at any group size, where the all-gather
    of the whole payloads grows with the ranks. Its dense int8 step is a quarter of dense."""
    def plan(world, sync, distopt=False):
        return plan_bucket("b", NUMEL, torch.float32, SLOTS, HiggsConfig(sync=sync, min_bucket_numel=0,
                                                                          min_param_numel=0, payload="int4"),
                           None, CPU, world=world, distributed_optimizer=distopt)

    ratios = {}
    for world in (2, 8, 64):
        for distopt in (False, True):
            sharded = plan(world, "sharded", distopt)
            assert path_at(sharded, 0.25, None) == "sharded"
            ratios[world, distopt] = sharded.form_wire(0.25) / sharded.dense_wire()
            assert 0.24 <= sharded.form_wire(1.0, int8=True) / sharded.dense_wire() <= 0.27, (world, distopt)
    for distopt in (False, True):  # a bitmap and int4 values at a quarter: 1/16 of fp32, whatever P
        assert all(0.06 <= ratios[world, distopt] <= 0.07 for world in (2, 8, 64)), ratios
    assert plan(8, "sparse").form_wire(0.25) > 3.9 * plan(8, "sharded").form_wire(0.25)  # (P-1) against 2(P-1)/P


def test_auto_takes_the_all_gather_at_two_ranks_and_the_sharded_form_beyond():
    """At 1 Gbit/s a 5% payload is worth gathering from 1 peer; from 7 it is not: each link
    carries 7 payloads, where the sharded form's all-to-all and gather carry under 2 (and at 64
    ranks the all-gather would carry more than the dense all-reduce). At two ranks both move the
    same bytes and the all-gather, with fewer collectives, is kept (it lost less loss there)."""
    for world, path in ((2, "sparse"), (8, "sharded"), (64, "sharded")):
        costs = LinkCosts.assumed(1.0, world, world, False, compress_seconds_per_element=0.0)
        paths = plan_bucket("b", NUMEL, torch.float32, SLOTS, HiggsConfig(link_gbps=1.0, min_bucket_numel=0),
                            NodeShape(1, world, 0), CPU, world=world)
        assert choose_form(paths, costs, 0.05)["path"] == path and path_at(paths, 0.05, costs) == path, world


def test_auto_sends_a_dense_step_in_int8_only_where_the_cost_model_says_it_pays():
    """--higgs-dense-int8 under 'auto': on a slow link the dense step goes as int8 through the
    form (a quarter of the bytes); on a link fast enough that compressing costs more than it
    saves, it stays Megatron's own dense step."""
    config = HiggsConfig(link_gbps=1.0, min_bucket_numel=0, payload="int4", dense_int8=True)
    for gbps, compress, pays in ((1.0, 1e-9, True), (400.0, 1e-7, False)):
        costs = LinkCosts.assumed(gbps, 8, 8, False, compress_seconds_per_element=compress,
                                  decode_seconds_per_element=compress)
        paths = plan_bucket("b", NUMEL, torch.float32, SLOTS, config, NodeShape(1, 8, 0), CPU, world=8)
        choose_form(paths, costs, 0.25)
        assert paths.dense_in_int8 and paths.int8_pays(costs) is pays and paths.int8_pays(None), gbps


def test_an_owner_sending_back_more_of_its_sum_is_priced_so():
    """--higgs-sum-density-factor 2: the gather of the owners' rows carries twice the density
    (bitmap positions cost the same), the all-to-all the same; still flat in P and below dense."""
    def wire(world, factor):
        paths = plan_bucket("b", NUMEL, torch.float32, SLOTS, HiggsConfig(sync="sharded", min_bucket_numel=0,
                                                                          payload="int4", sum_density_factor=factor),
                            None, CPU, world=world)
        return paths.form_wire(0.25) / paths.dense_wire()
    for world in (8, 64):
        assert 1.2 * wire(world, 1) < wire(world, 2) < 1.6 * wire(world, 1) < 0.2, world


def test_the_sharded_form_refuses_wide_values_of_a_narrower_gradient():
    """The owner sums in fp32 and sends the sum back in the payload's values: 'wide' values are
    the gradient's dtype, so a bf16 bucket on the sharded form would be read as fp32 on the way
    back. Named under 'sharded'; under 'auto' the all-gather stays its form."""
    def plan(sync):
        return plan_bucket("group0.bucket0", NUMEL, torch.bfloat16, SLOTS,
                           HiggsConfig(sync=sync, payload="wide", min_bucket_numel=0), None, CPU, world=8)
    with pytest.raises(ValueError, match="--higgs-payload wide needs fp32 gradients"):
        plan("sharded")
    assert set(plan("auto").candidates) == {"sparse"}


def test_a_dense_bucket_under_optimizer_instances_prices_megatrons_whole_step():
    """With two distributed-optimizer instances of four ranks, Megatron's dense step is the
    reduce-scatter inside the instance and the shard's all-reduce across the two: the dense
    path prices both, with the formula ``ddp.megatron_dense_wire`` counts them by (more than
    the reduce-scatter alone)."""
    from higgs_megatron.reduce.wire import dense_wire_bytes

    config = HiggsConfig(min_bucket_numel=10 ** 9)  # this bucket stays dense
    paths = plan_bucket("b", NUMEL, torch.float32, SLOTS, config, NodeShape(2, 4, 0, instances=True), CPU, world=4,
                        distributed_optimizer=True)
    assert paths.form is None and path_at(paths, 0.25, None) == "dense"
    assert paths.plain_dense_wire() == dense_wire_bytes(4 * NUMEL, 4, True, instances=2)
    assert paths.plain_dense_wire() > dense_wire_bytes(4 * NUMEL, 4, True)
