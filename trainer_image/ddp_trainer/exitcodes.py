"""Exit codes of ``python -m ddp_trainer``: the operator's restart policy reads them.

Codes 1-127 are permanent failures for the ``ExitCode`` restart policy, 128 and above are retried, so
every failure that is not the job's own fault (a signal, a lost peer) must land at 128 or above.
"""

from typing import Final

EXIT_OK: Final = 0
# Bad configuration (env contract or CLI): retrying cannot help.
EXIT_BAD_CONFIG: Final = 2
# Stopped by SIGTERM after every rank agreed to stop and rank 0 wrote its checkpoint (128 + 15).
EXIT_STOPPED: Final = 143
# A collective failed because a peer went away, the watchdog ended a rank stuck in a collective, or the
# process group could not be formed within the init timeout: the gang has to be restarted as a whole.
EXIT_PEER_LOST: Final = 170

RETRYABLE_THRESHOLD: Final = 128


def is_retryable(exit_code: int) -> bool:
    """What the ``ExitCode`` restart policy decides for one rank's exit code."""
    return exit_code >= RETRYABLE_THRESHOLD
