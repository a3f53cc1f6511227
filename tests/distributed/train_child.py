"""``bigbatch train`` (``cli.main``) under torchrun, then a check that the process group was left.

Run by test_train_torchrun.py as ``torchrun ... train_child.py train TASK --out DIR ...``; each
rank writes ``DIR/teardown-rank<r>``: ``left`` when no process group is initialised any more.
"""

import os
import sys

import torch.distributed as dist

from bigbatch import distributed
from bigbatch.cli import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    out = sys.argv[sys.argv.index("--out") + 1]
    with open(os.path.join(out, f"teardown-rank{os.environ['RANK']}"), "w") as file:
        file.write("still in the group" if dist.is_initialized() else "left")
    distributed.exit_process(code)  # Note [gloo exit]
