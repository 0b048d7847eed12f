"""PyTorch CPU peer of `lenet_bench`: the same LeNet, batch, loss and timing.

Usage: python3 lenet_torch.py BATCH REPS THREADS
Prints one JSON object: {"version", "threads", "batch", "fwd_bwd_s",
"images_per_s", "conv2d_gflops"}.
"""
import json
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F


def lenet():
    # The book's variant for data-parallel training, weights normal x 0.01.
    net = nn.Sequential(
        nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(800, 128), nn.ReLU(),
        nn.Linear(128, 10),
    )
    for p in net.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.01)
        else:
            nn.init.zeros_(p)
    return net


def main():
    batch, reps, threads = (int(a) for a in sys.argv[1:4])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = lenet()
    x = torch.rand(batch, 1, 28, 28)
    y = torch.randint(0, 10, (batch,))

    def step():
        net.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()

    step()  # warm-up
    t = time.perf_counter()
    for _ in range(reps):
        step()
    fwd_bwd = (time.perf_counter() - t) / reps

    # conv2d forward at the second layer's shape.
    cx = torch.rand(batch, 20, 13, 13)
    cw = torch.rand(50, 20, 5, 5)
    with torch.no_grad():
        F.conv2d(cx, cw)
        t = time.perf_counter()
        for _ in range(reps):
            F.conv2d(cx, cw)
        conv_s = (time.perf_counter() - t) / reps
    flops = 2 * batch * 50 * 9 * 9 * 20 * 5 * 5
    print(json.dumps({
        "version": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": batch,
        "fwd_bwd_s": fwd_bwd,
        "images_per_s": batch / fwd_bwd,
        "conv2d_gflops": flops / conv_s / 1e9,
    }))


if __name__ == "__main__":
    main()
