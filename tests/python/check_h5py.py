"""Reads a Tessera checkpoint with h5py alone and compares every dataset with the global tensor
the C++ side wrote next to it: check_h5py.py CHECKPOINT EXPECTED_DIR

EXPECTED_DIR/manifest.txt has one line per tensor: "<key> <numpy dtype> <dims separated by ,>"
and EXPECTED_DIR/<n>.bin holds line n's values, raw little-endian (bfloat16 as float32)."""
import sys

import h5py
import numpy as np


def main(path, expected):
    problems = []
    seen = 0
    with h5py.File(path, "r") as f, open(expected + "/manifest.txt") as m:
        for n, line in enumerate(m):
            key, dtype, dims = line.rstrip("\n").split(" ")
            shape = tuple(int(d) for d in dims.split(",")) if dims else ()
            want = np.fromfile(f"{expected}/{n}.bin", dtype=dtype).reshape(shape)
            got = f[key][()]
            seen += 1
            if got.dtype != want.dtype or got.shape != want.shape:
                problems.append(f"{key}: h5py gives {got.dtype} {got.shape}, "
                                f"expected {want.dtype} {want.shape}")
            elif not np.array_equal(got, want):
                problems.append(f"{key}: values differ")
        listed = []
        f.visititems(lambda name, obj: listed.append(name)
                     if isinstance(obj, h5py.Dataset) and not name.startswith("_tessera") else None)
    for p in problems:
        print(p)
    print(f"h5py: {seen} datasets compared, {len(listed)} in the file, {len(problems)} differ")
    return 0 if not problems and seen == len(listed) and seen > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
