"""Token windows (Note [token windows]): cut by tokens, sorted by length, trimmed; exact in float64."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from cases import OPTIMIZERS
from models import PAD, VOCAB, TinyCausalLM
from reference import full_batch_step, max_relative_error
from refusals import assert_refused

import bigbatch
from bigbatch.core import head as chunked
from bigbatch.core.head import with_chunked_head
from bigbatch.core.loss import token_cross_entropy

CTX = 12


class PerToken(nn.Module):
    """Each position's logits from its own token only: exact under any padding side."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def text_batch(n: int, gen: torch.Generator, left: bool = False) -> dict[str, torch.Tensor]:
    """Right- (or left-) padded text in the transformers convention, lengths 1 to CTX."""
    lengths = torch.randint(1, CTX + 1, (n,), generator=gen)
    lengths[0] = CTX
    position = torch.arange(CTX)[None, :]
    mask = (position >= CTX - lengths[:, None]) if left else (position < lengths[:, None])
    ids = torch.randint(1, VOCAB, (n, CTX), generator=gen) * mask
    labels = torch.where(mask, ids, torch.full_like(ids, PAD))
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": labels}


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]):
    return token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)


MODELS = {"causal": TinyCausalLM, "per_token": PerToken}
ROWS = [("causal", "plain"), ("per_token", "plain"), ("causal", "chunked"), ("causal", "ours")]
"""(model, loss): the plain head, and the chunked head (Note [chunked head]) by torch's op and by
ours (forced, as on torch < 2.13), whose reference is the plain head's full batch."""


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("budget, multiple", [(8, None), (30, None), (30, 4), (10_000, None)])
@pytest.mark.parametrize("model_name, head", ROWS)
def test_token_windows_equal_the_full_batch(
    model_name, head, budget, multiple, optimizer, gen, monkeypatch
):
    make = MODELS[model_name]
    if head == "ours":
        monkeypatch.setattr(chunked, "LINEAR_CE", None)
    torch.manual_seed(0)
    init = make().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt, opt = (
        OPTIMIZERS[optimizer](ref.parameters()),
        OPTIMIZERS[optimizer](model.parameters()),
    )
    acc = bigbatch.Accumulator(model, opt, micro_batch_tokens=budget, pad_to_multiple_of=multiple)
    for _ in range(2):  # fresh inputs each step
        batch = text_batch(10, gen)
        full_batch_step(ref, ref_opt, lm_loss, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", bigbatch.BigBatchWarning)  # samples over the budget
            loss = lm_loss if head == "plain" else with_chunked_head(lm_loss, model)
            result = acc.train_step(batch, loss)
        real = int(batch["attention_mask"].sum())
        assert result.tokens == real and result.padded_tokens >= real
    assert max_relative_error(ref, model) < 1e-10


def test_each_micro_batch_is_trimmed_and_capped(gen):
    batch = text_batch(10, gen)
    seen: list[tuple[int, int]] = []

    def loss(model, mb):
        seen.append(tuple(mb["input_ids"].shape))
        assert int(mb["attention_mask"][:, -1].max()) == 1  # no all-padding column kept
        return lm_loss(model, mb)

    torch.manual_seed(0)
    model = TinyCausalLM().double()
    acc = bigbatch.Accumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        micro_batch_size=3,
        micro_batch_tokens=24,
    )
    result = acc.train_step(batch, loss)
    lengths = sorted(batch["attention_mask"].sum(-1).tolist(), reverse=True)
    assert all(rows * length <= 24 or rows == 1 for rows, length in seen)
    start = 0
    for rows, length in seen:  # each sample pads at most a quarter of its row
        assert all(n >= 0.75 * length for n in lengths[start : start + rows])
        start += rows
    assert all(rows <= 3 for rows, _ in seen) and sum(rows for rows, _ in seen) == 10
    assert result.padded_tokens == sum(rows * length for rows, length in seen)
    assert result.padded_tokens - result.tokens < 10 * CTX - result.tokens  # less padding


