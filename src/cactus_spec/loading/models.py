"""Loading models: known names, local directories, GGUF files and hub ids.

A GGUF file is dequantised once into a dense bfloat16 copy in the model store
(``model_store``), keyed by
the file's sha256, so later loads take about a second; for the ggml backend it is read by
llama.cpp as it is (``gguf``), with no copy. A known name (``catalog``) loads its
cached GGUF only when it matches the pinned sha256; only a hub id reaches the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from cactus_spec import isa
from cactus_spec.backends.ggml import GgufModel
from cactus_spec.backends.quant import check_quant, quantize
from cactus_spec.core.checks import check_int
from cactus_spec.loading.catalog import REGISTRY
from cactus_spec.loading.gguf import check_ggml, read_gguf
from cactus_spec.loading.head_vocab import head_tokens, restrict_head
from cactus_spec.loading.model_store import (
    FETCH_HINT,
    ModelNotFoundError,
    ensure_dense_copy,
    file_sha256,
    verified_known_gguf,
)

__all__ = [
    "BACKENDS",
    "FETCH_HINT",
    "ModelSource",
    "as_loaded",
    "LoadedModel",
    "ModelNotFoundError",
    "VocabularyMismatchError",
    "check_device",
    "check_threads",
    "check_same_vocabulary",
    "tokenizers_differ",
    "load_model",
    "resolve_dtype",
]
#: The code that runs a loaded model (``loading.backend.make_backend``).
BACKENDS = ("auto", "lean", "hf", "ggml")
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


class VocabularyMismatchError(ValueError):
    """Target and draft models do not share a vocabulary."""


@dataclass
class LoadedModel:
    """A model ready for inference, with its tokenizer (if any) and where it came from:
    a transformers model, or a GGUF file loaded by llama.cpp for the ggml backend."""

    model: PreTrainedModel | GgufModel
    tokenizer: PreTrainedTokenizerBase | None
    identity: str  # local path or hub id
    sha256: str | None  # of the GGUF file, when loaded from one
    quant: str = "none"  # weight format of the linear layers: none, int8 or int4
    eos_ids: frozenset[int] = frozenset()  # ids that end generation
    head_tokens: torch.Tensor | None = None  # [N] the ids a truncated LM head keeps, in order

    @property
    def weight_format(self) -> str:
        """How the weights run: the GGUF's quantisation type (Q4_K_M, ...) for a model
        llama.cpp runs, else ``quant`` (none, int8 or int4)."""
        if isinstance(self.model, GgufModel):
            return self.model.file_type
        return self.quant

    @property
    def device(self) -> torch.device:
        if isinstance(self.model, GgufModel):
            return torch.device("cpu")
        return next(self.model.parameters()).device

    def transformers(self, purpose: str) -> PreTrainedModel:
        """The transformers model; ValueError saying ``purpose`` needs one, for a GGUF that
        llama.cpp runs (the ggml backend)."""
        if isinstance(self.model, GgufModel):
            raise ValueError(
                f"{purpose} needs a transformers model; {self.identity} is run by llama.cpp "
                "(backend ggml)"
            )
        return self.model


def _eos_ids(model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None) -> frozenset:
    """End-of-sequence ids from the generation config, the config, or the tokenizer."""
    found: set[int] = set()
    configs = () if model is None else (getattr(model, "generation_config", None), model.config)
    for source in (*configs, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    return frozenset(found)


def _cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX), at the level it
    is held to (``isa``)."""
    if not (isa.allows("avx512_bf16") or isa.allows("amx_bf16")):
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_verifier_quant(quant: str) -> str:
    """``quant``, or for ``auto`` the verifier format that fits this CPU at its level
    (``isa``): its dense weights where it computes in bfloat16, else int8 where the native
    kernels run (without bfloat16 arithmetic int8 decodes several times faster than float32,
    and its KL from bfloat16 is measured and reported with every result; ``docs/RESULTS.md``)."""
    if quant != "auto":
        return check_quant(quant, "verifier_quant")
    from cactus_spec.backends import native

    return "none" if _cpu_has_fast_bf16() or not native.available() else "int8"


def resolve_draft_quant(quant: str, rows: int, device: str | torch.device = "cpu") -> str:
    """``quant``, or for ``auto`` the draft format that decodes fastest where up to ``rows``
    rows are decoded at once on ``device``, at this process's level (``isa``). Any format
    keeps SpS exact and Cactus within its budget (the draft's probabilities enter Cactus's
    law, never its bound). Int4, whose one-row step reads about half of int8's bytes
    (end to end at one row 1.2-1.4x int8 on AVX512-BF16, 1.3x on AMX; a server at one
    client 1.08x; ``docs/RESULTS.md``), but int8 where AMX tiles run several rows: there
    int8's rows share each tile of weights and int4 unpacks its codes for every row (0.92x
    int8 at 8 rows). Int8 where the native kernels are not built (torch's int4 kernel
    computes in bfloat16); dense weights off the CPU, where the quantised kernels do not
    run."""
    if quant != "auto":
        return check_quant(quant, "draft_quant")
    from cactus_spec.backends import native

    if torch.device(device).type != "cpu":
        return "none"
    tiles = rows > 1 and isa.level() == "amx"
    return "int4" if native.available() and not tiles else "int8"


