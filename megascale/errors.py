"""User-facing errors.

Anything a person can fix (a config field, a path, a dataset, a checkpoint) raises a
`UserError` whose message names the field or file and what is wrong. The CLI prints it
as one line and exits with code 2; no traceback is shown for user mistakes.
"""


class UserError(Exception):
    """A mistake in the user's input; the message is shown as is, on one line."""

    exit_code = 2


class HostCheckError(UserError):
    """A host failed its self-check (megascale/fault/selfcheck.py): broken hardware, not a bad input, but
    like a bad input a restart on the same host cannot help. `megascale launch` does not restart it."""

    exit_code = 4


class PeerHostEvicted(UserError):
    """Another host of the job failed its self-check and leaves it (its ranks exit 4). This host is fine:
    `megascale launch` restarts it, in a new rendezvous round with a spare host in the evicted one's
    place, or with fewer hosts when `--nnodes MIN:MAX` and `parallel.dp = 0` allow it."""

    exit_code = 5


class CollectiveFailed(Exception):
    """A collective of this rank failed (a peer died, a link dropped, a timeout) and the rank has said so
    in one line, naming the op, and written its stacks and in-flight ops to its hang dump
    (observe/watchdog.py). The CLI exits 1 without a traceback (the dump has the stacks): a crash, which
    `megascale launch` restarts. The error it stands for is its __cause__."""
