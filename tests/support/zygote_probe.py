"""`python -m tests.support.zygote_probe ACTION`: prints what a started service sees of its process as
one JSON line, then exits 0, exits with a code (`exit N`), raises, or sleeps until killed."""
from __future__ import annotations

import json
import os
import random
import sys
import time

WARM = "torch" in sys.modules  # imported before this module ran: a zygote's child

if __name__ == "__main__":
    import torch

    print(json.dumps({"warm": WARM, "pid": os.getpid(), "session_leader": os.getsid(0) == os.getpid(),
                      "cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "threads": torch.get_num_threads(),
                      "path0": sys.path[0], "random": random.random(), "argv": sys.argv[1:]}))
    action = sys.argv[1]
    if action == "exit":
        sys.exit(int(sys.argv[2]))
    if action == "raise":
        raise RuntimeError("the probe's own bug")
    if action == "sleep":
        time.sleep(600)
