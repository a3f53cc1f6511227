"""Packed windows: several sequences in one row, exactly the full batch's step.

Run the check: PYTHONPATH=src python examples/packing.py
Train it:      bigbatch train examples/causal_lm.py:task --batch-size 32 --pack 128

A tiny Llama built from a config (random weights, nothing downloaded) learns text of very
different lengths. ``Accumulator(micro_batch_tokens=64, pack=32)`` keeps each step's batch of 8
sequences exactly but lays its samples whole into rows of 32 tokens (first-fit-decreasing),
positions restarting at each sample, no attention mask, and two rows per micro-batch: almost no
padding is computed, and every micro-batch has one shape. transformers keeps the samples apart by
their ``position_ids`` only when no cache is built, so the model is made with
``use_cache=False`` (bigbatch refuses a packed forward that would build one). Before the first
step the engine replays that window unpacked and compares (Note [packing audit]); every step's
``StepResult.ledger`` says what it counted and computed. The script checks the packed run against
one full-batch step of the same padded batches, in float64.
"""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import bigbatch


def padded_batch(n: int, vocab: int, length: int = 24) -> dict[str, torch.Tensor]:
    """``n`` sequences of 3 to ``length`` tokens, right-padded, padding not predicted."""
    ids = torch.randint(1, vocab, (n, length))
    real = torch.randint(3, length + 1, (n,))
    mask = (torch.arange(length)[None, :] < real[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple:
    """The causal LM's token loss as ``(loss_sum, count)``: packed rows come with
    ``position_ids`` and no mask, padded ones with their mask."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    return bigbatch.token_cross_entropy(model(**inputs).logits, batch["labels"], shift=True)


def float64_norms(model: torch.nn.Module) -> None:
    """Llama's RMSNorm computes in float32 even in a float64 model: here in float64 too."""
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = lambda x, m=module: (
                m.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
            )


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config).double()  # float64: the comparison is not blurred
    reference = copy.deepcopy(model)
    float64_norms(model), float64_norms(reference)
    acc = bigbatch.Accumulator(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), micro_batch_tokens=64, pack=32
    )
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(3):
        batch = padded_batch(8, config.vocab_size)  # 8 sequences of 3 to 24 tokens, padded
        result = acc.train_step(batch, loss_fn)
        loss_sum, tokens = loss_fn(reference, batch)  # the full batch in one step, to compare
        (loss_sum / tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ledger = result.ledger
        print(
            f"step {step}: token-mean loss {result.loss:.5f} (full batch "
            f"{(loss_sum / tokens).item():.5f}), {result.micro_batches} micro-batches of packed "
            f"rows, {ledger.input_tokens} real tokens in {ledger.computed_tokens} computed "
            f"({1 - ledger.token_efficiency:.0%} padding; padded rows: "
            f"{1 - ledger.input_tokens / batch['input_ids'].numel():.0%}), "
            f"{ledger.model_flops / 1e6:.1f} MFLOPs"
        )
    with torch.no_grad():
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        difference = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in pairs)
    print(f"largest relative parameter difference from full-batch training: {difference:.1e}")
    assert difference < 1e-10, "packed training should match full-batch training"


if __name__ == "__main__":
    main()
