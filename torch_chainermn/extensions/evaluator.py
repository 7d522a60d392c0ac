"""The multi-node evaluator: each rank evaluates its shard; the metrics are averaged, weighted, over ranks."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .._backend import group_of

__all__ = ["MultiNodeEvaluator", "create_multi_node_evaluator"]


def _as_float(value, what: str) -> float:
    try:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError
            return float(value.detach().reshape(()).item())
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"create_multi_node_evaluator: {what} must be a number or a one-element tensor, "
            f"got {type(value).__name__}"
            + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else "")
        ) from None


class MultiNodeEvaluator:
    """Calls `evaluate` on every rank and returns its metrics averaged across ranks.

    Made by `create_multi_node_evaluator`; see there. Attributes: `evaluate` (the wrapped callable),
    `comm`, `weight`.
    """

    def __init__(self, evaluate, comm=None, weight=None):
        if not callable(evaluate):
            raise ValueError(f"create_multi_node_evaluator: evaluate must be callable, got {type(evaluate).__name__}")
        if weight is not None and not callable(weight) and not isinstance(weight, (numbers.Real, torch.Tensor)):
            raise ValueError(
                "create_multi_node_evaluator: weight must be None, a number or a callable "
                f"returning one, got {type(weight).__name__}"
            )
        self.evaluate = evaluate
        self.comm = comm
        self.weight = weight

    def _local_weight(self) -> float:
        if self.weight is None:
            return 1.0
        weight = _as_float(self.weight() if callable(self.weight) else self.weight, "weight")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"create_multi_node_evaluator: weight must be finite and >= 0, got {weight}")
        return weight

    def __call__(self, *args, **kwargs) -> dict:
        group = group_of(self.comm, "create_multi_node_evaluator")
        # A rank whose evaluate fails must not leave the others waiting in the allreduce: each rank
        # reports success or its error in the exchange of metric names, and all raise together.
        failure, metrics, weight = None, {}, 0.0
        try:
            result = self.evaluate(*args, **kwargs)
            if not isinstance(result, Mapping):
                raise ValueError(
                    f"create_multi_node_evaluator: evaluate must return a dict of metrics, got {type(result).__name__}"
                )
            metrics = {key: _as_float(value, f"metric {key!r}") for key, value in result.items()}
            weight = self._local_weight()
        except Exception as error:  # noqa: BLE001  re-raised below, after the other ranks hear of it
            failure = error
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        reports = [None] * size
        summary = (
            f"{type(failure).__name__}: {failure}" if failure is not None else None,
            sorted(metrics, key=repr),
            weight,
        )
        dist.all_gather_object(reports, summary, group=group)

        if failure is not None:
            raise failure
        failed = [(r, report[0]) for r, report in enumerate(reports) if report[0] is not None]
        if failed:
            raise RuntimeError(
                "create_multi_node_evaluator: evaluation failed on "
                + "; ".join(f"rank {r}: {message}" for r, message in failed)
            )
        names = reports[rank][1]
        differing = [r for r, report in enumerate(reports) if report[1] != names]
        if differing:
            listing = "; ".join(f"rank {r}: {report[1]}" for r, report in enumerate(reports))
            raise ValueError(
                f"create_multi_node_evaluator: every rank's evaluate must return the same metric names, got {listing}"
            )
        total_weight = sum(report[2] for report in reports)
        if total_weight <= 0:
            raise ValueError(
                "create_multi_node_evaluator: the ranks' weights sum to zero; at least one rank "
                "must have a positive weight"
            )

        # A rank of weight 0 (an empty shard) adds exactly nothing, even when its metric is NaN.
        weighted = [weight * metrics[name] if weight > 0 else 0.0 for name in names]
        packed = torch.tensor(weighted, dtype=torch.float64)
        dist.all_reduce(packed, group=group)
        averaged = dict(zip(names, (packed / total_weight).tolist()))
        return {name: averaged[name] for name in metrics}  # this rank's own key order


def create_multi_node_evaluator(evaluate, comm=None, weight=None) -> MultiNodeEvaluator:
    """Wrap `evaluate` so that calling it returns its metrics averaged across the ranks of `comm`.

    ChainerMN's `create_multi_node_evaluator`, for PyTorch: each rank evaluates its own shard of the
    validation set, `evaluate(*args, **kwargs)` returns a dict of metrics (floats, ints or one-element
    tensors), and the wrapper returns a dict of floats with the same keys: the mean over ranks,
    weighted by `weight` if given. `weight` is a number or a callable returning one (called after
    `evaluate`), typically the number of samples in this rank's shard, so that uneven shards give
    the average over the whole validation set instead of ChainerMN's unweighted mean of the ranks.

        evaluator = create_multi_node_evaluator(lambda: evaluate(model, shard), comm, weight=len(shard))
        metrics = evaluator()          # collective: every rank calls it

    Every rank must return the same metric names; otherwise, or when `evaluate` fails on any rank,
    every rank raises (none is left waiting). One allreduce, in float64, carries all metrics.
    """
    return MultiNodeEvaluator(evaluate, comm, weight)
