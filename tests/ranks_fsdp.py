"""An FSDP2 training loop recorded with hs.loop under torchrun (gloo, CPU),
for test_ranks.py: every Linear is sharded over the ranks, AdamW, per-rank
dropout streams; rank 0 prints the whole weights' sum at the end.
ZOO_DEVICE=cuda: the model and the data on the rank's GPU, NCCL."""

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import hindsight as hs

device = torch.device(os.environ.get("ZOO_DEVICE", "cpu"))
if device.type == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
rank = dist.get_rank()
torch.manual_seed(0)
# Wide enough that each rank's piece of the first weight (320 KB) is a chunk
# of its own, not packed with the rank's small items.
m = torch.nn.Sequential(torch.nn.Linear(8, 20000), torch.nn.Dropout(0.1), torch.nn.Linear(20000, 4)).to(device)
for layer in m:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(m)
opt = torch.optim.AdamW(m.parameters(), lr=0.01)
torch.manual_seed(100 + rank)
data = [(torch.randn(16, 8).to(device), torch.randn(16, 4).to(device)) for _ in range(6)]
with hs.checkpointing(model=m, optimizer=opt):
    for _epoch in hs.loop("epoch", range(3)):
        for x, y in hs.loop("step", data):
            loss = torch.nn.functional.mse_loss(m(x), y)
            opt.zero_grad()
            # ZOO_RANK1_SCALE=x (ZOO_RANK0_SCALE): rank 1's (0's) gradient scaled (it computes otherwise).
            (loss * float(os.environ.get(f"ZOO_RANK{rank}_SCALE", "1"))).backward()
            opt.step()  # the gradients stay: a mid-epoch checkpoint keeps them, sharded
            hs.log("loss", loss.item())
            time.sleep(float(os.environ.get("ZOO_SLEEP", "0")))
whole = {k: v.full_tensor() for k, v in m.state_dict().items()}
if rank == 0:
    print("FINAL", repr(sum(v.double().sum().item() for v in whole.values())))
dist.destroy_process_group()
