"""Base58 with the Bitcoin alphabet, used to show PeerIDs."""

from __future__ import annotations

from .errors import ProtocolError

ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_INDEX = {c: i for i, c in enumerate(ALPHABET)}
# A 32-byte PeerID is at most 44 characters; anything far longer is hostile.
MAX_ENCODED_LENGTH = 128


def b58encode(data: bytes) -> str:
    """Encode bytes; each leading zero byte becomes a leading ``1``."""
    zeros = len(data) - len(data.lstrip(b"\0"))
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, rem = divmod(number, 58)
        digits.append(ALPHABET[rem])
    return "1" * zeros + "".join(reversed(digits))


def b58decode(text: str) -> bytes:
    """Decode a base58 string.

    Raises:
        ProtocolError: on a character outside the alphabet or an absurd length.
    """
    if not isinstance(text, str) or len(text) > MAX_ENCODED_LENGTH:
        raise ProtocolError("base58 text is not a string of sane length")
    number = 0
    for char in text:
        digit = _INDEX.get(char)
        if digit is None:
            raise ProtocolError(f"invalid base58 character {char!r}")
        number = number * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * zeros + body
