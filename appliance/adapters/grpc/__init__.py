"""The gRPC wire: Triton's GRPCInferenceService over the appliance's own HTTP/2 server
(``h2``), its calls, the protobuf codec and the health service."""
