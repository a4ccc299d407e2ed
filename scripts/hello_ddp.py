"""Hello, DDP: a complete data-parallel training script in plain torch.distributed.

    torchrun --standalone --nproc-per-node 2 scripts/hello_ddp.py   # torchrun starts 2 ranks
    python scripts/hello_ddp.py                                     # the script spawns 2 ranks

Every rank trains its own replica of a small model on its own share of the data; DDP averages
the gradients during backward, so the replicas stay identical.  Rank 0 saves the trained model
to hello_ddp.pt (or to the path given as the first argument).  Copy this file; the book's
chapters open up each of its lines.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # now, before any group exists (why: section 5 of its page)
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


# --8<-- [start:setup]
def setup() -> torch.device:
    """Join the other ranks (torchrun's environment says where) and pick this rank's device."""
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on its machine
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    on_gpu = torch.cuda.device_count() >= ranks_here  # one GPU per rank, or none at all
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)  # before any CUDA work, or every rank uses GPU 0
    dist.init_process_group("nccl" if on_gpu else "gloo")  # reads RANK, WORLD_SIZE, MASTER_*
    return device
# --8<-- [end:setup]


# --8<-- [start:data]
def make_data(n: int = 2048) -> TensorDataset:
    """The same synthetic regression data on every rank: y = x·w + noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)
# --8<-- [end:data]


def train(device: torch.device, checkpoint: str, epochs: int = 5) -> None:
    """This rank's share of the training; rank 0 saves the model at the end."""
    # --8<-- [start:model]
    data = make_data()
    # This rank's 1/N of the data; drop_last=True: equal shares, never padded (training).
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    torch.manual_seed(0)  # same initial weights everywhere (DDP also copies rank 0's)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    # --8<-- [end:model]
    # --8<-- [start:loop]
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank
        total = torch.zeros(2, device=device)  # sum of batch losses, number of batches
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients while backward runs
            optimizer.step()  # identical gradients, identical step: replicas stay equal
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)  # sum over all ranks: the mean loss of the whole epoch
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: mean loss {(total[0] / total[1]).item():.4f}")
    if dist.get_rank() == 0:  # one writer; model.module is the model DDP wraps
        torch.save(model.module.state_dict(), checkpoint)
        print(f"saved {checkpoint}")
    # --8<-- [end:loop]


# --8<-- [start:main]
def main(checkpoint: str) -> None:
    """One rank's life: join the group, train, leave the group (even after an error)."""
    device = setup()
    try:
        train(device, checkpoint)
    finally:  # train() has returned, so its DDP, which holds the group too, is gone
        dist.destroy_process_group()
# --8<-- [end:main]


# --8<-- [start:launch]
def spawned(rank: int, world_size: int, checkpoint: str) -> None:
    """Started by mp.spawn: set by hand what torchrun would have put in the environment."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    main(checkpoint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # port 0: the operating system picks a free one
        return s.getsockname()[1]


if __name__ == "__main__":
    checkpoint = sys.argv[1] if len(sys.argv) > 1 else "hello_ddp.pt"
    if "RANK" in os.environ:  # torchrun started this process: it is already one rank
        main(checkpoint)
    else:  # plain python: start 2 ranks on this machine
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        mp.spawn(spawned, args=(2, checkpoint), nprocs=2)
# --8<-- [end:launch]
