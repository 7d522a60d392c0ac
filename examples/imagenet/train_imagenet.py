"""ChainerMN's ImageNet example for PyTorch: a ResNet trained data-parallel with multi-node BatchNorm.

    torchrun --nproc-per-node 4 examples/imagenet/train_imagenet.py --synthetic
    mpiexec -n 4 python examples/imagenet/train_imagenet.py --synthetic --communicator flat --fp16
    torchrun --nproc-per-node 4 examples/imagenet/train_imagenet.py --train DIR/train --val DIR/val \\
        --image-size 224 --width 64 --batchsize 32

(as root, mpiexec also needs --allow-run-as-root, and --oversubscribe for more ranks than cores).

Data. --train/--val are image folders, one subfolder per class (`train/<class>/<image>`), read with
PIL. As in ChainerMN's example, rank 0 lists the files and `scatter_dataset` deals out the
(path, label) pairs, not the images: every rank reads its own images, so the folders must be
readable at the same path on every node. --synthetic (or no --train) uses random images instead, no
files needed: each sample is drawn from a generator seeded by its index, with a faint
class-dependent colour so that the loss goes down.

Model. A ResNet of BasicBlocks (--depth 10/18/34, ResNet-18 by default) whose first stage has --width
channels (64 in the real ResNet; 16 by default here, so that it trains on a CPU). Images of 64 pixels
or fewer get a CIFAR-style stem (3x3 convolution, no max-pool), larger ones ImageNet's (7x7 stride 2,
max-pool). `convert_mnbn_model(model, comm)` turns every BatchNorm into a multi-node one, whose batch
statistics are those of the global batch (--no-mnbn keeps per-rank BatchNorm; the running statistics
are then averaged across ranks with AllreducePersistent before each validation).

Communication. The ChainerMN way throughout: `create_communicator(--communicator,
allreduce_grad_dtype=...)` and `create_multi_node_optimizer(SGD, comm, double_buffering=...)`.
--fp16 compresses the gradients to float16 on the wire by creating the communicator with
allreduce_grad_dtype=float16 (ChainerMN's pure_nccl option, here on every communicator), rather than
wrapping the model in DDP with hooks.fp16_compress_hook: the optimizer packs the whole model's
gradients into one buffer, casts them and prescales them by 1/size in the same pass (so the float16
sum cannot overflow), makes one allreduce per step through the chosen communicator, and combines with
--double-buffering (the previous step's mean is applied while this step's allreduce runs) in the same
code path. The multi-node BatchNorm layers share their statistics over the same communicator.

Output. Rank 0 shows a tqdm progress bar on stderr (--no-progress to hide it) and prints, per epoch, the
training loss, the validation loss and top-1 accuracy and the throughput in images per second over
all ranks; --out writes the same as JSON. --iterations caps the steps per epoch.

CPU only for now (the backend's CUDA paths are not there yet): pure_nccl cannot be chosen.
"""

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

import torch_chainermn  # registers the "chainermn" backend (and, under mpiexec, reads rank and size from MPI)
from torch_chainermn.options import COMMUNICATORS

try:
    from PIL import Image
except ImportError:  # only --synthetic works without PIL
    Image = None

CPU_COMMUNICATORS = tuple(name for name in COMMUNICATORS if name != "pure_nccl")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".ppm", ".tif", ".tiff", ".webp")
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet's channel statistics
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
DEPTHS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