@pytest.mark.parametrize("left, trim", [(False, True), (True, True), (False, False)])
def test_fixed_count_micro_batches_are_trimmed_to_their_longest(gen, left, trim):
    """The sample cut trims right-padded text too (Note [per-token tensors]) and reports its
    padding; a left-padded batch, or trim_padding=False, keeps the whole width. Exact either
    way (a causal model)."""
    batch, widths = text_batch(10, gen, left=left), []
    short = (slice(4, None), slice(None, CTX // 2) if left else slice(CTX // 2, None))
    batch["attention_mask"][short] = 0  # samples 4-9: at most half the padded length
    batch["labels"][short] = PAD

    def loss(model, mb):
        widths.append(mb["input_ids"].shape[1])
        assert mb["labels"].shape == mb["attention_mask"].shape == mb["input_ids"].shape
        return lm_loss(model, mb)

    torch.manual_seed(0)
    ref, model = TinyCausalLM().double(), TinyCausalLM().double()
    model.load_state_dict(ref.state_dict())
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), lm_loss, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    result = bigbatch.Accumulator(model, opt, 4, trim_padding=trim).train_step(batch, loss)
    assert max_relative_error(ref, model) < 1e-10
    lengths = batch["attention_mask"].sum(-1).tolist()
    if left or not trim:
        assert widths == [CTX] * 3 and result.tokens is None
        return
    assert widths == [max(lengths[i : i + 4]) for i in (0, 4, 8)] and max(widths[1:]) <= CTX // 2
    assert (
        result.tokens == sum(lengths)
        and result.padded_tokens == 4 * sum(widths[:2]) + 2 * widths[2]
    )


def test_labels_on_the_padding_keep_the_whole_width(gen):
    """Silent before: labels copied from the ids (the pad id, not -100, past each sample) are
    trained on by the full batch; trimming a fixed-count micro-batch to its attended tokens
    dropped them. The sample cut now says so once and keeps the whole width: exact."""
    batch = text_batch(10, gen)
    batch["labels"] = batch["input_ids"].clone()  # pad id 0 on the padding, counted by the loss
    widths = []

    def loss(model, mb):
        widths.append(mb["input_ids"].shape[1])
        return lm_loss(model, mb)

    torch.manual_seed(0)
    ref, model = TinyCausalLM().double(), TinyCausalLM().double()
    model.load_state_dict(ref.state_dict())
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), lm_loss, batch)
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), 4)
    with pytest.warns(bigbatch.BigBatchWarning, match="labels is not -100 .* no micro-batch is"):
        acc.train_step(batch, loss)
    assert widths == [CTX] * 3 and max_relative_error(ref, model) < 1e-10
    from bigbatch.core._tokens import check_extent

    with pytest.raises(ValueError, match=r"sample \d+ .* would drop that token"):
        check_extent(batch, batch["attention_mask"].sum(-1).tolist(), {"labels": -100})


def feats_loss(model: nn.Module, mb: dict):
    """The token loss plus a per-sample term of ``feats``, a vector of CTX features per sample."""
    loss_sum, count = lm_loss(model, mb)
    return loss_sum + (mb["feats"].sum(-1) * model.head[0].bias.sum()).sum(), count


@pytest.mark.parametrize("cut", [{"micro_batch_tokens": 30}, {"micro_batch_size": 4}])
def test_a_per_sample_tensor_as_wide_as_the_tokens_is_never_trimmed(gen, cut):
    """Issue 30: a per-sample ``feats`` of CTX columns in a batch padded to CTX was trimmed as
    if per-token, a silently wrong step. Token windows refuse it until ``pad_values`` says; the
    sample cut warns and keeps the batch's width; declared, both are exact."""
    batch = {
        **text_batch(10, gen),
        "feats": torch.randn(10, CTX, generator=gen, dtype=torch.float64),
    }
    for declared in (None, {"feats": None}):
        torch.manual_seed(0)
        ref, model = PerToken().double(), PerToken().double()
        model.load_state_dict(ref.state_dict())
        full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), feats_loss, batch)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        acc = bigbatch.Accumulator(model, opt, **cut, pad_values=declared)
        message = r"batch\['feats'\] has 12 columns, as many as the tokens: .*=\{'feats': None\}"
        if declared is None and "micro_batch_tokens" in cut:
            with pytest.raises(ValueError, match=message):
                acc.train_step(batch, feats_loss)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", bigbatch.BigBatchWarning)
            assert acc.train_step(batch, feats_loss).micro_batches > 1
        shown = [str(w.message) for w in caught]  # undeclared: said once, nothing trimmed
        assert (
            shown == []
            if declared
            else re.match(message + ".* no micro-batch is trimmed", shown[0])
        )
        assert max_relative_error(ref, model) < 1e-10


