"""Writes the seed corpora of the fuzz targets (fuzz/*/seeds).

state_dict seeds: small dicts saved with torch.save by the PyTorch of the
interpreter that runs this script, in both kinds of input that
fuzz/state_dict_input.h describes: the file itself (NAME.pt), and its
pickle and storages as records, pickled with protocol 2 (torch.save's
default) and 4 (NAME-protocolN.records). scripts/fuzz.sh adds the files of
tests/fixtures/python to the corpus. The committed seeds were written by
Debian 12's PyTorch 1.13 (/usr/bin/python3) and by the pinned PyPI torch
2.15 (`scripts/pypi-libtorch.sh python`):

    /usr/bin/python3 fuzz/make_seeds.py state_dict fuzz/state_dict/seeds
    .deps/pytorch-2.15.0/bin/python fuzz/make_seeds.py state_dict fuzz/state_dict/seeds

entry_points seeds: the fuzz target decodes any bytes into a case, so its
seeds are pseudo-random bytes of a few lengths (no torch needed):

    python3 fuzz/make_seeds.py entry_points fuzz/entry_points/seeds
"""

import collections
import io
import os
import random
import sys
import zipfile

RECORD_SEPARATOR = b"\n--record--\n"  # kRecordSeparator in state_dict_input.h


def state_dicts(torch):
    """The dicts to save, by name: every dtype, view and value kind that a
    state_dict may hold, kept to a few hundred bytes of storage each."""
    generator = torch.Generator().manual_seed(17)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(dtype)

    base = torch.arange(12, dtype=torch.float32)
    dicts = {
        "float_dtypes": {
            "f32": randn(2, 3), "f64": randn(3, dtype=torch.float64),
            "f16": randn(4, dtype=torch.float16), "bf16": randn(2, 2, dtype=torch.bfloat16)},
        "integer_dtypes": {
            "i64": torch.arange(3), "i32": torch.arange(4, dtype=torch.int32),
            "i16": torch.arange(2, dtype=torch.int16), "i8": torch.arange(3, dtype=torch.int8),
            "u8": torch.arange(5, dtype=torch.uint8), "bool": torch.tensor([True, False])},
        "complex": {"c64": torch.complex(randn(3), randn(3)),
                    "c128": torch.complex(randn(2, dtype=torch.float64),
                                          randn(2, dtype=torch.float64))},
        "scalar_and_empty": {"scalar": torch.tensor(2.5), "empty": torch.zeros(0),
                             "empty_rows": torch.zeros(0, 3)},
        # Views share one storage: offsets, transposes, steps and stride 0.
        "views": {"whole": base, "slice": base[2:7], "matrix_t": base.view(3, 4).t(),
                  "every_other": base[::2], "expanded": base[:1].expand(4),
                  "broadcast": torch.ones(1).expand(3, 5)},
        "mixed_values": {"weight": randn(2), "step": 7, "lr": 0.125, "name": "adam",
                         "flags": [True, False, None], "pair": (1, 2.0), "nested": {"x": 1}},
    }
    mha = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    dicts["mha_packed"] = mha.state_dict()
    separate = torch.nn.MultiheadAttention(4, 2, kdim=3, vdim=2, add_bias_kv=True)
    dicts["mha_separate_bias_kv"] = separate.state_dict()
    dicts["parameters"] = collections.OrderedDict(
        weight=torch.nn.Parameter(randn(2, 2)), bias=torch.nn.Parameter(randn(2)))
    if hasattr(torch, "float8_e4m3fn"):  # PyTorch 2.x: _rebuild_tensor_v3
        dicts["dtypes_without_storage_class"] = {
            "f8": randn(3).to(torch.float8_e4m3fn), "u16": torch.arange(3).to(torch.uint16)}
    return dicts


def records_of(saved):
    """data.pkl and the storages data/0, data/1, ... of a torch.save file."""
    archive = zipfile.ZipFile(io.BytesIO(saved))
    by_name = {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}
    storages = sorted((name for name in by_name if name.startswith("data/")),
                      key=lambda name: int(name[len("data/"):]))
    assert storages == [f"data/{i}" for i in range(len(storages))], storages
    return [by_name["data.pkl"]] + [by_name[name] for name in storages]


def write_state_dict_seeds(directory):
    import torch

    version = torch.__version__.split("+")[0]
    for name, state_dict in state_dicts(torch).items():
        stem = os.path.join(directory, f"{version}-{name}")
        torch.save(state_dict, stem + ".pt")
        for protocol in (2, 4):
            buffer = io.BytesIO()
            torch.save(state_dict, buffer, pickle_protocol=protocol)
            flags = b"\x01" if protocol == 4 else b"\x00"  # 0x01: with a byteorder record
            with open(f"{stem}-protocol{protocol}.records", "wb") as file:
                file.write(flags + RECORD_SEPARATOR.join(records_of(buffer.getvalue())))


def write_entry_point_seeds(directory):
    generator = random.Random(2024)
    for index, length in enumerate([8, 16, 24, 32, 48, 64, 96, 128, 192, 256] * 3):
        with open(os.path.join(directory, f"random-{index:02d}"), "wb") as file:
            file.write(bytes(generator.randrange(256) for _ in range(length)))


def main(kind, directory):
    os.makedirs(directory, exist_ok=True)
    if kind == "state_dict":
        write_state_dict_seeds(directory)
    elif kind == "entry_points":
        write_entry_point_seeds(directory)
    else:
        sys.exit(f"unknown kind {kind!r}: expected state_dict or entry_points")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} state_dict|entry_points OUTPUT_DIR")
    main(sys.argv[1], sys.argv[2])
