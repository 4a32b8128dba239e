"""The finish hook: `global_profiler.finish_hook_cmd`, run once per run by the driver.

The command string is passed to the shell exactly as configured; everything the hook needs
arrives in its environment (nothing from data or config is spliced into the string):

    PLAIT_PROFILE_SAVE_PATH   absolute save_path; manifest.jsonl there lists every artifact
    PLAIT_PROFILE_TOOL        torch | torch_memory | nsys | memray
    PLAIT_PROFILE_RANK        0 (the hook runs in the driver, once, not per worker)
    PLAIT_PROFILE_ROLE        driver (roles and ranks of the artifacts are in the manifest)

A hook that fails or cannot start is reported as one warning line and never raised: profiling
must not stop training. The hook blocks the driver while it runs.
"""

from __future__ import annotations

import logging
import os
import subprocess

log = logging.getLogger("plait.profiler")


def run_finish_hook(cmd: str, save_path: str, tool: str) -> bool:
    """Run `cmd` through the shell with the PLAIT_PROFILE_* environment; True if it exited 0."""
    env = {**os.environ,
           "PLAIT_PROFILE_SAVE_PATH": os.path.abspath(save_path),
           "PLAIT_PROFILE_TOOL": tool,
           "PLAIT_PROFILE_RANK": "0",
           "PLAIT_PROFILE_ROLE": "driver"}
    try:
        code = subprocess.run(cmd, shell=True, env=env).returncode
    except Exception as err:  # e.g. no shell, fork failure
        log.warning("profiler finish_hook_cmd could not run: %s: %s", type(err).__name__, err)
        return False
    if code != 0:
        log.warning("profiler finish_hook_cmd exited with status %d", code)
    return code == 0