def parse_args():
    parser = argparse.ArgumentParser(description="ChainerMN example: ImageNet (ResNet) with multi-node BatchNorm")
    data = parser.add_argument_group("data")
    data.add_argument("--train", type=Path, help="training image folder, one subfolder per class")
    data.add_argument("--val", type=Path, help="validation image folder (same classes as --train)")
    data.add_argument(
        "--synthetic",
        action="store_true",
        help="random images instead of folders (the default when --train is not given)",
    )
    data.add_argument("--synthetic-train-size", type=int, default=1024, help="synthetic training samples")
    data.add_argument("--synthetic-val-size", type=int, default=256, help="synthetic validation samples")
    data.add_argument("--classes", type=int, default=10, help="number of synthetic classes")
    data.add_argument("--image-size", type=int, help="side of the square crops (default: 32 synthetic, 224 folders)")
    data.add_argument("--loaderjob", "-j", type=int, default=0, help="data loading processes per rank")
    model = parser.add_argument_group("model")
    model.add_argument("--depth", type=int, choices=sorted(DEPTHS), default=18, help="ResNet depth")
    model.add_argument("--width", type=int, default=16, help="channels of the first stage (ResNet: 64)")
    model.add_argument(
        "--no-mnbn", dest="mnbn", action="store_false", help="per-rank BatchNorm instead of multi-node BatchNorm"
    )
    training = parser.add_argument_group("training")
    training.add_argument(
        "--communicator",
        default="hierarchical",
        choices=CPU_COMMUNICATORS,
        help="ChainerMN allreduce communicator (default: hierarchical)",
    )
    training.add_argument("--fp16", action="store_true", help="float16 gradients on the wire")
    training.add_argument(
        "--double-buffering",
        action="store_true",
        help="overlap each step's gradient allreduce with the next step (one step stale)",
    )
    training.add_argument("--batchsize", "-B", type=int, default=32, help="minibatch size per process")
    training.add_argument("--epoch", "-E", type=int, default=10, help="number of epochs")
    training.add_argument("--iterations", type=int, help="at most this many steps per epoch")
    training.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate (cosine decay to 0)")
    training.add_argument("--momentum", type=float, default=0.9)
    training.add_argument("--weight-decay", type=float, default=1e-4)
    training.add_argument("--seed", type=int, default=0, help="seed for the model, the data and the shuffling")
    output = parser.add_argument_group("output")
    output.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    output.add_argument("--out", type=Path, help="rank 0 writes a JSON summary of the run here")
    args = parser.parse_args()
    if args.train is None:
        args.synthetic = True
    if args.synthetic and (args.train is not None or args.val is not None):
        parser.error("--synthetic and --train/--val exclude each other")
    if not args.synthetic and Image is None:
        parser.error("reading image folders needs PIL (pip install pillow); use --synthetic without it")
    if args.image_size is None:
        args.image_size = 32 if args.synthetic else 224
    for name in ("batchsize", "epoch", "image_size", "width", "classes", "synthetic_train_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.iterations is not None and args.iterations < 1:
        parser.error("--iterations must be at least 1")
    return args


# ---------------------------------------------------------------------------------------------- data
# Rank 0 makes a list of sample descriptors, (path, label) or (index, label); scatter_dataset deals
# them out; each rank turns its own descriptors into images.


def list_image_folder(root: Path, classes=None):
    """[(path, label)] of every image under root/<class>/, and the sorted class names."""
    if classes is None:
        classes = sorted(entry.name for entry in root.iterdir() if entry.is_dir())
    if not classes:
        raise SystemExit(f"{root}: no class subfolders")
    samples = []
    for label, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue  # a class missing from the validation set
        for path in sorted(folder.rglob("*")):
            if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file():
                samples.append((str(path), label))
    if not samples:
        raise SystemExit(f"{root}: no images ({', '.join(IMAGE_EXTENSIONS)})")
    return samples, classes


def normalize(image: np.ndarray) -> torch.Tensor:
    """HWC float32 in [0, 1] to a normalized CHW tensor."""
    return torch.from_numpy(((image - MEAN) / STD).transpose(2, 0, 1).copy())


class ImageFiles(Dataset):
    """Images read with PIL: shorter side resized to 8/7 of the crop, then a random crop and flip
    (training) or the centre crop (validation)."""

    def __init__(self, samples, size: int, train: bool):
        self.samples = samples
        self.size = size
        self.train = train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB")
            scale = math.ceil(self.size * 8 / 7) / min(image.size)
            image = image.resize(
                (max(self.size, round(image.width * scale)), max(self.size, round(image.height * scale))),
                Image.BILINEAR,
            )
        width, height = image.size
        if self.train:
            left, top = np.random.randint(0, width - self.size + 1), np.random.randint(0, height - self.size + 1)
        else:
            left, top = (width - self.size) // 2, (height - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        array = np.asarray(image, dtype=np.float32) / 255.0
        if self.train and np.random.rand() < 0.5:
            array = array[:, ::-1]
        return normalize(array), label


class SyntheticImages(Dataset):
    """Random images, each a function of (seed, index) only, so any rank can make any sample."""

    def __init__(self, samples, size: int, classes: int, seed: int):
        self.samples = samples  # (index, label)
        self.size = size
        self.classes = classes
        self.seed = seed

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        sample, label = self.samples[index]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + sample)
        image = torch.randn(3, self.size, self.size, generator=generator)
        # A faint colour per class: something to learn.
        hue = 2 * math.pi * label / self.classes
        image += 0.5 * torch.tensor([math.cos(hue), math.sin(hue), math.cos(hue + 2.1)]).view(3, 1, 1)
        return image, label


