# Adapted from pytorch/examples, imagenet/main.py
# (https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/imagenet/main.py, BSD-3-Clause).
# Shape kept: main() -> main_worker() -> the epoch loop calling train() and
# validate(); AverageMeter / ProgressMeter objects updated in the step loop
# `for i, (images, target) in enumerate(train_loader)`; top-1/top-5 accuracy;
# SGD with momentum and weight decay, StepLR stepped per epoch; `best_acc1`;
# save_checkpoint() writing checkpoint.pth.tar and copying model_best.pth.tar;
# DataLoader(shuffle=True, num_workers=args.workers, pin_memory=True).
# Changed for the zoo: hindsight (hs.args, hs.checkpointing, hs.loop, hs.log of
# what it prints), a tiny CNN instead of torchvision.models (the `--dummy`
# FakeData path with 3x16x16 images and 10 classes, seeded), no distributed /
# multiprocessing / GPU branches and no --resume/--evaluate, StepLR's
# step_size an argument (30 epochs in the original), the zoo test hook.
import argparse
import shutil
import time
from enum import Enum

import torch
import torch.nn as nn
import torch.optim
import torch.utils.data
from torch.optim.lr_scheduler import StepLR

import hindsight as hs
import zoo_hook

parser = argparse.ArgumentParser(description='PyTorch ImageNet Training')
parser.add_argument('-j', '--workers', default=2, type=int, metavar='N',
                    help='number of data loading workers (default: 2)')
parser.add_argument('--epochs', default=3, type=int, metavar='N',
                    help='number of total epochs to run')
parser.add_argument('--start-epoch', default=0, type=int, metavar='N',
                    help='manual epoch number (useful on restarts)')
parser.add_argument('-b', '--batch-size', default=32, type=int,
                    metavar='N',
                    help='mini-batch size (default: 32)')
parser.add_argument('--lr', '--learning-rate', default=0.1, type=float,
                    metavar='LR', help='initial learning rate', dest='lr')
parser.add_argument('--momentum', default=0.9, type=float, metavar='M',
                    help='momentum')
parser.add_argument('--wd', '--weight-decay', default=1e-4, type=float,
                    metavar='W', help='weight decay (default: 1e-4)',
                    dest='weight_decay')
parser.add_argument('-p', '--print-freq', default=2, type=int,
                    metavar='N', help='print frequency (default: 2)')
parser.add_argument('--seed', default=0, type=int,
                    help='seed for initializing training. ')
parser.add_argument('--lr-step', default=2, type=int, help='(zoo) StepLR step_size, 30 in the original')
parser.add_argument('--train-size', default=256, type=int, help='(zoo) FakeData training images')


class FakeData(torch.utils.data.Dataset):
    """Stands in for torchvision.datasets.FakeData(size, (3, 16, 16), 10, ToTensor())."""

    def __init__(self, size, image_size, num_classes, offset=0):
        self.size, self.image_size, self.num_classes, self.offset = size, image_size, num_classes, offset

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index + self.offset)
        target = int(torch.randint(0, self.num_classes, (1,), generator=g))
        img = torch.rand(self.image_size, generator=g) + 0.3 * target / self.num_classes
        return img, target


def tiny_cnn(num_classes=10):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes),
    )


best_acc1 = 0


def main():
    args = hs.args(parser)
    torch.manual_seed(args.seed)
    main_worker(args)


def main_worker(args):
    global best_acc1
    device = torch.device("cpu")

    model = tiny_cnn()

    # define loss function (criterion), optimizer, and learning rate scheduler
    criterion = nn.CrossEntropyLoss().to(device)

    optimizer = torch.optim.SGD(model.parameters(), args.lr,
                                momentum=args.momentum,
                                weight_decay=args.weight_decay)

    """Sets the learning rate to the initial LR decayed by 10 every lr_step epochs"""
    scheduler = StepLR(optimizer, step_size=args.lr_step, gamma=0.1)

    print("=> Dummy data is used!")
    train_dataset = FakeData(args.train_size, (3, 16, 16), 10)
    val_dataset = FakeData(64, (3, 16, 16), 10, offset=10**6)

    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=True,
        num_workers=args.workers, pin_memory=True, sampler=None)

    val_loader = torch.utils.data.DataLoader(
        val_dataset, batch_size=args.batch_size, shuffle=False,
        num_workers=args.workers, pin_memory=True, sampler=None)

    with hs.checkpointing(model=model, optimizer=optimizer, scheduler=scheduler):
        for epoch in hs.loop("epoch", range(args.start_epoch, args.epochs)):
            # train for one epoch
            train(train_loader, model, criterion, optimizer, epoch, device, args)

            # evaluate on validation set
            acc1 = validate(val_loader, model, criterion, args)
            hs.log("val_acc1", acc1)

            scheduler.step()

            # remember best acc@1 and save checkpoint
            is_best = acc1 > best_acc1
            best_acc1 = max(acc1, best_acc1)
            # zoo: epoch-probe: sum(p.norm().item() for p in model.parameters())

            save_checkpoint({
                'epoch': epoch + 1,
                'arch': 'tiny_cnn',
                'state_dict': model.state_dict(),
                'best_acc1': best_acc1,
                'optimizer' : optimizer.state_dict(),
                'scheduler' : scheduler.state_dict()
            }, is_best)
    zoo_hook.final(model=model, optimizer=optimizer, scheduler=scheduler, best_acc1=best_acc1)


