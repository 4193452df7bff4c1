"""Process-wide allocator settings of the router, so memory freed after abuse goes back to the system.

Why: a refused 32 MiB body or a burst of large answers is freed by Python at once, but glibc's malloc
keeps freed heap pages for reuse, and its mmap threshold grows with every large block freed (up to
32 MiB), so later large blocks come from the heap too and are never returned. Measured here with 40
refused 40 MiB chunked bodies: RSS 44 -> 93 MB and staying there with the defaults, 44 -> 62 MB
with a fixed 64 KiB mmap threshold, and back near the baseline once free heap pages are trimmed.

Blocks of 64 KiB and more are mmapped (given back when freed), and the server's once-a-second sweep
calls :func:`trim` every few seconds to hand free heap pages back. Both are set by the router's own
entry point (``vllm-stack router``, and so the chart's image); tests do not set them. Elsewhere than
glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 64 * 1024  # bytes: larger blocks get their own mapping, unmapped when freed
TRIM_THRESHOLD = 1024 * 1024  # bytes of free space at the heap's top that malloc gives back itself
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


class Allocator:
    """glibc's malloc tuning and trimming, or nothing where the C library is another one."""

    def __init__(self) -> None:
        self._libc: ctypes.CDLL | None = None
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
                self._libc = libc
        except OSError:
            self._libc = None

    @property
    def available(self) -> bool:
        return self._libc is not None

    def configure(self) -> None:
        """Fixed thresholds (a fixed mmap threshold also stops glibc from raising it dynamically)."""
        if self._libc is None:
            return
        ok = self._libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and self._libc.mallopt(
            _M_TRIM_THRESHOLD, TRIM_THRESHOLD
        )
        if not ok:
            log.warning("mallopt refused the router's allocator settings")

    def trim(self) -> None:
        """Give free heap pages back to the system (all arenas, not only the top of the heap)."""
        if self._libc is not None:
            self._libc.malloc_trim(0)
