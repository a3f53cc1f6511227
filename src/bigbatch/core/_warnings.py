"""``BigBatchWarning``: the one warning category of bigbatch (filter it with ``warnings``)."""

from __future__ import annotations


class BigBatchWarning(UserWarning):
    """Something that makes accumulation differ from the big batch (e.g. BatchNorm layers).

    Emitted once per cause and naming the modules involved; silence it with
    ``warnings.filterwarnings("ignore", category=bigbatch.BigBatchWarning)``.
    """
