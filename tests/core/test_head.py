"""``head_cross_entropy`` (Note [chunked head]) against the plain head's loss, in float64; the
deferred head of ``--chunked-head`` (Note [deferred head])."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import bigbatch
from bigbatch.core import head as chunked
from bigbatch.core.head import HeadLogits, chunk_size, deferred_head, with_chunked_head
from bigbatch.core.loss import token_cross_entropy

VOCAB, DIM = 23, 6


@pytest.fixture(params=["torch", "ours"])
def path(request, monkeypatch):
    """torch's F.linear_cross_entropy where it is installed, and ours (forced: torch < 2.13)."""
    if request.param == "torch" and chunked.LINEAR_CE is None:
        pytest.skip("this torch has no F.linear_cross_entropy (torch >= 2.13)")
    if request.param == "ours":
        monkeypatch.setattr(chunked, "LINEAR_CE", None)
    return request.param


def labelled(gen: torch.Generator, shape=(4, 9)) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    labels[1] = -100  # a row with nothing to predict
    labels[2, 4:] = -100  # padding
    return labels


def grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def close(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    pairs = zip(got, want, strict=True)
    return all(float((g - w).norm() / w.norm().clamp_min(1e-30)) < 1e-10 for g, w in pairs)


def _detached(values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.detach() for v in values]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_equals_the_plain_head_float64(path, bias, shift, smoothing, chunk, gen):
    head = nn.Linear(DIM, VOCAB, bias=bias).double()
    hidden = torch.randn(4, 9, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = labelled(gen)
    loss_sum, count = bigbatch.head_cross_entropy(
        hidden, head, labels, shift=shift, label_smoothing=smoothing, chunk_tokens=chunk
    )
    logits, want_labels = head(hidden), labels
    if shift:
        logits, want_labels = logits[:, :-1], labels[:, 1:]
    want = F.cross_entropy(logits.flatten(0, 1), want_labels.flatten(), reduction="sum",
                           label_smoothing=smoothing)  # fmt: skip
    if not smoothing:  # the loss contract's own token loss, the same value
        assert torch.allclose(want, token_cross_entropy(head(hidden), labels, shift=shift)[0])
    assert int(count) == int((want_labels != -100).sum())
    params = (hidden, *head.parameters())
    assert close(_detached([loss_sum.reshape(1)]), _detached([want.reshape(1)]))
    assert close(grads(loss_sum / count, *params), grads(want / count, *params))


def test_tied_embedding_weights(path, gen):
    """A head that is the input embedding's weight: both uses add up in its gradient."""
    embed = nn.Embedding(VOCAB, DIM).double()
    ids = torch.randint(0, VOCAB, (3, 8), generator=gen)
    loss_sum, count = bigbatch.head_cross_entropy(embed(ids).tanh(), embed.weight, ids)
    want_sum, want_count = token_cross_entropy(
        embed(ids).tanh() @ embed.weight.t(), ids, shift=True
    )
    assert int(count) == int(want_count)
    assert close(grads(loss_sum, embed.weight), grads(want_sum, embed.weight))


def test_nothing_labelled_is_a_zero_that_reaches_the_weights(path, gen):
    head = nn.Linear(DIM, VOCAB).double()
    hidden = torch.randn(2, 5, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    loss_sum, count = bigbatch.head_cross_entropy(hidden, head, torch.full((2, 5), -100))
    loss_sum.backward()
    assert float(loss_sum) == 0 and int(count) == 0
    assert all(float(p.grad.abs().max()) == 0 for p in (hidden, *head.parameters()))


def test_z_loss_is_a_named_term_of_the_same_pass(gen):
    head = nn.Linear(DIM, VOCAB).double()
    hidden = torch.randn(4, 9, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = labelled(gen)
    terms = bigbatch.head_cross_entropy(hidden, head, labels, z_loss=1e-2, chunk_tokens=4)
    (ce, count), (z, z_count, weight) = terms["ce"], terms["z"]
    assert set(terms) == {"ce", "z"} and weight == 1e-2 and int(count) == int(z_count)
    logits, kept = head(hidden)[:, :-1], labels[:, 1:] != -100
    want_ce = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    want_z = torch.logsumexp(logits, -1)[kept].square().sum()
    params = (hidden, *head.parameters())
    assert close(_detached([ce, z]), _detached([want_ce, want_z]))
    got = grads(ce / count + weight * z / count, *params)
    assert close(got, grads(want_ce / count + weight * want_z / count, *params))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_states_sum_in_float32(path, dtype, gen):
    head = nn.Linear(DIM, VOCAB)
    hidden = torch.randn(64, 16, DIM, generator=gen)
    labels = torch.randint(0, VOCAB, (64, 16), generator=gen)
    loss_sum, _ = bigbatch.head_cross_entropy(hidden.to(dtype), head, labels)
    want, _ = token_cross_entropy(head.to(dtype)(hidden.to(dtype)), labels, shift=True)  # upcast
    assert loss_sum.dtype == torch.float32
    assert abs(float(loss_sum) - float(want)) < 1e-4 * float(want)  # the half products differ


@pytest.mark.parametrize(
    "options",
    [{"softcap": 2.0}, {"softcap": 1.5, "label_smoothing": 0.2}, {"weight": True},
     {"weight": True, "label_smoothing": 0.1}, {"weight": True, "softcap": 3.0}],
    ids=["softcap", "softcap-smoothing", "weight", "weight-smoothing", "weight-softcap"],
)  # fmt: skip
def test_softcap_and_class_weights_equal_the_plain_head_float64(path, options, gen):
    """``softcap``: Gemma 2's cap · tanh(logits / cap); ``weight``: F.cross_entropy's class
    weights, whose mean is Σ w_y · loss / Σ w_y (smoothing included): the count is Σ w_y."""
    head = nn.Linear(DIM, VOCAB).double()
    hidden = torch.randn(4, 9, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    labels, cap = labelled(gen), options.get("softcap")
    if options.get("weight"):
        options = {**options, "weight": torch.rand(VOCAB, dtype=torch.float64, generator=gen)}
    logits = head(hidden)[:, :-1] * 3  # large enough for the cap to bind
    loss_sum, count = bigbatch.head_cross_entropy(
        hidden, (head.weight * 3, head.bias * 3), labels, chunk_tokens=5, **options
    )
    if cap:
        logits = cap * torch.tanh(logits / cap)
    want = F.cross_entropy(
        logits.flatten(0, 1), labels[:, 1:].flatten(), weight=options.get("weight"),
        label_smoothing=options.get("label_smoothing", 0.0),
    )  # fmt: skip
    params = (hidden, *head.parameters())
    assert close(_detached([loss_sum / count]), _detached([want]))
    assert close(grads(loss_sum / count, *params), grads(want, *params))


def test_backward_twice_and_higher_order_gradients(path, gen):
    """``retain_graph=True`` and torch's gradcheck work on both paths; a backward with
    ``create_graph=True`` (a gradient penalty) is refused in one line (Note [head gradients])."""
    head = nn.Linear(DIM, VOCAB).double()
    hidden = torch.randn(3, 4, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = labelled(gen, (3, 4))
    loss_sum, _ = bigbatch.head_cross_entropy(hidden, head, labels, chunk_tokens=5)
    loss_sum.backward(retain_graph=True)
    first = [p.grad.clone() for p in (hidden, *head.parameters())]
    loss_sum.backward()
    assert close([p.grad for p in (hidden, *head.parameters())], [2 * g for g in first])
    loss = lambda h, w, b: bigbatch.head_cross_entropy(h, (w, b), labels, chunk_tokens=5)[0]  # noqa: E731
    assert torch.autograd.gradcheck(loss, (hidden, head.weight, head.bias))
    with pytest.raises(RuntimeError, match="head_cross_entropy has no higher-order gradients"):
        torch.autograd.grad(loss(hidden, head.weight, head.bias), hidden, create_graph=True)


@pytest.mark.needs("transformers", "accelerate")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mixed_precision_as_accelerate_runs_the_model(dtype):
    """A transformers LM under bf16 autocast, its forward wrapped by accelerate's
    ``convert_outputs_to_fp32`` (which calls ``.float()`` on half-precision outputs): the
    deferred head's loss equals the plain head's at bf16's rounding (its hidden states reach
    the head in bf16, as autocast's linear takes them); a float64 model stays exact."""
    from accelerate.utils import convert_outputs_to_fp32
    from integrations.hf_models import collate, llama, texts

    model, batch = llama().to(dtype), collate(texts(4))
    model.forward = convert_outputs_to_fp32(model.forward)
    params = list(model.parameters())

    def run(deferred: bool, autocast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            with deferred_head(model) if deferred else contextlib.nullcontext():
                logits = model(input_ids=batch["input_ids"]).logits
                loss_sum, count = token_cross_entropy(logits, batch["labels"], shift=True)
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss_sum / count, params)])
        return loss_sum.detach(), grad

    (got, grad), (want, want_grad), (fp32, _) = run(True), run(False), run(False, False)
    error = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    if dtype == torch.float64:
        assert error(got, want) < 1e-10 and error(grad, want_grad) < 1e-10
    else:  # bf16 products, as the plain head's: not the float32 ones
        assert error(got, want) < error(fp32, want) / 10 and error(grad, want_grad) < 1e-2
    with torch.autocast("cpu", torch.bfloat16), deferred_head(model):
        logits = model.get_output_embeddings()(torch.zeros(2, 3, 16, dtype=dtype))
        if dtype == torch.float64:  # autocast leaves float64 alone
            assert logits.dtype == torch.float64
        else:
            assert logits.dtype == torch.bfloat16 and logits.float().dtype == torch.float32


def test_chunk_sizes():
    assert chunk_size(32768, None, None) == 512 and chunk_size(2**20, None, None) == 256
    assert chunk_size(32768, None, "16MiB") == 128 and chunk_size(10**9, None, "1KiB") == 1
    assert chunk_size(32768, 100, "64MiB") == 100


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"chunk_tokens": 0}, ValueError, r"chunk_tokens=0 is not allowed: use a positive"),
        ({"chunk_tokens": 2.5}, ValueError, r"chunk_tokens=2.5 is not allowed"),
        ({"chunk_memory": "lots"}, ValueError, r"chunk_memory='lots' is not a size"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing=1.5 is not allowed: use a number"),
        ({"z_loss": -1.0}, ValueError, r"z_loss=-1.0 is not allowed: use a weight >= 0"),
        ({"head": "lm_head"}, TypeError, r"head=str is not allowed: pass the output layer"),
        ({"labels": torch.zeros(2, 4, dtype=torch.long)}, ValueError, r"labels \(2, 4\) do not match"),
        ({"labels": torch.zeros(2, 5)}, TypeError, r"labels of dtype torch.float32 are not allowed"),
        ({"labels": torch.full((2, 5), VOCAB)}, ValueError, rf"labels hold {VOCAB}, which is not allowed"),
        ({"labels": torch.full((2, 5), -100), "ignore_index": -1}, ValueError, r"labels hold -100.*ignore_index=-1"),
        ({"shift": 2}, TypeError, r"shift=2 is not allowed: use True"),
        ({"shift": None}, TypeError, r"shift=None is not allowed"),
        ({"softcap": 0.0}, ValueError, r"softcap=0.0 is not allowed: use a number > 0"),
        ({"softcap": float("inf")}, ValueError, r"softcap=inf is not allowed"),
        ({"softcap": True}, ValueError, r"softcap=True is not allowed"),
        ({"weight": torch.ones(VOCAB - 1)}, ValueError, rf"weight=\({VOCAB - 1},\) is not allowed: use a float tensor"),
        ({"weight": [1.0] * VOCAB}, ValueError, r"weight=list is not allowed"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused(kwargs, error, message):
    call = {"hidden": torch.randn(2, 5, DIM), "head": nn.Linear(DIM, VOCAB),
            "labels": torch.zeros(2, 5, dtype=torch.long), **kwargs}  # fmt: skip
    with pytest.raises(error, match=message):
        bigbatch.head_cross_entropy(
            call.pop("hidden"), call.pop("head"), call.pop("labels"), **call
        )


class Scaled(nn.Module):
    """An LM whose logits are scaled after its head (Cohere, Granite), or soft-capped (Gemma 2)."""

    def __init__(self, cap: bool = False) -> None:
        super().__init__()
        self.embed, self.head, self.cap = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB), cap

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor):
        logits = 0.5 * (self.head(self.embed(ids).tanh()) / 4.0)
        return torch.tanh(logits) * 30 if self.cap else logits


@pytest.mark.parametrize("cap", [False, True])
def test_a_deferred_head_scales_and_soft_caps_exactly(cap, gen):
    """0.5 · (logits / 4), and then 30 · tanh(logits / 8) (Gemma 2's soft-capping)."""
    model = Scaled(cap).double()
    ids = torch.randint(0, VOCAB, (3, 7), generator=gen)
    loss = lambda m, b: token_cross_entropy(m(b), b, shift=True)  # noqa: E731
    loss_sum, count = with_chunked_head(loss, model)(model, ids)
    want_sum, want_count = loss(model, ids)
    params = list(model.parameters())
    assert int(count) == int(want_count) and close(
        grads(loss_sum, *params), grads(want_sum, *params)
    )
    with deferred_head(model):
        logits = model(ids)
        assert isinstance(logits, HeadLogits) and logits.scale == 0.125
        assert logits.cap == (30.0 if cap else None)
    assert "forward" not in model.head.__dict__  # the layer computes logits again


def test_deferred_logits_refuse_what_changes_them(gen):
    model, ids = Scaled().double(), torch.randint(0, VOCAB, (3, 7), generator=gen)
    nan, inf = float("nan"), float("inf")
    with deferred_head(model):
        logits = model(ids)
        for misuse, what in [(lambda: logits.argmax(-1), ".argmax"), (lambda: logits[0], "indexing"),
                             (lambda: F.softmax(logits, -1), "softmax"),
                             (lambda: logits * torch.ones(1), "multiplying them by a Tensor"),
                             (lambda: logits * nan, r"multiplying them by nan \(a non-finite scale\)"),
                             (lambda: inf * logits, r"multiplying them by inf \(a non-finite scale\)"),
                             (lambda: logits / inf, r"dividing them by inf \(a non-finite scale\)"),
                             (lambda: logits + torch.ones(1), r"the operator \+"),
                             (lambda: 1 - logits, "the operator -"), (lambda: -logits, "the operator unary -"),
                             (lambda: 2 / logits, r"the operator / \(dividing by them\)"),
                             (lambda: logits**2, r"the operator \*\*"),
                             (lambda: torch.tanh(logits).tanh(), "a second tanh"),
                             (lambda: logits.to(torch.float16), r"\.to\(torch.float16\) of torch.float64 logits"),
                             (lambda: logits.float(), r"\.to\(torch.float32\) of torch.float64 logits"),
                             (lambda: logits.half(), ".half")]:  # fmt: skip
            with pytest.raises(TypeError, match=f"so {what}.*cannot be applied to them"):
                misuse()


def test_deferred_logits_answer_what_keeps_them(gen):
    """What a logging hook reads (shape, device), OPT's ``.contiguous()``, accelerate's
    ``dtype`` test (its ``.float()``: test_mixed_precision_as_accelerate_runs_the_model)."""
    model, ids = Scaled().double(), torch.randint(0, VOCAB, (3, 7), generator=gen)
    with deferred_head(model):
        logits = model(ids)
        assert logits.shape == (3, 7, VOCAB) == logits.size() and logits.size(-1) == VOCAB
        assert logits.dim() == logits.ndim == 3 and logits.device == ids.device
        assert logits.contiguous() is logits and logits.dtype == torch.float64
        assert logits.to(torch.float64).dtype == torch.float64
        assert hasattr(logits, "dtype") and not hasattr(logits, "__array__")


def test_an_output_layer_with_its_own_forward_is_refused():
    """peft's LoRA layer has its base layer's ``weight`` and adds a low-rank product: the chunked
    head would compute the weight's logits only (found by tests/fuzz/test_fuzz_head.py)."""

    class LoRA(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + x.sum(-1, keepdim=True)

    model = Scaled()
    model.head = LoRA(DIM, VOCAB)
    with pytest.raises(TypeError, match="Scaled's output layer is a LoRA with its own forward"):
        with_chunked_head(lambda m, b: m(b), model)


def test_a_model_without_an_output_layer_is_refused():
    with pytest.raises(TypeError, match="Sequential has no get_output_embeddings"):
        with_chunked_head(lambda m, b: m(b), nn.Sequential(nn.Linear(2, 2)))


def test_check_finds_the_chunked_head_exact_in_float64(path, gen):
    """The verifier sees a per-token (loss_sum, count) loss computed in float64 throughout."""
    from models import TinyCausalLM
    from test_tokens import lm_loss, text_batch

    model = TinyCausalLM()
    report = bigbatch.check(model, text_batch(10, gen), with_chunked_head(lm_loss, model))
    assert report.exact and report.compute_dtype == torch.float64, report.summary()


def test_train_step_with_the_z_loss_equals_the_full_batch(gen):
    """The named terms of the same pass (ce, z) through token windows, against their full batch."""
    import copy

    from cases import OPTIMIZERS
    from models import TinyCausalLM
    from reference import max_relative_error
    from test_tokens import text_batch

    def terms(model, batch):
        with deferred_head(model):
            logits = model(batch["input_ids"])
        return logits.cross_entropy(batch["labels"], z_loss=0.01, chunk_tokens=7)

    def full(model, batch):  # the plain head's logits, the same two means
        logits, labels = model(batch["input_ids"])[:, :-1], batch["labels"][:, 1:]
        kept = labels != -100
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return ce / kept.sum() + 0.01 * torch.logsumexp(logits, -1)[kept].square().mean()

    torch.manual_seed(0)
    ref = TinyCausalLM().double()
    model = copy.deepcopy(ref)
    ref_opt, opt = OPTIMIZERS["adamw"](ref.parameters()), OPTIMIZERS["adamw"](model.parameters())
    acc = bigbatch.Accumulator(model, opt, micro_batch_tokens=30)
    for _ in range(2):
        batch = text_batch(10, gen)
        full(ref, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert acc.train_step(batch, terms).micro_batches > 1
    assert max_relative_error(ref, model) < 1e-10
