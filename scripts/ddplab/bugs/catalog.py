"""The bug lab's catalogue: every scenario, what it looks like, and where PyTorch says so.

``expect`` is the distinctive part of the symptom: a piece of the error text (error, hang) that
this torch prints, or, for a silent bug, what the giveaway number measures.  The tests check
that each broken version still produces it, so a reworded message fails loudly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import collectives, ddp_errors, sharding, silent

KINDS = ("error", "hang", "silent")


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str            # error / hang / silent: what the reader sees
    summary: str         # one line, for --list
    expect: str          # the distinctive part of the symptom (see above)
    raised_by: str       # the PyTorch (or gloo) source that produces the symptom
    diagnosis: str       # the tool or number that reveals it
    where: str = "ranks"  # ranks: in the shared launch; own: its own launch; main: no ranks

    def broken(self) -> Callable:
        return _function(self.name, "broken")

    def fixed(self) -> Callable:
        return _function(self.name, "fixed")


def _function(name: str, version: str) -> Callable:
    for module in (ddp_errors, collectives, silent, sharding):
        found = getattr(module, f"{name}_{version}", None)
        if found is not None:
            return found
    raise LookupError(f"no function {name}_{version}")


REDUCER = "torch/csrc/distributed/c10d/reducer.cpp"
GLOO_TIMEOUT = "gloo: third_party/gloo/gloo/transport/tcp/unbound_buffer.cc (the group's timeout)"

SCENARIOS = [
    Scenario("unused_parameter", "error",
             "a parameter that gets no gradient (an unused head)",
             "Expected to have finished reduction in the prior iteration",
             f"{REDUCER}, Reducer::ensure_prior_reduction_finished",
             "TORCH_DISTRIBUTED_DEBUG=INFO names the parameters"),
    Scenario("checkpoint_twice", "error",
             "shared weights under two reentrant checkpoints, find_unused_parameters=True",
             "Expected to mark a variable ready only once",
             f"{REDUCER}, Reducer::checkAndRaiseMarkedTwiceError",
             "TORCH_DISTRIBUTED_DEBUG=INFO names the parameter marked twice"),
    Scenario("checkpoint_silent", "silent",
             "the same model with DDP's defaults: no error, wrong gradients",
             "max |gradient − single process|",
             "nothing raises: DDP all-reduces a bucket before the second checkpoint's gradient",
             "comparing with one process on the whole batch"),
    Scenario("different_shapes", "error",
             "replicas whose parameter shapes differ (a vocabulary built per rank)",
             "appears not to match sizes of the same param in process 0",
             f"{REDUCER}, verify_params_across_processes (DDP's constructor)",
             "the message itself, on the rank that differs; rank 0 only times out"),
    Scenario("inplace_parameter", "error",
             "a parameter changed in place inside forward",
             "modified by an inplace operation",
             "torch/csrc/autograd/saved_variable.cpp, SavedVariable::unpack",
             "torch.autograd.set_detect_anomaly(True) shows the forward line"),
    Scenario("module_prefix", "error",
             "DDP's state dict (module.-prefixed keys) loaded into a bare model",
             'Unexpected key(s) in state_dict: "module.',
             "torch/nn/modules/module.py, Module.load_state_dict",
             "the message lists the missing and the unexpected keys"),
    Scenario("every_rank_saves", "silent",
             "every rank saves its own state to one path: the last writer wins",
             "ranks whose state can be read back",
             "nothing raises: each torch.save replaces the file",
             "reading the file back and counting whose state it holds"),
    Scenario("sampler_set_epoch", "silent",
             "DistributedSampler without set_epoch: the same order every epoch",
             "later epochs that repeat epoch 0's order",
             "nothing raises: DistributedSampler seeds its shuffle with seed + epoch",
             "comparing the orders of two epochs"),
    Scenario("same_augmentation", "silent",
             "the same augmentation randomness on every rank",
             "share of random draws equal on every rank",
             "nothing raises: one seed, one stream of random numbers, on every rank",
             "gathering the random draws of every rank"),
    Scenario("accumulation_no_sync", "silent",
             "gradient accumulation without no_sync: an all-reduce per micro-batch",
             "gradient all-reduces per optimizer step",
             "nothing raises: every backward of a DDP model all-reduces",
             "counting DDP's all-reduces with a comm hook"),
    Scenario("one_rank_collective", "hang",
             "a collective that only rank 0 calls (an all_reduce inside `if rank == 0`)",
             "Timed out waiting", GLOO_TIMEOUT,
             "py-spy dump of the stuck ranks; the flight recorder and torchfrtrace"),
    Scenario("mismatched_shapes", "hang",
             "an all_reduce whose tensor size differs across ranks",
             "Timed out waiting", GLOO_TIMEOUT,
             "TORCH_DISTRIBUTED_DEBUG=DETAIL reports the mismatch"),
    Scenario("uneven_inputs", "hang",
             "ranks with different numbers of batches, without Join",
             "Timed out waiting", GLOO_TIMEOUT,
             "counting the batches per rank; py-spy shows rank 0 inside backward"),
    Scenario("rank_crash", "error",
             "one rank raises (a bad label) while the other waits in the all-reduce",
             "out of bounds",
             "aten/src/ATen/native/LossNLL.cpp (the root cause, on rank 1)",
             "the first failure, with its traceback (mp.spawn here, torchrun's 'Root Cause')",
             where="own"),
    Scenario("port_taken", "error",
             "the rendezvous port is already taken by another job",
             "EADDRINUSE",
             "torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp (the store's listen)",
             "the message names the port; `ss -ltnp` names the process holding it",
             where="main"),
    Scenario("dist_before_init", "error",
             "a torch.distributed call before init_process_group",
             "Default process group has not been initialized",
             "torch/distributed/distributed_c10d.py, _get_default_group",
             "the traceback's last line of your code", where="main"),
    Scenario("skipped_gather", "hang",
             "a sharded model's forward that only rank 0 runs (validation under `if rank == 0`)",
             "Timed out waiting", GLOO_TIMEOUT,
             "py-spy dump: rank 0 inside fully_shard's pre-forward unshard (its all-gather), "
             "rank 1 in the barrier"),
    Scenario("local_norm_clip", "silent",
             "clip_grad_norm_ on the parameters of a model sharded by hand: each rank's own norm",
             "max |parameter − unsharded training|",
             "nothing raises: torch.nn.utils.clip_grad_norm_ sees plain tensors, this rank's "
             "shards, and clips by their norm (torch/nn/utils/clip_grad.py)",
             "the check: train an unsharded copy next to it, or gather the norm each rank used"),
    Scenario("save_one_rank", "error",
             "rank 0 saves the state dict of a fully_shard model: its own shards only",
             "size mismatch for",
             "torch/nn/modules/module.py, Module._load_from_state_dict (loading it later)",
             "the shapes in the message: half the rows of every weight"),
]

BY_NAME = {s.name: s for s in SCENARIOS}

# Seen only on GPUs: described, with their text, and not reproduced on this CPU machine.
GPU_ONLY = {
    "duplicate_gpu": {
        "summary": "every rank on cuda:0 (no torch.cuda.set_device(local_rank))",
        "text": "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1d000",
        "raised_by": "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (NCCL's "
                     "ncclInvalidUsage, reported by the process group)",
    },
    "map_location": {
        "summary": "a checkpoint loaded without map_location piles onto GPU 0",
        "text": "torch.OutOfMemoryError: CUDA out of memory (on GPU 0 only)",
        "raised_by": "torch/serialization.py: tensors go back to the device they were saved "
                     "from (cuda:0) unless map_location says otherwise",
    },
    "nccl_watchdog": {
        "summary": "an NCCL collective that never completes: the watchdog ends the job",
        "text": "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=…, "
                "OpType=ALLREDUCE, …) ran for 600000 milliseconds before timing out.",
        "raised_by": "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, the watchdog thread",
    },
}
