"""ShardedOptimizer (ZeRO-1 by hand) against DDP + ZeroRedundancyOptimizer and DDP + an ordinary
optimizer, on gloo CPU ranks: bit for bit.

ZeRO-1 changes who computes an update, not the update: the gradients are DDP's (all-reduced as
before), and each element's update is the same arithmetic on the same averaged gradient.  The
broadcast from the owner copies bits.  So parameters and optimizer state are asked to be equal
(max |Δ| == 0) at 2, 3 and 4 ranks, with AdamW and with SGD with momentum, after several steps.
"""

from __future__ import annotations

import pytest
import zero_workers
from test_naive_ddp import launch
from torch import nn

from ddplab.sharded_optimizer import partition_parameters

QUANTITIES = ["params_vs_unsharded", "params_vs_zero_redundancy", "state_vs_unsharded",
              "state_vs_zero_redundancy"]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}_ranks")
def zero1(request, tmp_path_factory):
    world_size = request.param
    results = launch(zero_workers.zero1_checks, world_size,
                     tmp_path_factory.mktemp(f"zero1_{world_size}"), timeout=300)
    return world_size, results


@pytest.mark.parametrize("optimizer", sorted(zero_workers.OPTIMIZERS))
@pytest.mark.parametrize("quantity", QUANTITIES)
def test_bitwise_equal_to_native(zero1, optimizer, quantity):
    world_size, results = zero1
    assert results[optimizer][quantity] == 0.0, f"{optimizer} at {world_size} ranks"


@pytest.mark.parametrize("case", ["one_group", "two_groups"])
def test_owner_map_is_zero_redundancy_optimizers(zero1, case):
    world_size, results = zero1
    maps = results["owner_maps"][case]
    assert maps["function"] == maps["native"], f"{case} at {world_size} ranks"
    assert maps["ours_owner"] == maps["native_owner"]


@pytest.mark.parametrize("optimizer", sorted(zero_workers.OPTIMIZERS))
def test_each_rank_holds_the_state_of_its_own_parameters_only(zero1, optimizer):
    world_size, results = zero1
    # Rank 0's optimizer has state for exactly the parameters native gives rank 0.
    owned = sorted(results["owner_maps"]["one_group"]["native"][0])
    assert results[optimizer]["owned_here"] == owned, f"at {world_size} ranks"


@pytest.mark.parametrize("optimizer", sorted(zero_workers.OPTIMIZERS))
def test_consolidated_state_dict_is_the_unsharded_optimizers(zero1, optimizer):
    _, results = zero1
    found = results[optimizer]
    assert found["consolidated_keys_equal"]
    assert found["consolidated_groups_equal"]
    assert found["consolidated_vs_unsharded"] == 0.0
    assert found["consolidated_vs_zero_redundancy"] == 0.0


@pytest.mark.parametrize("optimizer", sorted(zero_workers.OPTIMIZERS))
def test_reloaded_state_continues_bitwise(zero1, optimizer):
    _, results = zero1
    assert results[optimizer]["reload_continues_bitwise"] == 0.0


def test_a_learning_rate_scheduler_reaches_every_owner(zero1):
    # LambdaLR halves the rate every step through .param_groups: bitwise with plain AdamW.
    world_size, results = zero1
    assert results["scheduler"] == 0.0, f"at {world_size} ranks"


def test_state_dict_without_consolidating_on_that_rank_is_a_clear_error(zero1):
    _, results = zero1
    message = results["adamw"]["state_dict_elsewhere"]
    assert message.startswith("ShardedOptimizer: rank ")
    assert "consolidate_state_dict(to=" in message


def test_partition_is_greedy_largest_first_to_the_emptiest_rank():
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))  # 20, 5, 15, 3 elements
    w0, b0, w1, b1 = model.parameters()
    # 20 -> rank 0; 15 -> rank 1; 5 -> rank 1 (15 < 20); 3 -> rank 0 (20 == 20: the first)
    assert partition_parameters(model.parameters(), 2) == [[w0, b1], [w1, b0]]