@pytest.mark.parametrize("form", ["labels", "unnamed", "key"])
def test_a_per_token_tensor_of_another_width_is_refused(gen, form):
    """Issue 30: labels padded to another length than the mask were left whole, and the loss
    failed in torch naming nothing. Named keys and a tuple batch's tensors alike."""
    batch = text_batch(10, gen)
    wide = torch.nn.functional.pad(batch["labels"], (0, 2), value=PAD)  # CTX + 2 columns
    model = PerToken().double()
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_tokens=30,
        lengths=(lambda b: (b[1] != PAD).sum(-1).clamp_min(1)) if form == "unnamed" else None,
    )  # fmt: skip
    where = {"labels": r"batch\['labels'\]", "unnamed": r"batch\[1\]", "key": r"batch\['targets'\]"}
    if form == "unnamed":
        batch = (batch["input_ids"], wide)
    else:
        batch["labels" if form == "labels" else "targets"] = wide
    with assert_refused(
        model, ValueError, match=where[form] + " has 14 columns where the tokens have 12"
    ):
        acc.train_step(batch, lm_loss)


def test_buckets_give_one_shape_per_bucket(gen):
    torch.manual_seed(0)
    model = TinyCausalLM().double()
    shapes: set[tuple[int, int]] = set()

    def loss(m, mb):
        shapes.add(tuple(mb["input_ids"].shape))
        return lm_loss(m, mb)

    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_tokens=32,
        pad_to_multiple_of=4,
    )  # fmt: skip
    for _ in range(5):
        acc.train_step(text_batch(16, gen), loss)
    # one shape per bucket: (32 // length, length) for length in 4, 8, 12
    assert shapes <= {(8, 4), (4, 8), (2, 12)}


def test_lengths_function_for_a_tuple_batch(gen):
    torch.manual_seed(0)
    init = PerToken().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    batch = text_batch(9, gen)
    pair = (batch["input_ids"], batch["labels"])
    loss = lambda m, b: token_cross_entropy(m(b[0]), b[1], shift=True)  # noqa: E731
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), loss, pair)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_tokens=20,
        lengths=lambda b: (b[1] != PAD).sum(-1).clamp_min(1),
    )  # fmt: skip
    assert acc.train_step(pair, loss).micro_batches > 1
    assert max_relative_error(ref, model) < 1e-10


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"micro_batch_tokens": 0}, ValueError, r"micro_batch_tokens=0 is not allowed"),
        ({"micro_batch_tokens": 1.5}, TypeError, r"micro_batch_tokens=1.5 is not allowed"),
        ({"pad_to_multiple_of": 8}, ValueError, r"give micro_batch_tokens too"),
        ({"trim_padding": "no"}, TypeError, r"trim_padding='no' is not allowed: use True or"),
        ({"micro_batch_tokens": 64, "trim_padding": False}, ValueError, r"trim every micro-batch"),
        ({"micro_batch_tokens": 64, "pad_to_multiple_of": 0}, ValueError, r"pad_to_multiple_of=0"),
        ({"micro_batch_tokens": 64, "lengths": 3}, TypeError, r"lengths=3 is not callable"),
        ({"micro_batch_tokens": 64, "pad_to_multiple_of": 128}, ValueError, r"^pad_to_multiple_of=128 is larger than micro_batch_tokens=64: every micro-batch would be padded to at least 128 tokens, over the budget\. Use pad_to_multiple_of=64 \(at most 64\), or a larger micro_batch_tokens\.$"),
        ({"micro_batch_tokens": 64, "micro_batch_size": "auto"}, ValueError, r'micro_batch_tokens="auto"'),
    ],
)  # fmt: skip
def test_bad_token_settings_are_refused(kwargs, error, message):
    model = nn.Linear(2, 2)
    with pytest.raises(error, match=message):
        bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _lengths(batch):
    return batch["attention_mask"].sum(-1)


