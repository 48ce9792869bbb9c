"""Request bytes off the wire -> ``GenerateRequest``, with a field-level error for bad bytes.

The gRPC proxy hands the replica the raw request bytes (``add_SpecInferServicer_to_server``
below registers no request deserializer), so bytes that are not a ``GenerateRequest`` -- garbage,
a truncated message, invalid UTF-8 in a string field -- become ``INVALID_ARGUMENT`` naming the
field instead of the ``INTERNAL: Exception deserializing request!`` grpcio answers by itself.

Invalid UTF-8 is located by parsing the bytes again into a mirror of the message types whose
string fields are ``bytes`` (built from the descriptor, so new fields are covered).
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from protos import specinfer_pb2 as pb

from .grpc_proxy import cancels_reach_replica
from .serve_requests import InvalidArgument

_MIRROR_PACKAGE = "specinfer.wire_mirror"


def _bytes_mirror():
    """(The GenerateRequest class of a copy of specinfer.proto whose strings are bytes, the full
    names of the mirror's fields that were strings)."""
    converted = set()
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    proto.name, old_package, proto.package = "specinfer_wire_mirror.proto", proto.package, _MIRROR_PACKAGE
    del proto.service[:]
    for message in proto.message_type:
        for field in message.field:
            if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                converted.add(f"{_MIRROR_PACKAGE}.{message.name}.{field.name}")
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(f".{old_package}.", f".{_MIRROR_PACKAGE}.")
        for nested in message.nested_type:  # map entries
            for field in nested.field:
                if field.HasField("type_name"):
                    field.type_name = field.type_name.replace(f".{old_package}.", f".{_MIRROR_PACKAGE}.")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    mirror = message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_MIRROR_PACKAGE}.GenerateRequest"))
    return mirror, frozenset(converted)


_MIRROR, _WERE_STRINGS = _bytes_mirror()


def decode_request(raw: bytes | pb.GenerateRequest) -> pb.GenerateRequest:
    """A GenerateRequest from wire bytes (a message passes through); raises InvalidArgument."""
    if isinstance(raw, pb.GenerateRequest):
        return raw
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise InvalidArgument("request", f"expected a specinfer.v1.GenerateRequest, got {type(raw).__name__}")
    raw = bytes(raw)
    try:
        return pb.GenerateRequest.FromString(raw)
    except DecodeError:
        pass
    field = invalid_utf8_field(raw)
    if field is not None:
        raise InvalidArgument(field, "is not valid UTF-8 (proto3 string fields must be)")
    raise InvalidArgument("request", f"{len(raw)} bytes that are not a specinfer.v1.GenerateRequest "
                          "(malformed protobuf wire format)")


def invalid_utf8_field(raw: bytes) -> str | None:
    """The path of the first string field holding invalid UTF-8 (``stop[3]``), or None."""
    try:
        mirror = _MIRROR.FromString(raw)
    except DecodeError:
        return None
    return _find_invalid(mirror, "")


def _find_invalid(message, prefix: str) -> str | None:
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        items = list(value) if field.is_repeated else [value]
        for index, item in enumerate(items):
            where = f"{path}[{index}]" if field.is_repeated else path
            if field.full_name in _WERE_STRINGS and not _utf8(item):
                return where
            if field.message_type is not None:
                found = _find_invalid(item, f"{where}.")
                if found:
                    return found
    return None


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def add_SpecInferServicer_to_server(servicer, server) -> None:  # noqa: N802 (grpc's naming)
    """``protos.specinfer_pb2_grpc.add_SpecInferServicer_to_server`` without the request
    deserializer: the replica gets the bytes and ``decode_request`` answers bad ones. In Serve's
    proxy its streams pass client cancels to the replica (``cluster.grpc_proxy``).

    Name it in ``grpc_options.grpc_servicer_functions`` (configs/serve.yaml).
    """
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=None,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=None,
            response_serializer=pb.GenerateChunk.SerializeToString),
    }
    service = pb.DESCRIPTOR.services_by_name["SpecInfer"].full_name
    with cancels_reach_replica(server):  # inside Serve's proxy: stream cancels reach the replica
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        if hasattr(server, "add_registered_method_handlers"):
            server.add_registered_method_handlers(service, handlers)
