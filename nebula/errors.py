"""One exception tree for the whole project; backend errors are wrapped at the edges."""


class NebulaError(Exception):
    """Base of every error Nebula raises on purpose."""


class ConfigError(NebulaError):
    """A configuration value, codec spec or command-line argument is invalid."""


class WireError(NebulaError):
    """A message on the wire is malformed, oversized or fails its checksum. `rule` names the check of
    docs/protocol.md §1.5 that refused it (`nebula.wire.RULES`); empty for a sender's own mistake."""

    def __init__(self, message: str, rule: str = ""):
        super().__init__(message)
        self.rule = rule


class CodecError(NebulaError):
    """A tensor cannot be encoded or decoded by the requested codec."""


class AuthError(NebulaError):
    """A peer, key or certificate was refused."""


class TransportError(NebulaError):
    """A channel failed: timeout, dead peer, closed socket."""


class RecvTimeout(TransportError):
    """No message arrived within a recv's timeout (the channel itself is fine)."""


class LinkDown(TransportError):
    """Another site stayed unreachable for longer than [channel] wan_timeout: the job stops (exit 3,
    not restarted: the network must come back first) and resumes from its checkpoints when started again."""


class RemoteError(NebulaError):
    """A remote service answered with an ERROR message."""

    def __init__(self, code: str, message: str):
        super().__init__(f"remote error [{code}]: {message}")
        self.code = code
        self.remote_message = message


class PeerFailed(RemoteError):
    """Another stage of the job failed and said why (an ERROR message): the job cannot go on without it, so
    this stage stops too, and is not restarted either (a restart would wait for a stage that is gone)."""


class StageError(NebulaError):
    """A stage failed to build, train, checkpoint or resume."""


class DataError(NebulaError):
    """A data set is missing, malformed or inconsistent between sites."""


# Exit codes of `nebula ...` commands and services, what supervisors act on.
EXIT_ERROR = 2  # failed; running it again may succeed (a link or a peer failed)
EXIT_FIX_FIRST = 3  # a service that fails the same way until its cause is fixed: supervisors do not restart it
FIX_FIRST = (ConfigError, DataError, StageError, LinkDown, PeerFailed)
