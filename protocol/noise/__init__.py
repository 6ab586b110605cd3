"""swarm/1's secure channel: a sans-I/O Noise XX handshake and transport.

``Noise_XX_25519_AESGCM_SHA256`` with prologue ``b"swarm/1"``; every handshake and
transport message is framed with a 2-byte big-endian length. See ``handshake.py`` for the
handshake rules and ``transport.py`` for the data path; ``state.py`` is the bare Noise
state machine (explicit keys, for test vectors).
"""

from ..framing import NEED_DATA as NEED_DATA
from .cipher import AESGCM as AESGCM
from .cipher import ChaChaPoly as ChaChaPoly
from .cipher import CipherState as CipherState
from .handshake import BUSY_SIGNAL as BUSY_SIGNAL
from .handshake import DEFAULT_CIPHER as DEFAULT_CIPHER
from .handshake import MAX_HANDSHAKE_MESSAGE_LENGTH as MAX_HANDSHAKE_MESSAGE_LENGTH
from .handshake import PROLOGUE as PROLOGUE
from .handshake import NoiseHandshake as NoiseHandshake
from .payload import SIGNATURE_PREFIX as SIGNATURE_PREFIX
from .payload import IdentityMismatchError as IdentityMismatchError
from .state import HandshakeState as HandshakeState
from .transport import MAX_MESSAGE_LENGTH as MAX_MESSAGE_LENGTH
from .transport import MAX_PLAINTEXT_PER_MESSAGE as MAX_PLAINTEXT_PER_MESSAGE
from .transport import NoiseTransport as NoiseTransport
from .transport import sealed_size as sealed_size

__all__ = [
    "AESGCM",
    "BUSY_SIGNAL",
    "DEFAULT_CIPHER",
    "MAX_HANDSHAKE_MESSAGE_LENGTH",
    "MAX_MESSAGE_LENGTH",
    "MAX_PLAINTEXT_PER_MESSAGE",
    "NEED_DATA",
    "PROLOGUE",
    "SIGNATURE_PREFIX",
    "ChaChaPoly",
    "CipherState",
    "HandshakeState",
    "IdentityMismatchError",
    "NoiseHandshake",
    "NoiseTransport",
    "sealed_size",
]
