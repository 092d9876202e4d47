"""llama.cpp as a backend: a GGUF file run by llama.cpp's own library (ggml), no dense copy.

Through llama-cpp-python's low-level API (``llama_cpp.llama_cpp``, pinned in the ``peers``
extra). ``GgufModel`` is the file loaded once (weights mapped as stored, Q4_K_M blocks and
all); ``GgmlBackend`` is one llama_context over it holding every row: row r is sequence id r,
with a stream of the KV cache of its own (``context_length`` cells). A call feeds all its
rows' tokens in one ``llama_decode`` (several when they pass the context's ``n_batch``), the
output flag set only on the positions whose logits are wanted, and copies those logits once
into one float32 tensor. Rollback and reset are ``llama_memory_seq_rm``. No token trees
(``reads_trees = False``).

A row's logits are bit for bit those it gets alone, whatever its neighbours (the tests check
it on SmolLM2, Q4_1: llama.cpp's products gave each token the same bits at widths 1 to 40,
and a stream per row gives its attention the same cells). One KV cache shared by the rows
(``kv_unified``) moved a row's logits by up to 1.8 beside three others, and read the same
sequence differently in two of four rows (by 0.79), so greedy tokens flipped. The price:
llama.cpp splits a batch into ubatches of as many tokens from each row, over rows of
consecutive ids, so rows fed different counts, or of ids apart, take a forward each.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
import weakref
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from gguf import LlamaFileType
from torch import Tensor

from cactus_spec import isa
from cactus_spec.backends.lean import DEFAULT_CONTEXT
from cactus_spec.paths import cache_dir

__all__ = ["INSTALL_HINT", "GgmlBackend", "GgufModel", "available", "ggml_kernel"]

INSTALL_HINT = "pip install 'cactus-spec[peers]' (builds llama.cpp from source, ~7 minutes)"

#: Most tokens one ``llama_decode`` reads (the context's n_batch; n_ubatch is llama.cpp's).
DECODE_TOKENS = 2048


def available() -> bool:
    """Whether llama-cpp-python is installed (nothing is imported)."""
    return importlib.util.find_spec("llama_cpp") is not None


def ggml_kernel() -> str:
    """llama.cpp's build and the CPU features its kernels use (results that depend on them
    record it)."""
    lib = _library()  # first: it chooses which build the binding loads
    from llama_cpp import __version__

    features = lib.llama_print_system_info().decode().strip(" |")
    return f"llama.cpp (llama-cpp-python {__version__}), {features}"


def held_build(level: str) -> Path:
    """Where ``make ggml-LEVEL`` puts a llama.cpp build for ``level`` (``isa.ISAS``)."""
    return cache_dir() / "ggml" / level


def held_library(held: str) -> str | None:
    """The llama.cpp library a process held to level ``held`` (``isa.chosen()``, not
    ``native``) loads: the one ``LLAMA_CPP_LIB_PATH`` names, else ``make ggml-LEVEL``'s build
    where it was made; None: neither (the installed one, built for the CPU's own level)."""
    named = os.environ.get("LLAMA_CPP_LIB_PATH")
    return named or (str(held_build(held)) if held_build(held).is_dir() else None)


def build_level(system_info: str) -> str:
    """The level (``isa.ISAS``) a llama.cpp build's kernels run at, from its system info
    ("CPU : SSE3 = 1 | ... | AVX2 = 1 | AVX512 = 1 | ..."): the highest x86 level whose
    features it reports on, ``portable`` with none of them."""
    on = set(re.findall(r"([A-Z0-9_]+) = 1", system_info))
    if "AMX_INT8" in on:
        return "amx"
    if "AVX512" in on:
        return "avx512"
    return "avx2" if "AVX2" in on else "portable"


@cache
def _library() -> ModuleType:
    """llama.cpp's low-level API, its backend initialised once, its log held to errors.

    A process held to a level (``CACTUS_SPEC_ISA``) loads the build ``make ggml-LEVEL`` made
    for it, unless ``LLAMA_CPP_LIB_PATH`` names another, and refuses (ValueError, before any
    model loads) a build whose kernels run above the level: llama.cpp picks its kernels when
    it is built, so held to AVX2 it would otherwise run AVX512 ones."""
    held = isa.chosen()
    library = None if held == "native" else held_library(held)
    if library is not None:
        os.environ["LLAMA_CPP_LIB_PATH"] = library  # where the binding looks
    from llama_cpp import llama_cpp as lib

    built = build_level(lib.llama_print_system_info().decode())
    if held != "native" and isa.ISAS.index(built) < isa.ISAS.index(held):
        raise ValueError(
            f"backend ggml: CACTUS_SPEC_ISA={held}, but llama.cpp's library runs {built} "
            f"kernels; build one for {held} (make ggml-{held}, into {held_build(held)}) or "
            "point LLAMA_CPP_LIB_PATH at one"
        )
    lib.llama_log_set(_errors_only(lib), None)
    lib.llama_backend_init()
    return lib


#: GGML_LOG_LEVEL_ERROR in the pinned llama.cpp's ggml.h (the binding's own log callback
#: reads the older numbering, in which this is DEBUG and a warning is an error).
_LOG_ERROR = 4


@cache
def _errors_only(lib: ModuleType):
    """A log callback writing llama.cpp's errors to stderr (cached: llama.cpp keeps the
    pointer, so the function must live as long as the process)."""

    @lib.llama_log_callback
    def log(level: int, text: bytes, _user_data: object) -> None:
        if level == _LOG_ERROR:
            sys.stderr.write(text.decode(errors="replace"))

    return log


class GgufModel:
    """A GGUF file loaded by llama.cpp, to be run with ``threads`` CPU threads (None:
    torch's count); ``file_type`` is its quantisation type as llama.cpp's tools name it
    (Q4_K_M, Q4_1, ...). ValueError naming the file when llama.cpp cannot read it."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        lib = _library()
        handle = lib.llama_model_load_from_file(
            str(path).encode(), lib.llama_model_default_params()
        )
        if not handle:
            raise ValueError(
                f"backend ggml could not read {path}: llama.cpp lacks its architecture or "
                "the file is damaged"
            )
        self.path, self.handle = path, handle
        self.threads = threads or torch.get_num_threads()
        vocab = lib.llama_model_get_vocab(handle)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        self.max_positions = int(lib.llama_model_n_ctx_train(handle))
        eos = int(lib.llama_vocab_eos(vocab))
        self.eos_ids = frozenset([eos] if eos >= 0 else [])
        self.file_type = _file_type(int(lib.llama_model_ftype(handle)))
        weakref.finalize(self, lib.llama_model_free, handle)


def _file_type(ftype: int) -> str:
    """The name of a llama.cpp file type (``Q4_K_M`` for 15), or llama.cpp's own description
    of one the gguf package does not list; guessed or stated alike."""
    ftype &= ~LlamaFileType.GUESSED
    try:
        return LlamaFileType(ftype).name.removeprefix("MOSTLY_")
    except ValueError:  # a type newer than the gguf package
        return _library().llama_ftype_name(ftype).decode()


class GgmlBackend:
    """The Backend protocol over a ``GgufModel``: ``slots`` rows (sequence ids) of one
    llama_context, at most ``context_length`` tokens each (default ``lean.DEFAULT_CONTEXT``,
    at most the model's trained context)."""

    #: No token-tree attention here (``append_tree`` refuses).
    reads_trees = False

    def __init__(self, model: GgufModel, slots: int = 1, context_length: int | None = None):
        lib = _library()
        self.model = model
        self._size = min(model.max_positions, context_length or DEFAULT_CONTEXT)
        params = lib.llama_context_default_params()
        params.n_ctx = self._size * slots
        params.n_batch = DECODE_TOKENS
        params.n_seq_max = slots
        params.n_threads = params.n_threads_batch = model.threads
        params.kv_unified = False  # a stream per row: see the module's docstring
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED  # what auto picks on a CPU
        params.no_perf = True
        context = lib.llama_init_from_model(model.handle, params)
        if not context:
            raise ValueError(
                f"backend ggml could not make a context of {slots} rows of {self._size} tokens "
                f"over {model.path}"
            )
        self._context = context
        self._memory = lib.llama_get_memory(context)
        self._lengths = [0] * slots
        self._batch = _Batch(min(DECODE_TOKENS, int(lib.llama_n_batch(context))), slots)
        weakref.finalize(self, lib.llama_free, context)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def context_length(self) -> int:
        return self._size

    @property
    def slots(self) -> int:
        """How many rows (sequence ids) the context holds."""
        return len(self._lengths)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def length_of(self, row: int) -> int:
        """Tokens cached in ``row``."""
        return self._lengths[self._check_row(row)]

    def append(self, token_ids, keep: int = 0, row: int = 0) -> Tensor:
        """Feed tokens to one row; float32 logits [keep or T, V]."""
        ids = torch.as_tensor(token_ids).tolist()
        return self.append_ragged([ids], [row], last_only=False, keep=keep)[0]

    def append_ragged(
        self,
        token_lists: list[list[int]],
        rows: list[int],
        last_only: bool = False,
        keep: int = 0,
    ) -> list[Tensor]:
        """Feed row ``rows[i]`` the tokens ``token_lists[i]`` after its cached ones, all rows
        in one ``llama_decode`` per ``DECODE_TOKENS`` tokens; return each row's float32 logits
        [T_i, V], of its last ``keep`` tokens when keep > 0, or its last one when
        ``last_only``. A failed decode leaves every row as it was and raises RuntimeError."""
        counts = self._check_feed(token_lists, rows)
        wanted = [1 if last_only else min(keep, n) if keep else n for n in counts]
        order = sorted(range(len(rows)), key=rows.__getitem__)  # rows by id: see _layout
        try:
            logits = self._decode(*self._layout(token_lists, rows, wanted, order))  # [W, V]
        except RuntimeError:
            for row in rows:  # what earlier pieces wrote
                _library().llama_memory_seq_rm(self._memory, row, self._lengths[row], -1)
            raise
        for row, count in zip(rows, counts, strict=True):
            self._lengths[row] += count
        out: list[Tensor] = [logits] * len(rows)
        for i, part in zip(order, logits.split([wanted[i] for i in order]), strict=True):
            out[i] = part
        return out

    def _layout(
        self, token_lists: list[list[int]], rows: list[int], wanted: list[int], order: list[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The batch's tokens [N], their positions in their rows, their rows and their output
        flags (1 on each row's last ``wanted``), the rows in ``order``: by id, since llama.cpp
        puts only rows of consecutive ids in one ubatch."""
        lists = [token_lists[i] for i in order]
        counts = [len(ids) for ids in lists]
        tokens = np.fromiter((t for ids in lists for t in ids), np.int32, sum(counts))  # [N]
        seqs = np.repeat(np.asarray([rows[i] for i in order], np.int32), counts)  # [N]
        firsts = np.cumsum([0, *counts[:-1]])  # [R] where each row's tokens start in the batch
        lengths = np.asarray([self._lengths[rows[i]] for i in order])  # [R]
        positions = np.arange(len(tokens)) + np.repeat(lengths - firsts, counts)  # [N]
        outputs = np.zeros(len(tokens), np.int8)  # [N]
        for first, count, i in zip(firsts, counts, order, strict=True):
            outputs[first + count - wanted[i] : first + count] = 1
        return tokens, positions.astype(np.int32), seqs, outputs

    def _check_feed(self, token_lists: list[list[int]], rows: list[int]) -> list[int]:
        """Each list's token count; ValueError for an empty list, a row given twice or out of
        range, a token outside the vocabulary or a row fed past its context."""
        if len(set(rows)) != len(rows) or len(rows) != len(token_lists):
            raise ValueError(f"rows must be distinct, one per token list; got {rows}")
        counts = [len(ids) for ids in token_lists]
        for ids, row, count in zip(token_lists, rows, counts, strict=True):
            if count == 0:
                raise ValueError("append needs at least one token")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
            if self.length_of(row) + count > self._size:
                raise ValueError(
                    f"context overflow: {self.length_of(row)} cached + {count} new tokens "
                    f"exceed context_length {self._size}"
                )
        return counts

    def _decode(
        self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray
    ) -> Tensor:
        """Decode the tokens [N] in pieces of the batch's capacity; the logits of the flagged
        ones, in order, copied once from llama.cpp's buffer: [flagged, V]."""
        lib = _library()
        logits = torch.empty(int(outputs.sum()), self.vocab_size)  # [flagged, V]
        done = 0
        for first in range(0, len(tokens), self._batch.capacity):
            piece = slice(first, first + self._batch.capacity)
            batch = self._batch.fill(tokens[piece], positions[piece], seqs[piece], outputs[piece])
            status = lib.llama_decode(self._context, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status}")
            flagged = int(outputs[piece].sum())
            if flagged:
                pointer = lib.llama_get_logits(self._context)
                block = np.ctypeslib.as_array(pointer, shape=(flagged, self.vocab_size))
                logits[done : done + flagged] = torch.from_numpy(block)  # the one copy
                done += flagged
        return logits

    def rollback(self, length: int, row: int = 0) -> None:
        """Keep only the first ``length`` cached tokens of ``row`` (llama_memory_seq_rm)."""
        current = self.length_of(row)
        if not 0 <= length <= current:
            raise ValueError(f"rollback length must be in [0, {current}]; got {length}")
        if length < current:
            if not _library().llama_memory_seq_rm(self._memory, row, length, -1):
                raise ValueError(
                    f"backend ggml cannot roll back {self.model.path}'s cache to {length} "
                    "tokens (llama.cpp keeps whole sequences only for this architecture)"
                )
            self._lengths[row] = length

    def reset(self, row: int | None = None) -> None:
        """Empty ``row`` (default: every row)."""
        for each in range(self.slots) if row is None else [row]:
            self.rollback(0, each)

    def append_tree(
        self, token_lists: list[list[int]], parent_lists: list[list[int]], rows: list[int]
    ) -> list[Tensor]:
        """Not here: the ggml backend reads no token trees."""
        raise ValueError(_NO_TREES)

    def commit_path(self, path: list[int], row: int = 0) -> None:
        """Not here (see ``append_tree``)."""
        raise ValueError(_NO_TREES)

    def synchronize(self) -> None:
        """Nothing to wait for: ``llama_decode`` returns when its CPU work is done."""

    def _check_row(self, row: int) -> int:
        if not 0 <= row < self.slots:
            raise ValueError(f"row must be in [0, {self.slots}), got {row}")
        return row


_NO_TREES = (
    "the ggml backend does not read token trees (append_tree, commit_path); "
    "use verification chain or block"
)


class _Batch:
    """A ``llama_batch`` over arrays of ours, refilled for every decode: up to ``capacity``
    tokens, each of one of ``slots`` sequences."""

    def __init__(self, capacity: int, slots: int) -> None:
        lib = _library()
        self.capacity = capacity
        self._tokens = np.zeros(capacity, np.int32)  # [C]
        self._positions = np.zeros(capacity, np.int32)  # [C]
        self._one_seq = np.ones(capacity, np.int32)  # [C] each token in one sequence
        self._seq_ids = np.arange(slots, dtype=np.int32)  # [S] the ids the pointers point at
        base = self._seq_ids.ctypes.data
        self._row_pointers = base + 4 * np.arange(slots, dtype=np.uintp)  # [S] &seq_ids[r]
        self._seq_pointers = np.zeros(capacity, np.uintp)  # [C] each token's &seq_ids[row]
        self._outputs = np.zeros(capacity, np.int8)  # [C]
        self._struct = lib.llama_batch(
            0,
            self._tokens.ctypes.data_as(ctypes.POINTER(lib.llama_token)),
            None,
            self._positions.ctypes.data_as(ctypes.POINTER(lib.llama_pos)),
            self._one_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            self._seq_pointers.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(lib.llama_seq_id))),
            self._outputs.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def fill(
        self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, outputs: np.ndarray
    ):
        """The batch of these tokens [n] (n <= capacity), their positions, rows and flags."""
        count = len(tokens)
        self._tokens[:count] = tokens
        self._positions[:count] = positions
        self._seq_pointers[:count] = self._row_pointers[seqs]
        self._outputs[:count] = outputs
        self._struct.n_tokens = count
        return self._struct
