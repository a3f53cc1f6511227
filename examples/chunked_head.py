"""A causal language model's loss without its logits: the chunked head, exact under accumulation.

Run: PYTHONPATH=src python examples/chunked_head.py

The largest tensors of an LM's step are its head's logits, tokens x vocabulary (and the loss's
float32 copies of them). ``bigbatch.head_cross_entropy(hidden, head, labels)`` takes the hidden
states *before* the head and computes the token cross-entropy a chunk of tokens at a time, so
the logits are never all in memory; it returns ``(loss_sum, count)``, and the engine divides
once by the window's token count. Here a tiny GPT-2 (built from a config, random weights,
float64) trains with token windows and the chunked head, and every step is checked against one
full-batch step with the plain head: the same weights to float64 rounding. The printed peaks
compare the two heads on one larger micro-batch (vocabulary 32,768).
"""

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import bigbatch

torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
model = GPT2LMHeadModel(config).double()  # float64: the comparison is not blurred by rounding
reference = copy.deepcopy(model)


def padded_batch(n: int, length: int = 24) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, config.vocab_size, (n, length))
    mask = (torch.arange(length)[None, :] < torch.randint(3, length + 1, (n, 1))).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def chunked_loss(model, batch):
    """The decoder's hidden states, then the head in chunks: (loss_sum, labelled tokens)."""
    hidden = model.transformer(batch["input_ids"], attention_mask=batch["attention_mask"])
    head = model.get_output_embeddings()  # GPT-2's head is tied to its token embedding
    return bigbatch.head_cross_entropy(hidden.last_hidden_state, head, batch["labels"])


def plain_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return bigbatch.token_cross_entropy(logits, batch["labels"], shift=True)


acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           micro_batch_tokens=96)  # fmt: skip
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
for step in range(3):
    batch = padded_batch(8)
    result = acc.train_step(batch, chunked_loss)
    loss_sum, tokens = plain_loss(reference, batch)  # the full batch in one step, plain head
    full = loss_sum / tokens
    full.backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    print(f"step {step}: loss {result.loss:.6f} (full batch, plain head {full.item():.6f}), "
          f"{result.micro_batches} micro-batches, {result.tokens} tokens")  # fmt: skip
pairs = zip(model.parameters(), reference.parameters(), strict=True)
difference = max(float((a - b).norm() / b.norm()) for a, b in pairs)
print(f"largest relative parameter difference from full-batch training: {difference:.1e}")
assert difference < 1e-10, "the chunked head, accumulated, should match the plain full batch"

# What the head adds to a step's memory, vocabulary 32,768, 2,048 tokens (float32):
head = torch.nn.Linear(256, 32768, bias=False)
hidden = torch.randn(2, 1024, 256, requires_grad=True)
labels = torch.randint(0, 32768, (2, 1024))
for name, loss in [
    ("plain head", lambda: bigbatch.token_cross_entropy(head(hidden), labels, shift=True)),
    ("chunked head", lambda: bigbatch.head_cross_entropy(hidden, head, labels)),
]:
    with bigbatch.measure_peak("cpu") as peak:
        loss_sum, count = loss()
        (loss_sum / count).backward()
    print(f"{name}: {peak}")
