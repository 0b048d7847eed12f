"""PyTorch CPU peer of `train_lenet`: the same LeNet (weights normal x 0.01,
biases zero), the same data split sizes, batch, learning rate and SGD.

Usage: python3 train_lenet_torch.py DATA_DIR EPOCHS BATCH LR MOMENTUM WD THREADS TRAIN_LIMIT
(TRAIN_LIMIT 0: all 50,000 training images; 10,000 are held out for validation)
Prints one JSON object: {"version", "threads", "epochs": [{"epoch",
"train_loss", "train_acc", "valid_acc", "seconds", "images_per_s"}],
"test_acc"}.
"""
import gzip
import json
import sys
import time

import numpy as np
import torch
from torch.nn import functional as F

from lenet_torch import lenet  # the same network as the benchmark peer


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    rank = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def accuracy(net, x, y, batch):
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            correct += (net(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    return correct / len(y)


def main():
    root = sys.argv[1]
    epochs, batch = int(sys.argv[2]), int(sys.argv[3])
    lr, momentum, wd = float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    threads, limit = int(sys.argv[7]), int(sys.argv[8])
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    images = torch.tensor(idx(f"{root}/train-images-idx3-ubyte.gz"), dtype=torch.float32) / 255
    labels = torch.tensor(idx(f"{root}/train-labels-idx1-ubyte.gz"), dtype=torch.int64)
    test_x = torch.tensor(idx(f"{root}/t10k-images-idx3-ubyte.gz"), dtype=torch.float32) / 255
    test_y = torch.tensor(idx(f"{root}/t10k-labels-idx1-ubyte.gz"), dtype=torch.int64)
    images, test_x = images.unsqueeze(1), test_x.unsqueeze(1)
    order = torch.randperm(len(labels))
    valid_idx, train_idx = order[:10000], order[10000:]
    if limit:
        train_idx = train_idx[:limit]
    train_x, train_y = images[train_idx], labels[train_idx]
    valid_x, valid_y = images[valid_idx], labels[valid_idx]
    net = lenet()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    report = []
    for epoch in range(epochs):
        perm = torch.randperm(len(train_y))
        start = time.perf_counter()
        loss_sum, correct = 0.0, 0
        for i in range(0, len(train_y), batch):
            b = perm[i:i + batch]
            x, y = train_x[b], train_y[b]
            opt.zero_grad()
            out = net(x)
            loss = F.cross_entropy(out, y, reduction="sum")
            (loss / len(y)).backward()
            opt.step()
            loss_sum += loss.item()
            correct += (out.argmax(1) == y).sum().item()
        seconds = time.perf_counter() - start
        report.append({
            "epoch": epoch + 1,
            "train_loss": loss_sum / len(train_y),
            "train_acc": correct / len(train_y),
            "valid_acc": accuracy(net, valid_x, valid_y, batch),
            "seconds": seconds,
            "images_per_s": len(train_y) / seconds,
        })
        print(json.dumps(report[-1]), file=sys.stderr)
    print(json.dumps({
        "version": torch.__version__,
        "threads": torch.get_num_threads(),
        "epochs": report,
        "test_acc": accuracy(net, test_x, test_y, batch),
    }))


if __name__ == "__main__":
    main()
