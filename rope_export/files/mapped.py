"""Memory the process maps from checkpoint files, and giving its pages back once they are written.

``rope_export.hf.checkpoint_map.map_safetensors`` makes parameters views of a checkpoint file mapped
copy-on-write and remembers each mapping here. ``file_range`` tells ``tensor_stream`` where in the
file an unchanged tensor's bytes are, so it copies them from the file (or reads a strided one's range)
instead of faulting the mapped pages in one by one; a transposed matrix past ``SOURCE_LIMIT`` (lm_head)
is gathered from the mapped pages themselves, so that no buffer of its size is needed. Once
``tensor_stream`` has written a tensor whose memory lies in such a mapping, it calls ``release`` on that
memory: ``MADV_DONTNEED`` unmaps its
pages from the process (the RSS falls, as a plain read into freed buffers would leave it; the
file's pages stay in the page cache for whoever reads the checkpoint next, and a later read of a
released page maps the file's again). A page the process changed is its own copy, which
``MADV_DONTNEED`` would drop: ``release`` first reads ``/proc/self/pagemap`` and leaves a tensor
alone if any of its pages is such a copy, so nothing is ever lost. Without pagemap (not Linux)
``release`` does nothing. No torch here: numpy and the standard library.
"""

from __future__ import annotations

import mmap
import threading
import weakref

_ADVICE = getattr(mmap, "MADV_DONTNEED", None)
_PAGEMAP = "/proc/self/pagemap"
_PAGE = mmap.PAGESIZE
_lock = threading.Lock()
_maps: list[tuple[int, int, weakref.ref, str]] = []  # (address, length, the mmap, its file)


def remember(mapping: mmap.mmap, path: str) -> None:
    """Remember ``mapping`` (an open mmap of the whole file ``path``) so that ``release`` and ``file_range``
    can find it by address."""
    import numpy as np

    address = np.frombuffer(mapping, np.uint8).ctypes.data if len(mapping) else 0
    with _lock:
        _maps[:] = [m for m in _maps if m[2]() is not None]
        _maps.append((address, len(mapping), weakref.ref(mapping), str(path)))


def file_range(address: int, length: int) -> tuple[str, int] | None:
    """(file, offset) whose bytes are [address, address + length) of a remembered mapping, when no page of that
    range was changed by the process (then the file holds exactly the memory's bytes); else None."""
    if length <= 0:
        return None
    with _lock:
        found = [(base, size, path) for base, size, ref, path in _maps
                 if base <= address and address + length <= base + size and ref() is not None]
    if not found:
        return None
    base, _, path = found[0]
    first = address // _PAGE * _PAGE
    if not _only_file_pages(first, -(-(address + length - first) // _PAGE) * _PAGE):
        return None
    return path, address - base


def release(address: int, length: int) -> bool:
    """Give back the whole pages of [address, address + length) that lie in a remembered mapping (clean
    pages only; see the module doc). True if a mapping held them."""
    if _ADVICE is None or length <= 0:
        return False
    with _lock:
        found = [(base, size, ref()) for base, size, ref, _ in _maps if base <= address < base + size]
    if not found or found[0][2] is None:
        return False
    base, size, mapping = found[0]
    start = -(-(address - base) // _PAGE) * _PAGE  # whole pages inside the range: a neighbour's page is kept
    end = min(address + length - base, size) // _PAGE * _PAGE
    if end > start:
        if not _only_file_pages(base + start, end - start):
            return False  # a page of it was changed: the process's own copy, kept
        try:
            mapping.madvise(_ADVICE, start, end - start)
        except (OSError, ValueError):  # a kernel without it, or the mapping closed meanwhile
            return False
    return True


def _only_file_pages(address: int, length: int) -> bool:
    """True when no page of the range is anonymous memory (a copy-on-write copy): each page's pagemap entry
    (present bit 63, swapped bit 62, file-or-shared bit 61) says so; False when pagemap cannot be read."""
    import numpy as np

    try:
        with open(_PAGEMAP, "rb", buffering=0) as f:
            f.seek(address // _PAGE * 8)
            entries = np.frombuffer(f.read(length // _PAGE * 8), "<u8")
    except OSError:
        return False
    if entries.size != length // _PAGE:
        return False
    resident = (entries >> np.uint64(62)) != 0  # present or swapped
    return not bool(np.any(resident & ((entries >> np.uint64(61)) & np.uint64(1) == 0)))


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
