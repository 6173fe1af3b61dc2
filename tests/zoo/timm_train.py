# Adapted from huggingface/pytorch-image-models (timm): train.py's main loop and
# train_one_epoch()/validate(), with ModelEmaV2 (timm/utils/model_ema.py),
# NativeScaler (timm/utils/cuda.py), AverageMeter (timm/utils/metrics.py),
# the Scheduler base and CosineLRScheduler (timm/scheduler/), update_summary
# (timm/utils/summary.py)
# (https://github.com/huggingface/pytorch-image-models/blob/aa4b5850c1543fa488abf260f18390eda46cf85d/train.py,
# Apache-2.0).
# Shape kept: the epoch loop calling train_one_epoch(epoch, model, loader, ...)
# and validate() on the model and on the EMA model, an lr scheduler that is not
# a torch LRScheduler (step_update(num_updates) after every optimizer update,
# step(epoch + 1) after every epoch, its state a plain __dict__), gradient
# accumulation inside the step loop (`need_update`, `continue` when no update,
# `accum_steps` changed for the last batches), the loss scaler called as
# `loss_scaler(loss, optimizer, clip_grad=..., need_update=...)`, EMA weights
# updated after every optimizer update, AverageMeters read after the loop,
# summary.csv appended every epoch, best metric tracked in the loop.
# Changed for the zoo: hindsight (hs.args, hands-free `hs.checkpointing()`: the
# objects are found by hindsight, hs.loop, hs.log of what it logs); the timm
# pieces written out compactly below (no timm install), a tiny CNN in place of
# create_model(), seeded synthetic images, no distributed / prefetcher / mixup
# / naflex / saver branches, CPU only (the scaler is timm's NativeScaler on
# device='cpu'), the zoo test hook.
import argparse
import csv
import math
import os
import time
from collections import OrderedDict
from contextlib import suppress
from copy import deepcopy

import torch
import torch.nn as nn

import hindsight as hs
import zoo_hook


# -- timm/utils/metrics.py
class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self):
        self.reset()

    def reset(self):
        self.val = 0
        self.avg = 0
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def accuracy(output, target, topk=(1,)):
    maxk = min(max(topk), output.size()[1])
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.reshape(1, -1).expand_as(pred))
    return [correct[:min(k, maxk)].reshape(-1).float().sum(0) * 100. / batch_size for k in topk]


# -- timm/utils/model_ema.py
class ModelEmaV2(nn.Module):
    def __init__(self, model, decay=0.9999, device=None):
        super().__init__()
        # make a copy of the model for accumulating moving average of weights
        self.module = deepcopy(model)
        self.module.eval()
        self.decay = decay
        self.device = device  # perform ema on different device from model if set
        if self.device is not None:
            self.module.to(device=device)

    def _update(self, model, update_fn):
        with torch.no_grad():
            for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
                if self.device is not None:
                    model_v = model_v.to(device=self.device)
                ema_v.copy_(update_fn(ema_v, model_v))

    def update(self, model):
        self._update(model, update_fn=lambda e, m: self.decay * e + (1. - self.decay) * m)

    def set(self, model):
        self._update(model, update_fn=lambda e, m: m)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# -- timm/utils/cuda.py
class NativeScaler:
    state_dict_key = "amp_scaler"

    def __init__(self, device='cuda'):
        try:
            self._scaler = torch.amp.GradScaler(device=device)
        except (AttributeError, TypeError):
            self._scaler = torch.cuda.amp.GradScaler()

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode='norm', parameters=None,
                 create_graph=False, need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict):
        self._scaler.load_state_dict(state_dict)


# -- timm/scheduler/scheduler.py and cosine_lr.py (noise options left out)
class Scheduler:
    def __init__(self, optimizer, param_group_field, t_in_epochs=True, initialize=True):
        self.optimizer = optimizer
        self.param_group_field = param_group_field
        self._initial_param_group_field = f"initial_{param_group_field}"
        if initialize:
            for i, group in enumerate(self.optimizer.param_groups):
                group.setdefault(self._initial_param_group_field, group[param_group_field])
        self.base_values = [group[self._initial_param_group_field] for group in self.optimizer.param_groups]
        self.metric = None
        self.t_in_epochs = t_in_epochs
        self.update_groups(self.base_values)

    def state_dict(self):
        return {key: value for key, value in self.__dict__.items() if key != 'optimizer'}

    def load_state_dict(self, state_dict):
        self.__dict__.update(state_dict)

    def _get_values(self, t, on_epoch=True):
        proceed = (on_epoch and self.t_in_epochs) or (not on_epoch and not self.t_in_epochs)
        if not proceed:
            return None
        return self._get_lr(t)

    def step(self, epoch, metric=None):
        self.metric = metric
        values = self._get_values(epoch, on_epoch=True)
        if values is not None:
            self.update_groups(values)

    def step_update(self, num_updates, metric=None):
        self.metric = metric
        values = self._get_values(num_updates, on_epoch=False)
        if values is not None:
            self.update_groups(values)

    def update_groups(self, values):
        if not isinstance(values, (list, tuple)):
            values = [values] * len(self.optimizer.param_groups)
        for param_group, value in zip(self.optimizer.param_groups, values):
            param_group[self.param_group_field] = value


