"""The gRPC endpoint's HTTP/2 core: a sans-I/O state machine (``machine``: frames,
streams, flow control and limits; ``inbound`` the DATA received within the server's
windows, cut into messages; ``outbound`` the bytes to send within the client's
windows; ``watch`` the watchdog's decisions; ``frames`` and ``headers`` the wire's
pieces, ``limits`` what a client may cost) and the thin asyncio driver over it
(``connection``), with the accept loop's connection limit (``accept``)."""
