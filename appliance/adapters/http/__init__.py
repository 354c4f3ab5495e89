"""The HTTP/1.1 wire: the front (heads parsed by hand, bodies admitted before they are
read), KServe v2 routes, Triton's generate extension, the OpenAI API and the NVR
detection API. Each route supplies a form reader and an encoder to the exchange."""
