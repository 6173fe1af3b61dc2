# Adapted from pytorch/examples, time_sequence_prediction/train.py and generate_sine_wave.py
# (https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/time_sequence_prediction/train.py,
# BSD-3-Clause).
# Shape kept: two LSTMCells in double precision unrolled in Python, full-batch
# training with LBFGS and a `closure()` defined inside the loop (it prints the
# loss at every evaluation, so a step logs `loss` several times), a no-grad
# prediction of the future after every step, one loop only (`for i in
# range(opt.steps)`: no inner loop).
# Changed for the zoo: hindsight (hs.args, hs.checkpointing, hs.loop, hs.log of
# what it prints), the sine waves generated in memory (shorter, fewer), a
# smaller hidden size, no matplotlib figures (the prediction is saved with
# numpy instead), the zoo test hook.
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

import hindsight as hs
import zoo_hook

HIDDEN = 16


class Sequence(nn.Module):
    def __init__(self):
        super(Sequence, self).__init__()
        self.lstm1 = nn.LSTMCell(1, HIDDEN)
        self.lstm2 = nn.LSTMCell(HIDDEN, HIDDEN)
        self.linear = nn.Linear(HIDDEN, 1)

    def forward(self, input, future = 0):
        outputs = []
        h_t = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        c_t = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), HIDDEN, dtype=torch.double)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):# if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs


def generate_sine_wave(T=20, L=30, N=10):
    np.random.seed(2)
    x = np.empty((N, L), 'int64')
    x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
    return np.sin(x / 1.0 / T).astype('float64')


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=5, help='steps to run')
    parser.add_argument('--future', type=int, default=20, help='(zoo) steps predicted, 1000 in the original')
    parser.add_argument('--max-iter', type=int, default=4, help='(zoo) LBFGS max_iter, 20 (its default) in the original')
    opt = hs.args(parser)
    # set random seed to 0
    np.random.seed(0)
    torch.manual_seed(0)
    # load data and make training set
    data = generate_sine_wave()
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    # build the model
    seq = Sequence()
    seq.double()
    criterion = nn.MSELoss()
    # use LBFGS as optimizer since we can load the whole data to train
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8, max_iter=opt.max_iter)
    #begin to train
    with hs.checkpointing(seq=seq, optimizer=optimizer):
        for i in hs.loop("step", range(opt.steps)):
            print('STEP: ', i)
            def closure():
                optimizer.zero_grad()
                out = seq(input)
                loss = criterion(out, target)
                print('loss:', loss.item())
                hs.log("loss", loss.item())
                # zoo: step-probe: out.abs().mean().item()
                loss.backward()
                return loss
            optimizer.step(closure)
            # begin to predict, no need to track gradient here
            with torch.no_grad():
                future = opt.future
                pred = seq(test_input, future=future)
                loss = criterion(pred[:, :-future], test_target)
                print('test loss:', loss.item())
                hs.log("test_loss", loss.item())
                y = pred.detach().numpy()
            # zoo: epoch-probe: sum(p.norm().item() for p in seq.parameters())
            np.save('predict%d.npy' % i, y)
            zoo_hook.step(i)
    zoo_hook.final(seq=seq, optimizer=optimizer)