def resolve_dtype(
    name: str | torch.dtype | None, device: str | torch.device = "cpu", label: str = "dtype"
) -> torch.dtype:
    """Map a dtype name to a torch dtype; None or "auto" picks the fastest safe one for
    `device`. ValueError naming ``label`` for anything else."""
    if isinstance(name, torch.dtype) and name in _DTYPES.values():
        return name
    if name is None or name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    if isinstance(name, str) and name.lower() in _DTYPES:
        return _DTYPES[name.lower()]
    allowed = ", ".join([*_DTYPES, "auto"])
    raise ValueError(f"{label} must be one of {allowed}; got {name!r}")


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).exists() for name in _TOKENIZER_FILES)


def _from_pretrained(
    ref: str | Path, dtype: torch.dtype, local: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, local_files_only=local)
    if local and not _has_tokenizer(Path(ref)):
        return model, None
    return model, AutoTokenizer.from_pretrained(ref, local_files_only=local)


def _looks_like_path(source: str) -> bool:
    """Whether `source` is meant as a path, not a `name` or `org/name` hub id."""
    return source.endswith(".gguf") or source.startswith(".") or not _HUB_ID.match(source)


def _not_found(source: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {source!r} {why}; to get the default model pair, {FETCH_HINT}"
    )


def _load_source(
    source: str | Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None, str, str | None]:
    """Load from a known name, a GGUF file, a local directory or a hub id:
    (model, tokenizer, identity, sha)."""
    if isinstance(source, str) and source in REGISTRY:
        source = verified_known_gguf(source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        model, tokenizer = _from_pretrained(ensure_dense_copy(path), dtype, local=True)
        return model, tokenizer, str(path), file_sha256(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise _not_found(str(source), "is a directory without config.json")
        model, tokenizer = _from_pretrained(path, dtype, local=True)
        return model, tokenizer, str(path), None
    if path.exists():
        raise _not_found(str(source), "is neither a .gguf file nor a model directory")
    if isinstance(source, Path) or _looks_like_path(source):
        raise _not_found(str(source), "does not exist")
    try:
        model, tokenizer = _from_pretrained(source, dtype, local=False)
    except OSError as err:
        raise _not_found(source, f"could not be loaded from the Hugging Face hub ({err})") from err
    return model, tokenizer, source, None


def load_model(
    source: str | Path | PreTrainedModel,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    threads: int | None = None,
    quant: str = "none",
    head_vocab: int | None = None,
    backend: str = "auto",
) -> LoadedModel:
    """Load a model from a model object, a known name (``cactus-spec models fetch``), a local
    directory, a `.gguf` file or a hub id.

    Only a hub id reaches the network. A path that does not exist raises ModelNotFoundError;
    a damaged file raises CorruptModelError. A model object keeps its own dtype unless
    `dtype` is given. ``quant="int8"`` or ``"int4"`` turns the linear layers into quantised
    ones (``backends.quant``; the model then runs in float32 or bfloat16 around them, and a
    model object is changed in place). ``head_vocab=N`` keeps the N most frequent tokens in
    the LM head (``head_vocab``: a cheaper draft; ``head_tokens`` lists the ids its logits
    stand for). ``backend="ggml"`` loads a known name or a `.gguf` file as llama.cpp runs
    it, with no dense copy (``gguf``: no quant, head_vocab or dtype then, CPU only).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "ggml":
        return _load_ggml(source, dtype, device, threads, quant, head_vocab)
    device = check_device(device)
    if threads is not None:
        torch.set_num_threads(check_threads(threads))
    hf_logging.disable_progress_bar()  # our own progress goes to stderr; theirs is noise here
    check_quant(quant)
    if isinstance(source, PreTrainedModel):
        model, tokenizer, identity, sha = source, None, type(source).__name__, None
        if dtype is not None:  # (transformers' wrapped ``to`` loses its self in the types)
            model = model.to(dtype=resolve_dtype(dtype, device))  # type: ignore[call-arg]
    elif isinstance(source, (str, Path)):
        model, tokenizer, identity, sha = _load_source(source, resolve_dtype(dtype, device))
    else:
        raise TypeError(
            "source must be a known model name, a path, a hub id or a PreTrainedModel, "
            f"got {type(source).__name__}"
        )
    model = model.to(device).eval()  # type: ignore[arg-type]
    head = None if head_vocab is None else _truncate_head(model, tokenizer, head_vocab)
    if quant != "none":
        if device.type != "cpu":
            raise ValueError(f"quant {quant} runs on the CPU only, not on {device}")
        model = quantize(model, quant)
    eos = _eos_ids(model, tokenizer)
    return LoadedModel(model, tokenizer, identity, sha, quant, eos, head)


def _load_ggml(
    source: object,
    dtype: object,
    device: object,
    threads: int | None,
    quant: str,
    head_vocab: int | None,
) -> LoadedModel:
    """``load_model`` for the ggml backend: the GGUF file read by llama.cpp, its tokenizer."""
    check_ggml({"dtype": dtype, "device": str(device), "quant": quant, "head_vocab": head_vocab})
    if not isinstance(source, (str, Path)):
        raise TypeError(
            f"backend ggml reads a known model name or a .gguf path, got {type(source).__name__}"
        )
    threads = None if threads is None else check_threads(threads)
    model, tokenizer, identity, sha = read_gguf(source, threads)
    eos = model.eos_ids | _eos_ids(None, tokenizer)
    return LoadedModel(model, tokenizer, identity, sha, "none", eos)


def _truncate_head(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, size: int
) -> torch.Tensor:
    """Keep the ``size`` most frequent tokens in the LM head (``head_vocab``); the ids kept."""
    if tokenizer is None:
        raise ValueError("draft_vocab needs the model's tokenizer to rank its tokens")
    ids = head_tokens(tokenizer, size, _config_vocab_size(model))
    restrict_head(model, ids)
    return ids


def check_threads(threads: object) -> int:
    """``threads`` if it is an integer >= 1, else ValueError."""
    return check_int("threads", threads)


def check_device(device: object, label: str = "device") -> torch.device:
    """The torch device named ``device`` (cpu, cuda, cuda:N or mps), if this machine has it;
    ValueError naming ``label`` and the allowed values otherwise."""
    name = str(device)
    if not isinstance(device, (str, torch.device)) or not _DEVICE.match(name):
        raise ValueError(f"{label} must be cpu, cuda, cuda:N or mps, got {device!r}")
    parsed = torch.device(name)
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{label} {name!r} is not available: this torch has no CUDA device")
        if (parsed.index or 0) >= count:
            raise ValueError(f"{label} {name!r} is not available: CUDA devices are 0..{count - 1}")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{label} {name!r} is not available on this machine")
    return parsed


def _config_vocab_size(model: PreTrainedModel | GgufModel) -> int:
    if isinstance(model, GgufModel):
        return model.vocab_size
    return model.config.get_text_config().vocab_size


def tokenizers_differ(verifier: LoadedModel, draft: LoadedModel) -> bool:
    """Whether both models come with tokenizers and these map tokens to ids differently
    (the draft then drafts text: ``runtime.cross_vocab``)."""
    if verifier.tokenizer is None or draft.tokenizer is None:
        return False
    return verifier.tokenizer.get_vocab() != draft.tokenizer.get_vocab()


def check_same_vocabulary(verifier: LoadedModel, draft: LoadedModel) -> int:
    """Return the shared vocabulary size V (slice logits to `[..., :V]`), or raise.

    With both tokenizers, V is `len(tokenizer)` (embedding rows padded beyond it are fine)
    and the token-to-id maps must agree; otherwise the configs' vocab sizes must match.
    """
    if verifier.tokenizer is not None and draft.tokenizer is not None:
        sizes = (len(verifier.tokenizer), len(draft.tokenizer))
        if sizes[0] == sizes[1] and verifier.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise VocabularyMismatchError(
                f"verifier and draft tokenizers both have {sizes[0]} tokens but map them to "
                "different ids"
            )
    else:
        sizes = (_config_vocab_size(verifier.model), _config_vocab_size(draft.model))
    if sizes[0] != sizes[1]:
        raise VocabularyMismatchError(
            f"verifier and draft vocabularies differ: the verifier has {sizes[0]} tokens, "
            f"draft has {sizes[1]} (drafting across vocabularies needs both tokenizers)"
        )
    widths = (_config_vocab_size(verifier.model), _config_vocab_size(draft.model))
    if sizes[0] > min(widths):
        raise VocabularyMismatchError(
            f"the tokenizers have {sizes[0]} tokens but the models only produce "
            f"{min(widths)} logits"
        )
    return sizes[0]


#: What a model argument may be: a name, path or hub id, a loaded model, or a transformers model.
ModelSource = str | LoadedModel | PreTrainedModel


def as_loaded(
    name: str,
    source: ModelSource,
    *,
    dtype: str | torch.dtype | None = None,
    device: str = "cpu",
    threads: int | None = None,
    quant: str = "none",
    head_vocab: int | None = None,
    backend: str = "auto",
) -> LoadedModel:
    """``source`` loaded (TypeError naming ``name`` for anything else) for ``backend``;
    ``quant`` and ``head_vocab`` apply only to what is loaded here, never to a model the
    caller owns."""
    if isinstance(source, LoadedModel):
        return source
    if not isinstance(source, (str, PreTrainedModel)) and not hasattr(source, "__fspath__"):
        raise TypeError(
            f"{name} must be a model name, path, hub id, LoadedModel or PreTrainedModel, "
            f"got {type(source).__name__}"
        )
    if isinstance(source, PreTrainedModel):
        quant, head_vocab = "none", None
    return load_model(
        source,
        dtype=dtype,
        device=device,
        threads=threads,
        quant=quant,
        head_vocab=head_vocab,
        backend=backend,
    )
