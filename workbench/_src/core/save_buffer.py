"""Keeps TensorFlow's checkpoint write buffer in malloc's arenas in a process that saves periodically.

Every SaveV2 (core/checkpoints.py writes each checkpoint with one) writes through an 8 MiB buffer
that TensorFlow allocates and fills with zeros at every save (tensor_bundle's FileOutputBuffer),
whatever the checkpoint's size. glibc serves such a block from its arenas, and reuses it, once
a block of that size has been freed (its dynamic mmap threshold). But TensorFlow pins glibc's
mmap threshold at 128 KiB the first time a process builds a GeneratorDataset op (every tf.distribute
iterator does, for its per-device generator: `ApplyPython311MemoryPatch`, by its log message a
mitigation of "memory leak in Python 3.11", as reported for from_generator in
tensorflow/tensorflow#65675), and a pinned threshold
no longer adapts: from then on each save maps 8 MiB afresh, the kernel faults in and zeroes its
2,048 pages, and unmaps them when the save ends: 6 to 12 CPU-ms per save for the digits MLP,
whose whole checkpoint is 0.3 MB (bench/bench_heal.py --no-malloc-setting shows it).

`keep_save_buffer_allocated()` sets the mmap threshold just above that buffer, and the trim
threshold to twice it (the pair glibc's dynamic rule itself would reach after one save), so the
buffer stays in the arena of the thread that writes it and is reused. Called at a run's first
periodic save, where the input pipeline exists already (TensorFlow's own setting, made once per
process, comes first and is replaced). Process-wide, on glibc only (elsewhere: a no-op). Safe
while other threads allocate as far as TensorFlow's own call is: mallopt takes the main arena's
lock, and the other arenas read the two values as they allocate.
"""

from __future__ import annotations

import ctypes

SAVE_BUFFER = 8 << 20  # bytes: tensor_bundle's write buffer (TensorFlow 2.x)
# Just above the buffer's malloc chunk (the 8 MiB plus its header), so it is not mmapped.
MMAP_THRESHOLD = SAVE_BUFFER + (64 << 10)
# A freed buffer at the top of its arena is kept, not handed back, below this much free top.
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
# glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_save_buffer_allocated() -> bool:
    """Sets glibc's mmap and trim thresholds above TensorFlow's save buffer; True when glibc took
    both (False where the C library has no mallopt or refuses, e.g. musl: saves stay correct,
    only slower)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # (the trim threshold first: with the mmap one raised and trimming at 128 KiB, a freed
    # buffer on top of its arena would be handed back at once)
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def _mallopt():
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):  # glibc's parameters only
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
