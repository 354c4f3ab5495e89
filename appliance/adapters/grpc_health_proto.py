"""health.proto's messages and service (``grpc.health.v1.Health``: Check, Watch, List),
for the gRPC endpoint's health service, without the grpcio-health-checking package.

That package's generated code pins protobuf to the releases it was built with, and
no release of it agrees with the grpcio and protobuf that ``tritonclient[grpc]``
accepts; so health.proto's messages and service are declared here, in a descriptor
pool of their own (nothing else registered under ``grpc.health.v1`` can clash with
them); :class:`appliance.adapters.grpc_server.Health` serves them. The wire format is
the standard one:
``grpc_health_probe``, Kubernetes' gRPC probes and grpcio-health-checking's client
talk to it unchanged.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE = "grpc.health.v1.Health"
# HealthCheckResponse.ServingStatus
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _descriptor() -> Any:
    """health.proto's file descriptor: its messages and the Health service."""
    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="appliance/grpc_health_v1.proto", package="grpc.health.v1", syntax="proto3"
    )
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(
        name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL
    )
    response = proto.message_type.add(name="HealthCheckResponse")
    status = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=field.TYPE_ENUM,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
        label=field.LABEL_OPTIONAL,
    )
    proto.message_type.add(name="HealthListRequest")
    listed = proto.message_type.add(name="HealthListResponse")
    entry = listed.nested_type.add(name="StatusesEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    entry.field.add(
        name="value",
        number=2,
        type=field.TYPE_MESSAGE,
        type_name=".grpc.health.v1.HealthCheckResponse",
        label=field.LABEL_OPTIONAL,
    )
    listed.field.add(
        name="statuses",
        number=1,
        type=field.TYPE_MESSAGE,
        type_name=".grpc.health.v1.HealthListResponse.StatusesEntry",
        label=field.LABEL_REPEATED,
    )
    service = proto.service.add(name="Health")
    for method, suffix, streaming in (("Check", "Check", False), ("List", "List", False),
                                      ("Watch", "Check", True)):  # fmt: skip
        service.method.add(
            name=method,
            input_type=f".grpc.health.v1.Health{suffix}Request",
            output_type=f".grpc.health.v1.Health{suffix}Response",
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