class CosineLRScheduler(Scheduler):
    def __init__(self, optimizer, t_initial, lr_min=0., warmup_t=0, warmup_lr_init=0, t_in_epochs=True):
        super().__init__(optimizer, param_group_field="lr", t_in_epochs=t_in_epochs)
        self.t_initial = t_initial
        self.lr_min = lr_min
        self.warmup_t = warmup_t
        self.warmup_lr_init = warmup_lr_init
        if self.warmup_t:
            self.warmup_steps = [(v - warmup_lr_init) / self.warmup_t for v in self.base_values]
            super().update_groups(self.warmup_lr_init)
        else:
            self.warmup_steps = [1 for _ in self.base_values]

    def _get_lr(self, t):
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        t = t - self.warmup_t
        return [self.lr_min + 0.5 * (lr_max - self.lr_min) * (1 + math.cos(math.pi * t / self.t_initial))
                for lr_max in self.base_values]


# -- timm/utils/summary.py
def update_summary(epoch, train_metrics, eval_metrics, filename, lr=None, write_header=False):
    rowd = OrderedDict(epoch=epoch)
    rowd.update([('train_' + k, v) for k, v in train_metrics.items()])
    rowd.update([('eval_' + k, v) for k, v in eval_metrics.items()])
    if lr is not None:
        rowd['lr'] = lr
    with open(filename, mode='a') as cf:
        dw = csv.DictWriter(cf, fieldnames=rowd.keys())
        if write_header:
            dw.writeheader()
        dw.writerow(rowd)


class SyntheticImages(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, 10, (n,), generator=g)
        self.images = torch.randn(n, 3, 16, 16, generator=g) + self.targets.view(-1, 1, 1, 1) * 0.1

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.images[i], int(self.targets[i])


def tiny_model(num_classes=10):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(32, num_classes),
    )


# -- train.py
parser = argparse.ArgumentParser(description='PyTorch ImageNet Training')
parser.add_argument('--epochs', type=int, default=3)
parser.add_argument('-b', '--batch-size', type=int, default=16)
parser.add_argument('--lr', type=float, default=0.05)
parser.add_argument('--weight-decay', type=float, default=2e-5)
parser.add_argument('--momentum', type=float, default=0.9)
parser.add_argument('--warmup-epochs', type=int, default=1)
parser.add_argument('--warmup-lr', type=float, default=1e-4)
parser.add_argument('--min-lr', type=float, default=1e-5)
parser.add_argument('--grad-accum-steps', type=int, default=3)
parser.add_argument('--clip-grad', type=float, default=1.0)
parser.add_argument('--clip-mode', type=str, default='norm')
parser.add_argument('--model-ema', action='store_true', default=True)
parser.add_argument('--model-ema-decay', type=float, default=0.9)
parser.add_argument('--log-interval', type=int, default=1)
parser.add_argument('--workers', type=int, default=2)
parser.add_argument('--seed', type=int, default=42)
parser.add_argument('--output', type=str, default='output')
parser.add_argument('--train-size', type=int, default=192, help='(zoo) synthetic training images')


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, device=torch.device('cpu'),
                    lr_scheduler=None, amp_autocast=suppress, loss_scaler=None, model_ema=None):
    second_order = hasattr(optimizer, 'is_second_order') and optimizer.is_second_order
    update_time_m = AverageMeter()
    data_time_m = AverageMeter()
    losses_m = AverageMeter()

    model.train()

    accum_steps = args.grad_accum_steps
    last_accum_steps = len(loader) % accum_steps
    updates_per_epoch = (len(loader) + accum_steps - 1) // accum_steps
    num_updates = epoch * updates_per_epoch
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps

    data_start_time = update_start_time = time.time()
    optimizer.zero_grad()
    update_sample_count = 0
    for batch_idx, (input, target) in hs.loop("step", enumerate(loader)):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        update_idx = batch_idx // accum_steps
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps

        input, target = input.to(device), target.to(device)

        # multiply by accum steps to get equivalent for full update
        data_time_m.update(accum_steps * (time.time() - data_start_time))

        def _forward():
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output, target)
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss):
            if loss_scaler is not None:
                loss_scaler(
                    _loss,
                    optimizer,
                    clip_grad=args.clip_grad,
                    clip_mode=args.clip_mode,
                    parameters=model.parameters(),
                    create_graph=second_order,
                    need_update=need_update,
                )
            else:
                _loss.backward(create_graph=second_order)
                if need_update:
                    optimizer.step()

        loss = _forward()
        _backward(loss)

        losses_m.update(loss.item() * accum_steps, input.size(0))
        update_sample_count += input.size(0)
        zoo_hook.step(epoch, batch_idx)

        if not need_update:
            data_start_time = time.time()
            continue

        num_updates += 1
        optimizer.zero_grad()
        if model_ema is not None:
            model_ema.update(model)
        # zoo: step-probe: sum(v.float().norm().item() for v in model_ema.state_dict().values())

        time_now = time.time()
        update_time_m.update(time.time() - update_start_time)
        update_start_time = time_now

        if update_idx % args.log_interval == 0 or last_batch:
            lrl = [param_group['lr'] for param_group in optimizer.param_groups]
            lr = sum(lrl) / len(lrl)
            print(f'Train: {epoch} [{update_idx:>4d}/{updates_per_epoch}]  '
                  f'Loss: {losses_m.val:#.3g} ({losses_m.avg:#.3g})  LR: {lr:.3e}')
            hs.log("loss", losses_m.val)
            hs.log("loss_avg", losses_m.avg)
            hs.log("lr", lr)

        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)

        update_sample_count = 0
        data_start_time = time.time()
        # end for

    return OrderedDict([('loss', losses_m.avg)])