@pytest.mark.parametrize(
    "lengths, returned",
    [
        (lambda b: None, "None"),
        (lambda b: "abc", "'abc'"),
        (lambda b: b["attention_mask"], r"a tensor of shape \(4, 12\)"),
        (lambda b: [0, *_lengths(b).tolist()[1:]], "a length of 0"),
        (lambda b: _lengths(b) - 20, "a length of -"),
        (lambda b: [2.5, *_lengths(b).tolist()[1:]], "a length of 2.5"),
        (lambda b: _lengths(b)[:3], "3 lengths for 4 samples"),
        (lambda b: 7, "7"),
    ],
    ids=["None", "text", "2-D", "zero", "negative", "fraction", "too few", "a number"],
)
def test_lengths_that_are_not_one_length_per_sample_are_refused(lengths, returned, gen):
    """Before: Python's own errors ('NoneType' object is not iterable, invalid literal for
    int(), ...) or "returned 4 lengths for 4 samples (or one below 1)"."""
    model = PerToken().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               micro_batch_tokens=20, lengths=lengths)  # fmt: skip
    with assert_refused(
        model,
        ValueError,
        match=rf"^lengths\(batch\) returned {returned}.*: return one length per sample, a "
        r"positive integer \(its tokens\), as a list or a 1-D tensor\.$",
    ):
        acc.train_step(text_batch(4, gen), lm_loss)


def test_lengths_longer_than_the_rows_are_refused(gen):
    """Found by tests/fuzz: lengths past the padded width (a left-padded tuple batch, lengths
    from its mask + 2) padded columns of 0, a real label, and stepped off the full batch."""
    model = PerToken().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               micro_batch_tokens=40, lengths=lambda b: b[1].sum(-1) + 2)  # fmt: skip
    batch = text_batch(4, gen, left=True)
    with assert_refused(
        model, ValueError, match=rf"returned a length of {CTX + 2} for a batch of {CTX} "
    ):
        acc.train_step((batch["input_ids"], batch["attention_mask"], batch["labels"]), lm_loss)


@pytest.mark.parametrize("key", ["labels", "attention_mask", "labels without lengths"])
def test_lengths_that_would_trim_labelled_or_attended_tokens_are_refused(key, gen):
    """Silent before: the trim dropped a labelled (or attended) token, and the step was not the
    full batch's. Lengths one short of a sample's labelled or attended tokens, or (with the
    attention mask's lengths) a label on padding, are refused naming the sample and token."""
    model = PerToken().double()
    batch = text_batch(4, gen)
    batch["labels"][0, -1] = batch["attention_mask"][0, -1] = 1  # sample 0: all 12 tokens
    if key == "attention_mask":
        batch["labels"][0, -1] = PAD  # attended, not labelled
    given = key != "labels without lengths"
    end = 3
    if not given:  # sample 1: 3 tokens, a label on its padding (a collator that left pad labels)
        batch["attention_mask"][1, end:], batch["labels"][1, end:] = 0, PAD
        batch["labels"][1, end] = 5
    short = (lambda b: [11, *_lengths(b).tolist()[1:]]) if given else None
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               micro_batch_tokens=20, lengths=short)  # fmt: skip
    source, sample, tokens, token = (
        ("lengths\\(batch\\)", 0, 11, 12) if given else ("attention_mask", 1, end, end + 1)
    )
    name, pad = (key, 0 if key == "attention_mask" else -100) if given else ("labels", -100)
    with assert_refused(
        model,
        ValueError,
        match=rf"^{source} gives sample {sample} {tokens} tokens, but its {name} is not {pad} at "
        rf"token {token}: trimming micro-batches to these lengths would drop that token, and the "
        r"step would not be the full batch's\. Set it to",
    ):
        acc.train_step(batch, lm_loss)


def test_batches_without_lengths_and_masks_with_gaps_are_refused(gen):
    model = PerToken().double()
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_tokens=20
    )
    batch = text_batch(4, gen)
    with assert_refused(model, TypeError, match="needs each sample's length: pass a mapping batch"):
        acc.train_step((batch["input_ids"], batch["labels"]), lm_loss)
    batch["attention_mask"][0, 1] = 0  # a hole inside the first sample
    for bad in (batch, text_batch(4, gen, left=True)):
        with pytest.raises(ValueError, match="micro_batch_tokens needs right padding"):
            acc.train_step(bad, lm_loss)


