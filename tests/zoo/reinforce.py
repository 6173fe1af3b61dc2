# Adapted from pytorch/examples, reinforcement_learning/reinforce.py
# (https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/reinforcement_learning/reinforce.py,
# BSD-3-Clause).
# Shape kept: a module-level env and policy, `for i_episode in count(1)` ended
# by `break` once solved, an inner `for t in range(1, 10000)` over environment
# steps ended by `break` (not a training step: the policy is updated once per
# episode, in finish_episode()), log-probs and rewards kept in lists on the
# policy module, `running_reward` carried across episodes, Categorical sampling
# (the global torch RNG) and dropout in the policy.
# Changed for the zoo: hindsight (hs.args, hs.checkpointing, hs.loop on the
# episode loop, hs.log of what it prints); gymnasium is not installed here, so
# a small CartPole written out below stands in for gym.make('CartPole-v1') (same
# API: reset(seed=...) -> (obs, info), step -> 5-tuple, its own np_random,
# spec.reward_threshold), with a lower threshold and a 120-step time limit;
# a --max-episodes bound; the zoo test hook.
import argparse
import math
from collections import deque
from itertools import count

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions import Categorical

import hindsight as hs
import zoo_hook


class Spec:
    def __init__(self, reward_threshold, max_episode_steps):
        self.reward_threshold = reward_threshold
        self.max_episode_steps = max_episode_steps


class CartPole:
    """gymnasium's CartPole-v1 dynamics (Euler), with TimeLimit folded in."""

    def __init__(self, reward_threshold, max_episode_steps):
        self.spec = Spec(reward_threshold, max_episode_steps)
        self.np_random = np.random.default_rng()
        self.state = None
        self.steps = 0

    def reset(self, seed=None):
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
        self.state = self.np_random.uniform(low=-0.05, high=0.05, size=(4,))
        self.steps = 0
        return np.array(self.state, dtype=np.float32), {}

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        costheta, sintheta = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot**2 * sintheta) / 1.1
        thetaacc = (9.8 * sintheta - costheta * temp) / (0.5 * (4.0 / 3.0 - 0.1 * costheta**2 / 1.1))
        xacc = temp - 0.05 * thetaacc * costheta / 1.1
        x, x_dot = x + 0.02 * x_dot, x_dot + 0.02 * xacc
        theta, theta_dot = theta + 0.02 * theta_dot, theta_dot + 0.02 * thetaacc
        self.state = (x, x_dot, theta, theta_dot)
        self.steps += 1
        terminated = bool(x < -2.4 or x > 2.4 or theta < -12 * 2 * math.pi / 360 or theta > 12 * 2 * math.pi / 360)
        truncated = self.steps >= self.spec.max_episode_steps
        return np.array(self.state, dtype=np.float32), 1.0, terminated, truncated, {}


parser = argparse.ArgumentParser(description='PyTorch REINFORCE example')
parser.add_argument('--gamma', type=float, default=0.99, metavar='G',
                    help='discount factor (default: 0.99)')
parser.add_argument('--seed', type=int, default=543, metavar='N',
                    help='random seed (default: 543)')
parser.add_argument('--render', action='store_true',
                    help='render the environment')
parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                    help='interval between training status logs (default: 10)')
parser.add_argument('--max-episodes', type=int, default=40, help='(zoo) stop after this many episodes')
parser.add_argument('--threshold', type=float, default=60.0, help='(zoo) spec.reward_threshold')
args = hs.args(parser)


env = CartPole(args.threshold, 120)
env.reset(seed=args.seed)
torch.manual_seed(args.seed)


class Policy(nn.Module):
    def __init__(self):
        super(Policy, self).__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


policy = Policy()
optimizer = optim.Adam(policy.parameters(), lr=1e-2)
eps = np.finfo(np.float32).eps.item()


def select_action(state):
    state = torch.from_numpy(state).float().unsqueeze(0)
    probs = policy(state)
    m = Categorical(probs)
    action = m.sample()
    policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    R = 0
    policy_loss = []
    returns = deque()
    for r in policy.rewards[::-1]:
        R = r + args.gamma * R
        returns.appendleft(R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    for log_prob, R in zip(policy.saved_log_probs, returns):
        policy_loss.append(-log_prob * R)
    optimizer.zero_grad()
    policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    optimizer.step()
    del policy.rewards[:]
    del policy.saved_log_probs[:]


def main():
    running_reward = 10
    with hs.checkpointing(policy=policy, optimizer=optimizer):
        for i_episode in hs.loop("episode", count(1)):
            state, _ = env.reset()
            ep_reward = 0
            for t in range(1, 10000):  # Don't infinite loop while learning
                action = select_action(state)
                state, reward, terminated, truncated, _ = env.step(action)
                if args.render:
                    env.render()
                policy.rewards.append(reward)
                ep_reward += reward
                # zoo: step-probe: float(state[2])
                if terminated or truncated:
                    break

            running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
            finish_episode()
            hs.log("ep_reward", ep_reward)
            hs.log("running_reward", running_reward)
            # zoo: epoch-probe: sum(p.norm().item() for p in policy.parameters())
            zoo_hook.step(i_episode)
            if i_episode % args.log_interval == 0:
                print(f'Episode {i_episode}\tLast reward: {ep_reward:.2f}\tAverage reward: {running_reward:.2f}')
            if running_reward > env.spec.reward_threshold:
                print(f"Solved! Running reward is now {running_reward} and the last episode runs to {t} time steps!")
                break
            if i_episode >= args.max_episodes:
                break
    zoo_hook.final(policy=policy, optimizer=optimizer, running_reward=running_reward)


if __name__ == '__main__':
    main()
