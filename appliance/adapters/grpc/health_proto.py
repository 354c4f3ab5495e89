"""health.proto's messages and service (``grpc.health.v1.Health``: Check, Watch, List),
for the gRPC endpoint's health service, without the grpcio-health-checking package.

That package's generated code pins protobuf to the releases it was built with, and
no release of it agrees with the grpcio and protobuf that ``tritonclient[grpc]``
accepts; so health.proto's messages and service are declared here, in a descriptor
pool of their own (nothing else registered under ``grpc.health.v1`` can clash with
them); :class:`appliance.adapters.grpc.server.Health` serves them. The wire format is
the standard one:
``grpc_health_probe``, Kubernetes' gRPC probes and grpcio-health-checking's client
talk to it unchanged.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "grpc.health.v1.Health"
_PACKAGE = ".grpc.health.v1."
_F = descriptor_pb2.FieldDescriptorProto


def _field(
    message: Any, name: str, number: int, kind: int, type_name: str = "", repeated: bool = False
) -> None:
    """One field of a message, as health.proto declares it (``type_name`` relative to
    the package; set only when given: an empty one would count as set)."""
    label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    field = message.field.add(name=name, number=number, type=kind, label=label)
    if type_name:
        field.type_name = _PACKAGE + type_name


def _descriptor() -> Any:
    """health.proto's file descriptor: its messages and the Health service."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="appliance/grpc_health_v1.proto", package="grpc.health.v1", syntax="proto3"
    )
    request = proto.message_type.add(name="HealthCheckRequest")
    _field(request, "service", 1, _F.TYPE_STRING)
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    _field(response, "status", 1, _F.TYPE_ENUM, "HealthCheckResponse.ServingStatus")
    proto.message_type.add(name="HealthListRequest")
    listed = proto.message_type.add(name="HealthListResponse")
    entry = listed.nested_type.add(name="StatusesEntry")
    entry.options.map_entry = True
    _field(entry, "key", 1, _F.TYPE_STRING)
    _field(entry, "value", 2, _F.TYPE_MESSAGE, "HealthCheckResponse")
    _field(listed, "statuses", 1, _F.TYPE_MESSAGE, "HealthListResponse.StatusesEntry", True)
    service = proto.service.add(name="Health")
    for method, suffix, streaming in (("Check", "Check", False), ("List", "List", False),
                                      ("Watch", "Check", True)):  # fmt: skip
        service.method.add(
            name=method,
            input_type=f"{_PACKAGE}Health{suffix}Request",
            output_type=f"{_PACKAGE}Health{suffix}Response",
            server_streaming=streaming,
        )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool.FindFileByName(proto.name)


DESCRIPTOR = _descriptor()
HealthCheckRequest, HealthCheckResponse, HealthListRequest, HealthListResponse = (
    message_factory.GetMessageClass(DESCRIPTOR.message_types_by_name[name])
    for name in ("HealthCheckRequest", "HealthCheckResponse", "HealthListRequest",
                 "HealthListResponse")
)  # fmt: skip
