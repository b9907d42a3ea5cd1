"""The one codec for every message between processes: msgpack over multiprocess pipes.

A message is a dataclass from ``engine.protocol.messages``; it travels as a
msgpack map tagged with its class name. Its lists of ints travel as raw little-endian int32
bytes (msgpack ext type 1), never as msgpack lists. msgpack walks the rest in C: its
``default`` hook turns each message into its map, its ``object_hook`` each map back.
"""
from __future__ import annotations

import functools
import struct
import sys
from array import array
from dataclasses import fields, is_dataclass

import msgpack

from . import messages

_INT32_LIST = 1


MESSAGE_TYPES = {name: cls for name, cls in vars(messages).items()
                 if isinstance(cls, type) and is_dataclass(cls) and cls.__module__ == messages.__name__}


def encode(message) -> bytes:
    return msgpack.packb(message, default=_pack_message, use_bin_type=True)


def decode(data: bytes):
    return msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, object_hook=_unpack_message,
                           strict_map_key=False)


def _pack_message(value):
    """msgpack's hook for what it cannot pack itself (it walks lists, maps and numbers in C):
    a message becomes a map tagged with its class name, its int lists int32 bytes; a set a list."""
    if is_dataclass(value) and not isinstance(value, type):
        body = {name: _pack_sequence(item) if isinstance(item, _SEQUENCES) else item
                for name in _field_names(type(value)) for item in (getattr(value, name),)}
        body["~"] = type(value).__name__
        return body
    if isinstance(value, (set, frozenset)):
        return _pack_sequence(value)
    raise TypeError(f"cannot encode a {type(value).__name__}: messages are dataclasses of plain values")


_SEQUENCES = (list, tuple, set, frozenset)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _pack_sequence(value):
    items = list(value)
    packed = _int32_bytes(items)
    return items if packed is None else msgpack.ExtType(_INT32_LIST, packed)


def _int32_bytes(items: list) -> bytes | None:
    """``items`` as little-endian int32 bytes when they are ints in range, else None. The first item's type
    decides between ints and bools (a list of bools stays one); ``struct`` refuses any other item (a
    float, None, a number out of range). One C call: a 3,000-token prompt in about a third of the time
    that a type check of every item and an ``array`` took, on the event loop's thread for every request."""
    if not items or type(items[0]) is not int:
        return None
    try:
        return struct.pack(f"<{len(items)}i", *items)
    except struct.error:
        return None


def _ext_hook(code: int, data: bytes):
    if code != _INT32_LIST:
        raise ValueError(f"unknown msgpack ext type {code}")
    values = array("i")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def _unpack_message(body: dict):
    """msgpack's hook for each map it read (innermost first): a tagged map becomes its message."""
    name = body.pop("~", None)
    if name is None:
        return body
    cls = MESSAGE_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown message type {name!r}")
    return cls(**body)
