"""ChainerMN's training extensions for PyTorch: AllreducePersistent, the multi-node evaluator and the
multi-node checkpointer.

Every function takes `comm`: a torch_chainermn communicator, a ProcessGroup, or None for the default
group. Each one is collective: every rank of the group must call it, in the same order.
"""

from .checkpoint import MultiNodeCheckpointer, create_multi_node_checkpoint, create_multi_node_checkpointer
from .evaluator import MultiNodeEvaluator, create_multi_node_evaluator
from .persistent import AllreducePersistent

__all__ = [
    "AllreducePersistent",
    "MultiNodeCheckpointer",
    "MultiNodeEvaluator",
    "create_multi_node_checkpoint",
    "create_multi_node_checkpointer",
    "create_multi_node_evaluator",
]
