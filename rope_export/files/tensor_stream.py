"""Tensors to one file at the disk's speed: large sequential writes, no copy of a whole tensor.

The exporter's weights are of three kinds: torch tensors (``TorchTensor``), numpy arrays that
onnxscript's optimizer made by folding a ``Transpose`` into its initializer (a *strided view* of
the torch weight, not a copy), and tensors of an input file (``ExternalTensor``). numpy's
``tofile`` on a strided view calls ``fwrite`` once per element (minutes for a 1B model), so:

* a C-contiguous tensor is written straight from its memory (a ``memoryview``, no copy);
* a strided one is gathered ``CHUNK`` bytes at a time (whole leading-axis slices) into one of three
  reused buffers (torch's strided copy), so memory grows by three chunks whatever the tensor's size;
  a transposed matrix (``W.T`` of a Linear weight: most of a model's bytes) goes through torch's
  cache-blocked transpose, a ``BLOCK`` of ``W``'s columns at a time (``_transposed_chunks``);
* an input file's tensor is copied file to file (``copy_file_range`` by onnx_ir, or read straight into
  ``DirectFile``'s buffer);
* a tensor whose memory is mapped from a checkpoint (``rope_export.files.mapped``) gives its pages back
  once written, so the process holds about one tensor of it at a time, not the whole model.

The file is best a ``rope_export.files.direct.DirectFile`` (``open_stream``): past the page cache (the
1B fp32 export's 4.94 GB in 4.1 s instead of 9.3 s here). The writes run on a thread of their own
while the next chunk is gathered (both release the GIL).
An error on that thread is raised in the caller's; on any exception (KeyboardInterrupt included)
the thread is stopped and joined before the exception goes on, so the caller's cleanup (the staging
folder of ``onnx_files.write``) never races a write.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx_ir as ir

from rope_export.common.fileio import read_range
from rope_export.files.direct import DirectFile, aligned_buffer
from rope_export.files.mapped import extent, file_range, release

CHUNK = 64 * 2**20  # bytes per write: large enough for the disk, small enough to keep two in memory
SOURCE_LIMIT = 256 * 2**20  # a transposed checkpoint matrix up to this is read into a buffer, not faulted in
_PACKED = {ir.DataType.INT4, ir.DataType.UINT4, ir.DataType.FLOAT4E2M1, ir.DataType.INT2, ir.DataType.UINT2,
           ir.DataType.FLOAT6E2M3, ir.DataType.FLOAT6E3M2}  # fewer bits than a byte: onnx_ir packs them


def _torch_array(raw) -> np.ndarray | None:
    """The torch tensor's memory as a numpy array of bytes-compatible items (no copy), or None."""
    import torch

    if raw.device.type != "cpu" or getattr(raw, "is_sparse", False) or raw.is_quantized:
        return None
    try:
        raw = raw.detach()
        if raw.dtype == torch.bfloat16 or raw.dtype.is_floating_point and raw.element_size() == 1:
            raw = raw.view({2: torch.uint16, 1: torch.uint8}[raw.element_size()])  # numpy has no bf16/fp8
        return raw.numpy()
    except (TypeError, RuntimeError):  # dtypes numpy cannot view (complex32, packed types...)
        return None


def _array_of(tensor: ir.TensorProtocol) -> np.ndarray | None:
    """An array whose C-order bytes are the tensor's serialized bytes, or None (then ``tobytes``)."""
    if sys.byteorder != "little" or tensor.dtype in _PACKED or isinstance(tensor, ir.ExternalTensor):
        return None
    raw = getattr(tensor, "raw", None)
    if isinstance(raw, np.ndarray):
        array = raw
    elif type(raw).__module__.startswith("torch") and hasattr(raw, "detach"):
        array = _torch_array(raw)
    else:
        return None
    if array is None or array.nbytes != tensor.nbytes or array.dtype.byteorder == ">":
        return None
    return array


