"""The out-of-memory message (``comm/memcap.py``): what failed, the process's memory, and the fix."""

from __future__ import annotations

import gc

import torch

from comm.memcap import out_of_memory_message, release_freed, status_bytes

MiB = 1 << 20


def test_a_bare_memory_error_says_what_it_means_and_others_are_kept_as_they_are() -> None:
    bare = out_of_memory_message("stage 0: steps 0-1: MemoryError:")
    assert bare.startswith("stage 0: steps 0-1: MemoryError: can't allocate memory (Python's allocator); ")
    assert "Fix:" in bare
    torch_said = "stage 1: step 3: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried 8 GB"
    assert out_of_memory_message(torch_said).startswith(torch_said + "; ")
    told = out_of_memory_message("stage 0: step 2: MemoryError: pinned buffer\n\nTraceback (most recent...)")
    assert told.startswith("stage 0: step 2: MemoryError: pinned buffer; ")  # its text, no traceback


def test_release_freed_hands_back_a_tensor_held_only_by_a_reference_cycle() -> None:
    """The mapped bytes the cap counts (``VmData``), read from the kernel: a 64 MiB tensor in a cycle stays
    mapped after its last name goes, and is unmapped by ``release_freed``."""

    class Frame:  # stands for a failed step's frame that its exception's traceback points back to
        pass

    enabled = gc.isenabled()
    gc.disable()  # no collection but the one under test
    try:
        before = status_bytes("VmData")
        held = Frame()
        held.cycle = held  # type: ignore[attr-defined]
        held.tensor = torch.ones(64 * MiB, dtype=torch.uint8)  # type: ignore[attr-defined]
        assert status_bytes("VmData") - before >= 60 * MiB
        del held
        assert status_bytes("VmData") - before >= 60 * MiB  # unreachable, still mapped
        release_freed()
        assert status_bytes("VmData") - before < 8 * MiB
    finally:
        if enabled:
            gc.enable()
