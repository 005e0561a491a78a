#!/usr/bin/env python
"""The plain PyTorch training loop a user would write (pytorch/examples' imagenet script, cut down), what
bench.py's section 8 measures ray-dp against: ImageFolder or tensors in memory, DataLoader, model, SGD.
Prints one JSON line: each epoch's seconds of training and mean train loss, the steps, the start.

    python bench/plain_loop.py --data-dir DIR --model mobilenet_v3_small --image-size 224   # DIR/train/CLASS/*.png
    python bench/plain_loop.py --model resnet18 --epochs 4   # the lessons' ResNet-18, 512 random 28 x 28 images
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, TensorDataset
from torchvision import datasets, transforms as T


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", help="an ImageFolder's parent (its train/); none: 512 images in memory")
    parser.add_argument("--model", default="mobilenet_v3_small")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("-j", "--loader-workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.data_dir:
        augment = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                             T.Normalize([0.13] * 3, [0.31] * 3)])
        train = datasets.ImageFolder(os.path.join(args.data_dir, "train"), augment)
        model = torchvision.models.get_model(args.model, num_classes=len(train.classes))
    else:  # the lessons' ResNet-18 is ray_dp's model code; only the model is taken from it
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import ray_dp
        train = TensorDataset(torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,)))
        model = ray_dp.build_model(args.model, (1, 28, 28), 10)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=args.loader_workers,
                        drop_last=True, persistent_workers=args.loader_workers > 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    seconds, losses, started_at = [], [], time.time()
    for _ in range(args.epochs):
        model.train()
        batches = iter(loader)
        begun, loss_sum = time.perf_counter(), 0.0
        for images, labels in batches:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
        seconds.append(time.perf_counter() - begun)
        losses.append(loss_sum / len(loader))
    print(json.dumps({"epoch_seconds": seconds, "train_loss": losses, "steps": len(loader),
                      "started_at": started_at}))


if __name__ == "__main__":
    main()
