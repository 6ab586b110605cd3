"""Codecs by name: what a round's metadata names, :func:`get_codec` builds."""

from __future__ import annotations

import inspect
from typing import Any

from .base import Codec
from .int8 import Int8Codec
from .simple import Float16Codec, NoneCodec
from .topk import TopKCodec

CODECS: dict[str, type[Codec]] = {
    codec.name: codec for codec in (NoneCodec, Float16Codec, Int8Codec, TopKCodec)
}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)
"""The codec names, in codec-id order: ``("none", "float16", "int8", "topk")``."""


def get_codec(name: str, **params: Any) -> Codec:
    """A new codec instance: ``get_codec("int8", block_size=4096)``.

    Parameters by codec: every codec takes ``max_elements``; ``int8`` takes
    ``block_size``; ``topk`` takes exactly one of ``k`` and ``fraction``.
    ``get_codec(codec.name, **codec.params)`` rebuilds an equivalent codec.

    Raises:
        ValueError: for an unknown name or an out-of-range parameter.
        TypeError: for a parameter the codec does not take, or one of the wrong type.
    """
    try:
        codec = CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}") from None
    accepted = [p for p in inspect.signature(codec.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted), key=str)
    if unknown:  # (the constructor's own error named a class, not the codec's parameters)
        raise TypeError(
            f"codec {name!r} takes no parameter {', '.join(map(repr, unknown))}; its "
            f"parameters: {', '.join(accepted)}"
        )
    return codec(**params)
