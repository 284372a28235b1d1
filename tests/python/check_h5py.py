"""Reads a Tessera checkpoint with h5py alone and compares every dataset with the global tensor
the C++ side wrote next to it: check_h5py.py CHECKPOINT EXPECTED_DIR

EXPECTED_DIR/manifest.txt has one line per tensor: "<key> <numpy dtype> <dims separated by ,>"
and EXPECTED_DIR/<n>.bin holds line n's values, raw little-endian (bfloat16 as float32)."""
import sys

import h5py
import numpy as np


MASK = (1 << 64) - 1


def mix(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def raw_bytes(ds):
    """The dataset's bytes as stored (bfloat16 as its 16 raw bits)."""
    if ds.attrs["tessera.dtype"] == "bfloat16":
        out = np.empty(ds.shape, dtype=np.uint16)
        if out.size:
            ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=ds.id.get_type())
        return out.tobytes()
    return np.ascontiguousarray(ds[()]).tobytes()


def checksum_problems(f):
    """Recomputes every tile's sums from the documented rules (docs/checkpoint.md)."""
    table = f["_tessera/checksums"][()].astype(object)
    own = 0
    for i, t in enumerate(table):
        own = (own + mix((int(t) + 0x9E3779B97F4A7C15 * (i + 1)) & MASK)) & MASK
    problems = [] if own ^ len(table) == int(f.attrs["tessera.checksum_table"]) else ["table"]
    names = []
    f.visititems(lambda n, o: names.append(n)
                 if isinstance(o, h5py.Dataset) and not n.startswith("_tessera") else None)
    for name in names:
        ds = f[name]
        data = raw_bytes(ds)
        tile, first = int(ds.attrs["tessera.checksum_tile_bytes"]), int(ds.attrs["tessera.checksum_first"])
        for k in range(0, (len(data) + tile - 1) // tile):
            chunk = data[k * tile:(k + 1) * tile]
            chunk += b"\0" * (-len(chunk) % 4)
            w = np.frombuffer(chunk, dtype="<u4").astype(object)
            idx = np.arange(k * tile // 4, k * tile // 4 + len(w), dtype=object)
            a, b = int(w.sum()) & MASK, int((w * (2 * idx + 1)).sum()) & MASK
            if (a, b) != (int(table[first + 2 * k]), int(table[first + 2 * k + 1])):
                problems.append(f"{name} tile {k}")
    return problems


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
    with h5py.File(path, "r") as f:
        bad = checksum_problems(f)
    problems += [f"checksum recomputed from the documented rules differs: {b}" for b in bad]
    for p in problems:
        print(p)
    print(f"h5py: {seen} datasets compared, {len(listed)} in the file, {len(problems)} differ")
    return 0 if not problems and seen == len(listed) and seen > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
