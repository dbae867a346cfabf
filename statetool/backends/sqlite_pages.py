"""The pages of a SQLite file read as bytes: its page digest, a copy made in one pass over
them, and where two files first differ (decisions.md, "Relocation and transfer").

Driver-free: a state frozen by the write lock (every committed row in the main file, no
writer able to add one) is its file's bytes, so a move copies those bytes itself, in big
aligned blocks, instead of going through the online backup API page by page. Each block
read is written to the copy and hashed as it is (the hash in a second thread: hashlib
releases the GIL, so hashing overlaps the reads and writes), so the source is read once
and its digest is the digest of the bytes the copy was given.

The page digest is sha256 over the database's pages with the header fields a backup
rewrites zeroed (the change counter, bytes 24-27, its copy at 92-95, and the schema
cookie, 40-43): a copy by these bytes or by the backup API has the digest of its source.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from statetool.backends.base import Progress
from statetool.backends.sqlite_file import page_size_of
from statetool.errors import StateError

#: Bytes read (and written) at once: a multiple of every page size up to 4 MiB.
BLOCK_BYTES = 4 << 20
#: Pages between two progress reports: the steps the online backup API was driven in, so a
#: copy reports the same ``done`` counts (the crash tests' ``copy-page-<n>`` points).
PAGES_PER_STEP = 4096
#: Blocks in flight between the reader and the hashing thread (memory: this many blocks).
_BUFFERS = 4
#: The header fields a backup rewrites (change counter, schema cookie, version-valid-for).
_REWRITTEN = ((24, 28), (40, 44), (92, 96))


def _extent(header: bytes, size: int) -> int:
    """The database's bytes in a file of ``size`` bytes with this 100-byte ``header``: its
    page count times its page size while that count is valid (bytes 24-27 equal 92-95, as
    every SQLite since 3.7.0 writes), else the file's whole pages."""
    page_size = page_size_of(header)
    pages = int.from_bytes(header[28:32], "big")
    if pages and header[24:28] == header[92:96]:
        return pages * page_size
    return size - size % page_size


def _hashed_header(block: memoryview | bytes) -> bytes:
    """The first 100 bytes of ``block`` (the file's header) as the digest sees them."""
    header = bytearray(block[:100])
    for start, end in _REWRITTEN:
        header[start:end] = b"\0" * (end - start)
    return bytes(header)


def _read_full(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` (a regular file may answer a read short);
    returns the bytes read, fewer only at the end of the file."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _blocks(fd: int, path: Path) -> Iterator[tuple[memoryview, int, int, int]]:
    """The database's bytes in the open file ``fd`` (at ``path``) as ``(block, offset, page
    size, pages in all)``, read in aligned blocks of at most :data:`BLOCK_BYTES` (never more
    than :data:`PAGES_PER_STEP` pages) into :data:`_BUFFERS` buffers used in turn: a block
    stays valid until ``_BUFFERS - 1`` more have been read. Raises ``RIVET_STATE_CORRUPT``
    when the file ends before its header says."""
    header = os.pread(fd, 100, 0)
    page_size = page_size_of(header)
    extent = _extent(header, os.fstat(fd).st_size)
    block = page_size * min(PAGES_PER_STEP, max(1, BLOCK_BYTES // page_size))
    buffers = [memoryview(bytearray(min(block, extent))) for _ in range(_BUFFERS)]
    offset = 0
    while offset < extent:
        view = buffers[(offset // block) % _BUFFERS][:min(block, extent - offset)]
        if _read_full(fd, view, offset) < len(view):
            raise StateError("RIVET_STATE_CORRUPT", f"{path} ends before the {extent} bytes its header gives; "
                             "nothing was changed", {"path": str(path)})
        yield view, offset, page_size, extent // page_size
        offset += len(view)


def _hash_block(digest: hashlib._Hash, view: memoryview, offset: int) -> None:
    """Add the block at ``offset`` to the page digest (the header as the digest sees it)."""
    if offset == 0:
        digest.update(_hashed_header(view))
        view = view[100:]
    digest.update(view)


def content_digest(path: Path) -> str:
    """The page digest (sha256, hex; module docstring) of the SQLite file at ``path``, read
    once in big blocks. Raises ``RIVET_STATE_CORRUPT`` (shorter than its header says)."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        for view, offset, _page_size, _pages in _blocks(fh.fileno(), path):
            _hash_block(digest, view, offset)
    return digest.hexdigest()


def copy_digested(source: Path, copy: int, progress: Progress) -> str:
    """Copy the database's pages from the file ``source`` (frozen: nobody writes it
    meanwhile) to the open, empty file ``copy`` in one pass over them, and return their
    page digest (sha256, hex), computed from the very bytes written, in a second thread
    while the next block is read. ``progress(pages done, pages)`` after every
    :data:`PAGES_PER_STEP` pages and at the end. Nothing is fsynced. Raises
    ``RIVET_STATE_CORRUPT`` (the source is shorter than its header says) and the
    ``OSError`` of a write (a full disk)."""
    digest = hashlib.sha256()
    hashing: list[Future[None]] = []
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="page-digest") as hasher:
            for view, offset, page_size, pages in _blocks(fd, source):
                hashing.append(hasher.submit(_hash_block, digest, view, offset))
                written = 0
                while written < len(view):
                    written += os.pwrite(copy, view[written:], offset + written)
                if len(hashing) == _BUFFERS:  # the next block is read into the oldest one's buffer
                    hashing.pop(0).result()
                done = (offset + len(view)) // page_size
                if done % PAGES_PER_STEP == 0 or done == pages:
                    progress(done, pages)
            for pending in hashing:
                pending.result()
    finally:
        os.close(fd)
    return digest.hexdigest()


def first_difference(a: Path, b: Path) -> int | None:
    """The number (1-based) of the first page (of ``a``'s page size) at which the files
    ``a`` and ``b`` differ, the header fields the digest zeroes aside, or None when they
    do not. A second read of both: only for the message of a copy that failed to verify."""
    with open(a, "rb", buffering=BLOCK_BYTES) as fa, open(b, "rb", buffering=BLOCK_BYTES) as fb:
        page_size = page_size_of(fa.read(100))
        fa.seek(0)
        page = 1
        while True:
            mine, theirs = fa.read(page_size), fb.read(page_size)
            if page == 1:
                mine, theirs = _hashed_header(mine) + mine[100:], _hashed_header(theirs) + theirs[100:]
            if mine != theirs:
                return page
            if not mine:
                return None
            page += 1
