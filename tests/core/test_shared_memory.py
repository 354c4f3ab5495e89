"""The system shared-memory registry against real POSIX shm objects."""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm

from appliance.core.shared_memory import RESERVED_PREFIX, SharedMemoryRegistry
from appliance.errors import ApplianceError, Code

SIZE = 64
_keys = itertools.count()


@pytest.fixture
def region() -> Iterator[tuple[str, shm.SharedMemoryRegion]]:
    """A fresh 64-byte POSIX shm object holding bytes 0..63; destroyed afterwards."""
    key = f"/appliance_test_{os.getpid()}_{next(_keys)}"
    handle = shm.create_shared_memory_region("r", key, SIZE)
    try:
        shm.set_shared_memory_region(handle, [np.arange(SIZE, dtype=np.uint8)])
        yield key, handle
    finally:
        shm.destroy_shared_memory_region(handle)


def error(call: object, *args: object) -> ApplianceError:
    assert callable(call)
    with pytest.raises(ApplianceError) as e:
        call(*args)
    return e.value


def test_register_status_unregister(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 0, SIZE)
    reg.register("b", key, 16, 32)
    assert reg.status() == [
        {"name": "a", "key": key, "offset": 0, "byte_size": SIZE},
        {"name": "b", "key": key, "offset": 16, "byte_size": 32},
    ]
    assert reg.status("b") == [{"name": "b", "key": key, "offset": 16, "byte_size": 32}]
    # the window of "b" starts at byte 16 of the object
    assert bytes(reg.view("b", 0, 4, "input 'x'")) == bytes([16, 17, 18, 19])
    reg.unregister("b")
    assert [r["name"] for r in reg.status()] == ["a"]
    assert error(reg.status, "b").code is Code.NOT_FOUND
    reg.unregister("b")  # unknown names are a no-op, as in Triton
    reg.unregister()
    assert reg.status() == []


def test_duplicate_name_is_refused(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 0, 8)
    exc = error(reg.register, "a", key, 8, 8)
    assert exc.code is Code.INVALID_ARG
    assert exc.message == "shared memory region 'a' already in manager"  # Triton's
    assert reg.status("a")[0]["offset"] == 0  # the first registration is untouched


def test_missing_and_malformed_keys() -> None:
    reg = SharedMemoryRegistry(enabled=True)
    missing = f"/appliance_missing_{os.getpid()}"
    exc = error(reg.register, "a", missing, 0, 8)
    assert exc.code is Code.INTERNAL  # Triton's code and text
    assert (
        exc.message
        == f"Unable to open shared memory region: '{missing}' (No such file or directory)"
    )
    for key in ("", "/", "///"):
        exc = error(reg.register, "a", key, 0, 8)
        assert exc.message == f"cannot register shared memory region 'a' - invalid shm key '{key}'"
    for key in ("/a/b", "/..", "/.", "/a\0b"):
        assert "is not a POSIX shared-memory name" in error(reg.register, "a", key, 0, 8).message
    for key in (f"{RESERVED_PREFIX}_k", f"/{RESERVED_PREFIX}_k", f"///{RESERVED_PREFIX}_k"):
        assert error(reg.register, "a", key, 0, 8).message == (
            f"cannot register shared memory region 'a' with key '{key}' as the key contains "
            f"the reserved prefix '{RESERVED_PREFIX}'"
        )
    assert reg.status() == []


