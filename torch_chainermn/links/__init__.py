"""Model-parallel modules (ChainerMN's chainermn.links): MultiNodeChainList (pipelining in
pipeline.py) and create_multi_node_n_step_rnn."""

from .multi_node_chain_list import MultiNodeChainList
from .n_step_rnn import MultiNodeNStepRNN, create_multi_node_n_step_rnn

__all__ = ["MultiNodeChainList", "MultiNodeNStepRNN", "create_multi_node_n_step_rnn"]