def synthetic_descriptors(n: int, classes: int, seed: int):
    labels = np.random.RandomState(seed).randint(0, classes, size=n)
    return [(i, int(label)) for i, label in enumerate(labels)]


def load_datasets(args, comm):
    """This rank's (train, val) shards, the number of classes and the size of the whole validation set."""
    if comm.rank == 0:
        if args.synthetic:
            train = synthetic_descriptors(args.synthetic_train_size, args.classes, args.seed)
            val = [
                (args.synthetic_train_size + i, label)
                for i, label in synthetic_descriptors(args.synthetic_val_size, args.classes, args.seed + 1)
            ]
            classes = [str(c) for c in range(args.classes)]
        else:
            train, classes = list_image_folder(args.train)
            val = list_image_folder(args.val, classes)[0] if args.val is not None else []
        print(
            f"data: {'synthetic' if args.synthetic else args.train}  classes: {len(classes)}  "
            f"train: {len(train)}  val: {len(val)}  image size: {args.image_size}",
            flush=True,
        )
    else:
        train = val = classes = None
    n_classes, n_val = comm.bcast_obj((len(classes), len(val)) if comm.rank == 0 else None)
    # Equal-length training shards: every rank runs the same number of steps. Validation shards do
    # not repeat samples; the evaluator weights each rank by its shard's size.
    train = torch_chainermn.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    val = torch_chainermn.scatter_dataset(val, comm, shuffle=True, seed=args.seed, force_equal_length=False)
    if args.synthetic:
        return (
            SyntheticImages(train, args.image_size, n_classes, args.seed),
            SyntheticImages(val, args.image_size, n_classes, args.seed),
            n_classes,
            n_val,
        )
    return ImageFiles(train, args.image_size, True), ImageFiles(val, args.image_size, False), n_classes, n_val


# ---------------------------------------------------------------------------------------------- model


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet of BasicBlocks: four stages of width, 2 width, 4 width, 8 width channels."""

    def __init__(self, blocks=(2, 2, 2, 2), width: int = 64, classes: int = 1000, small_images: bool = False):
        super().__init__()
        if small_images:
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
            )
        stages, in_channels = [], width
        for i, count in enumerate(blocks):
            channels = width * 2**i
            for j in range(count):
                stages.append(BasicBlock(in_channels, channels, 2 if i > 0 and j == 0 else 1))
                in_channels = channels
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        for block in self.stages:
            nn.init.zeros_(block.bn2.weight)  # each residual block starts as the identity

    def forward(self, x):
        h = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


# ---------------------------------------------------------------------------------------------- output


def write_json_atomically(path: Path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(temporary, path)


# ---------------------------------------------------------------------------------------------- training


@torch.no_grad()
def evaluate(model, loader):
    """Loss and top-1 accuracy on this rank's validation shard (NaN when empty: its weight is 0)."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, t in loader:
        y = model(x)
        loss_sum += F.cross_entropy(y, t, reduction="sum").item()
        correct += (y.argmax(1) == t).sum().item()
        count += len(t)
    if count == 0:
        return {"loss": float("nan"), "accuracy": float("nan")}
    return {"loss": loss_sum / count, "accuracy": correct / count}