def test_register_bounds(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    assert f"exceeds the {SIZE} bytes of key" in error(reg.register, "a", key, 8, SIZE).message
    assert "exceeds" in error(reg.register, "a", key, SIZE, 1).message
    for offset, size in ((-1, 8), (0, 0), (0, -8), (True, 8), (0, 8.0)):
        exc = error(reg.register, "a", key, offset, size)
        assert "offset must be an integer >= 0 and byte_size an integer > 0" in exc.message
    assert "needs a non-empty name" in error(reg.register, "", key, 0, 8).message
    assert reg.status() == []
    reg.register("end", key, SIZE - 1, 1)  # the very last byte is fine
    assert bytes(reg.view("end", 0, 1, "x")) == bytes([SIZE - 1])


def test_view_bounds(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 16, 16)
    assert bytes(reg.view("a", 12, 4, "x")) == bytes([28, 29, 30, 31])
    assert len(reg.view("a", 15, 0, "x")) == 0
    for offset, size in ((-1, 4), (16, 0), (16, 1), (1 << 70, 1)):  # Triton's texts
        exc = error(reg.view, "a", offset, size, "input 'x'")
        assert exc.code is Code.INVALID_ARG
        assert exc.message.startswith("input 'x': Invalid offset for shared memory region: 'a'")
    for offset, size in ((0, -1), (0, 17), (13, 4)):
        exc = error(reg.view, "a", offset, size, "input 'x'")
        assert exc.message.startswith(
            "input 'x': Invalid offset + byte size for shared memory region: 'a'"
        )
    exc = error(reg.view, "nope", 0, 1, "input 'x'")
    assert exc.message == "input 'x': Unable to find shared memory region: 'nope'"


def test_views_are_read_only_and_zero_copy(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, handle = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 0, SIZE)
    view = reg.view("a", 0, 4, "x")
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 1  # type: ignore[index]
    shm.set_shared_memory_region(handle, [np.full(4, 200, dtype=np.uint8)])
    assert bytes(view) == bytes([200] * 4)  # a view of the mapping, not a copy
    del view


def test_write_bounds(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, handle = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 32, 16)
    reg.write("a", 4, 8, np.full(2, -1, dtype=np.int32).data, "output 'y'")
    got = shm.get_contents_as_numpy(handle, np.uint8, [SIZE]).copy()
    assert got[36:44].tolist() == [255] * 8
    assert got[32:36].tolist() == [32, 33, 34, 35] and got[44] == 44  # neighbours untouched
    # the declared window must be inside the region and the data must fit in it
    assert "Invalid offset + byte size" in error(reg.write, "a", 12, 8, b"\1" * 4, "o").message
    assert "Invalid offset for" in error(reg.write, "a", -1, 4, b"\1", "o").message
    exc = error(reg.write, "a", 0, 4, b"\1" * 5, "output 'y'")
    assert exc.message == (
        "output 'y': needs 5 bytes but shared_memory_byte_size is 4 in region 'a'"
    )
    assert (
        "Unable to find shared memory region: 'b'"
        in error(reg.write, "b", 0, 4, b"\1", "o").message
    )
    assert shm.get_contents_as_numpy(handle, np.uint8, [SIZE]).copy().tolist() == got.tolist()


def test_unregister_while_a_view_is_alive(region: tuple[str, shm.SharedMemoryRegion]) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 8, 16)
    arr = np.frombuffer(reg.view("a", 0, 16, "x"), dtype=np.uint8)  # an in-flight input
    reg.unregister("a")
    reg.unregister()
    gc.collect()
    assert arr.tolist() == list(range(8, 24))  # still mapped and readable
    assert "Unable to find shared memory region" in error(reg.view, "a", 0, 1, "x").message
    del arr
    gc.collect()  # the last view goes: the mapping is unmapped without a BufferError


def test_disabled_registry_refuses_everything(
    region: tuple[str, shm.SharedMemoryRegion],
) -> None:
    key, _ = region
    reg = SharedMemoryRegistry(enabled=False)
    calls = [
        (reg.register, "a", key, 0, 8),
        (reg.status,),
        (reg.unregister,),
        (reg.view, "a", 0, 8, "x"),
        (reg.write, "a", 0, 8, b"\0", "x"),
        (reg.check, "a", 0, 8, "x"),
    ]
    for call, *args in calls:
        exc = error(call, *args)
        assert exc.code is Code.INVALID_ARG
        assert "set 'shared_memory: system' in the server config" in exc.message


def test_a_region_in_use_outlives_its_unregister_until_the_last_request_ends(
    region: tuple[str, shm.SharedMemoryRegion],
) -> None:
    # Triton's L0_shared_memory TestSharedMemoryUnregister: unregister while requests
    # use a region lets them finish (and new ones use it) until the last is answered
    key, _ = region
    reg = SharedMemoryRegistry(enabled=True)
    reg.register("a", key, 0, 16)
    reg.register("b", key, 0, 16)
    first = reg.hold("a", "input 'x'")
    reg.unregister()
    assert [r["name"] for r in reg.status()] == ["a"]  # b went at once, a is in use
    second = reg.hold("a", "input 'x'")  # a request placed meanwhile still finds it
    reg.write("a", 0, 4, b"\1\2\3\4", "output 'y'")
    reg.release(first)
    assert reg.status("a")[0]["name"] == "a"
    reg.release(second)
    assert reg.status() == []
    exc = error(reg.status, "a")
    assert exc.code is Code.NOT_FOUND
    assert exc.message == "Unable to find system shared memory region: 'a'"
    exc = error(reg.hold, "a", "input 'x'")
    assert exc.message == "input 'x': Unable to find shared memory region: 'a'"
