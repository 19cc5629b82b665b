"""``keep_freed_memory``: message-sized buffers allocated again and again, many in flight at
once (as a socket's received messages are), stop faulting pages."""

import subprocess
import sys
import textwrap

import pytest

from kvoffload.memory.heap import keep_freed_memory

PROGRAM = textwrap.dedent(
    """
    import resource, sys
    from kvoffload.memory.heap import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    size, in_flight = (1 << 20) + 16, 16

    def burst():
        held = [bytearray(size) for _ in range(in_flight)]
        for buf in held:
            buf[::4096] = b"y" * len(range(0, size, 4096))  # write every page
        del held

    burst()  # warm up: the heap grows once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        burst()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


def test_reused_buffers_fault_no_pages_once_freed_memory_is_kept():
    if not keep_freed_memory():
        pytest.skip("the C library has no mallopt (not glibc)")
    default, kept = faults("default"), faults("keep")
    pages = 20 * 16 * (1 << 20) // 4096
    assert default > pages // 2, f"{default} faults for {pages} pages written without it"
    assert kept < pages // 20, f"{kept} faults for {pages} pages written with freed memory kept"
