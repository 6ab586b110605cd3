"""What a blob per tensor costs int8: a model's flat vector encoded and decoded in chunks,
as one blob per chunk (blocks spanning tensors, wire v6) and as one blob per tensor of a
chunk (wire v7, ``training/averaging/pieces.py``), in the same run; prints JSON.

    python benchmarks/int8_pieces.py                    # GPT-2 small's 148 tensors, ~124M values
    python benchmarks/int8_pieces.py --width 256 --layers 4
    python benchmarks/int8_pieces.py --tiny 200000     # 200,000 tensors of 3 values

The layout is a GPT-2-shaped transformer: token and position embeddings, then per layer two
LayerNorms, the attention's fused qkv and output projections and the MLP (weights and
biases), then a final LayerNorm. Chunks are the averager's default 2 MiB (524,288 values).
Timings are the best of ``--reps`` passes over the whole vector, with the averager's torch
casts, on one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's code

from protocol.codecs import get_codec
from training.averaging.casts import TORCH_CASTS
from training.averaging.pieces import RangeCodec

CHUNK = 524_288


def gpt2_sizes(width: int, layers: int, vocab: int, context: int) -> list[int]:
    d = width
    sizes = [vocab * d, context * d]
    for _ in range(layers):
        sizes += [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return [*sizes, d, d]


def measure(ranges: RangeCodec, flat: np.ndarray, reps: int) -> dict[str, float]:
    total = flat.size
    out = bytearray(
        max(ranges.encoded_size(a, min(total, a + CHUNK)) for a in range(0, total, CHUNK))
    )
    back = np.empty(CHUNK, np.float32)
    best_encode = best_decode = float("inf")
    for _ in range(reps):
        encode = decode = 0.0
        for a in range(0, total, CHUNK):
            b = min(total, a + CHUNK)
            t0 = time.perf_counter()
            size = ranges.encode_into(flat[a:b], out, a)
            t1 = time.perf_counter()
            ranges.decode_into(memoryview(out)[:size], back[: b - a], a)
            decode += time.perf_counter() - t1
            encode += t1 - t0
        best_encode, best_decode = min(best_encode, encode), min(best_decode, decode)
    wire = sum(ranges.encoded_size(a, min(total, a + CHUNK)) for a in range(0, total, CHUNK))
    return {
        "encode_s": round(best_encode, 4),
        "decode_s": round(best_decode, 4),
        "encode_gbps": round(4 * total / best_encode / 1e9, 2),
        "decode_gbps": round(4 * total / best_decode / 1e9, 2),
        "wire_bytes": wire,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--tiny", type=int, default=0, help="instead: this many tensors of 3 values each"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tiny:
        sizes = [3] * args.tiny
    else:
        sizes = gpt2_sizes(args.width, args.layers, args.vocab, args.context)
    offsets = tuple(int(x) for x in np.cumsum((0, *sizes)))
    flat = np.random.default_rng(0).standard_normal(offsets[-1]).astype(np.float32)
    codec = get_codec("int8")
    codec.casts = TORCH_CASTS
    whole = measure(RangeCodec(codec, (0, offsets[-1])), flat, args.reps)
    per_tensor = measure(RangeCodec(codec, offsets), flat, args.reps)
    report = {
        "tensors": len(sizes),
        "elements": offsets[-1],
        "chunk_elements": CHUNK,
        "one_blob_per_chunk": whole,
        "one_blob_per_tensor": per_tensor,
        "encode_ratio": round(per_tensor["encode_s"] / whole["encode_s"], 3),
        "decode_ratio": round(per_tensor["decode_s"] / whole["decode_s"], 3),
        "wire_ratio": round(per_tensor["wire_bytes"] / whole["wire_bytes"], 6),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
