"""Memory the process maps from checkpoint files, and giving its pages back once they are written.

``rope_export.checkpoints.map_safetensors`` makes parameters views of a checkpoint file mapped
copy-on-write and registers each mapping here. Once ``tensor_stream`` has written a tensor whose
memory lies in such a mapping, it calls ``release`` on that memory: ``MADV_PAGEOUT`` hands the
clean pages back (the process's RSS falls, as a plain read into freed buffers would leave it),
while a page the process modified (copy-on-write: anonymous memory now) stays as it is, so nothing
is ever lost; a later read of a released page reads the file again. Without ``MADV_PAGEOUT``
(Linux < 5.4, other systems) ``release`` does nothing. No torch here: numpy and the standard library.
"""

from __future__ import annotations

import mmap
import threading
import weakref

_ADVICE = getattr(mmap, "MADV_PAGEOUT", None)
_PAGE = mmap.PAGESIZE
_lock = threading.Lock()
_maps: list[tuple[int, int, weakref.ref]] = []  # (address, length, the mmap), by address


def register(mapping: mmap.mmap) -> None:
    """Remember ``mapping`` (an open mmap) so that ``release`` can find it by address."""
    import numpy as np

    address = np.frombuffer(mapping, np.uint8).ctypes.data if len(mapping) else 0
    with _lock:
        _maps[:] = [m for m in _maps if m[2]() is not None]
        _maps.append((address, len(mapping), weakref.ref(mapping)))


def release(address: int, length: int) -> bool:
    """Give back the whole pages of [address, address + length) that lie in a registered mapping (clean
    pages only; see the module doc). True if a mapping held them."""
    if _ADVICE is None or length <= 0:
        return False
    with _lock:
        found = [(base, size, ref()) for base, size, ref in _maps if base <= address < base + size]
    if not found or found[0][2] is None:
        return False
    base, size, mapping = found[0]
    start = -(-(address - base) // _PAGE) * _PAGE  # whole pages inside the range: a neighbour's page is kept
    end = min(address + length - base, size) // _PAGE * _PAGE
    if end > start:
        try:
            mapping.madvise(_ADVICE, start, end - start)
        except (OSError, ValueError):  # a kernel without it, or the mapping closed meanwhile
            return False
    return True


def extent(array) -> tuple[int, int]:
    """(first address, bytes spanned) of a numpy array's memory, whatever its strides."""
    address = array.__array_interface__["data"][0]
    low = high = 0
    for dim, stride in zip(array.shape, array.strides, strict=True):
        if dim == 0:
            return address, 0
        if stride < 0:
            low += (dim - 1) * stride
        else:
            high += (dim - 1) * stride
    return address + low, high - low + array.itemsize
