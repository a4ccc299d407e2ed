"""FullyShardedDP against FSDP2's ``fully_shard``, on gloo CPU ranks: bit for bit.

Both gather full parameters from the same shards (copies: exact), compute the same forward and
backward, and reduce-scatter each unit's gradients with ``ReduceOp.AVG``.  gloo's reduce-scatter
all-reduces the whole message and keeps a chunk, and its ring adds an element's N terms in an
order set by the element's offset in the message; so equal bits need every gradient element at
FSDP2's offset: the shard-major layout of ``torch._chunk_cat``.  With that layout, parameters and
AdamW state are equal (``== 0``) at 2, 3 and 4 ranks; with a DDP bucket's flat parameter-major
layout only at 2 ranks (two terms: a + b = b + a).
"""

from __future__ import annotations

import math

import fsdp_workers
import pytest
import torch
from test_naive_ddp import launch

from ddplab.fsdp_layout import (
    offsets,
    padded_rows,
    parameter_major,
    shard,
    shard_major,
    split_shards,
    unshard,
)

SHAPES = [p.shape for p in fsdp_workers.model().parameters()]
UNITS = [[p.shape for p in child.parameters()] for child in fsdp_workers.model().children()
         if any(True for _ in child.parameters())]
FLOAT32_U = 2.0 ** -24  # unit roundoff of float32


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}_ranks")
def bitwise(request, tmp_path_factory):
    """One launch per world size runs every case (process start-up dominates the time)."""
    world = request.param
    return world, launch(fsdp_workers.bitwise_cases, world,
                         tmp_path_factory.mktemp(f"fsdp{world}"), timeout=600)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return launch(fsdp_workers.three_rank_cases, 3, tmp_path_factory.mktemp("fsdp3"),
                  timeout=600)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """``fully_shard`` saved with DCP at 2 ranks, loaded at 3 (the same folder)."""
    folder = tmp_path_factory.mktemp("dcp")
    saved = launch(fsdp_workers.dcp_save, 2, folder, timeout=600)
    return saved, launch(fsdp_workers.dcp_resume, 3, folder, timeout=600)


# --- the layout, without ranks ----------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_major_is_fsdp2s_chunk_cat(world):
    tensors = [torch.randn(s) for s in SHAPES]
    assert torch.equal(shard_major(tensors, world), torch._chunk_cat(tensors, 0, world))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_and_rows_round_trip(world):
    tensors = [torch.randn(s) for s in SHAPES]
    message = shard_major(tensors, world)
    assert all(torch.equal(a, b) for a, b in zip(unshard(message.view(-1), SHAPES, world),
                                                 tensors, strict=True))
    for rank in range(world):
        pieces = split_shards(message[rank], SHAPES, rank, world)
        assert all(torch.equal(p, shard(t, rank, world)) for p, t in zip(pieces, tensors,
                                                                         strict=True))


def test_shards_follow_torch_chunk_and_may_be_empty():
    # 4 rows over 3 ranks: torch.chunk makes chunks of 2, so rank 2 owns nothing.
    assert [shard(torch.zeros(4, 5), r, 3).shape[0] for r in range(3)] == [2, 2, 0]
    assert [shard(torch.zeros(10), r, 4).shape[0] for r in range(4)] == [3, 3, 3, 1]


def test_offsets_name_the_same_element_in_both_layouts():
    tensors = [torch.arange(math.prod(s), dtype=torch.float32).view(s) + 1000 * i
               for i, s in enumerate(UNITS[0])]
    where = offsets(UNITS[0], 0, 58, 3)
    assert shard_major(tensors, 3).view(-1)[where["shard_major"]] == 58
    assert parameter_major(tensors, 3)[where["parameter_major"]] == 58


# --- FullyShardedDP against fully_shard ---------------------------------------------------------

@pytest.mark.parametrize("case", ["default", "keep_after_forward", "root_parameter",
                                  "accumulate_every_micro_batch", "accumulate_once_per_step",
                                  "full_state"])