def validate(model, loader, loss_fn, args, device=torch.device('cpu'), amp_autocast=suppress, log_suffix=''):
    losses_m = AverageMeter()
    top1_m = AverageMeter()
    top5_m = AverageMeter()

    model.eval()
    with torch.no_grad():
        for batch_idx, (input, target) in enumerate(loader):
            with amp_autocast():
                output = model(input)
            loss = loss_fn(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
            top5_m.update(acc5.item(), output.size(0))

    metrics = OrderedDict([('loss', losses_m.avg), ('top1', top1_m.avg), ('top5', top5_m.avg)])
    print(f'Test{log_suffix}: Loss: {losses_m.avg:>6.3f}  Acc@1: {top1_m.avg:>7.3f}  Acc@5: {top5_m.avg:>7.3f}')
    return metrics


def main():
    args = hs.args(parser)
    torch.manual_seed(args.seed)
    device = torch.device('cpu')
    os.makedirs(args.output, exist_ok=True)

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, nesterov=True)
    amp_autocast = suppress
    loss_scaler = NativeScaler(device='cpu')
    model_ema = None
    if args.model_ema:
        model_ema = ModelEmaV2(model, decay=args.model_ema_decay)

    dataset_train = SyntheticImages(args.train_size, seed=1)
    dataset_eval = SyntheticImages(64, seed=2)
    loader_train = torch.utils.data.DataLoader(dataset_train, batch_size=args.batch_size, shuffle=True,
                                               num_workers=args.workers, drop_last=True)
    loader_eval = torch.utils.data.DataLoader(dataset_eval, batch_size=2 * args.batch_size, shuffle=False,
                                              num_workers=args.workers)

    updates_per_epoch = (len(loader_train) + args.grad_accum_steps - 1) // args.grad_accum_steps
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * updates_per_epoch,
                                     lr_min=args.min_lr, warmup_t=args.warmup_epochs * updates_per_epoch,
                                     warmup_lr_init=args.warmup_lr, t_in_epochs=False)
    num_epochs = args.epochs
    start_epoch = 0
    train_loss_fn = nn.CrossEntropyLoss()
    validate_loss_fn = nn.CrossEntropyLoss()
    eval_metric = 'top1'
    best_metric = None
    best_epoch = None

    with hs.checkpointing():
        for epoch in hs.loop("epoch", range(start_epoch, num_epochs)):
            train_metrics = train_one_epoch(
                epoch, model, loader_train, optimizer, train_loss_fn, args,
                device=device, lr_scheduler=lr_scheduler, amp_autocast=amp_autocast,
                loss_scaler=loss_scaler, model_ema=model_ema)

            eval_metrics = validate(model, loader_eval, validate_loss_fn, args, amp_autocast=amp_autocast)

            if model_ema is not None:
                ema_eval_metrics = validate(model_ema.module, loader_eval, validate_loss_fn, args,
                                            amp_autocast=amp_autocast, log_suffix=' (EMA)')
                eval_metrics = ema_eval_metrics

            if lr_scheduler is not None:
                # step LR for next epoch
                lr_scheduler.step(epoch + 1, eval_metrics[eval_metric])

            lrs = [param_group['lr'] for param_group in optimizer.param_groups]
            update_summary(epoch, train_metrics, eval_metrics, filename=os.path.join(args.output, 'summary.csv'),
                           lr=sum(lrs) / len(lrs), write_header=best_metric is None)
            hs.log("train_loss", train_metrics['loss'])
            hs.log("eval_loss", eval_metrics['loss'])
            hs.log("eval_top1", eval_metrics['top1'])
            # zoo: epoch-probe: sum(p.norm().item() for p in model.parameters())

            if best_metric is None or eval_metrics[eval_metric] > best_metric:
                best_metric, best_epoch = eval_metrics[eval_metric], epoch
    print('*** Best metric: {0} (epoch {1})'.format(best_metric, best_epoch))
    zoo_hook.final(model=model, model_ema=model_ema, optimizer=optimizer, loss_scaler=loss_scaler,
                   lr_scheduler=lr_scheduler.state_dict(), best_metric=best_metric, best_epoch=best_epoch)


if __name__ == '__main__':
    main()
