"""A GGUF file holding the first N transformer layers of a model, every other tensor and key unchanged.

    python bench/truncated_gguf.py MODEL.gguf N OUT.gguf             # layers 0..N-1
    python bench/truncated_gguf.py CUT.gguf N OUT.gguf --tile L      # L layers: layer i is CUT's i % N

What it is for: a remote GPU machine that receives at most 64 MiB per call cannot receive the 94 MB
bundled SmolLM2-135M file, but it can receive the same model cut to its first N of 30 layers (with
N = 10: the 30 MB Q8_0 embedding and 10 x 2.2 MB of Q4_1 layers). The cut model keeps SmolLM2's
real weights, tokenizer, shapes and tensor types, so backend-against-backend parity (GPU vs CPU on
the same file: logits, greedy tokens, survivors) checks the same kernels on the same bytes as the
whole model; only `{arch}.block_count` changes. Its outputs are not SmolLM2's.

--tile L goes the other way, on the GPU machine: from the cut file it writes a model of L layers whose
layer i holds the cut's layer i % N, i.e. the whole model's shapes, tensor types and bytes per token
(with L = 30, SmolLM2-135M's) for speed measurements, from real blocks.
"""
from __future__ import annotations

import argparse
import re

import gguf

LAYER = re.compile(r"^blk\.(\d+)\.")


def truncate(src: str, n_layer: int, dst: str, tile: int | None = None) -> None:
    """Write dst: src's metadata and its tensors outside blk.{>= n_layer}; with tile, `tile` layers
    (block_count = tile), layer i a copy of kept layer i % n_layer."""
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    old = int(reader.get_field(count_key).contents())
    if not 1 <= n_layer <= old:
        raise SystemExit(f"{src} has {old} layers; N must be in 1..{old}, got {n_layer}")
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = (tile or n_layer) if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    kept = []        # (name written, source tensor)
    for t in reader.tensors:
        m = LAYER.match(t.name)
        if m is None:
            kept.append((t.name, t))
        elif int(m.group(1)) < n_layer:
            rest = t.name[m.end():]
            kept += [(f"blk.{il}.{rest}", t) for il in range(int(m.group(1)), tile or n_layer, n_layer)]
    kept.sort(key=lambda nt: (0, int(LAYER.match(nt[0]).group(1))) if LAYER.match(nt[0]) else (-1, 0))
    for name, t in kept:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("n_layer", type=int)
    ap.add_argument("out")
    ap.add_argument("--tile", type=int, default=None, metavar="L", help="write L layers, layer i = layer i %% N")
    a = ap.parse_args(argv)
    if a.tile is not None and a.tile < a.n_layer:
        raise SystemExit(f"--tile {a.tile} must be >= N ({a.n_layer})")
    truncate(a.model, a.n_layer, a.out, a.tile)
    print(a.out)


if __name__ == "__main__":
    main()
