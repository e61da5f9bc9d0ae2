"""Reading a zip archive in place: whether a buffer ends with the zip directory that
describes it (nothing cut off, nothing before it), and a file object over a memoryview so
``zipfile`` parses a mapped or in-memory artifact without copying it. Split from
:mod:`kiln.artifact.container`, which reads artifacts through them."""
from __future__ import annotations

import io
import struct


def ends_with_directory(view: memoryview) -> bool:
    """The file ends with a zip end-of-central-directory record (and its comment), right
    after the central directory it describes, itself at the offset the record gives: so
    no bytes precede the archive and none of it is cut off."""
    tail = bytes(view[-(22 + 0xFFFF):])
    base = len(view) - len(tail)
    pos = tail.rfind(b"PK\x05\x06")
    while pos >= 0:
        if pos + 22 <= len(tail):
            cd_size, cd_offset, comment = struct.unpack_from("<IIH", tail, pos + 12)
            if pos + 22 + comment == len(tail):
                end = base + pos
                locator = end - 20
                if locator >= 0 and bytes(view[locator:locator + 4]) == b"PK\x06\x07":  # zip64
                    (record,) = struct.unpack_from("<Q", view, locator + 8)
                    if record + 56 > locator or bytes(view[record:record + 4]) != b"PK\x06\x06":
                        return False
                    cd_size, cd_offset = struct.unpack_from("<QQ", view, record + 40)
                    end = record
                return cd_offset + cd_size == end
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    return False


class ViewFile(io.RawIOBase):
    """A seekable read-only file over a memoryview, so zipfile parses the
    directory of a mapped or in-memory artifact without copying it."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer):
        chunk = self._view[self._pos:self._pos + len(buffer)]
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        return n
