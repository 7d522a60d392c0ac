#!/usr/bin/env python
"""The language-model task of the simulated cluster: data, model and validation loss.

A small decoder-only transformer learns to predict the next byte of the Python standard library's
own sources (the running interpreter's `sysconfig.get_paths()["stdlib"]`, *.py files, without the
test suites and site-packages). Bytes are the tokens (vocabulary 256), so there is no tokenizer to
install and every machine with the same Python version has the same corpus (compare the printed
size and hash across machines). The files are split into training and validation by file, with a
fixed seed, so validation text is never seen in training.

train_lm.py (one rank of the cluster) imports this module. Run it alone to size the task on one
process, without any networking: the compute step time, the loss curve, and the magnitudes of the
gradients and of DiLoCo's outer gradients (what the 2-bit thresholds are chosen from):

    .venv/bin/python benchmarks/cluster/lm.py --steps 300
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# Directories that hold test suites or third-party code, not the standard library's own code.
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


# ---------------------------------------------------------------------------------------- data


@dataclass
class Corpus:
    train: torch.Tensor  # uint8, the training files end to end
    val: torch.Tensor  # uint8, the validation files end to end
    files: int
    val_files: int
    digest: str  # sha256 of both parts, first 12 hex digits

    def describe(self) -> str:
        return (
            f"corpus: {self.files} stdlib .py files ({self.val_files} for validation), "
            f"{len(self.train) / 1e6:.2f} MB train + {len(self.val) / 1e6:.2f} MB val, sha256 {self.digest}"
        )


def stdlib_files(root: str | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_mb: float = 8.0, val_fraction: float = 0.05, seed: int = 0) -> Corpus:
    """The stdlib's sources, split by file (a seeded shuffle of the sorted list; the first
    val_fraction of files validate), training part capped at max_mb (loading all 14 MB is quick,
    but a few hundred steps see well under 1 MB of it; the cap keeps the corpus the same on a
    Python whose stdlib has grown)."""
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    n_val = max(1, round(len(files) * val_fraction))
    val = b"\n".join(p.read_bytes() for p in files[:n_val])
    train, used = [], 0
    for p in files[n_val:]:
        if used >= max_mb * 1e6:
            break
        data = p.read_bytes()
        train.append(data)
        used += len(data) + 1
    n_files = n_val + len(train)
    train = b"\n".join(train)
    digest = hashlib.sha256(train + b"\0" + val).hexdigest()[:12]
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), n_files, n_val, digest)


def batches(data: torch.Tensor, batch: int, context: int, seed: int):
    """An endless stream of (inputs, targets): `batch` windows of `context` bytes at random places,
    the targets shifted by one. Each rank draws from its own seed, so ranks see different text."""
    gen = torch.Generator().manual_seed(seed)
    span = torch.arange(context + 1)
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch, 1), generator=gen)
        window = data[starts + span].long()
        yield window[:, :-1], window[:, 1:]


def validation_windows(val: torch.Tensor, count: int, context: int) -> torch.Tensor:
    """`count` fixed windows of context + 1 bytes, evenly spaced over the validation text: the same
    set at every evaluation and on every machine with this corpus."""
    starts = torch.linspace(0, len(val) - context - 2, count).long()
    return val[starts[:, None] + torch.arange(context + 1)].long()


# ---------------------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each on a residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    def __init__(self, dim: int = 128, layers: int = 4, heads: int = 4, context: int = 128):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2 or name == "pos":
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_of(model, inputs, targets) -> torch.Tensor:
    """Mean cross-entropy in nats per byte."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


@torch.no_grad()
def validation_loss_sum(model, windows: torch.Tensor, chunk: int = 32) -> tuple[float, int]:
    """(sum of the per-byte losses, bytes) over `windows`, so that ranks can add their shares."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), chunk):
        w = windows[i : i + chunk]
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, 256), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train(was_training)
    return total, count


def learning_rate(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then constant: time to a target loss should compare how
    modes communicate, not how a decay schedule was tuned to a step budget."""
    return lr * min(1.0, (step + 1) / max(1, warmup))


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The task's options, shared by this sizing run, train_lm.py and the driver (run.py --task lm)."""
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64, help="bytes per training window")
    p.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's learning rate (every mode)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--corpus-mb", type=float, default=8.0, help="cap on the training text")
    p.add_argument("--val-windows", type=int, default=64, help="fixed validation windows")


def build(args) -> ByteLM:
    torch.manual_seed(0)  # every rank builds the same parameters
    return ByteLM(args.dim, args.layers, args.heads, args.context)


# ---------------------------------------------------------------------------------------- sizing


def percentiles(t: torch.Tensor) -> str:
    a = t.abs().flatten()
    if a.numel() > 1_000_000:
        a = a[torch.randperm(a.numel(), generator=torch.Generator().manual_seed(0))[:1_000_000]]
    q = torch.quantile(a, torch.tensor([0.5, 0.9, 0.99]))
    return f"mean {a.mean():.2e}, p50 {q[0]:.2e}, p90 {q[1]:.2e}, p99 {q[2]:.2e}, max {a.max():.2e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--sync-every", type=int, default=16, help="H: the outer gradient is measured over H steps")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = load_corpus(args.corpus_mb)
    print(f"{corpus.describe()} (loaded in {time.perf_counter() - t0:.2f} s)")
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: dim {args.dim}, {args.layers} layers, {args.heads} heads, context {args.context}: "
        f"{n_params / 1e6:.3f}M parameters, {n_params * 4 / 1e6:.2f} MB fp32 gradient"
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    data = batches(corpus.train, args.batch, args.context, seed=0)
    windows = validation_windows(corpus.val, args.val_windows, args.context)
    times, start = [], [q.detach().clone() for q in model.parameters()]
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, args.lr, args.warmup)
        t = time.perf_counter()
        x, y = next(data)
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        if step in (0, 50, args.steps // 2):
            # 2-bit compresses a node's SUM of its ranks' gradients: with M ranks a node, about M x
            # these per-rank values (less when the ranks' gradients disagree).
            print(
                f"  step {step}: |gradient| per rank {percentiles(torch.cat([q.grad.flatten() for q in model.parameters()]))}"
            )
        opt.step()
        times.append(time.perf_counter() - t)
        if (step + 1) % args.sync_every == 0:
            if (step + 1) // args.sync_every in (1, 3, args.steps // (2 * args.sync_every)):
                # DiLoCo's outer gradient: the parameters H steps ago minus now (one replica's)
                delta = torch.cat([(a - q).flatten() for a, q in zip(start, model.parameters())])
                print(
                    f"  steps {step + 2 - args.sync_every}..{step + 1}: |outer gradient| over "
                    f"H={args.sync_every} {percentiles(delta)}"
                )
            start = [q.detach().clone() for q in model.parameters()]
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            t = time.perf_counter()
            total, count = validation_loss_sum(model, windows)
            print(
                f"step {step + 1:4d}: train {loss.item():.3f}, val {total / count:.3f} "
                f"(eval {time.perf_counter() - t:.2f} s), step {statistics.median(times[-args.eval_every :]):.4f} s"
            )
    print(
        f"median step {statistics.median(times[5:]):.4f} s on {args.threads} thread(s); "
        f"{args.batch * args.context} tokens per step"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
