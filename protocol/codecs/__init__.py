"""Tensor compression codecs: numpy arrays in, self-describing bytes out, float32 back.

    codec = get_codec("int8")             # or "none", "float16", get_codec("topk", fraction=0.01)
    blob = codec.encode(grad)             # bytes: a small fixed header, then raw payload
    restored = codec.decode(blob)         # float32, grad's shape
    codec.decode_into(blob, buffer)       # into a preallocated float32 array

Decoding anything malformed raises :class:`~protocol.errors.ProtocolError`; ``int8`` and
``topk`` refuse NaN and infinity with :class:`NonFiniteError`. See ``base`` for the format.
"""

from .base import BlobHeader as BlobHeader
from .base import Codec as Codec
from .base import NonFiniteError as NonFiniteError
from .base import read_header as read_header
from .int8 import Int8Codec as Int8Codec
from .registry import CODEC_NAMES as CODEC_NAMES
from .registry import get_codec as get_codec
from .simple import Float16Codec as Float16Codec
from .simple import NoneCodec as NoneCodec
from .topk import TopKCodec as TopKCodec

__all__ = [
    "CODEC_NAMES",
    "BlobHeader",
    "Codec",
    "Float16Codec",
    "Int8Codec",
    "NonFiniteError",
    "NoneCodec",
    "TopKCodec",
    "get_codec",
    "read_header",
]
