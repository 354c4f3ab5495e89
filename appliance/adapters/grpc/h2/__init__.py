"""The gRPC endpoint's HTTP/2 core: frames, HPACK headers, flow control and stream
limits, with the accept loop that drives them."""
