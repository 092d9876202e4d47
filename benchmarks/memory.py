"""Resident memory of the default pair in one process: built, then after decoding.

    python benchmarks/memory.py --verifier-quant none
    python benchmarks/memory.py --verifier-quant int8

Builds ``SpeculativeDecoder`` on the default pair (int8 draft) with the verifier format
given, then decodes 64 tokens with Cactus(1), K = 10. Prints the resident set (anonymous
memory and file-backed pages apart) and the process's peak, from /proc (Linux).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cactus_spec import DecodeSpec, SpeculativeDecoder

PROMPT = "Write a Python function that checks whether a number is prime."


def memory_line(tag: str) -> str:
    """RSS, its anonymous and file-backed parts, and the peak RSS so far, in GB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()[0] if value.split() else ""
    gb = {key: int(fields[key]) * 1024 / 1e9 for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    return (
        f"{tag}: RSS {gb['VmRSS']:.2f} GB (anonymous {gb['RssAnon']:.2f}, "
        f"file-backed {gb['RssFile']:.2f}), peak {gb['VmHWM']:.2f} GB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier-quant", default="none", choices=["none", "int8"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    spec = DecodeSpec.of("cactus", delta=1.0, num_draft_tokens=10)
    decoder = SpeculativeDecoder(
        "qwen-coder-1.5b", "qwen-coder-0.5b", spec, verifier_quant=args.verifier_quant
    )
    print(memory_line(f"pair built, verifier {args.verifier_quant}"), flush=True)
    decoder.generate(PROMPT, 64)
    print(memory_line("after 64 new tokens"), flush=True)


if __name__ == "__main__":
    main()
