"""Process tuning for stage workers and orchestrators.

Large ZMQ messages are received into fresh malloc'd buffers; above glibc's mmap threshold each
one is a new mapping, and first-touch page faults (one per 4 KiB page) dominate a 64 MB
transfer. Letting malloc back those mappings with transparent huge pages cuts the faults 512x
and roughly doubles large-tensor throughput (see bench/bench_transfer.py). glibc reads tunables
only at process start, so they are set in the environment of the processes we launch.
"""

from __future__ import annotations

import os

HUGETLB_TUNABLE = "glibc.malloc.hugetlb=1"


def worker_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment additions for a launched process; an explicit GLIBC_TUNABLES wins."""
    current = (base if base is not None else os.environ).get("GLIBC_TUNABLES")
    if current is not None:
        return {}
    return {"GLIBC_TUNABLES": HUGETLB_TUNABLE}
