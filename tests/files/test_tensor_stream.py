"""rope_export.files.tensor_stream: the bytes written are onnx_ir's own serialization of each tensor,
whatever its layout (contiguous, a transposed view, torch bf16, an input file's tensor, packed
4-bit), also when a tensor spans many chunks; an error on the writer thread reaches the caller."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
import torch
from torch.onnx._internal.exporter._core import TorchTensor

from rope_export.files import tensor_stream
from rope_export.files.tensor_stream import SequentialWriter


def _tensors() -> list[ir.TensorProtocol]:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((37, 53)).astype(np.float32)
    torch_weight = torch.from_numpy(rng.standard_normal((29, 31)).astype(np.float32)).to(torch.bfloat16)
    return [
        ir.Tensor(weight),  # contiguous
        ir.Tensor(weight.T),  # what onnxscript's optimizer leaves after folding a Transpose: a strided view
        ir.Tensor(rng.standard_normal((3, 5, 7)).astype(np.float16).transpose(2, 0, 1)),
        ir.Tensor(weight[:, ::3]),  # strided inner axis
        ir.Tensor(weight.T.astype(ml_dtypes.bfloat16), dtype=ir.DataType.BFLOAT16),
        TorchTensor(torch_weight),  # bf16 straight from torch memory
        TorchTensor(torch_weight.T),  # a transposed torch view
        TorchTensor(torch.arange(24, dtype=torch.float16).reshape(4, 6)),
        ir.Tensor(np.array([1, -2, 3, -4, 5], np.int8), dtype=ir.DataType.INT4),  # packed two per byte
        ir.Tensor(np.array(3.5, np.float32)),  # 0-d
    ]


def _written(tensors) -> bytes:
    f = io.BytesIO()
    with SequentialWriter(f) as writer:
        for tensor in tensors:
            writer.write(tensor)
    return f.getvalue()


def test_each_layout_is_written_as_onnx_ir_serializes_it():
    tensors = _tensors()
    assert _written(tensors) == b"".join(t.tobytes() for t in tensors)


def test_tensors_spanning_many_chunks_keep_their_bytes_and_order(monkeypatch):
    monkeypatch.setattr(tensor_stream, "CHUNK", 64)  # rows of 37x53 fp32 views are 148-212 bytes: deeper axes too
    tensors = _tensors()
    assert _written(tensors * 3) == b"".join(t.tobytes() for t in tensors * 3)


def test_an_input_files_tensor_is_copied_file_to_file(tmp_path):
    data = np.arange(1000, dtype=np.float32)
    (tmp_path / "w.data").write_bytes(b"\0" * 16 + data.tobytes())
    external = ir.ExternalTensor("w.data", 16, data.nbytes, ir.DataType.FLOAT, shape=ir.Shape([1000]), name="w",
                                 base_dir=str(tmp_path))
    with open(tmp_path / "out", "wb") as f, SequentialWriter(f) as writer:
        writer.write(ir.Tensor(np.ones(3, np.float32)))
        writer.write(external)
        writer.write(ir.Tensor(np.zeros(2, np.float32)))
    assert (tmp_path / "out").read_bytes() == np.ones(3, np.float32).tobytes() + data.tobytes() + \
        np.zeros(2, np.float32).tobytes()


class _FullDisk(io.RawIOBase):
    def writable(self):
        return True

    def write(self, b):
        raise OSError(28, "No space left on device")


def test_an_error_on_the_writer_thread_reaches_the_caller():
    with pytest.raises(OSError, match="No space left"):
        with SequentialWriter(_FullDisk()) as writer:
            for tensor in _tensors() * 4:
                writer.write(tensor)


def test_memory_mapped_from_a_checkpoint_is_written_then_given_back_never_losing_a_change(tmp_path):
    import mmap

    import torch

    from rope_export.files import mapped

    source = tmp_path / "weights.bin"
    data = np.arange(2**20, dtype=np.float32).reshape(1024, 1024)
    data.tofile(source)
    with open(source, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped.remember(mapping, source)
    weight = torch.frombuffer(mapping, dtype=torch.float32).view(1024, 1024)
    weight[3, 5] = -1.0  # copy-on-write: the process's own page from now on
    expected = data.copy()
    expected[3, 5] = -1.0
    out = tmp_path / "out.data"
    with open(out, "wb") as f, SequentialWriter(f) as writer:
        writer.write(ir.Tensor(weight.numpy().T))  # a strided view, gathered
        writer.write(ir.Tensor(weight.numpy()))  # contiguous, written from the mapping
    written = np.fromfile(out, dtype=np.float32)
    np.testing.assert_array_equal(written[: 2**20].reshape(1024, 1024), expected.T)
    np.testing.assert_array_equal(written[2**20:].reshape(1024, 1024), expected)
    assert weight[3, 5] == -1.0 and torch.equal(weight, torch.from_numpy(expected))  # released, nothing lost
    assert not mapped.release(*mapped.extent(weight.numpy()))  # holds a changed page: kept whole
    assert not mapped.release(*mapped.extent(expected))  # not mapped from a checkpoint: left alone
    with open(source, "rb") as f:
        clean = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped.remember(clean, source)
    unchanged = torch.frombuffer(clean, dtype=torch.float32).view(1024, 1024)
    assert float(unchanged.sum()) == float(data.astype(np.float64).sum())  # every page read
    if Path(mapped._PAGEMAP).exists():
        assert mapped.release(*mapped.extent(unchanged.numpy()))  # given back: clean pages of the file
    assert torch.equal(unchanged, torch.from_numpy(data))  # and read from the file again


def test_an_unchanged_checkpoint_tensor_is_copied_or_read_from_its_file(tmp_path, monkeypatch):
    import mmap

    from rope_export.files import mapped

    source = tmp_path / "weights.bin"
    data = np.arange(3 * 2**18, dtype=np.float32)
    data.tofile(source)
    with open(source, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped.remember(mapping, source)
    whole = np.frombuffer(mapping, np.float32)
    weight = whole[1000: 1000 + 512 * 1024].reshape(512, 1024)  # mid-file, not page-aligned
    copied = []
    monkeypatch.setattr(SequentialWriter, "_external", lambda self, t, f: (copied.append(t.offset), t.tofile(f)))
    out = tmp_path / "out.data"
    with open(out, "wb") as f, SequentialWriter(f) as writer:
        writer.write(ir.Tensor(weight))  # contiguous: file to file
        writer.write(ir.Tensor(weight.T))  # strided: its range read, then gathered
        writer.write(ir.Tensor(weight[:, ::-2]))  # negative strides too
    assert copied == [4000]
    expected = np.concatenate([weight.reshape(-1), weight.T.reshape(-1), weight[:, ::-2].reshape(-1)])
    np.testing.assert_array_equal(np.fromfile(out, np.float32), expected)
    assert mapped.file_range(*mapped.extent(weight)) == (str(source), 4000)


@pytest.mark.parametrize("chunk, block", [(2**26, 2**23), (4096, 2048), (1000, 64)])
def test_transposed_matrices_of_odd_shapes_are_written_by_blocks_byte_for_byte(monkeypatch, chunk, block):
    """The blocked transpose (``_transposed_chunks``): fp16/bf16/fp8/fp32/fp64 Linear weights seen as ``W.T``,
    shapes that no chunk or block divides, chunks of one row (``CHUNK`` below a row) and blocks cut at a
    chunk's end; the bytes are numpy's own ``W.T.tobytes()``."""
    monkeypatch.setattr(tensor_stream, "CHUNK", chunk)
    monkeypatch.setattr(tensor_stream, "BLOCK", block)
    rng = np.random.default_rng(1)
    f16 = rng.standard_normal((131, 67)).astype(np.float16)
    f16[0, :3] = [np.inf, -np.nan, -0.0]  # any bit pattern goes through unchanged
    arrays = [
        f16.T,
        rng.standard_normal((64, 1031)).astype(np.float16).T,
        rng.standard_normal((1031, 64)).astype(np.float16).T,
        rng.standard_normal((97, 301)).astype(np.float32).T,
        rng.standard_normal((65, 66)).astype(np.float64).T,
        rng.integers(0, 255, (200, 77), dtype=np.uint8).T,
    ]
    assert all(tensor_stream._is_transposed_matrix(a) for a in arrays)
    tensors = [ir.Tensor(a) for a in arrays] + [
        ir.Tensor(rng.standard_normal((80, 90)).astype(ml_dtypes.bfloat16).T, dtype=ir.DataType.BFLOAT16),
        ir.Tensor(rng.standard_normal((70, 75)).astype(ml_dtypes.float8_e4m3fn).T,
                  dtype=ir.DataType.FLOAT8E4M3FN),
        TorchTensor(torch.randn(129, 257, generator=torch.Generator().manual_seed(2)).to(torch.float16).T),
        TorchTensor(torch.randn(96, 100, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).T),
    ]
    assert _written(tensors) == b"".join(t.tobytes() for t in tensors)


def test_a_read_only_transposed_view_is_written_without_a_warning():
    weight = np.arange(128 * 96, dtype=np.float16).reshape(128, 96)
    weight.flags.writeable = False  # onnxscript's folded initializers are read-only views
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _written([ir.Tensor(weight.T)]) == weight.T.tobytes()
