"""How a run ends other than by finishing, as the CLI reports it.

RunError: a failure while running that one line explains (a checkpoint write, a reward function,
a worker); printed without a traceback, exit 1. Interrupted: a signal, exit 128 + signum. Bad
input before any work is a ConfigError (exit 2), in configtree.py."""


class RunError(RuntimeError):
    pass


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived (see lifecycle.signals_as_interrupt); exit status 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum
