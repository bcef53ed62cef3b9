"""One exception tree for the whole project; backend errors are wrapped at the edges."""


class NebulaError(Exception):
    """Base of every error Nebula raises on purpose."""


class ConfigError(NebulaError):
    """A configuration value, codec spec or command-line argument is invalid."""


class WireError(NebulaError):
    """A message on the wire is malformed, oversized or fails its checksum."""


class CodecError(NebulaError):
    """A tensor cannot be encoded or decoded by the requested codec."""


class AuthError(NebulaError):
    """A peer, key or certificate was refused."""


class TransportError(NebulaError):
    """A channel failed: timeout, dead peer, closed socket."""


class RemoteError(NebulaError):
    """A remote service answered with an ERROR message."""

    def __init__(self, code: str, message: str):
        super().__init__(f"remote error [{code}]: {message}")
        self.code = code
        self.remote_message = message


class StageError(NebulaError):
    """A stage failed to build, train, checkpoint or resume."""


class DataError(NebulaError):
    """A data set is missing, malformed or inconsistent between sites."""
