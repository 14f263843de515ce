"""`draftsmith train ...` with profile_hook's phase timers and torch profiler attached at run time (draftsmith's venv).

    PROFILE=DIR python draftsmith_profile.py train --data STORE --output RUN ...

Nothing in draftsmith is changed: profile_hook patches torch's backward / clip / optimizer-step entry points, then
this runs the draftsmith CLI exactly as `python -m draftsmith` does.
"""

from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_hook

if __name__ == "__main__":
    profile_hook.install(os.environ["PROFILE"], "draftsmith")
    sys.argv = ["draftsmith", *sys.argv[1:]]
    runpy.run_module("draftsmith", run_name="__main__", alter_sys=True)
