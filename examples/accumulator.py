"""The same training as examples/plain_loop.py with ``bigbatch.Accumulator.train_step``.

Run: PYTHONPATH=src python examples/accumulator.py

``train_step`` cuts each logical batch of 10 into micro-batches of 4 (4 + 4 + 2), back-propagates
each micro-batch's loss sum, divides once by the total count, clips, steps the optimizer (and a
scheduler, once) and zeroes the gradients: the step equals one full-batch step, exactly.
"""

import torch
import torch.nn.functional as F

import bigbatch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = [(torch.randn(10, 6), torch.randint(0, 3, (10,))) for _ in range(20)]  # 20 logical batches


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)  # a mean over the micro-batch: bigbatch weighs it by size


acc = bigbatch.Accumulator(model, optimizer, micro_batch_size=4, max_grad_norm=1.0)
for step, batch in enumerate(data):
    result = acc.train_step(batch, loss_fn)
    if step % 5 == 0:  # result.loss is the whole batch's mean loss (one host sync per step)
        print(f"step {step}: loss {result.loss:.4f} over {result.micro_batches} micro-batches")