@pytest.mark.parametrize(
    ("precision", "form"),  # fp16 with a tuple batch: nothing counted first, the scale follows
    [("fp32", "mapping"), ("fp16", "mapping"), ("fp16", "tuple")],
)
def test_a_mean_loss_with_pad_rows_is_refused_and_changes_nothing(gen, precision, form):
    torch.manual_seed(0)
    model = PerToken().to(torch.float64 if precision == "fp32" else torch.float32)
    before = copy.deepcopy(model.state_dict())
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_tokens=32,
        pad_to_multiple_of=4, precision=precision,
        lengths=(lambda b: b[1].sum(-1)) if form == "tuple" else None,
    )  # fmt: skip
    batch = text_batch(3, gen)  # 3 full rows at 2 per micro-batch: the second has a pad row
    batch["attention_mask"].fill_(1)
    batch["labels"] = batch["input_ids"].clone()
    if form == "tuple":
        batch = (batch["input_ids"], batch["attention_mask"], batch["labels"])
    mean = lambda m, b: torch.nn.functional.cross_entropy(  # noqa: E731
        m(b[0] if form == "tuple" else b["input_ids"]).float().flatten(0, 1),
        (b[2] if form == "tuple" else b["labels"]).flatten(), ignore_index=PAD,
    )  # fmt: skip
    message = "loss_fn returned a mean, which would average over"
    if form == "tuple":  # found by tests/fuzz: a tuple's pads were 0, a real label (silent)
        message = r"pad_to_multiple_of=4 pads rows .* a tuple batch has no keys: pass a mapping"
    with pytest.raises(ValueError, match=message):
        acc.train_step(batch, mean)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cached_loss_with_pad_rows_is_refused_and_changes_nothing(gen):
    model = PerToken().double()
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_tokens=32,
        pad_to_multiple_of=4,
    )  # fmt: skip
    loss = bigbatch.cached_loss(
        lambda m, b: m(b["input_ids"]).mean(dim=1), lambda reps: reps.pow(2).sum(-1).mean()
    )
    with assert_refused(
        model,
        ValueError,
        match=r"^cached_loss takes no pad rows: drop pad_to_multiple_of for it\.$",
    ):  # 3 samples of CTX tokens: 2 per micro-batch of 32, the second padded with a row
        ids = torch.randint(1, VOCAB, (3, CTX), generator=gen)
        full = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        acc.train_step(full, loss)


def test_a_sample_longer_than_the_budget_warns_once(gen):
    model = PerToken().double()
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_tokens=5
    )
    with pytest.warns(bigbatch.BigBatchWarning, match="longer than micro_batch_tokens=5"):
        acc.train_step(text_batch(6, gen), lm_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", bigbatch.BigBatchWarning)
        acc.train_step(text_batch(6, gen), lm_loss)


def test_a_bucket_longer_than_the_budget_says_so(gen):
    """A sample of 9 tokens fits a budget of 10, its bucket of 16 does not: the warning said the
    sample was longer than the budget."""
    model = PerToken().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               micro_batch_tokens=10, pad_to_multiple_of=8)  # fmt: skip
    batch = text_batch(3, gen)
    batch["attention_mask"][:, 9:] = 0
    batch["labels"][:, 9:] = PAD
    with pytest.warns(
        bigbatch.BigBatchWarning,
        match=r"^a sample of 9 tokens, in a bucket of 16 \(pad_to_multiple_of=8\), is longer "
        r"than micro_batch_tokens=10: it gets a micro-batch of its own",
    ):
        assert acc.train_step(batch, lm_loss).micro_batches == 3