def test_bit_for_bit_equal_to_fully_shard(bitwise, case):
    # Parameters (each rank's shard) and AdamW's exp_avg, exp_avg_sq and step after 4 steps
    # (2 steps of 3 micro-batches for the accumulation cases), the largest |diff| over ranks.
    world, results = bitwise
    assert results[case] == 0.0, f"{case} at {world} ranks"


def test_parameters_are_this_ranks_shards_as_fully_shard_holds_them(bitwise):
    _, results = bitwise
    assert results["parameters_are_shards"] == results["native_local_shapes"]
    assert results["full_state_names"]


def test_the_flat_layout_is_bitwise_at_two_ranks_only(bitwise):
    # Same sums at other offsets: from 3 ranks on, other orders of the N terms.  The bound: a
    # few float32 roundings per step on parameters of size ~1.
    world, results = bitwise
    if world == 2:
        assert results["flat_layout"] == 0.0
    else:
        assert 0.0 < results["flat_layout"] < 1e-6


def gloo_ring_chunk(offset: int, numel: int, world: int) -> int:
    """Which ring chunk an element falls in, for a small message (gloo ``allreduce.cc``,
    ``ring()``): ``numSegments = roundUp(max(ceil(bytes / maxSegmentBytes), 2N), N)`` is 2N here,
    each rank's chunk is 2 segments of ``ceil(numel / 2N)`` elements.  Chunk c starts at rank
    c - 1, and each rank adds its own term to what it received, so at 3 ranks chunk c is
    g_c + (g_(c-2) + g_(c-1)): chunk 0 sums (g1+g2)+g0, chunk 1 (g2+g0)+g1, chunk 2 (g0+g1)+g2."""
    return offset // (2 * math.ceil(numel / (2 * world)))


def test_the_element_whose_sum_order_differs(three_ranks):
    # The first element of the first unit whose averaged gradient differs between the layouts:
    # 0.weight[8, 2], owned by rank 2.  Shard-major puts it at offset 66 of the 96-element
    # message (ring chunk 2), the flat layout at 58 (chunk 1): gloo adds (g0+g1)+g2 for
    # fully_shard and (g2+g0)+g1 for the flat layout, then divides by 3.
    found = three_ranks["element"]
    assert (found["name"], found["position"]) == ("0.weight", [8, 2])
    assert found["offsets"] == {"owner": 2, "shard_major": 66, "parameter_major": 58}
    assert found["message_numel"] == 96
    assert [gloo_ring_chunk(found["offsets"][k], 96, 3)
            for k in ("shard_major", "parameter_major")] == [2, 1]
    assert found["native"] == found["orders"]["(g0+g1)+g2"]
    assert found["flat"] == found["orders"]["(g2+g0)+g1"]
    assert found["native"] != found["flat"]


def test_freed_after_forward_unless_asked_to_keep(bitwise):
    _, results = bitwise
    assert results["full_bytes_after_forward_keep_False"] == 0  # ZeRO-3: gathered again in bwd
    assert results["full_bytes_after_forward_keep_True"] == 4 * results["full_numel"]  # ZeRO-2
    assert results["full_bytes_after_backward_keep_True"] == 0  # resharded once backward ends
    assert results["full_bytes_after_no_grad_forward_keep_True"] == 0  # no backward to wait for
    assert results["parameters_between_keep_False"] == results["parameters_are_shards"]


def test_each_unit_is_freed_once_its_backward_is_done(bitwise):
    # fully_shard's post_backward reshards a unit right after its reduce-scatter, whether or
    # not it was kept gathered after forward.
    _, results = bitwise
    for keep in (False, True):
        assert results[f"later_units_gathered_in_backward_keep_{keep}"] == [[False] * 3]


def test_finishing_after_backward_is_a_no_op(bitwise):
    _, results = bitwise
    assert results["every_shard_has_grad"]
    assert results["finish_again_sends"] == {"all_gather": 0, "reduce_scatter": 0}
    assert results["finish_again_grads"] == 0.0


# --- gradient accumulation ----------------------------------------------------------------

def message_bytes(world: int) -> int:
    """One reduce-scatter of every unit (or one all-gather of every unit): padded float32."""
    return sum(4 * padded_rows(s[0], world) * world * math.prod(s[1:])
               for unit in UNITS for s in unit)


