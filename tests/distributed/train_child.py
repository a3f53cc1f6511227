"""``bigbatch train`` (``cli.main``) under torchrun, then a check that the process group was left.

Run by test_train_torchrun.py as ``torchrun ... train_child.py train TASK --out DIR ...``; each
rank writes ``DIR/teardown-rank<r>``: ``left`` when no process group is initialised any more.
With ``COUNT_COLLECTIVES=1`` in the environment each rank also writes
``DIR/collectives-rank<r>.json``: the collectives it ran (``c10d::`` events of torch's profiler,
so a collective from any path, Python or C++, counts), by name.
"""

import collections
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from bigbatch.app.cli import main
from bigbatch.distributed import launch as distributed

if __name__ == "__main__":
    counting = os.environ.get("COUNT_COLLECTIVES") == "1"
    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        torch.profiler.profile(activities=activities)
        if counting
        else contextlib.nullcontext() as prof
    ):
        code = main(sys.argv[1:])
    out, rank = sys.argv[sys.argv.index("--out") + 1], os.environ["RANK"]
    with open(os.path.join(out, f"teardown-rank{rank}"), "w") as file:
        file.write("still in the group" if dist.is_initialized() else "left")
    if counting:
        names = collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
        with open(os.path.join(out, f"collectives-rank{rank}.json"), "w") as file:
            json.dump(names, file)
    distributed.exit_process(code)  # Note [gloo exit]