def chunks(array: np.ndarray, buffers: Iterator[np.ndarray],
           scratch: list[np.ndarray] | None = None) -> Iterator[memoryview]:
    """C-order bytes of ``array`` in pieces of about ``CHUNK`` bytes.

    Contiguous: views of its memory. Strided: whole leading-axis slices copied into the next buffer
    of ``buffers`` (the caller must not need a buffer again until its bytes are written); a transposed matrix
    through the buffer ``scratch`` holds (``_transposed_chunks``; replaced there when too small)."""
    if array.flags.c_contiguous:
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        for start in range(0, flat.size, CHUNK):
            yield memoryview(flat[start: start + CHUNK])
        return
    if _is_transposed_matrix(array) and array[0].nbytes <= CHUNK:
        yield from _transposed_chunks(array, buffers, scratch)
        return
    if array.ndim == 1:
        array = array.reshape(-1, 1)
    row = max(array[0].nbytes, 1)
    if row > CHUNK:  # one slice is already past a chunk: go one axis deeper
        for sub in array:
            yield from chunks(sub, buffers, scratch)
        return
    step = CHUNK // row
    for start in range(0, array.shape[0], step):
        part = array[start: start + step]
        buffer = next(buffers)[: part.nbytes].view(array.dtype).reshape(part.shape)
        _gather(buffer, part)
        yield memoryview(buffer.reshape(-1).view(np.uint8))


_SAME_SIZE_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
BLOCK = 8 * 2**20  # bytes of a transposed matrix's source columns gathered at a time (stays in cache)


def _is_transposed_matrix(array: np.ndarray) -> bool:
    """``array`` is ``W.T`` of a C-contiguous matrix ``W`` (a Linear weight onnxscript folded a Transpose into),
    large enough for torch's blocked transpose (it takes matrices of 3600 items or more)."""
    return (array.ndim == 2 and array.T.flags.c_contiguous and min(array.shape) >= 64
            and array.dtype.itemsize in _SAME_SIZE_INT)


