# Adapted from huggingface/transformers: examples/pytorch/language-modeling/run_clm.py
# (https://github.com/huggingface/transformers/blob/main/examples/pytorch/language-modeling/run_clm.py, Apache-2.0),
# rewritten in its shape, simplified.
# Shape kept: ModelArguments / DataTrainingArguments dataclasses parsed with
# TrainingArguments by HfArgumentParser; the raw texts tokenized, then
# concatenated and cut into block_size chunks (group_texts) whose labels are
# their input_ids; a causal LM built from a config (the script's
# --model_type path, no pretrained weights); Trainer with an eval set,
# compute_metrics over preprocess_logits_for_metrics (next-token accuracy);
# trainer.train(resume_from_checkpoint=...), save_model, log_metrics /
# save_metrics / save_state; evaluate and perplexity = exp(eval_loss).
# Changed for the zoo: hindsight (HindsightCallback, whose
# resume_from_checkpoint() replaces the script's get_last_checkpoint
# logic); synthetic "texts" of random token ids instead of a dataset
# download and a tokenizer (the tokenizer is the identity); a tiny GPT-2;
# no datasets library; a callback printing the zoo hook's step markers; the
# zoo test hook.
import math
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import hindsight as hs
from hindsight.transformers import HindsightCallback
import zoo_hook


@dataclass
class ModelArguments:
    model_type: str = field(default="gpt2", metadata={"help": "model type to build from scratch"})
    n_layer: int = field(default=2)
    n_embd: int = field(default=32)
    n_head: int = field(default=2)
    vocab_size: int = field(default=64)


@dataclass
class DataTrainingArguments:
    train_texts: int = field(default=64, metadata={"help": "number of synthetic training texts"})
    eval_texts: int = field(default=8)
    block_size: int = field(default=16)
    max_train_samples: int = field(default=None)


def synthetic_texts(n, vocab, seed):
    # Texts of varying length, as a corpus has: group_texts evens them out.
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 40, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def group_texts(ids, block_size):
    concatenated = [t for text in ids for t in text]
    total = (len(concatenated) // block_size) * block_size
    blocks = [concatenated[i : i + block_size] for i in range(0, total, block_size)]
    return [{"input_ids": b, "labels": list(b)} for b in blocks]


class Blocks(torch.utils.data.Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return {k: torch.tensor(v) for k, v in self.examples[i].items()}


class ZooSteps(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        # zoo: step-probe: model.transformer.wte.weight.double().sum().item()
        zoo_hook.step(math.floor(state.epoch - 1e-9), state.global_step)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        # zoo: epoch-probe: model.lm_head.weight.double().norm().item()
        print(f"epoch {state.epoch:.2f} done at step {state.global_step}")


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    defaults = [
        "--output_dir", "clm-out", "--num_train_epochs", "2", "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "4", "--logging_steps", "1", "--eval_strategy", "epoch",
        "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--seed", "42",
        "--dataloader_num_workers", "0", "--disable_tqdm", "True",
    ]
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(defaults + sys.argv[1:])

    set_seed(training_args.seed)

    raw_train = synthetic_texts(data_args.train_texts, model_args.vocab_size, 0)
    raw_eval = synthetic_texts(data_args.eval_texts, model_args.vocab_size, 1)
    train_dataset = group_texts(raw_train, data_args.block_size)
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset[: data_args.max_train_samples]
    eval_dataset = group_texts(raw_eval, data_args.block_size)

    config = AutoConfig.for_model(
        model_args.model_type,
        n_layer=model_args.n_layer,
        n_embd=model_args.n_embd,
        n_head=model_args.n_head,
        vocab_size=model_args.vocab_size,
        n_positions=data_args.block_size,
    )
    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Training new model from scratch - Total size={n_params / 2**20:.2f}M params")

    def preprocess_logits_for_metrics(logits, labels):
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        # the prediction at position i is for the token at i + 1
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        accuracy = float((preds == labels).mean())
        hs.log("eval_accuracy_hs", accuracy)
        return {"accuracy": accuracy}

    hindsight_cb = HindsightCallback()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Blocks(train_dataset),
        eval_dataset=Blocks(eval_dataset),
        data_collator=default_data_collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        callbacks=[hindsight_cb, ZooSteps()],
    )

    checkpoint = hindsight_cb.resume_from_checkpoint()
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()

    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    metrics = trainer.evaluate()
    metrics["eval_samples"] = len(eval_dataset)
    try:
        perplexity = math.exp(metrics["eval_loss"])
    except OverflowError:
        perplexity = float("inf")
    metrics["perplexity"] = perplexity
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)

    zoo_hook.final(model=model.state_dict())


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
