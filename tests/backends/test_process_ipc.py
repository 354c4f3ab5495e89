"""The wire of process isolation on its own: tensors through a real shared segment,
and everything a worker could send that must not be believed."""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import pytest

from appliance.backends import process_ipc
from appliance.backends.process_ipc import Segment, create_segment_fd, read_tensors, write_tensors
from appliance.errors import invalid


@pytest.fixture
def pair() -> Any:
    """Two mappings of one segment, as the server and its worker hold them."""
    fd = create_segment_fd(4096)
    host, worker = Segment(fd, 4096), Segment(os.dup(fd), 4096)
    yield host, worker
    host.close()
    worker.close()


def test_tensors_round_trip_in_every_layout(pair: tuple[Segment, Segment]) -> None:
    host, worker = pair
    tensors = {
        "f16": np.arange(6, dtype=np.float16).reshape(2, 3),
        "big_endian": np.arange(5, dtype=">i4"),
        "strided": np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],
        "bool": np.array([True, False, True]),
        "empty": np.zeros((3, 0), np.uint64),
        "bytes": np.array([b"", b"\x00\xff", "caf\u00e9"], dtype=object),
        "large": np.ones(10_000, np.float32),  # grows the segment past its 4 KiB
    }
    described = write_tensors(host, tensors, 0)
    assert host.size > 4096
    worker.remap(host.size)
    seen = read_tensors(worker, described, copy=False)
    for name, arr in tensors.items():
        expected = np.array([b"", b"\x00\xff", b"caf\xc3\xa9"], dtype=object) if (
            name == "bytes"
        ) else arr
        np.testing.assert_array_equal(seen[name], expected, err_msg=name)
        assert seen[name].shape == arr.shape
    assert not seen["large"].flags.writeable  # the model gets read-only views
    assert all(d[3] % process_ipc.ALIGN == 0 for d in described)
    # the host copies what it reads: the segment is reused by the next request
    copied = read_tensors(host, described, copy=True)
    assert copied["large"].flags.owndata and copied["large"].flags.writeable


@pytest.mark.parametrize(
    ("descriptor", "problem"),
    [
        (["x", "FP32", [4], 4090, 16], "outside the shared segment"),
        (["x", "FP32", [4], 0, 12], "12 bytes for FP32"),
        (["x", "FP99", [4], 0, 16], "bad tensor descriptor"),
        (["x", "FP32", [-1], 0, 16], "bad tensor descriptor"),
        (["x", "FP32", [4], -8, 16], "bad tensor descriptor"),
        (["x", "FP32", [True], 0, 4], "bad tensor descriptor"),
        (["x", "FP32", [1] * 65, 0, 4], "bad tensor descriptor"),
        (["x", "FP32", [4], 0], "bad tensor descriptor"),
    ],
)
def test_descriptors_from_the_other_side_are_checked(
    pair: tuple[Segment, Segment], descriptor: list[Any], problem: str
) -> None:
    host, _ = pair
    with pytest.raises(ValueError, match=problem):
        read_tensors(host, [descriptor], copy=True)


def test_the_segment_cannot_be_shrunk(pair: tuple[Segment, Segment]) -> None:
    """Sealed: a worker cannot truncate the file under the server's mapping (SIGBUS)."""
    _, worker = pair
    with pytest.raises(PermissionError):
        os.ftruncate(worker.fd, 0)
    worker.resize(8192)  # growing is allowed
    assert os.fstat(worker.fd).st_size == 8192


def test_frames_are_bounded_and_must_be_objects() -> None:
    a, b = socket.socketpair()
    with a, b:
        process_ipc.send_frame(a, {"op": "infer"})
        assert process_ipc.recv_frame(b) == {"op": "infer"}
        a.sendall((process_ipc.MAX_FRAME + 1).to_bytes(4, "little"))
        with pytest.raises(ValueError, match="exceeds"):
            process_ipc.recv_frame(b)
    a, b = socket.socketpair()
    with a, b:
        body = b"[1, 2]"
        a.sendall(len(body).to_bytes(4, "little") + body)
        with pytest.raises(ValueError, match="not a JSON object"):
            process_ipc.recv_frame(b)
        a.close()
        with pytest.raises(process_ipc.ChannelClosed):
            process_ipc.recv_frame(b)


def test_errors_keep_their_code_and_others_become_internal() -> None:
    frame = process_ipc.error_frame(invalid("input 'x' is wrong"))
    assert frame == {
        "ok": False,
        "code": "INVALID_ARG",
        "reason": "OTHER",
        "message": "input 'x' is wrong",
    }
    frame = process_ipc.error_frame(KeyError("y"))
    assert frame["code"] == "INTERNAL" and frame["message"] == "KeyError: 'y'"