def main():
    args = parse_args()
    comm = torch_chainermn.create_communicator(
        args.communicator, allreduce_grad_dtype=torch.float16 if args.fp16 else None
    )
    if "OMP_NUM_THREADS" not in os.environ:
        # The ranks on a node share its cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.intra_size))
    if comm.rank == 0:
        print(
            f"world size: {comm.size} ({comm.inter_size} node(s))  communicator: {comm.communicator_name}  "
            f"transport: {torch_chainermn.transport(comm.group)}  allreduce_grad_dtype: {comm.allreduce_grad_dtype}  "
            f"double buffering: {args.double_buffering}  multi-node BatchNorm: {args.mnbn}",
            flush=True,
        )

    train, val, n_classes, n_val = load_datasets(args, comm)
    loader_options = {"num_workers": args.loaderjob}
    if args.loaderjob > 0:
        # Forking a process that holds MPI and communication threads is unsafe (ChainerMN's advice).
        loader_options.update(
            multiprocessing_context=multiprocessing.get_context("forkserver"), persistent_workers=True
        )
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + comm.rank)
    # drop_last: every rank's batches have the same size, and BatchNorm never sees a batch of one.
    train_loader = DataLoader(
        train, batch_size=args.batchsize, shuffle=True, drop_last=True, generator=generator, **loader_options
    )
    val_loader = DataLoader(val, batch_size=args.batchsize, **loader_options)
    steps = len(train_loader) if args.iterations is None else min(args.iterations, len(train_loader))
    if steps == 0:
        raise SystemExit(
            f"rank {comm.rank}: a training shard of {len(train)} samples makes no batch of {args.batchsize}"
        )

    torch.manual_seed(args.seed)
    model = ResNet(DEPTHS[args.depth], args.width, n_classes, small_images=args.image_size <= 64)
    if args.mnbn:
        model = torch_chainermn.convert_mnbn_model(model, comm)
    average_buffers = None if args.mnbn else torch_chainermn.AllreducePersistent(model, comm)
    optimizer = torch_chainermn.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay),
        comm,
        double_buffering=args.double_buffering,
    )
    # Cosine decay over all steps (the multi-node optimizer shares the wrapped one's param_groups).
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epoch * steps)
    evaluator = torch_chainermn.create_multi_node_evaluator(lambda: evaluate(model, val_loader), comm, weight=len(val))
    if comm.rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        print(
            f"model: ResNet-{args.depth} width {args.width}, {parameters / 1e6:.2f} M parameters  "
            f"batch size: {args.batchsize} per rank, {args.batchsize * comm.size} in all  steps per epoch: {steps}",
            flush=True,
        )

    history = []
    for epoch in range(1, args.epoch + 1):
        model.train()
        # On stderr, rank 0 only: redrawn in place on a terminal, every few seconds to a file or pipe.
        progress = tqdm(
            total=steps,
            desc=f"epoch {epoch}",
            disable=not (args.progress and comm.rank == 0),
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.1 if sys.stderr.isatty() else 5.0,
        )
        dist.barrier(group=comm.group)  # every rank starts the clock together
        start = time.perf_counter()
        loss_sum, images = 0.0, 0
        for step, (x, t) in enumerate(train_loader, 1):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), t)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.item() * len(t)
            images += len(t)
            seconds = time.perf_counter() - start
            progress.set_postfix_str(
                f"loss {loss.item():.3f}  {images * comm.size / seconds:.1f} images/s", refresh=False
            )
            progress.update()
            if step == steps:
                break
        if args.double_buffering:
            optimizer.flush()
        totals = comm.allreduce(np.array([loss_sum, images], dtype=np.float64))
        seconds = time.perf_counter() - start
        progress.close()
        throughput = totals[1] / seconds
        if average_buffers is not None:
            average_buffers()  # per-rank BatchNorm: validate with the ranks' mean running statistics
        # Collective; skipped by every rank alike when there is no validation set at all.
        metrics = evaluator() if n_val > 0 else {"loss": float("nan"), "accuracy": float("nan")}
        history.append(
            {
                "epoch": epoch,
                "train/loss": float(totals[0] / totals[1]),
                "val/loss": metrics["loss"],
                "val/accuracy": metrics["accuracy"],
                "images": int(totals[1]),
                "seconds": seconds,
                "images_per_second": float(throughput),
            }
        )
        if comm.rank == 0:
            print(
                f"epoch {epoch}  train/loss {history[-1]['train/loss']:.4f}  val/loss {metrics['loss']:.4f}  "
                f"val/accuracy {metrics['accuracy']:.4f}  {int(totals[1])} images in {seconds:.1f}s  "
                f"throughput {throughput:.1f} images/s",
                flush=True,
            )

    if comm.rank == 0 and args.out is not None:
        write_json_atomically(
            args.out,
            {
                "world_size": comm.size,
                "communicator": comm.communicator_name,
                "transport": torch_chainermn.transport(comm.group),
                "fp16": args.fp16,
                "allreduce_grad_dtype": str(comm.allreduce_grad_dtype),
                "double_buffering": args.double_buffering,
                "mnbn": args.mnbn,
                "synthetic": args.synthetic,
                "depth": args.depth,
                "width": args.width,
                "image_size": args.image_size,
                "steps_per_epoch": steps,
                "history": history,
            },
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
