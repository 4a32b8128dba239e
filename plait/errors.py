"""RunError: a failure while running that one line explains (a checkpoint write, a reward
function, a worker); the CLI prints it without a traceback and exits 1. Bad input before any
work is a ConfigError (exit 2), in configtree.py."""


class RunError(RuntimeError):
    pass
