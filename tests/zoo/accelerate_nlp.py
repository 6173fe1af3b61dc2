# Adapted from huggingface/accelerate, examples/nlp_example.py
# (https://github.com/huggingface/accelerate/blob/main/examples/nlp_example.py, Apache-2.0).
# Shape kept: a `training_function(config, args)` called from main() with a
# config dict and argparse flags, get_dataloaders() with a padding collate_fn
# (train shuffled with drop_last, eval not), a batch size above
# MAX_GPU_BATCH_SIZE turned into gradient accumulation done by hand
# (`loss / gradient_accumulation_steps`, optimizer step when
# `step % gradient_accumulation_steps == 0`), AdamW and a linear schedule with
# warm-up, `accelerator.prepare(...)` of all four, `model(**batch)`,
# evaluation with `accelerator.gather_for_metrics` after each epoch and
# `accelerator.print` of accuracy and F1.
# Changed for the zoo: hindsight (hs.args, hindsight.accelerate.checkpointing,
# hs.loop, hs.log of what the script prints), a small sequence classifier
# (embedding, one transformer encoder layer, mean pooling) written here in
# place of bert-base-cased, seeded synthetic sentence pairs in place of GLUE
# MRPC and its tokenizer, accuracy/F1 computed here in place of `evaluate`,
# the linear warm-up schedule as a LambdaLR, the zoo test hook (zoo_hook), and
# `# zoo:` comments where the driver inserts probe statements.
import argparse
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import AdamW
from torch.utils.data import DataLoader, Dataset

from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed

import hindsight as hs
import hindsight.accelerate as hsa
import zoo_hook

MAX_GPU_BATCH_SIZE = 8
EVAL_BATCH_SIZE = 16
VOCAB, PAD = 64, 0


class SyntheticPairs(Dataset):
    """Stands in for GLUE MRPC tokenized: variable-length token ids of a
    sentence pair, labelled 1 when the two halves share most tokens."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            length = int(torch.randint(6, 17, (1,), generator=g))
            a = torch.randint(1, VOCAB, (length,), generator=g)
            label = int(torch.randint(0, 2, (1,), generator=g))
            b = a.clone() if label else torch.randint(1, VOCAB, (length,), generator=g)
            self.items.append({"input_ids": torch.cat([a, b]), "labels": label})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate_fn(examples):
    # Pad to the longest sequence of the batch (the tokenizer's padding="longest").
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), longest), PAD, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = e["input_ids"]
    return {
        "input_ids": ids,
        "attention_mask": (ids != PAD).long(),
        "labels": torch.tensor([e["labels"] for e in examples]),
    }


def get_dataloaders(accelerator: Accelerator, batch_size: int = 16, train_size: int = 192):
    with accelerator.main_process_first():
        train_set, eval_set = SyntheticPairs(train_size, seed=1), SyntheticPairs(64, seed=2)
    train_dataloader = DataLoader(
        train_set, shuffle=True, collate_fn=collate_fn, batch_size=batch_size, drop_last=True
    )
    eval_dataloader = DataLoader(eval_set, shuffle=False, collate_fn=collate_fn, batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


@dataclass
class SequenceClassifierOutput:
    """What transformers' model output carries here: the loss and the logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class SequenceClassifier(nn.Module):
    """Stands in for AutoModelForSequenceClassification: returns .loss and .logits."""

    def __init__(self, dim=32, num_labels=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.encoder = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (h * mask).sum(1) / mask.sum(1)
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def accuracy_and_f1(predictions, references):
    tp = int(((predictions == 1) & (references == 1)).sum())
    fp = int(((predictions == 1) & (references == 0)).sum())
    fn = int(((predictions == 0) & (references == 1)).sum())
    accuracy = float((predictions == references).float().mean())
    f1 = 2 * tp / max(1, 2 * tp + fp + fn)
    return {"accuracy": accuracy, "f1": f1}


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    # If the batch size is too big we use gradient accumulation
    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size, args.train_size)
    model = SequenceClassifier()
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=4,
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    with hsa.checkpointing(accelerator):
        for epoch in hs.loop("epoch", range(num_epochs)):
            model.train()
            for step, batch in hs.loop("step", enumerate(train_dataloader)):
                outputs = model(**batch)
                loss = outputs.loss
                loss = loss / gradient_accumulation_steps
                accelerator.backward(loss)
                # zoo: step-probe: sum(p.grad.norm().item() for p in model.parameters())
                if step % gradient_accumulation_steps == 0:
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
                hs.log("loss", loss.item())
                zoo_hook.step(epoch, step)

            model.eval()
            all_predictions, all_references = [], []
            for step, batch in enumerate(eval_dataloader):
                with torch.no_grad():
                    outputs = model(**batch)
                predictions = outputs.logits.argmax(dim=-1)
                predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
                all_predictions.append(predictions)
                all_references.append(references)
            eval_metric = accuracy_and_f1(torch.cat(all_predictions), torch.cat(all_references))
            accelerator.print(f"epoch {epoch}:", eval_metric)
            hs.log("accuracy", eval_metric["accuracy"])
            hs.log("f1", eval_metric["f1"])
            # zoo: epoch-probe: sum(p.norm().item() for p in model.parameters())
    accelerator.end_training()
    zoo_hook.final(model=accelerator.unwrap_model(model), optimizer=optimizer, lr_scheduler=lr_scheduler)


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument(
        "--mixed_precision",
        type=str,
        default=None,
        choices=["no", "fp16", "bf16", "fp8"],
        help="Whether to use mixed precision.",
    )
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--num_epochs", type=int, default=3, help="(zoo) epochs")
    parser.add_argument("--train_size", type=int, default=192, help="(zoo) synthetic training pairs")
    args = hs.args(parser)
    config = {"lr": 2e-3, "num_epochs": args.num_epochs, "seed": 42, "batch_size": 16}
    training_function(config, args)


if __name__ == "__main__":
    main()
