"""create_multi_node_n_step_rnn: an RNN whose hidden state comes from one rank and goes on to another
(ChainerMN's, for torch.nn.LSTM, GRU and RNN), e.g. a seq2seq model with the encoder on rank 0 and
the decoder on rank 1:

    encoder = create_multi_node_n_step_rnn(torch.nn.LSTM(16, 32), comm, rank_in=None, rank_out=1)
    _, _, phi = encoder(xs)              # rank 0: sends (h_n, c_n) to rank 1; phi.backward() later
    decoder = create_multi_node_n_step_rnn(torch.nn.LSTM(16, 32), comm, rank_in=0, rank_out=None)
    ys, hidden, _ = decoder(xs)          # rank 1: starts from rank 0's final state
"""

from __future__ import annotations

import torch

from .._arguments import as_communicator
from ..functions.point_to_point import recv, send

USAGE = "create_multi_node_n_step_rnn(rnn, comm, rank_in=None, rank_out=None)"


class MultiNodeNStepRNN(torch.nn.Module):
    """Wraps `rnn` (torch.nn.LSTM, GRU or RNN): forward(input) receives the initial hidden state from
    `rank_in` (for an LSTM the pair (h_0, c_0)), runs the RNN, sends the final state to `rank_out`,
    and returns (output, final state, delegate variable or None)."""

    def __init__(self, rnn: torch.nn.RNNBase, comm, rank_in: int | None, rank_out: int | None):
        super().__init__()
        op = "create_multi_node_n_step_rnn"
        if not isinstance(rnn, torch.nn.RNNBase):
            raise ValueError(f"{op}: rnn must be a torch.nn.LSTM, GRU or RNN, got {type(rnn).__name__}")
        self.actual_rnn = rnn
        self.comm = as_communicator(op, comm, USAGE)
        for name, value in (("rank_in", rank_in), ("rank_out", rank_out)):
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value < self.comm.size
                or value == self.comm.rank
            ):
                raise ValueError(
                    f"{op}: {name} must be None or another rank in [0, {self.comm.size}) than this "
                    f"one ({self.comm.rank}), got {value!r}"
                )
        self.rank_in, self.rank_out = rank_in, rank_out
        self.is_lstm = isinstance(rnn, torch.nn.LSTM)

    def forward(self, input, hx=None, delegate_variable=None):
        if self.rank_in is not None:
            if hx is not None:
                raise ValueError(f"{type(self).__name__}: hx is received from rank {self.rank_in}; do not pass it")
            hx = recv(self.comm, self.rank_in, delegate_variable=delegate_variable, force_tuple=self.is_lstm)
            hx = tuple(hx) if self.is_lstm else hx
        output, hidden = self.actual_rnn(input, hx)
        delegate = None
        if self.rank_out is not None:
            delegate = send(tuple(hidden) if self.is_lstm else hidden, self.comm, self.rank_out)
        return output, hidden, delegate


def create_multi_node_n_step_rnn(rnn, comm, rank_in=None, rank_out=None) -> MultiNodeNStepRNN:
    """ChainerMN's create_multi_node_n_step_rnn for torch's RNN modules: the initial hidden state comes
    from `rank_in` (None: the usual hx argument, zeros by default), the final one goes to `rank_out`."""
    return MultiNodeNStepRNN(rnn, comm, rank_in, rank_out)
