"""A causal language model on variable-length text, cut by tokens (token windows).

Run the check: PYTHONPATH=src python examples/causal_lm.py
Train it:      bigbatch train examples/causal_lm.py:task --batch-size 32 --micro-batch-tokens 1024

The model is a tiny GPT-2 built from a config (random weights, nothing downloaded). Sequences
have very different lengths. ``Accumulator(micro_batch_tokens=96)`` keeps each step's batch of
8 sequences exactly, but cuts it by tokens: the sequences are sorted by length, each micro-batch
holds at most 96 padded tokens and is trimmed to its own longest sequence, so far less padding
is computed than with a fixed number of sequences per micro-batch. ``token_cross_entropy``
returns ``(loss_sum, count)`` and the engine divides once by the window's total token count: the
full batch's token mean. The script checks that against one full-batch step.

``task()`` is the same kind of model as a ``bigbatch train`` task: a 2-layer GPT-2 reading the
docstrings of Python's own standard library byte by byte (text that ships with Python: no
download), right-padded per batch with an attention mask, for ``--micro-batch-tokens`` (token
windows) or ``--micro-batch-size`` (each micro-batch trimmed to its longest docstring).
"""

import copy
import importlib
import inspect

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import bigbatch

MODULES = ("argparse collections contextlib dataclasses functools inspect itertools json os "
           "pathlib random re shutil statistics string textwrap typing").split()  # fmt: skip


def task(docstrings: int = 512, max_tokens: int = 128) -> bigbatch.Task:
    """A 2-layer GPT-2 learning the first paragraphs of the standard library's docstrings (7 to
    400 bytes, half under 50), one byte per token, at most ``max_tokens``."""
    found: dict[bytes, None] = {}  # in order, each once
    for name in MODULES:
        for _, member in inspect.getmembers(importlib.import_module(name)):
            text = (inspect.getdoc(member) or "").split("\n\n")[0].encode()[:max_tokens]
            if len(text) >= 16 and len(found) < docstrings:
                found[text] = None
    texts = [torch.tensor(list(text)) for text in found]
    config = GPT2Config(vocab_size=256, n_positions=max_tokens, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)  # the same initial weights in every run of the task
    return bigbatch.Task(model=GPT2LMHeadModel(config), train_data=texts, loss_fn=loss_fn,
                         collate_fn=right_padded)  # fmt: skip


def right_padded(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Byte sequences as one batch in the transformers convention (padding on the right)."""
    ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
    lengths = torch.tensor([len(s) for s in samples])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_fn(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return bigbatch.token_cross_entropy(logits, batch["labels"], shift=True)  # (loss_sum, tokens)


def padded_batch(n: int, vocab: int, length: int = 24) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (n, length))
    real = torch.randint(3, length + 1, (n,))  # each sequence's real length
    mask = (torch.arange(length)[None, :] < real[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)  # padding is not predicted
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    torch.manual_seed(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # the runs can match
    tiny = {"vocab_size": 64, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2,
            "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    config = GPT2Config(**tiny, **no_dropout)
    model = GPT2LMHeadModel(config).double()  # float64: the comparison is not blurred by rounding
    reference = copy.deepcopy(model)
    acc = bigbatch.Accumulator(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), micro_batch_tokens=96
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(3):
        batch = padded_batch(8, config.vocab_size)  # 8 sequences of 3 to 24 tokens, padded
        result = acc.train_step(batch, loss_fn)
        padding = 1 - result.tokens / result.padded_tokens
        loss_sum, tokens = loss_fn(reference, batch)  # the full batch in one step, to compare
        ref_loss = loss_sum / tokens
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        print(
            f"step {step}: token-mean loss {result.loss:.5f} (full batch {ref_loss.item():.5f}), "
            f"{result.micro_batches} micro-batches, {result.tokens} tokens, {padding:.0%} "
            f"padding (the batch padded to its longest: "
            f"{1 - result.tokens / batch['input_ids'].numel():.0%})"
        )
    with torch.no_grad():
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        difference = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in pairs)
    print(f"largest relative parameter difference from full-batch training: {difference:.1e}")
    assert difference < 1e-10, "accumulated training should match full-batch training"


if __name__ == "__main__":
    main()
