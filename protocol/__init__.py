"""swarm's wire protocol, sans-I/O: bytes in, bytes or typed values out.

No trio, sockets or torch here; everything is testable without a network.
The layers, bottom up (see docs/protocol.md):

- secure channel: the Noise XX handshake and transport ciphers (``protocol.noise``)
- frames: 4-byte length-prefixed frames (:func:`encode_frame`, :class:`FrameDecoder`)
- RPC envelope: one :class:`RpcFrame` per frame (:func:`encode_rpc_frame`,
  :func:`decode_rpc_frame`)
- bodies: typed messages (:class:`PingRequest`, ... , :data:`METHODS`)
- DHT records: :class:`Entry`, :func:`sign_entry`, :func:`validate_entry`
- tensor codecs: ``protocol.codecs``
"""

from __future__ import annotations

from . import noise as noise
from .address import MAX_ADDRESS_LENGTH as MAX_ADDRESS_LENGTH
from .address import Address as Address
from .base58 import b58decode as b58decode
from .base58 import b58encode as b58encode
from .dhtid import DHTID as DHTID
from .dhtid import ID_BITS as ID_BITS
from .dhtid import ID_BYTES as ID_BYTES
from .errors import LocalProtocolError as LocalProtocolError
from .errors import ProtocolError as ProtocolError
from .errors import RemoteProtocolError as RemoteProtocolError
from .errors import SwarmError as SwarmError
from .framing import DEFAULT_MAX_FRAME_SIZE as DEFAULT_MAX_FRAME_SIZE
from .framing import NEED_DATA as NEED_DATA
from .framing import FrameDecoder as FrameDecoder
from .framing import encode_frame as encode_frame
from .framing import encode_frame_header as encode_frame_header
from .identity import PEER_ID_LENGTH as PEER_ID_LENGTH
from .identity import PUBLIC_KEY_LENGTH as PUBLIC_KEY_LENGTH
from .identity import SIGNATURE_LENGTH as SIGNATURE_LENGTH
from .identity import Identity as Identity
from .identity import IdentityFileError as IdentityFileError
from .identity import PeerID as PeerID
from .identity import verify_signature as verify_signature
from .messages import MAX_NODES as MAX_NODES
from .messages import MESSAGE_TYPES as MESSAGE_TYPES
from .messages import METHODS as METHODS
from .messages import FindNodeRequest as FindNodeRequest
from .messages import FindNodeResponse as FindNodeResponse
from .messages import FindValueRequest as FindValueRequest
from .messages import FindValueResponse as FindValueResponse
from .messages import Message as Message
from .messages import NodeInfo as NodeInfo
from .messages import PingRequest as PingRequest
from .messages import PingResponse as PingResponse
from .messages import StoreRequest as StoreRequest
from .messages import StoreResponse as StoreResponse
from .messages import decode_message as decode_message
from .messages import register_message as register_message
from .records import MAX_CLOCK_SKEW as MAX_CLOCK_SKEW
from .records import MAX_ENTRIES_PER_STORE as MAX_ENTRIES_PER_STORE
from .records import MAX_KEY_BYTES as MAX_KEY_BYTES
from .records import MAX_SUBKEY_BYTES as MAX_SUBKEY_BYTES
from .records import MAX_SUBKEYS_PER_KEY as MAX_SUBKEYS_PER_KEY
from .records import MAX_TTL as MAX_TTL
from .records import MAX_VALUE_BYTES as MAX_VALUE_BYTES
from .records import Entry as Entry
from .records import RecordError as RecordError
from .records import RecordTooLargeError as RecordTooLargeError
from .records import Subkey as Subkey
from .records import check_key as check_key
from .records import key_owner as key_owner
from .records import owned_key as owned_key
from .records import owner_of as owner_of
from .records import sign_entry as sign_entry
from .records import signing_bytes as signing_bytes
from .records import validate_entry as validate_entry
from .rpc import MAX_ERROR_CODE_LENGTH as MAX_ERROR_CODE_LENGTH
from .rpc import MAX_ERROR_MESSAGE_LENGTH as MAX_ERROR_MESSAGE_LENGTH
from .rpc import MAX_HEADER_SIZE as MAX_HEADER_SIZE
from .rpc import MAX_METHOD_LENGTH as MAX_METHOD_LENGTH
from .rpc import MAX_REQUEST_ID as MAX_REQUEST_ID
from .rpc import MAX_TIMEOUT as MAX_TIMEOUT
from .rpc import PROTOCOL_VERSION as PROTOCOL_VERSION
from .rpc import FrameKind as FrameKind
from .rpc import RpcFrame as RpcFrame
from .rpc import decode_rpc_frame as decode_rpc_frame
from .rpc import encode_rpc_frame as encode_rpc_frame

__all__ = [
    # subpackages: the secure channel and the tensor codecs
    "noise",
    "codecs",
    # errors
    "SwarmError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    # identities, addresses, ids
    "PeerID",
    "Identity",
    "IdentityFileError",
    "verify_signature",
    "PEER_ID_LENGTH",
    "PUBLIC_KEY_LENGTH",
    "SIGNATURE_LENGTH",
    "b58encode",
    "b58decode",
    "Address",
    "MAX_ADDRESS_LENGTH",
    "DHTID",
    "ID_BITS",
    "ID_BYTES",
    # frames
    "encode_frame",
    "encode_frame_header",
    "FrameDecoder",
    "NEED_DATA",
    "DEFAULT_MAX_FRAME_SIZE",
    # RPC envelope
    "RpcFrame",
    "FrameKind",
    "encode_rpc_frame",
    "decode_rpc_frame",
    "PROTOCOL_VERSION",
    "MAX_HEADER_SIZE",
    "MAX_METHOD_LENGTH",
    "MAX_ERROR_CODE_LENGTH",
    "MAX_ERROR_MESSAGE_LENGTH",
    "MAX_REQUEST_ID",
    "MAX_TIMEOUT",
    # messages
    "Message",
    "NodeInfo",
    "PingRequest",
    "PingResponse",
    "FindNodeRequest",
    "FindNodeResponse",
    "FindValueRequest",
    "FindValueResponse",
    "StoreRequest",
    "StoreResponse",
    "METHODS",
    "MESSAGE_TYPES",
    "MAX_NODES",
    "decode_message",
    "register_message",
    # DHT records
    "Entry",
    "Subkey",
    "RecordError",
    "RecordTooLargeError",
    "key_owner",
    "owned_key",
    "owner_of",
    "signing_bytes",
    "sign_entry",
    "validate_entry",
    "check_key",
    "MAX_KEY_BYTES",
    "MAX_SUBKEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_ENTRIES_PER_STORE",
    "MAX_SUBKEYS_PER_KEY",
    "MAX_TTL",
    "MAX_CLOCK_SKEW",
]


def __getattr__(name: str) -> object:
    # The codecs pull in numpy; load them on first use so that a bootstrap node,
    # which never touches a tensor, stays small.
    if name == "codecs":
        import importlib

        return importlib.import_module(".codecs", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