def _transposed_chunks(array: np.ndarray, buffers: Iterator[np.ndarray],
                       scratch: list[np.ndarray] | None) -> Iterator[memoryview]:
    """Rows of ``array`` = ``W.T`` in pieces of about ``CHUNK`` bytes, made by torch's cache-blocked transpose
    (``copy_`` from a whole transposed contiguous matrix: 60x60 tiles), not by its element-wise strided copy,
    which re-reads each cache line of ``W`` once per output row (fp16 4096x14336: 0.3 GB/s against 1.5 GB/s
    here). That fast path takes only a whole matrix, so ``BLOCK`` bytes of ``W``'s columns are first copied
    into the buffer ``scratch`` holds (a contiguous matrix; each of its rows is a memcpy; the list keeps it
    for the next tensor), which is then transposed into the chunk. Items are copied as same-size ints (bytes
    unchanged, bf16 and fp8 included)."""
    import torch

    rows, cols = array.shape  # W is cols x rows
    with warnings.catch_warnings():  # a read-only view (onnxscript's folded initializers): only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(array.T.view(_SAME_SIZE_INT[array.dtype.itemsize]))
    row = cols * array.itemsize
    block = max(BLOCK // row, 64)
    scratch = [] if scratch is None else scratch
    if not scratch or scratch[0].nbytes < block * row:
        scratch[:] = [np.empty(block * row, np.uint8)]
    gathered = torch.from_numpy(scratch[0]).view(source.dtype)
    step = max(CHUNK // row, 1)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        buffer = next(buffers)[: (stop - start) * row]
        out = torch.from_numpy(buffer).view(source.dtype).view(stop - start, cols)
        for first in range(start, stop, block):
            last = min(first + block, stop)
            part = gathered[: (last - first) * cols].view(cols, last - first)
            part.copy_(source[:, first:last])
            out[first - start: last - start].copy_(part.t())
        yield memoryview(buffer)


def _gather(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for a strided ``src``: torch's strided copy is ~10x numpy's on a transposed
    fp32 weight (measured 3.4 GB/s against 0.34 GB/s; ``_transposed_chunks`` does better on
    matrices); items are copied as same-size ints (bytes unchanged, any dtype, bf16 included). numpy
    where torch cannot view the array (negative strides)."""
    kind = _SAME_SIZE_INT.get(src.dtype.itemsize)
    if kind is not None and all(stride >= 0 for stride in src.strides):
        import torch

        torch.from_numpy(dst.view(kind)).copy_(torch.from_numpy(src.view(kind)))
        return
    np.copyto(dst, src)


def contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` itself when C-contiguous, else a C-contiguous copy made by ``_gather``."""
    if array.flags.c_contiguous:
        return array
    out = np.empty(array.shape, array.dtype)
    with warnings.catch_warnings():  # a read-only view (onnxscript's folded initializers): only read here
        warnings.simplefilter("ignore", UserWarning)
        _gather(out, array)
    return out


class SequentialWriter:
    """Write tensors one after another to an open binary file, from a thread of its own.

    While it is open torch runs its copies on one thread: its second intra-op thread only competed with
    the writer thread for two cores and spun between copies (8B-shaped fp16 weights, 830 MB: 1.4 s of user
    CPU and 2.8 s wall with two, 0.5 s and 1.3-1.6 s with one, load about 4).

    Use as a context manager; ``write(tensor)`` queues its bytes, ``__exit__`` waits for them.
    ``written`` is the number of bytes handed to the file so far (for progress lines)."""

    def __init__(self, file):
        self.file, self.written, self.error = file, 0, None
        self._queue: queue.Queue = queue.Queue(maxsize=1)  # with the one being written: two chunks in flight
        self._cycle = None
        self._torch_threads: int | None = None  # torch's intra-op threads before __enter__, restored at exit
        self._source: np.ndarray | None = None  # a checkpoint range read for a strided tensor (_read_view)
        self._scratch: list[np.ndarray] = []  # the columns of a transposed matrix (_transposed_chunks)
        self._thread = threading.Thread(target=self._run, name="rope-export-writer", daemon=True)

    def __enter__(self):
        torch = sys.modules.get("torch")  # imported by whoever made the tensors, if any
        if torch is not None:  # one intra-op thread while writing (see the class doc)
            self._torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self._put(None)
            self._thread.join()
        finally:
            if self._torch_threads is not None:
                sys.modules["torch"].set_num_threads(self._torch_threads)
        if exc_type is None and self.error is not None:
            raise self.error
        return False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain: the caller raises the error at its next write or at exit
            try:
                if callable(item):
                    item(self.file)
                else:
                    self.file.write(item)
                    self.written += len(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self.error = exc

    def _put(self, item) -> None:
        while True:
            if self.error is not None and item is not None:
                raise self.error
            try:
                self._queue.put(item, timeout=0.1)  # a timeout, so that a signal can interrupt the wait
                return
            except queue.Full:
                if not self._thread.is_alive():
                    return

    def _buffers(self) -> Iterator[np.ndarray]:
        """Three buffers in turn, across tensors: one being filled, one queued, one being written."""
        if self._cycle is None:
            self._cycle = itertools.cycle([aligned_buffer(CHUNK) for _ in range(3)])  # DirectFile writes them as is
        return self._cycle

    def write(self, tensor: ir.TensorProtocol) -> None:
        array = _array_of(tensor)
        if array is None:
            if isinstance(tensor, ir.ExternalTensor):  # file to file, on the writer thread (keeps the order)
                self._put(lambda f, t=tensor: self._external(t, f))
            else:
                self._put(tensor.tobytes())
            return
        address, length = extent(array)
        source = file_range(address, length) if length <= max(array.nbytes, SOURCE_LIMIT) else None
        if source is not None and array.flags.c_contiguous:  # the checkpoint's own bytes: file to file
            path, offset = source
            whole = ir.ExternalTensor(Path(path).name, offset, length, ir.DataType.UINT8, shape=ir.Shape([length]),
                                      name="", base_dir=str(Path(path).parent))
            self._put(lambda f, t=whole: self._external(t, f))
            return
        # read the checkpoint's range into a buffer, not its mapped pages one by one; a transposed matrix past
        # SOURCE_LIMIT (lm_head) is gathered from the mapping instead, so the buffer stays small
        mapped_gather = _is_transposed_matrix(array) and length > SOURCE_LIMIT
        if source is not None and not mapped_gather:
            array = self._read_view(array, source, address, length)
        for piece in chunks(array, self._buffers(), self._scratch):
            self._put(piece)
        if source is None or mapped_gather:  # memory mapped from a checkpoint: its pages go back once written
            self._put(lambda f: release(address, length))

    def _read_view(self, array: np.ndarray, source: tuple[str, int], address: int, length: int) -> np.ndarray:
        """``array`` over a copy of its memory read from the file (the buffer is reused: the caller gathers
        from it before the next tensor)."""
        if self._source is None or self._source.size < length:
            self._source = np.empty(length, np.uint8)
        view = memoryview(self._source)[:length]
        path, offset = source
        with open(path, "rb", buffering=0) as f:
            if read_range(f.fileno(), offset, view) < length:
                raise OSError(f"{path} ended early while reading a tensor's bytes")
        return np.ndarray(array.shape, array.dtype, buffer=self._source,
                          offset=array.__array_interface__["data"][0] - address, strides=array.strides)

    def _external(self, tensor: ir.ExternalTensor, f) -> None:
        if isinstance(f, DirectFile):  # read straight into its aligned buffer
            f.copy_range(tensor.path, tensor.offset or 0, tensor.nbytes)
        else:  # onnx_ir: copy_file_range where it can
            tensor.tofile(f)
        self.written += tensor.nbytes
