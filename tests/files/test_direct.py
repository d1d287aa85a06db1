"""rope_export.files.direct: a file written past the page cache holds exactly the bytes given, whatever their sizes
against the alignment and the buffer; where O_DIRECT is refused (at open, or by a write) the same bytes go through
the page cache; an error leaves no padded tail behind as if the file were complete."""

from __future__ import annotations

import errno
import fcntl
import os

import numpy as np
import pytest

from rope_export.files import direct
from rope_export.files.direct import ALIGN, DirectFile, open_stream

needs_direct = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="O_DIRECT is Linux's")


def _pieces(seed: int = 0) -> list[bytes]:
    """Sizes around the alignment and the (shrunk) buffer: 0, 1, ALIGN-1, ALIGN+1, several buffers..."""
    rng = np.random.default_rng(seed)
    sizes = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 17, 5, 10 * ALIGN - 3, 2 * ALIGN]
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def _direct_file(path) -> DirectFile:
    stream = open_stream(path)
    if not isinstance(stream, DirectFile):
        stream.close()
        pytest.skip(f"the file system under {path.parent} refuses O_DIRECT")
    return stream


@needs_direct
def test_pieces_of_every_size_are_written_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "BUFFER", 4 * ALIGN)  # many full buffers, and pieces that straddle them
    pieces = _pieces()
    with _direct_file(tmp_path / "out.data") as f:
        assert f.direct and fcntl.fcntl(f._fd, fcntl.F_GETFL) & os.O_DIRECT
        for piece in pieces:
            assert f.write(piece) == len(piece)
        assert f.tell() == sum(map(len, pieces))
    assert (tmp_path / "out.data").read_bytes() == b"".join(pieces)  # the padding of the last write is cut off


@needs_direct
def test_a_files_range_is_copied_between_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "BUFFER", 4 * ALIGN)
    source = np.random.default_rng(1).integers(0, 256, 9 * ALIGN + 5, dtype=np.uint8).tobytes()
    (tmp_path / "source.bin").write_bytes(source)
    with _direct_file(tmp_path / "out.data") as f:
        f.write(b"abc")
        f.copy_range(tmp_path / "source.bin", 7, len(source) - 9)
        f.write(b"xyz")
    assert (tmp_path / "out.data").read_bytes() == b"abc" + source[7:-2] + b"xyz"


@needs_direct
def test_a_range_past_the_files_end_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"12345")
    with pytest.raises(OSError, match="short.bin ended early"), _direct_file(tmp_path / "out.data") as f:
        f.copy_range(tmp_path / "short.bin", 2, 10)


def test_a_file_system_refusing_o_direct_gets_a_plain_file(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    pieces = _pieces()
    with open_stream(tmp_path / "out.data") as f:
        assert not isinstance(f, DirectFile)
        for piece in pieces:
            f.write(piece)
    assert (tmp_path / "out.data").read_bytes() == b"".join(pieces)


def test_the_environment_can_ask_for_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROPE_EXPORT_DIRECT_IO", "0")
    with open_stream(tmp_path / "out.data") as f:
        assert not isinstance(f, DirectFile)


@needs_direct
def test_a_write_refused_midway_goes_on_through_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "BUFFER", 2 * ALIGN)
    real_pwrite, refused = os.pwrite, []

    def refuse_second_direct_write(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset > 0 and not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_second_direct_write)
    pieces = _pieces(2)
    with _direct_file(tmp_path / "out.data") as f:
        for piece in pieces:
            f.write(piece)
    assert refused and not f.direct
    assert (tmp_path / "out.data").read_bytes() == b"".join(pieces)


@needs_direct
def test_another_write_error_is_raised_and_the_file_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "BUFFER", ALIGN)
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    f = _direct_file(tmp_path / "out.data")
    with pytest.raises(OSError, match="full"), f:
        f.write(b"x" * (ALIGN + 1))
    assert f.closed


@needs_direct
def test_an_error_in_the_caller_writes_no_padded_tail(tmp_path):
    f = _direct_file(tmp_path / "out.data")
    with pytest.raises(KeyboardInterrupt), f:
        f.write(b"partial")
        raise KeyboardInterrupt
    assert f.closed and (tmp_path / "out.data").stat().st_size == 0  # the caller removes its staging folder


@needs_direct
def test_whole_aligned_blocks_are_written_from_their_own_memory_and_the_rest_gathered(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "BUFFER", 4 * ALIGN)
    block = direct.aligned_buffer(3 * ALIGN)
    block[:] = np.random.default_rng(3).integers(0, 256, block.size, dtype=np.uint8)
    with _direct_file(tmp_path / "out.data") as f:
        f.write(memoryview(block))  # aligned address, offset 0, whole blocks: straight to the file
        assert f._filled == 0 and f.tell() == 3 * ALIGN
        f.write(b"odd")
        f.write(memoryview(block))  # now at an unaligned offset: gathered into the buffer
        assert f._filled == (3 + 3 * ALIGN) % (4 * ALIGN)
        f.write(memoryview(block)[1: ALIGN + 1])  # unaligned address
    want = block.tobytes() + b"odd" + block.tobytes() + block[1: ALIGN + 1].tobytes()
    assert (tmp_path / "out.data").read_bytes() == want
