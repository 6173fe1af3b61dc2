"""An iteration-based training loop shaped like nanoGPT's ``train.py``: a
global iteration counter that drives learning-rate warm-up, gradient
accumulation over micro-batches, the next batch prefetched inside the step,
and evaluation every ``eval_interval`` iterations.

State that only lives in Python variables (``iter_num``, the prefetched
``X, Y``, the last ``loss``, ``best_val``) is checkpointed with the model:
hindsight finds the variables the loops change. A SIGUSR1 or SIGTERM
resumes with the same counter and batch; a replay of a probe added after
the step loop (reading ``loss`` or ``iter_num``) sees the recorded values.

    python examples/iteration_train.py --rounds 6 --out final.pt
"""

import math
import time

import torch
from torch import nn

import hindsight as hs

rounds = hs.arg("rounds", 6)
eval_interval = hs.arg("eval_interval", 8)
accum = hs.arg("accum", 2)
warmup = hs.arg("warmup", 10)
lr_max = hs.arg("lr", 3e-3)
delay = hs.arg("delay", 0.0)  # seconds per iteration, to make interruption easy to test
out = hs.arg("out", "")

torch.manual_seed(0)
vocab, block, batch = 32, 16, 8
text = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(5))
train_data, val_data = text[:3600], text[3600:]


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block - 1, (batch,))
    x = torch.stack([data[i : i + block] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
    return x, y


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 64)
        self.head = nn.Linear(64, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.relu(self.emb(x)))
        return logits, nn.functional.cross_entropy(logits.view(-1, vocab), y.view(-1))


def get_lr(it: int) -> float:
    if it < warmup:
        return lr_max * (it + 1) / warmup
    return lr_max * 0.5 * (1 + math.cos(math.pi * min(1.0, (it - warmup) / (rounds * eval_interval))))


@torch.no_grad()
def estimate_loss(model: nn.Module) -> float:
    model.eval()
    g = torch.Generator().manual_seed(99)
    ix = torch.randint(len(val_data) - block - 1, (64,), generator=g)
    x = torch.stack([val_data[i : i + block] for i in ix])
    y = torch.stack([val_data[i + 1 : i + 1 + block] for i in ix])
    model.train()
    return model(x, y)[1].item()


model = Bigram()
opt = torch.optim.AdamW(model.parameters(), lr=lr_max)
iter_num = 0
best_val = 1e9
X, Y = get_batch("train")  # fetch the very first batch

with hs.checkpointing(model=model, optimizer=opt):
    for rnd in hs.loop("round", range(rounds)):
        for _ in hs.loop("step", range(eval_interval)):
            lr = get_lr(iter_num)
            for group in opt.param_groups:
                group["lr"] = lr
            for micro in range(accum):
                _, loss = model(X, Y)
                loss = loss / accum
                X, Y = get_batch("train")  # prefetch the next micro-batch
                loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            iter_num += 1
            print(f"iter {iter_num} {loss.item() * accum:.6f}", flush=True)
            if delay:
                time.sleep(delay)
        val_loss = estimate_loss(model)
        best_val = min(best_val, val_loss)
        hs.log("val_loss", val_loss)

if out:
    torch.save({"model": model.state_dict(), "iter_num": iter_num, "best_val": best_val}, out)
    print("done", flush=True)
