"""How a run ends other than by finishing, as the CLI reports it.

RunError: a failure while running that one line explains (a checkpoint write, a reward function,
a worker); printed without a traceback, exit 1. Interrupted: a signal, exit 128 + signum. Bad
input before any work is a ConfigError (exit 2), in configtree.py."""


class RunError(RuntimeError):
    """`recoverable`: not the user's doing (a worker process or an engine that died); trainer.max_restarts
    resumes the run from its last checkpoint after one. User code's failures and plait's own refusals are not.
    `cause`: what a worker process raised, where a backend reports one; `log`: the file with its traceback."""
    recoverable = False
    cause: BaseException | None = None
    log: str = ""


class EngineDied(RunError):
    """The rollout engine's own process died or hung (vLLM's engine core; on Ray, the separated rollout's worker
    process): the trainer restarts it once per step with the current weights and re-issues the call
    (trainers/rollout_client.py); likewise the reward model's or judge's worker process on the reward pool
    (LMTrainer.score); where nothing catches it, one line."""
    recoverable = True


class EngineFailed(RunError):
    """The rollout engine, or the reward model or judge, died twice in one step (each is restarted once a step)."""
    recoverable = True


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived (see lifecycle.signals_as_interrupt); exit status 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum
