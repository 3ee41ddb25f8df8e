"""Request bytes that do not decode become INVALID_ARGUMENT naming the field, not UNKNOWN.

grpc.aio decodes a request before any interceptor or servicer code runs, and reports a
DecodeError (invalid UTF-8 in a string field, truncated or garbage bytes) as UNKNOWN.
`tolerant_deserializer` catches it and hands the servicer an `UndecodableRequest` instead;
`specmesh.server.grpc_server.ErrorInterceptor` turns that into INVALID_ARGUMENT with a BadRequest
naming the top-level field whose bytes are bad (empty when the message itself is garbage).
"""

from __future__ import annotations

from typing import Callable, Iterator

from google.protobuf.message import DecodeError, Message

from specmesh.errors import InvalidArgument

_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5
_FIXED_SIZES = {_FIXED64: 8, _FIXED32: 4}


class UndecodableRequest:
    """Stands in for a request whose bytes did not decode; carries the error to raise."""

    def __init__(self, error: InvalidArgument):
        self.error = error


def tolerant_deserializer(deserialize: Callable[[bytes], Message] | None):
    if deserialize is None:
        return None
    message_class = getattr(deserialize, "__self__", None)  # GenerateRequest.FromString -> GenerateRequest

    def decode(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as error:
            return UndecodableRequest(_explain(message_class, data, error))
    return decode


def _explain(message_class, data: bytes, error: DecodeError) -> InvalidArgument:
    name = getattr(getattr(message_class, "DESCRIPTOR", None), "full_name", "request message")
    if message_class is None:
        return InvalidArgument("", f"not a valid {name}: {error}")
    try:
        records = list(_top_level_records(data))
    except ValueError as malformed:
        return InvalidArgument("", f"not a valid {name} message ({malformed})")
    for number, record in records:
        try:
            message_class.FromString(record)
        except DecodeError:
            field = message_class.DESCRIPTOR.fields_by_number.get(number)
            what = "is not valid UTF-8" if field is not None and field.type == field.TYPE_STRING else "does not decode"
            return InvalidArgument(field.name if field is not None else "", what)
    return InvalidArgument("", f"not a valid {name} message")


def _top_level_records(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(field number, the record's bytes) for each top-level field of a serialized message."""
    position = 0
    while position < len(data):
        start = position
        tag, position = _varint(data, position)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            _, position = _varint(data, position)
        elif wire_type == _LENGTH_DELIMITED:
            length, position = _varint(data, position)
            position += length
        elif wire_type in _FIXED_SIZES:
            position += _FIXED_SIZES[wire_type]
        else:
            raise ValueError(f"unsupported wire type {wire_type} at byte {start}")
        if number == 0 or position > len(data):
            raise ValueError(f"truncated or corrupt field at byte {start}")
        yield number, data[start:position]


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while position < len(data) and shift < 64:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position += 1
        if not byte & 0x80:
            return value, position
        shift += 7
    raise ValueError(f"truncated varint at byte {position}")
