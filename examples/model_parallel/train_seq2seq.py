"""A seq2seq model with its encoder on rank 0 and its decoder on rank 1 (ChainerMN's multi-node
n-step RNN: create_multi_node_n_step_rnn), learning to reverse sequences of digits.

    torchrun --nproc-per-node 2 examples/model_parallel/train_seq2seq.py
    mpiexec -n 2 python examples/model_parallel/train_seq2seq.py

Rank 0 embeds the source sequence and runs the encoder LSTM; its final state (h, c) goes to rank 1
(`rank_out=1`), whose decoder LSTM starts from it (`rank_in=0`) and predicts the reversed sequence,
with teacher forcing in training. Rank 1 computes the loss and backprops; rank 0 backprops from the
delegate variable its RNN returned, which receives the gradient of the state from rank 1. Both ranks
draw the same synthetic batches (same seed); evaluation decodes greedily on rank 1 and reports
token and whole-sequence accuracy.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_chainermn
from torch_chainermn import create_multi_node_n_step_rnn

VOCAB, BOS = 10, 10  # digits 0-9, and a start symbol for the decoder


def parse_args():
    parser = argparse.ArgumentParser(description="ChainerMN example: seq2seq over two processes")
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--batchsize", "-b", type=int, default=64)
    parser.add_argument("--length", type=int, default=6, help="length of the sequences to reverse")
    parser.add_argument("--unit", "-u", type=int, default=64, help="embedding and LSTM size")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="rank 1 writes a JSON summary here")
    return parser.parse_args()


def batch(generator, size, length):
    src = torch.randint(0, VOCAB, (size, length), generator=generator)
    return src, src.flip(1)


class Encoder(torch.nn.Module):
    def __init__(self, comm, unit):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, unit)
        self.rnn = create_multi_node_n_step_rnn(
            torch.nn.LSTM(unit, unit, batch_first=True), comm, rank_in=None, rank_out=1
        )

    def forward(self, src):
        _, _, delegate = self.rnn(self.embed(src))
        return delegate


class Decoder(torch.nn.Module):
    def __init__(self, comm, unit):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB + 1, unit)
        self.rnn = create_multi_node_n_step_rnn(
            torch.nn.LSTM(unit, unit, batch_first=True), comm, rank_in=0, rank_out=None
        )
        self.out = torch.nn.Linear(unit, VOCAB)

    def forward(self, tgt):
        """Teacher forcing: the decoder reads BOS and tgt[:-1], predicts tgt."""
        inputs = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)
        ys, _, _ = self.rnn(self.embed(inputs))
        return self.out(ys)

    @torch.no_grad()
    def greedy(self, size, length):
        token = torch.full((size, 1), BOS)
        ys, hidden, _ = self.rnn(self.embed(token))  # receives the encoder's state
        out = []
        for _ in range(length):
            token = self.out(ys).argmax(-1)
            out.append(token)
            ys, hidden = self.rnn.actual_rnn(self.embed(token), hidden)  # local steps from here on
        return torch.cat(out, dim=1)


def main():
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    comm = torch_chainermn.create_communicator("naive")
    if comm.size != 2:
        raise SystemExit("this example runs on exactly 2 processes (encoder on rank 0, decoder on rank 1)")
    torch.manual_seed(args.seed + comm.rank)
    model = Encoder(comm, args.unit) if comm.rank == 0 else Decoder(comm, args.unit)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed)  # the same batches on both ranks
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        src, tgt = batch(data, args.batchsize, args.length)
        optimizer.zero_grad()
        if comm.rank == 0:
            model(src).backward()  # the delegate variable: receives the gradient of the state
        else:
            loss = F.cross_entropy(model(tgt).reshape(-1, VOCAB), tgt.reshape(-1))
            loss.backward()
        optimizer.step()
        if step % 100 == 0 and comm.rank == 1:
            print(f"step {step}  train/loss {loss.item():.4f}  elapsed {time.perf_counter() - start:.1f}s", flush=True)

    src, tgt = batch(torch.Generator().manual_seed(args.seed + 1), 1000, args.length)  # unseen sequences
    model.eval()
    with torch.no_grad():
        if comm.rank == 0:
            model(src)
        else:
            predicted = model.greedy(len(tgt), args.length)
            tokens = (predicted == tgt).float().mean().item()
            sequences = (predicted == tgt).all(1).float().mean().item()
            print(
                f"greedy decoding of 1000 unseen sequences: token accuracy {tokens:.4f}  "
                f"sequence accuracy {sequences:.4f}",
                flush=True,
            )
            if args.out is not None:
                import json

                args.out.write_text(
                    json.dumps({"token_accuracy": tokens, "sequence_accuracy": sequences, "steps": args.steps}) + "\n"
                )
    torch_chainermn.functions.drain(comm)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