def test_accumulating_unsharded_sends_one_reduce_scatter_per_step(bitwise):
    world, results = bitwise
    steps, micro = 2, 3
    every, once = results["bytes_every_micro_batch"], results["bytes_once_per_step"]
    assert every["reduce_scatter"] == steps * micro * message_bytes(world)
    assert once["reduce_scatter"] == steps * message_bytes(world)
    # Gathers do not change: every micro-batch gathers each unit in forward and in backward.
    assert every["all_gather"] == once["all_gather"] == steps * micro * 2 * message_bytes(world)


def test_accumulating_unsharded_holds_full_gradients_until_the_synced_backward(bitwise):
    # Between micro-batches without sync a rank holds every full gradient (unpadded: autograd
    # made them); the synced backward reduce-scatters them and keeps only this rank's shards.
    _, results = bitwise
    assert results["held_without_sync"] == {"full": 4 * results["full_numel"], "shards": 0}
    assert results["held_after_sync"] == {"full": 0, "shards": 4 * results["shard_numel"]}
    assert results["sync_restored"]


def test_the_two_accumulations_round_differently(bitwise):
    # avg(g1) + avg(g2) + avg(g3) against avg(g1 + g2 + g3): other roundings, even at 2 ranks.
    # Each matches fully_shard in the same mode (above); they match each other to float32.
    _, results = bitwise
    assert 0.0 < results["modes_differ_by"] < 1e-6


# --- global-norm clipping -----------------------------------------------------------------

def test_global_norm_clip_matches_clip_grad_norm_on_the_full_model(three_ranks):
    # Not bitwise: the squares are summed per shard, then over ranks, where torch sums them per
    # whole parameter.  Two float32 sums of the same n non-negative terms are each within
    # (n - 1)·u of the exact sum, so within 2n·u of each other (the sqrt halves that); the
    # clipped gradients carry the same relative error plus one rounding of the product.
    clip = three_ranks["clip"]["clipped"]
    bound = 2 * clip["numel"] * FLOAT32_U
    assert clip["norm_rel"] <= bound
    assert clip["grads_rel"] <= bound + 2 * FLOAT32_U


def test_without_clipping_the_gradients_are_untouched(three_ranks):
    clip = three_ranks["clip"]["not_clipped"]
    assert clip["grads_rel"] == 0.0  # the coefficient is clamped to exactly 1


def test_clipping_on_the_local_shards_norm_diverges(three_ranks):
    # Each rank sees a fraction of the norm, so it scales by its own, larger coefficient.
    clip = three_ranks["clip"]["clipped"]
    assert clip["local_norm_rel"] > 0.1
    assert clip["local_grads_rel"] > 0.1
    # and the mistake is silent while no clipping happens:
    assert three_ranks["clip"]["not_clipped"]["local_grads_rel"] == 0.0


# --- DCP: saved at 2 ranks, resumed at 3 ------------------------------------------------------

def test_dcp_saves_fully_shards_dtensor_shards(resumed):
    saved, _ = resumed
    assert saved["sharded_types"] == ["DTensor"]


@pytest.mark.parametrize("case", ["loaded", "continued", "ours_loaded", "ours_continued"])
def test_a_two_rank_checkpoint_continues_bitwise_at_three_ranks(resumed, case):
    # The reference: the same 2-rank run's full state (parameters and AdamW state) loaded at 3
    # ranks.  DCP's resharded load, into fully_shard or into FullyShardedDP, must hold the same
    # bits, and train on from there to the same bits.
    _, results = resumed
    assert results[case] == 0.0


def test_the_optimizer_state_is_part_of_the_continuation(resumed):
    _, results = resumed
    assert results["without_optimizer_state"] > 0.0


def test_loading_a_full_state_dict_rewrites_the_dict_it_was_given(resumed):
    # torch 2.13's _load_model_state_dict ends with state_dict.update(local_state_dict): the
    # caller's full tensors are replaced by the DTensors made from them.  Read a file again
    # before reusing what it held.
    _, results = resumed
    assert results["full_after_set"] == ["DTensor"]
