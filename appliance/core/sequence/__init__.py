"""Triton's sequence batcher: slots, strategies, and the control and state tensors it
adds to each request."""
