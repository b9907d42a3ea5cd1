"""The one codec for every message between processes: msgpack over multiprocess pipes.

A message is a dataclass from ``engine.protocol.messages``; it travels as a
msgpack map tagged with its class name. Lists of ints travel as raw little-endian int32
bytes (msgpack ext type 1), never as msgpack lists.
"""
from __future__ import annotations

import sys
from array import array
from dataclasses import fields, is_dataclass

import msgpack

from . import messages

_INT32_LIST = 1


MESSAGE_TYPES = {name: cls for name, cls in vars(messages).items()
                 if isinstance(cls, type) and is_dataclass(cls) and cls.__module__ == messages.__name__}


def encode(message) -> bytes:
    return msgpack.packb(_pack(message), use_bin_type=True)


def decode(data: bytes):
    return _unpack(msgpack.unpackb(data, raw=False, ext_hook=_ext_hook, strict_map_key=False))


def _pack(value):
    if is_dataclass(value):
        body = {f.name: _pack(getattr(value, f.name)) for f in fields(value)}
        body["~"] = type(value).__name__
        return body
    if isinstance(value, (list, tuple, frozenset, set)):
        items = list(value)
        packed = _int32_array(items)
        if packed is not None:
            return msgpack.ExtType(_INT32_LIST, packed.tobytes())
        return [_pack(v) for v in items]
    return value


def _int32_array(items: list) -> array | None:
    """``items`` as little-endian int32 when every one is an int (bools are not) in range, else None."""
    if not items or set(map(type, items)) != {int}:
        return None
    try:
        packed = array("i", items)
    except OverflowError:
        return None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed


def _ext_hook(code: int, data: bytes):
    if code != _INT32_LIST:
        raise ValueError(f"unknown msgpack ext type {code}")
    values = array("i")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def _unpack(value):
    if isinstance(value, dict):
        name = value.pop("~", None)
        body = {k: _unpack(v) for k, v in value.items()}
        if name is None:
            return body
        cls = MESSAGE_TYPES.get(name)
        if cls is None:
            raise ValueError(f"unknown message type {name!r}")
        return cls(**body)
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    return value
