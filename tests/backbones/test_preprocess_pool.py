"""The image processor's worker processes: what they keep between images."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

_HEAP_PROBE = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "keep":
    from care_core.backbones.preprocess_pool import keep_freed_memory
    assert keep_freed_memory()
before = libc.mallinfo2().hblks
block = libc.malloc(16 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(ctypes.c_void_p(block))
print(mapped, libc.mallinfo2().fordblks >= 16 << 20)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_a_worker_heap_keeps_freed_image_buffers_for_the_next_image() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallinfo2  # noqa: B018  # glibc >= 2.33
    except (OSError, AttributeError):
        pytest.skip("no glibc mallinfo2 here")
    runs = {how: subprocess.run([sys.executable, "-c", _HEAP_PROBE, how], capture_output=True, text=True, check=True)
            for how in ("default", "keep")}  # fmt: skip
    assert runs["default"].stdout.split() == ["1", "False"]  # 16 MiB mapped apart, and returned when freed
    assert runs["keep"].stdout.split() == ["0", "True"]  # from the heap, and kept there when freed
