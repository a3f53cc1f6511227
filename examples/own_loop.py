"""Keep your own loop: ``acc.micro_batch`` / ``acc.backward(loss_sum, count)`` / ``acc.step()``.

Run: PYTHONPATH=src python examples/own_loop.py

For loops that cannot hand the whole batch to ``train_step`` (a data loader yielding
micro-batches, custom logging per micro-batch...). Each micro-batch passes the *sum* of its
per-sample losses and how many samples it covers; ``step()`` divides once by the window's total.
"""

import torch
import torch.nn.functional as F

import bigbatch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
acc = bigbatch.Accumulator(model, optimizer, scheduler=scheduler, max_grad_norm=1.0)

micro_batches_per_step = 3
loader = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(60)]  # yields micro-batches
for i, (x, y) in enumerate(loader):
    last = (i + 1) % micro_batches_per_step == 0
    with acc.micro_batch(last=last):  # precision autocast; DDP/FSDP gradient sync only when last
        loss_sum = F.cross_entropy(model(x), y, reduction="sum")
        acc.backward(loss_sum, count=len(y))
    if last:
        result = acc.step()  # normalise, clip, optimizer step, scheduler step, zero_grad
        if i // micro_batches_per_step % 5 == 0:
            print(
                f"step {i // micro_batches_per_step}: loss {result.loss:.4f}, lr {scheduler.get_last_lr()[0]:.4f}"
            )
