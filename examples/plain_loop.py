"""The gradient-accumulation loop most tutorials show, and what it gets wrong.

Run: python examples/plain_loop.py

It trains a small classifier on random data with a logical batch of 10 samples cut into
micro-batches of 4 (4 + 4 + 2). Compare with examples/accumulator.py, which does the same
training with ``bigbatch.Accumulator`` and gets the full batch's gradient exactly.
"""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = [(torch.randn(10, 6), torch.randint(0, 3, (10,))) for _ in range(20)]  # 20 logical batches
micro_batch_size = 4
accumulation_steps = 3  # ceil(10 / 4)

for step, (x, y) in enumerate(data):
    for xb, yb in zip(x.split(micro_batch_size), y.split(micro_batch_size), strict=True):
        loss = F.cross_entropy(model(xb), yb)
        # WRONG for uneven micro-batches: the last one holds 2 samples, not 4, yet each
        # micro-batch mean gets the same weight 1/3. The gradient is not the full batch's mean
        # (and for a language model on padded sequences, a mean over tokens per micro-batch
        # divided by k is wrong even when the micro-batches hold equal numbers of samples).
        (loss / accumulation_steps).backward()
    # Easy to forget: clipping must come after the whole window, on the summed gradient.
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # forgetting this one mixes windows together
    # The loss printed is the last micro-batch's, not the batch's; and with a scheduler, a
    # scheduler.step() inside the inner loop would step it k times per optimizer step.
    if step % 5 == 0:
        print(f"step {step}: last micro-batch loss {loss.item():.4f}")