class Pooled(nn.Module):
    """A sentence encoder: token embeddings averaged over the attention mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.proj = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(ids))) * mask[..., None]
        return h.sum(1) / mask.sum(1, keepdim=True)


def _encode(model: nn.Module, mb: dict) -> torch.Tensor:
    return model(mb["input_ids"], mb["attention_mask"])


def _next_is_positive(reps: torch.Tensor, batch: dict) -> torch.Tensor:
    """In-batch negatives with an order-dependent target (the next sample): wrong if the batch
    loss saw the representations in another order than the batch's."""
    scores = reps @ reps.T / 0.5 - torch.eye(len(reps), dtype=reps.dtype) * 1e4
    target = (torch.arange(len(reps)) + 1) % len(reps)
    return torch.nn.functional.cross_entropy(scores, target)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_cached_loss_by_tokens_equals_the_full_batch(optimizer, gen):
    torch.manual_seed(0)
    init = Pooled().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    loss = bigbatch.cached_loss(_encode, _next_is_positive)
    ref_opt, opt = (
        OPTIMIZERS[optimizer](ref.parameters()),
        OPTIMIZERS[optimizer](model.parameters()),
    )
    acc = bigbatch.Accumulator(model, opt, micro_batch_tokens=30)
    for _ in range(2):
        batch = text_batch(10, gen)
        full_batch_step(ref, ref_opt, loss, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", bigbatch.BigBatchWarning)
            assert acc.train_step(batch, loss).micro_batches > 2
    assert max_relative_error(ref, model) < 1e-10


@pytest.mark.slow  # torch.compile (aot_eager: Dynamo's graphs and guards, eager kernels)
def test_compiled_buckets_equal_eager_and_compile_once_per_bucket(gen):
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    init = TinyCausalLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    compiled = torch.compile(model, backend="aot_eager")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    acc = bigbatch.Accumulator(
        compiled, torch.optim.AdamW(compiled.parameters(), lr=1e-2), micro_batch_tokens=24,
        pad_to_multiple_of=6,
    )  # fmt: skip
    for _ in range(3):
        batch = text_batch(10, gen)
        full_batch_step(ref, ref_opt, lm_loss, batch)
        acc.train_step(batch, lm_loss)
    assert max_relative_error(ref, model) < 1e-10
    buckets = {length for _, length in acc._runner.cut.shapes}  # lengths 6 and 12
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= len(buckets) + 1


def test_a_compiled_model_seeing_too_many_shapes_is_warned(gen, monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)  # wiring: a small limit
    model = PerToken().double()
    model._orig_mod = model  # stands for torch.compile's wrapper (only its marker is read)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_tokens=24
    )
    with pytest.warns(bigbatch.BigBatchWarning, match="more than torch's recompile_limit"):
        for _ in range(4):
            acc.train_step(text_batch(10, gen), lm_loss)


def test_lengths_describe_the_token_columns_of_a_tuple_batch(gen):
    """Issue 37: a tuple (features[N, 5], ids[N, 12], labels[N, 12]) with lengths= took its width
    from the features and called a correct lengths wrong ("a length of 12 for a batch of 5
    columns"). The width is the tokens' (the first tensor wide enough); the features, of another
    width, are then named as what bigbatch cannot classify."""
    model = PerToken().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               micro_batch_tokens=40, lengths=lambda b: b[2].ne(PAD).sum(-1))  # fmt: skip
    batch = text_batch(4, gen)
    features = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    with assert_refused(
        model, ValueError, match=r"^batch\[0\] has 5 columns where the tokens have 12"
    ):
        acc.train_step((features, batch["input_ids"], batch["labels"]), lm_loss)


@pytest.mark.parametrize("cut", [{"micro_batch_tokens": 20}, {"micro_batch_size": 4}])
def test_an_empty_batch_is_named(cut, gen):
    """Issue 37: 0 rows with micro_batch_tokens gave ``max() arg is an empty sequence``."""
    model = PerToken().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), **cut)
    empty = {k: v[:0] for k, v in text_batch(4, gen).items()}
    with assert_refused(model, ValueError, match=r"^batch: the batch is empty \(first dimension"):
        acc.train_step(empty, lm_loss)


@pytest.mark.parametrize("shift", [False, True])
def test_a_loss_that_teaches_a_causal_lm_to_copy_its_input_is_warned_once(shift, gen):
    """Issue 37: token_cross_entropy(logits, labels) defaults to shift=False; on a causal LM whose
    labels are its inputs it trains the model to copy its input, silently (its loss falls)."""
    model = TinyCausalLM().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    loss = lambda m, b: token_cross_entropy(m(b["input_ids"]), b["labels"], shift=shift)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            acc.train_step(text_batch(10, gen), loss)
    copying = [w for w in caught if "learns to copy its input" in str(w.message)]
    assert len(copying) == (0 if shift else 1), [str(w.message) for w in caught]
    if copying:
        assert "token_cross_entropy(logits, labels, shift=True)" in str(copying[0].message)