def train(train_loader, model, criterion, optimizer, epoch, device, args):
    batch_time = AverageMeter('Time', ':6.3f', Summary.NONE)
    data_time = AverageMeter('Data', ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', ':6.2f', Summary.NONE)
    top5 = AverageMeter('Acc@5', ':6.2f', Summary.NONE)
    progress = ProgressMeter(
        len(train_loader),
        [batch_time, data_time, losses, top1, top5],
        prefix="Epoch: [{}]".format(epoch))

    # switch to train mode
    model.train()

    end = time.time()
    for i, (images, target) in enumerate(hs.loop("step", train_loader)):
        # measure data loading time
        data_time.update(time.time() - end)

        # move data to the same device as model
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)

        # compute output
        output = model(images)
        loss = criterion(output, target)

        # measure accuracy and record loss
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))

        # compute gradient and do SGD step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        # measure elapsed time
        batch_time.update(time.time() - end)
        end = time.time()
        # zoo: step-probe: images.sum().item()

        if i % args.print_freq == 0:
            progress.display(i + 1)
            hs.log("loss", losses.val)
            hs.log("loss_avg", losses.avg)
            hs.log("acc1_avg", top1.avg)
        zoo_hook.step(epoch, i)


def validate(val_loader, model, criterion, args):

    def run_validate(loader, base_progress=0):
        device = torch.device("cpu")
        with torch.no_grad():
            end = time.time()
            for i, (images, target) in enumerate(loader):
                i = base_progress + i
                images = images.to(device)
                target = target.to(device)

                # compute output
                output = model(images)
                loss = criterion(output, target)

                # measure accuracy and record loss
                acc1, acc5 = accuracy(output, target, topk=(1, 5))
                losses.update(loss.item(), images.size(0))
                top1.update(acc1[0], images.size(0))
                top5.update(acc5[0], images.size(0))

                # measure elapsed time
                batch_time.update(time.time() - end)
                end = time.time()

                if i % args.print_freq == 0:
                    progress.display(i + 1)

    batch_time = AverageMeter('Time', ':6.3f', Summary.NONE)
    losses = AverageMeter('Loss', ':.4e', Summary.NONE)
    top1 = AverageMeter('Acc@1', ':6.2f', Summary.AVERAGE)
    top5 = AverageMeter('Acc@5', ':6.2f', Summary.AVERAGE)
    progress = ProgressMeter(
        len(val_loader),
        [batch_time, losses, top1, top5],
        prefix='Test: ')

    # switch to evaluate mode
    model.eval()

    run_validate(val_loader)

    progress.display_summary()

    return top1.avg


def save_checkpoint(state, is_best, filename='checkpoint.pth.tar'):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, 'model_best.pth.tar')


class Summary(Enum):
    NONE = 0
    AVERAGE = 1
    SUM = 2
    COUNT = 3


class AverageMeter(object):
    """Computes and stores the average and current value"""
    def __init__(self, name, fmt=':f', summary_type=Summary.AVERAGE):
        self.name = name
        self.fmt = fmt
        self.summary_type = summary_type
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

    def __str__(self):
        fmtstr = '{name} {val' + self.fmt + '} ({avg' + self.fmt + '})'
        return fmtstr.format(**self.__dict__)

    def summary(self):
        fmtstr = ''
        if self.summary_type is Summary.NONE:
            fmtstr = ''
        elif self.summary_type is Summary.AVERAGE:
            fmtstr = '{name} {avg:.3f}'
        elif self.summary_type is Summary.SUM:
            fmtstr = '{name} {sum:.3f}'
        elif self.summary_type is Summary.COUNT:
            fmtstr = '{name} {count:.3f}'
        else:
            raise ValueError('invalid summary type %r' % self.summary_type)

        return fmtstr.format(**self.__dict__)


class ProgressMeter(object):
    def __init__(self, num_batches, meters, prefix=""):
        self.batch_fmtstr = self._get_batch_fmtstr(num_batches)
        self.meters = meters
        self.prefix = prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        print('\t'.join(entries))

    def display_summary(self):
        entries = [" *"]
        entries += [meter.summary() for meter in self.meters]
        print(' '.join(entries))

    def _get_batch_fmtstr(self, num_batches):
        num_digits = len(str(num_batches // 1))
        fmt = '{:' + str(num_digits) + 'd}'
        return '[' + fmt + '/' + fmt.format(num_batches) + ']'


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)

        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))

        res = []
        for k in topk:
            correct_k = correct[:k].reshape(-1).float().sum(0, keepdim=True)
            res.append(correct_k.mul_(100.0 / batch_size))
        return res


if __name__ == '__main__':
    main()
