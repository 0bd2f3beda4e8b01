"""Node grouping in one process: the node-split groups keep the group's order."""

from higgs_megatron.topology import split_by_node


def test_split_by_node_keeps_the_group_order():
    assert split_by_node([4, 0, 5, 1], {0: "x", 1: "y", 4: "y", 5: "x"}) == [[4, 1], [0, 5]]
