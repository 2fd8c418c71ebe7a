"""A compile worker: ``python -m sparse_dsa_ops._cuda._worker`` reads a pickled list of kernel keys on stdin, builds
each into TileLang's disk cache and prints its position in the list once it is built.

:func:`sparse_dsa_ops._cuda.compile.warmup` starts several of these: TileLang's lowering holds the GIL, so threads
of one process lower one kernel at a time, while processes lower in parallel. A plain subprocess (not
``multiprocessing``) never re-imports the caller's main script.
"""

import logging
import pickle
import sys

from sparse_dsa_ops._cuda import compile as tl_compile


def main() -> int:
    logging.getLogger("tilelang").setLevel(logging.WARNING)
    keys = pickle.loads(sys.stdin.buffer.read())
    for i, key in enumerate(keys):
        tl_compile._compile(key)
        print(i, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
