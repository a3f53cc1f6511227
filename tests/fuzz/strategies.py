"""The generated cases: plain records (what hypothesis prints when a property fails) and the
strategies that draw them, shared by every property; and the settings profiles of the two tiers.

A case is data only (names, sizes, seeds): ``scenarios.py`` turns it into a model, batches and
the user's callables, so a case can be printed, shrunk, and sent to a gloo rank as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

# ---------------------------------------------------------------------------- profiles
_COMMON = dict(
    database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
# quick: a fixed seed, a few examples per property, and a failure reported as found, not shrunk
# (shrinking one costs a minute; the long profile shrinks); long: the slow tier's.
QUICK_PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
settings.register_profile(
    "fuzz-quick", derandomize=True, max_examples=30, phases=QUICK_PHASES, **_COMMON
)
settings.register_profile("fuzz-long", derandomize=True, max_examples=100, **_COMMON)


def hold(prop: Any, strategy: st.SearchStrategy, profile: str, examples: int | None = None) -> None:
    """Run ``prop(case)`` over ``strategy`` under the settings profile ``fuzz-<profile>``
    (``examples``: this property's own ``max_examples``). ``BIGBATCH_TEST_SEED=<n>`` or
    ``=random`` (the suite's convention, tests/seeds.py) explores other examples than the fixed
    seed's; hypothesis prints the seed and the failing case either way."""
    chosen = settings.get_profile(f"fuzz-{profile}")
    if examples is not None:
        chosen = settings(chosen, max_examples=examples)
    test = given(strategy)(prop)
    explore = os.environ.get("BIGBATCH_TEST_SEED")
    if explore:
        chosen = settings(chosen, derandomize=False)
        if explore != "random":
            test = seed(int(explore))(test)
    settings(chosen)(test)()


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Loss:
    """The user's loss: ``form`` "mean" (a scalar), "pair" ((sum, count)) or "terms" ({name:
    (sum, count[, weight])}) over ``terms`` = ((name, part, weight), ...); the parts are in
    scenarios.PARTS. ``count_fn``: "none", "right", or a wrong one ("off", "zero", "one",
    "nan", "negative", "nan_tensor"). ``stats``: "none", "fixed" (stats_fn with its keys in one
    order), "rotating" (the keys in another order at each call), "two_args" (stats_fn given to
    a loss_fn that takes two arguments)."""

    form: str
    terms: tuple[tuple[Any, str, float], ...]
    count_fn: str = "none"
    stats: str = "none"


@dataclass(frozen=True)
class Samples:
    """An MLP's batch of ``n`` samples packed as ``structure``; per-sample ``weights`` and
    ``flags`` ("random", "zeros", "ones") feed the weighted terms; ``column``: the weights
    travel as a list of strings (a per-sample column that is not a tensor)."""

    n: int
    structure: str
    weights: str
    flags: str
    column: bool
    seed: int


@dataclass(frozen=True)
class Text:
    """Padded text: one row per length (0: an all-padding row), ``width`` columns, padded on
    ``side``; the first ``prompt`` real tokens of each row are unlabelled; ``extras``: "feat"
    (per-sample values whose width happens to equal the padded length) and "tokw" (per-token
    weights of the shifted positions: width - 1)."""

    lengths: tuple[int, ...]
    width: int
    side: str
    prompt: int
    structure: str
    extras: tuple[str, ...]
    seed: int


@dataclass(frozen=True)
class Cut:
    """How the window is cut: ``Accumulator`` arguments, and ``lengths``: "default" (not
    passed), "mask" (attention_mask.sum(-1)), "labelled" (labels != -100 per row), "longer"
    (2 more), "zero", or a bad value ("none_value", "string", "2d", "negative")."""

    micro_batch_size: int | str | None
    micro_batch_tokens: int | str | None = None
    pad_to_multiple_of: int | None = None
    lengths: str = "default"
    trim_padding: bool = True  # the sample cut's default trim (issue 37), or the batch's width


@dataclass(frozen=True)
class Case:
    """One training run: ``data`` (Samples or Text) cut by ``cut``, trained ``steps`` steps
    (fresh data each) with ``loss`` and ``optimizer`` on ``model`` ("mlp", "bag", "gpt2",
    "llama")."""

    model: str
    data: Samples | Text
    cut: Cut
    loss: Loss
    optimizer: str
    steps: int


# ---------------------------------------------------------------------------- strategies
OPTIMIZERS = st.sampled_from(["sgd_momentum", "adamw"])
STEPS = st.sampled_from([1, 1, 2])
SEEDS = st.integers(0, 2**16)
WEIGHTS = st.sampled_from([1.0, 0.5, 2.0])
GOOD_COUNT_FNS = ("none", "right")
BAD_COUNT_FNS = ("off", "zero", "one", "nan", "negative", "nan_tensor")
# lengths= that may drop tokens ("labelled", "zero"; "mask" under left padding) or pad
# ("longer"): a refusal naming lengths is fine, a silent step off the full batch is not.
GOOD_LENGTHS = ("default", "mask", "labelled", "longer", "zero")
BAD_LENGTHS = ("none_value", "string", "2d", "negative")


@dataclass(frozen=True)
class Space:
    """The values each feature of a case is drawn from: a property's focus narrows some (the
    others stay benign), so that one family's faults do not hide another's."""

    forms: tuple[str, ...] = ("terms", "pair", "mean")
    sample_parts: tuple[str, ...] = ("ce", "wce", "sq", "loose")  # scenarios.PARTS
    token_parts: tuple[str, ...] = ("nll", "seq", "z", "tokw", "loose")
    names: tuple[Any, ...] = ("a", "b", "loss")  # term names
    count_fns: tuple[str, ...] = GOOD_COUNT_FNS
    stats: tuple[str, ...] = ("none", "fixed", "rotating")
    lengths: tuple[str, ...] = GOOD_LENGTHS
    extras: tuple[str, ...] = ("feat", "tokw")
    structures: tuple[str, ...] = ("dict", "tuple", "nested")  # of text batches
    sides: tuple[str, ...] = ("right", "left")
    prompts: tuple[int, ...] = (0, 0, 1, 3)
    cuts: tuple[str, ...] = ("tokens", "samples")  # how text is cut
    multiples: tuple[int | None, ...] = (None, None, 2, 3, 8, 64)  # pad_to_multiple_of
    labelled: bool = False  # every text window has a labelled token (no empty window)


EVERYTHING = Space(
    names=("a", "b", 1, "1", "loss"), count_fns=GOOD_COUNT_FNS + BAD_COUNT_FNS,
    stats=("none", "fixed", "rotating", "two_args"), lengths=GOOD_LENGTHS + BAD_LENGTHS,
)  # fmt: skip
# fmt: off
FOCI = {  # each feature family alone, the rest benign (the slow tier runs each)
    "everything": EVERYTHING,
    "terms": Space(
        stats=("none",), lengths=("default",), extras=(), multiples=(None,), labelled=True,
    ),
    "names": Space(  # 1 and "1" collide as strings
        forms=("terms",), names=("a", 1, "1"), stats=("none",), lengths=("default",), extras=(),
        multiples=(None,), labelled=True,
    ),
    "statistics": Space(
        forms=("pair", "terms"), stats=("fixed", "rotating"), lengths=("default",), extras=(),
        multiples=(None,), labelled=True,
    ),
    "lengths": Space(
        forms=("pair",), stats=("none",), extras=(), cuts=("tokens",), multiples=(None,),
        labelled=True,
    ),
    "sample_keys": Space(  # per-sample values as wide as the padded length
        forms=("pair", "terms"), token_parts=("nll", "seq"), stats=("none",),
        lengths=("default",), extras=("feat",), sides=("right",), cuts=("tokens",),
        multiples=(None,), labelled=True,
    ),
    "token_keys": Space(  # per-token values one column narrower than the padded length
        forms=("pair", "terms"), token_parts=("nll", "tokw"), stats=("none",),
        lengths=("default",), extras=("tokw",), sides=("right",), cuts=("tokens",),
        multiples=(None,), labelled=True,
    ),
    "padding": Space(  # pad_to_multiple_of's pad rows and columns
        token_parts=("nll", "seq", "z"), stats=("none",), lengths=("default", "mask"),
        extras=(), sides=("right",), cuts=("tokens",), multiples=(2, 3, 8, 64), labelled=True,
    ),
    "bad_arguments": Space(
        count_fns=BAD_COUNT_FNS, stats=("none", "two_args"),
        lengths=BAD_LENGTHS + ("default",), labelled=True,
    ),
}
# fmt: on


@st.composite
def losses(
    draw: Any, space: Space, parts: tuple[str, ...], per_sample: str, anchor_pairs: bool = False
) -> Loss:
    """A loss over ``parts``; ``per_sample``: the part whose count is the rows (a mean's). With
    ``space.labelled`` named terms include ``parts[0]``, which counts something, so that no
    window is empty while other terms may count nothing (``anchor_pairs``: a pair is
    ``parts[0]`` too, where the other parts may count nothing in a whole window)."""
    form = draw(st.sampled_from(space.forms))
    most = min(3, len(space.names)) if form == "terms" else 1
    chosen = draw(st.lists(st.sampled_from(parts), min_size=1, max_size=most, unique=True))
    if form == "mean":
        chosen = [per_sample]
    elif space.labelled and parts[0] not in chosen and (form == "terms" or anchor_pairs):
        chosen = [parts[0], *chosen[: most - 1]]
    keys = draw(st.permutations(space.names))[: len(chosen)] if form == "terms" else ["loss"]
    weights = [draw(WEIGHTS) if form == "terms" else 1.0 for _ in chosen]
    terms = tuple(zip(keys, chosen, weights, strict=True))
    stats = draw(st.sampled_from(space.stats))
    return Loss(form, terms, draw(st.sampled_from(space.count_fns)), stats)


@st.composite
def samples(draw: Any, low: int = 1, high: int = 12) -> Samples:
    structure = draw(st.sampled_from(["tuple", "dict", "tensor", "list", "nested"]))
    column = structure != "tensor" and draw(st.booleans())
    spread = st.sampled_from(["random", "zeros", "ones"])
    n = draw(st.integers(low, high))
    return Samples(n, structure, draw(spread), draw(spread), column, draw(SEEDS))


@st.composite
def texts(draw: Any, space: Space = Space(), low: int = 1, high: int = 8) -> Text:
    prompt = draw(st.sampled_from(space.prompts))
    width = draw(st.integers(prompt + 2 if space.labelled else 1, 10))
    lengths = draw(st.lists(st.integers(0, width), min_size=low, max_size=high))
    if space.labelled:  # the first row has a labelled (shifted) token
        lengths[0] = max(lengths[0], prompt + 2)
    extras = sorted(draw(st.sets(st.sampled_from(space.extras)))) if space.extras else []
    side, structure = draw(st.sampled_from(space.sides)), draw(st.sampled_from(space.structures))
    return Text(tuple(lengths), width, side, prompt, structure, tuple(extras), draw(SEEDS))


def sample_cuts(n: int) -> st.SearchStrategy[Cut]:
    sizes = st.one_of(st.integers(1, n + 2), st.sampled_from([None, "auto"]))
    return st.builds(Cut, sizes, trim_padding=st.booleans())


@st.composite
def token_cuts(draw: Any, space: Space, text: Text) -> Cut:
    whole = len(text.lengths) * text.width  # budgets below it cut the window
    tokens = draw(st.one_of(st.integers(1, max(whole, 2)), st.integers(1, 40), st.just("auto")))
    rows = draw(st.one_of(st.none(), st.integers(1, len(text.lengths) + 1)))
    multiple = draw(st.sampled_from(space.multiples))
    return Cut(rows, tokens, multiple, draw(st.sampled_from(space.lengths)))


@st.composite
def sample_cases(draw: Any, space: Space = EVERYTHING, low: int = 1) -> Case:
    data = draw(samples(low))
    loss = draw(losses(space, space.sample_parts, "ce", anchor_pairs=True))
    return Case("mlp", data, draw(sample_cuts(data.n)), loss, draw(OPTIMIZERS), draw(STEPS))


@st.composite
def token_cases(
    draw: Any, space: Space = EVERYTHING, models: tuple[str, ...] = ("bag",), low: int = 1
) -> Case:
    """Text cut by tokens or by samples (``low``: rows at least)."""
    text = draw(texts(space, low))
    by_tokens = draw(st.sampled_from(space.cuts)) == "tokens"
    cut = draw(token_cuts(space, text)) if by_tokens else draw(sample_cuts(len(text.lengths)))
    parts = tuple(p for p in space.token_parts if p != "tokw" or "tokw" in space.extras)
    loss = draw(losses(space, parts, "seq"))
    if any(part == "tokw" for _, part, _ in loss.terms) and "tokw" not in text.extras:
        text = replace(text, extras=(*text.extras, "tokw"))  # the part reads it
    model = draw(st.sampled_from(models))
    return Case(model, text, cut, loss, draw(OPTIMIZERS), draw(STEPS))


# ---------------------------------------------------------------------------- other features
@dataclass(frozen=True)
class Grads:
    """Micro-batches of ``pieces`` samples (an MLP, a mean cross-entropy), each given to the
    window by ``routes`` ("backward", or accumulate_grads with a "list", "tuple", "dict" or
    "generator" of gradients), with counts of type ``count`` ("int", "float", "tensor")."""

    pieces: tuple[int, ...]
    routes: tuple[str, ...]
    count: str
    optimizer: str
    seed: int


@st.composite
def grads_cases(draw: Any) -> Grads:
    pieces = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    route = st.sampled_from(["backward", "list", "tuple", "dict", "generator"])
    routes = draw(st.lists(route, min_size=len(pieces), max_size=len(pieces)))
    count = draw(st.sampled_from(["int", "float", "tensor"]))
    return Grads(tuple(pieces), tuple(routes), count, draw(OPTIMIZERS), draw(SEEDS))


@dataclass(frozen=True)
class Cached:
    """``cached_loss`` over an MLP encoder: InfoNCE between ``n`` query / document pairs,
    ``form`` "mean", "pair", "terms" (plus a weighted regulariser) or "one_arg"
    (``batch_loss_fn(reps)``); ``temperature``: a learnable one, used by the batch loss."""

    n: int
    micro_batch_size: int
    structure: str
    form: str
    temperature: bool
    optimizer: str
    steps: int
    seed: int


@st.composite
def cached_cases(draw: Any) -> Cached:
    n = draw(st.integers(1, 10))
    return Cached(
        n, draw(st.integers(1, n + 1)), draw(st.sampled_from(["tuple", "dict"])),
        draw(st.sampled_from(["mean", "pair", "terms", "one_arg"])), draw(st.booleans()),
        draw(OPTIMIZERS), draw(STEPS), draw(SEEDS),
    )  # fmt: skip


POLICIES = st.one_of(
    st.builds(Cut, st.one_of(st.integers(1, 9), st.just("auto"))),
    st.builds(Cut, st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.integers(4, 40), st.just("auto"))),
)  # fmt: skip


@dataclass(frozen=True)
class Resume:
    """A step under the sizing policy ``first``; the engine state it saves is loaded by an
    ``Accumulator`` built with ``second``, which takes the next step."""

    text: Text
    first: Cut
    second: Cut
    optimizer: str


@st.composite
def resume_cases(draw: Any) -> Resume:
    """Right-padded rows of 2 tokens or more (every window has labelled tokens)."""
    width = draw(st.integers(2, 10))
    lengths = draw(st.lists(st.integers(2, width), min_size=2, max_size=8))
    text = Text(tuple(lengths), width, "right", 0, "dict", (), draw(SEEDS))
    first = draw(POLICIES)
    second = draw(st.one_of(st.just(first), POLICIES))
    return Resume(text, first, second, draw(OPTIMIZERS))


@dataclass(frozen=True)
class Ranks:
    """``case`` trained on two gloo ranks (DDP): rank 0 holds the first ``split`` rows of each
    window, rank 1 the rest; the full batch is the whole window."""

    case: Case
    split: int


RANKS = Space(  # what crosses ranks: the counts of every term, statistics, token windows
    lengths=("default", "mask"), extras=(), multiples=(None, 4), labelled=True
)


@st.composite
def rank_cases(draw: Any, space: Space = RANKS) -> Ranks:
    case = draw(st.one_of(sample_cases(space, low=2), token_cases(space, low=2)))
    n = len(case.data.lengths) if isinstance(case.data, Text) else case.data.n
    return Ranks(case, draw(st.integers(1, n - 1)))
