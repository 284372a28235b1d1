"""Cross-checks Tessera's safetensors files against Hugging Face's reference package.

    check_safetensors.py read SPEC     the package reads every file SPEC lists (Tessera wrote them)
                                       and compares each tensor bit for bit with the pattern
    check_safetensors.py write SPEC    the package writes every file SPEC lists, for Tessera to read

SPEC is JSON: {"files": [{"path": P, "metadata": {str: str} or null,
                          "tensors": {name: {"dtype": "F32", "shape": [...], "seed": s,
                                             "transposed": false}}}]}
Element i of a tensor holds the low bytes of pattern(seed, i) (BOOL: its lowest bit), the rule of
tests/common/bit_pattern.h; "transposed" means the tensor is the transpose of such a 2-D tensor of
the reversed shape. numpy has no bfloat16: BF16 tensors are compared through the package's own
parser (safetensors.deserialize, which hands out raw bytes) and written through
safetensors.serialize_file; every other dtype also goes through safetensors.numpy."""
import json
import sys

import numpy as np
import safetensors
from safetensors.numpy import load_file, save_file

MASK = (1 << 64) - 1
# dtype -> (numpy type of the values, numpy type of the same-sized bits, dtype name for TensorSpec)
DTYPES = {
    "F32": (np.float32, np.uint32, "float32"),
    "F64": (np.float64, np.uint64, "float64"),
    "F16": (np.float16, np.uint16, "float16"),
    "BF16": (None, np.uint16, "bfloat16"),
    "I64": (np.int64, np.uint64, "int64"),
    "I32": (np.int32, np.uint32, "int32"),
    "BOOL": (np.bool_, np.uint8, "bool"),
}


def pattern(seed, n):
    """pattern(seed, i) for i in [0, n): splitmix64's finalizer of seed * golden + i."""
    x = np.arange(n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & MASK)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def expected_bits(spec):
    """The tensor's elements as unsigned integers of its width, in row-major order."""
    _, bits_type, _ = DTYPES[spec["dtype"]]
    shape = tuple(spec["shape"])
    if spec.get("transposed"):
        shape = shape[::-1]
    x = pattern(spec["seed"], int(np.prod(shape, dtype=np.int64)))
    if spec["dtype"] == "BOOL":
        x &= np.uint64(1)
    bits = x.astype(bits_type).reshape(shape)
    return np.array(bits.T if spec.get("transposed") else bits, order="C")


def read(spec_path):
    with open(spec_path, encoding="utf-8") as f:
        files = json.load(f)["files"]
    problems, compared = [], 0
    for entry in files:
        path, want = entry["path"], entry["tensors"]
        with open(path, "rb") as f:
            raw = f.read()
        # The package's own parser: validation, then every tensor's bytes, BF16 included.
        parsed = {name: t for name, t in safetensors.deserialize(raw)}
        if set(parsed) != set(want):
            problems.append(f"{path}: the package sees {sorted(parsed)}, expected {sorted(want)}")
            continue
        with safetensors.safe_open(path, framework="np") as f:
            metadata = f.metadata() or {}
            # safetensors.numpy.load_file is this with every tensor; it refuses files holding
            # BF16, so those are read one tensor at a time.
            arrays = {k: f.get_tensor(k) for k in f.keys() if want[k]["dtype"] != "BF16"}
        if not any(t["dtype"] == "BF16" for t in want.values()):
            loaded = load_file(path)
            if set(loaded) != set(arrays):
                problems.append(f"{path}: load_file gives {sorted(loaded)}")
        if metadata != (entry.get("metadata") or {}):
            problems.append(f"{path}: metadata {metadata}, expected {entry.get('metadata')}")
        for name, spec in want.items():
            bits = expected_bits(spec)
            t = parsed[name]
            if t["dtype"] != spec["dtype"] or list(t["shape"]) != spec["shape"]:
                problems.append(f"{path} '{name}': the package gives {t['dtype']} {t['shape']}, "
                                f"expected {spec['dtype']} {spec['shape']}")
                continue
            if bytes(t["data"]) != bits.tobytes():
                problems.append(f"{path} '{name}': bytes differ")
            if name in arrays:
                a = arrays[name]
                value_type, bits_type, _ = DTYPES[spec["dtype"]]
                if a.dtype != np.dtype(value_type) or list(a.shape) != spec["shape"]:
                    problems.append(f"{path} '{name}': numpy gives {a.dtype} {a.shape}")
                elif not np.array_equal(a.view(bits_type), bits):
                    problems.append(f"{path} '{name}': numpy values differ")
            compared += 1
    for p in problems:
        print(p)
    print(f"safetensors {safetensors.__version__}: {compared} tensors in {len(files)} files "
          f"compared, {len(problems)} problems")
    return 0 if not problems and compared > 0 else 1


def write(spec_path):
    with open(spec_path, encoding="utf-8") as f:
        files = json.load(f)["files"]
    for entry in files:
        arrays = {}
        for name, spec in entry["tensors"].items():
            assert not spec.get("transposed"), "numpy writes only contiguous arrays"
            value_type, _, _ = DTYPES[spec["dtype"]]
            bits = expected_bits(spec)
            arrays[name] = bits if value_type is None else bits.view(value_type)
        if all(DTYPES[s["dtype"]][0] is not None for s in entry["tensors"].values()):
            save_file(arrays, entry["path"], metadata=entry.get("metadata"))
            continue
        # BF16 has no numpy type: the package's raw interface takes the bytes and a dtype name.
        specs = {}
        for name, a in arrays.items():
            # `arrays` keeps the memory alive while the package reads it through data_ptr.
            specs[name] = safetensors.TensorSpec(dtype=DTYPES[entry["tensors"][name]["dtype"]][2],
                                                 shape=list(a.shape), data_ptr=a.ctypes.data,
                                                 data_len=a.nbytes)
        safetensors.serialize_file(specs, entry["path"], metadata=entry.get("metadata"))
    print(f"safetensors {safetensors.__version__}: wrote {len(files)} files")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("read", "write"):
        sys.exit(__doc__)
    sys.exit(read(sys.argv[2]) if sys.argv[1] == "read" else write(sys.argv[2]))
