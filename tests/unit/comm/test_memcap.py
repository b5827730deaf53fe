"""The out-of-memory message (``comm/memcap.py``): what failed, the process's memory, and the fix."""

from __future__ import annotations

from comm.memcap import out_of_memory_message


def test_a_bare_memory_error_says_what_it_means_and_others_are_kept_as_they_are() -> None:
    bare = out_of_memory_message("stage 0: steps 0-1: MemoryError:")
    assert bare.startswith("stage 0: steps 0-1: MemoryError: can't allocate memory (Python's allocator); ")
    assert "Fix:" in bare
    torch_said = "stage 1: step 3: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried 8 GB"
    assert out_of_memory_message(torch_said).startswith(torch_said + "; ")
    told = out_of_memory_message("stage 0: step 2: MemoryError: pinned buffer\n\nTraceback (most recent...)")
    assert told.startswith("stage 0: step 2: MemoryError: pinned buffer; ")  # its text, no traceback
