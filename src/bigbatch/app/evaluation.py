"""``evaluate``: a task's loss and metric over its eval data, each ``Σ sum / Σ count``."""

from __future__ import annotations

import torch

from bigbatch.app.signals import StopSignals
from bigbatch.app.task import Task
from bigbatch.core._tree import map_tensors
from bigbatch.core.loss import as_sum_and_count
from bigbatch.core.split import batch_size as samples_in


def evaluate(
    task: Task, model: torch.nn.Module, batch_size: int, stop: StopSignals | None = None
) -> tuple[float | None, float | None]:
    """``(eval_loss, metric)`` over the task's eval data, each ``Σ sum / Σ count``; Nones without.

    Args:
        task: the task (its ``eval_data``, ``loss_fn``, ``metric`` and ``collate_fn``).
        model: the model to evaluate (in eval mode and without gradients here).
        batch_size: samples per forward.
        stop: the run's signals: a signal ends the evaluation at the next batch, and the
            figures returned are then partial (the caller, who sees ``stop.signum``, drops them).
    """
    if task.eval_data is None:
        return None, None
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(task.eval_data, batch_size, collate_fn=task.collate_fn)
    totals = [0.0, 0.0, 0.0, 0.0]  # loss sum, loss count, metric sum, metric count
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch in loader:
            if stop is not None and stop.signum:
                break
            batch = map_tensors(lambda t: t.to(device), batch)
            outputs = [task.loss_fn(model, batch)]
            if task.metric is not None:
                outputs.append(task.metric(model, batch))
            for at, output in enumerate(outputs):
                value, count = as_sum_and_count(output, samples_in(batch))
                totals[2 * at] += float(value)
                totals[2 * at + 1] += float(count)
    model.train(was_training)
    metric = totals[2] / totals[3] if task.metric is not None and totals[3] else None
    return totals[0] / max(totals[1], 1e-30), metric
