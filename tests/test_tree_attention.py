"""Token trees on the lean backend: every node ``append_tree`` feeds gets the logits a plain
append of its root-to-node path gives (SmolLM2-135M in float32 and on its native int8 blocks,
tiny models on native int4 and bfloat16 blocks), in a batch of rows with their own prompts and
trees fed over two calls; ``commit_path`` keeps a path exactly (its keys and values moved in
the cache); rollback and append drop a pending tree; a causal mask over the same nodes fails
the same check (negative control); bad parents and paths raise ValueError."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_lm
from test_lean import make_tiny_qwen2
from test_native_block import KINDS

from cactus_spec.backends import native
from cactus_spec.backends.hf import TransformersBackend
from cactus_spec.backends.lean import LeanBackend, LeanModel
from cactus_spec.backends.native_block import NativeBlock
from cactus_spec.backends.quant import quantize

#: Two rows' trees, each fed in two calls: (tokens, parents) per call, parents indexing the
#: row's tree nodes in feeding order (-1: after the prompt). Row 0: one root with three
#: children, depth 3; row 1: two roots. Tokens repeat across branches.
TREES = [
    [([11, 22, 33, 11], [-1, 0, 0, 0]), ([44, 22, 55, 66, 33], [1, 1, 3, 4, 6])],
    [([77, 88, 99, 77], [-1, -1, 0, 1]), ([88, 22, 99], [2, 3, 4])],
]
PROMPTS = [
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],
    [1530, 314, 253, 1345, 28, 4],
]
#: Largest |tree - chain| / max |chain| of a node's logits: float sums in another order (int8,
#: int4: which may move an activation code by one step); bf16: the cache's rounding of keys
#: computed from other rows of products.
TOLERANCE = {"float32": 1e-4, "int8": 1e-4, "int4": 1e-4, "bf16": 2e-2}


def _gap(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def _paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    """The root-to-node token path of every node of a tree."""
    paths: list[list[int]] = []
    for parent, token in zip(parents, tokens, strict=True):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths


def _chain_logits(model: LeanModel, prompt: list[int], paths: list[list[int]]) -> torch.Tensor:
    """Logits [n, V] of fresh chain appends of prompt + each path, at their last tokens (in
    one ragged forward, which gives each row its own logits: test_lean)."""
    backend = LeanBackend(model, batch=len(paths))
    logits = backend.append_ragged([prompt + path for path in paths], list(range(len(paths))), True)
    return torch.cat(logits)


def _feed_trees(backend: LeanBackend, prompts, trees) -> list[torch.Tensor]:
    """Prefill the prompts into rows 0, 1, feed the trees call by call (the second call with
    the rows in reverse order); each row's logits of all its nodes [N, V]."""
    backend.append_ragged(prompts, list(range(len(prompts))))
    out = [[] for _ in trees]
    for call in range(2):
        rows = list(range(len(trees)))[:: 1 if call == 0 else -1]
        tokens = [trees[row][call][0] for row in rows]
        parents = [trees[row][call][1] for row in rows]
        for row, logits in zip(rows, backend.append_tree(tokens, parents, rows), strict=True):
            out[row].append(logits)
    return [torch.cat(logits) for logits in out]


def _flat(tree) -> tuple[list[int], list[int]]:
    """A tree's tokens and parents over all its calls."""
    return [t for ids, _ in tree for t in ids], [p for _, ps in tree for p in ps]


def _check_tree_logits(model: LeanModel, kind: str, prompts=PROMPTS, trees=TREES) -> None:
    backend = LeanBackend(model, batch=2)
    got = _feed_trees(backend, prompts, trees)
    for prompt, tree, logits in zip(prompts, trees, got, strict=True):
        tokens, parents = _flat(tree)
        assert logits.shape == (len(tokens), model.vocab_size)
        expected = _chain_logits(model, prompt, _paths(parents, tokens))  # [N, V]
        for node in range(len(tokens)):
            assert _gap(logits[node], expected[node]) < TOLERANCE[kind]
    assert [backend.length_of(row) for row in (0, 1)] == [len(p) for p in prompts]


@pytest.fixture(scope="module")
def smollm2() -> dict[str, LeanModel]:
    """SmolLM2-135M as a float32 lean model and as int8 native blocks."""
    from cactus_spec.loading.fetch import fetch
    from cactus_spec.loading.models import load_model

    hf = load_model(fetch("smollm2-135m"), dtype="float32").model
    models = {"float32": LeanModel(hf)}
    if native.available():
        models["int8"] = LeanModel(quantize(copy.deepcopy(hf), "int8"))
        assert all(isinstance(block, NativeBlock) for block in models["int8"].blocks)
    return models


SMOLLM2_KINDS = [
    "float32",
    pytest.param("int8", marks=pytest.mark.skipif(not native.available(), reason="no native")),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", SMOLLM2_KINDS)
def test_smollm2_tree_nodes_get_their_paths_logits(smollm2, kind) -> None:
    _check_tree_logits(smollm2[kind], kind)


def _check_commit_path(model: LeanModel, kind: str, prompts=PROMPTS) -> None:
    """Commit one root-to-leaf path per row, then a plain append continues that path."""
    backend = LeanBackend(model, batch=2)
    _feed_trees(backend, prompts, TREES)
    kept = [[0, 3, 6, 8], [1, 3, 5]]  # one root-to-leaf path per row
    for row, path in enumerate(kept):
        backend.commit_path(path, row)
    lengths = [len(prompt) + len(path) for prompt, path in zip(prompts, kept, strict=True)]
    assert [backend.length_of(row) for row in (0, 1)] == lengths
    got = backend.append_ragged([[123], [456]], [0, 1])
    for row, (path, token) in enumerate(zip(kept, [123, 456], strict=True)):
        tokens, parents = _flat(TREES[row])
        kept_path = _paths(parents, tokens)[path[-1]]
        expected = _chain_logits(model, prompts[row], [kept_path + [token]])[0]
        assert _gap(got[row][0], expected) < TOLERANCE[kind]
    assert [backend.length_of(row) for row in (0, 1)] == [n + 1 for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("kind", SMOLLM2_KINDS)
def test_smollm2_commit_path_then_append_continues_the_path(smollm2, kind) -> None:
    _check_commit_path(smollm2[kind], kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_attention_and_commit_path_on_cuda() -> None:
    """The same two checks with the lean backend's torch attention on a GPU."""
    model = LeanModel(make_tiny_lm(vocab_size=512).cuda())
    prompts = [[3, 17, 42, 8, 99, 1, 5], [6, 7, 8]]
    _check_tree_logits(model, "float32", prompts)
    _check_commit_path(model, "float32", prompts)


@pytest.mark.slow
def test_smollm2_negative_control_a_causal_mask_over_the_nodes_differs(smollm2) -> None:
    """The same nodes fed as a chain (every node sees all earlier ones) miss some node's path
    logits by far more than the tolerance: the check above can fail."""
    model, prompt = smollm2["float32"], PROMPTS[0]
    tokens, parents = _flat(TREES[0])
    backend = LeanBackend(model)
    backend.append(prompt)
    chained = backend.append_ragged([tokens], [0])[0]  # [N, V]
    expected = _chain_logits(model, prompt, _paths(parents, tokens))  # [N, V]
    gaps = [_gap(chained[node], expected[node]) for node in range(len(tokens))]
    assert max(gaps) > 100 * TOLERANCE["float32"]


@pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")
@pytest.mark.parametrize("kind", KINDS)
def test_native_blocks_of_every_kind_give_tree_nodes_their_paths_logits(kind) -> None:
    model = make_tiny_qwen2()
    model = quantize(model, kind) if kind != "bf16" else model.bfloat16()
    lean = LeanModel(model)
    assert all(isinstance(block, NativeBlock) for block in lean.blocks)
    _check_tree_logits(lean, kind, [[3, 17, 42, 8, 99, 1, 5], [6, 7, 8]])


def test_a_wide_tree_takes_the_long_attention_path_with_its_mask() -> None:
    """19 nodes in one call (more than lean's matrix-product attention takes: SDPA with the
    tree mask), then one more, beside a row of 2 then 1 (in a forward of its own)."""
    generator = torch.Generator().manual_seed(0)
    parents = [-1] + [int(torch.randint(0, n, (), generator=generator)) for n in range(1, 20)]
    tokens = torch.randint(0, 128, (20,), generator=generator).tolist()
    tree = [(tokens[:19], parents[:19]), (tokens[19:], parents[19:])]
    small = [([5, 6], [-1, 0]), ([7], [0])]
    _check_tree_logits(LeanModel(make_tiny_lm()), "float32", [[3, 17, 42], [8, 99]], [tree, small])


def test_rollback_and_append_drop_a_pending_tree() -> None:
    model = LeanModel(make_tiny_lm())
    backend, prompt = LeanBackend(model), [3, 17, 42, 8, 99]
    backend.append(prompt)
    backend.append_tree([[5, 6, 7]], [[-1, 0, 0]], [0])
    backend.rollback(3)
    with pytest.raises(ValueError, match="parent must be in"):
        backend.append_tree([[9]], [[2]], [0])  # the dropped tree's node 2
    got = backend.append_tree([[9, 10]], [[-1, 0]], [0])[0]
    assert _gap(got[1], _chain_logits(model, prompt[:3], [[9, 10]])[0]) < TOLERANCE["float32"]
    backend.append([11])  # follows the prompt's first 3 tokens: the tree is gone
    assert backend.length_of(0) == 4
    got = backend.append_tree([[12, 13]], [[-1, 0]], [0])[0]
    expected = _chain_logits(model, prompt[:3] + [11], [[12, 13]])[0]
    assert _gap(got[1], expected) < TOLERANCE["float32"]
    backend.commit_path([], 0)  # drops the tree, keeps the length
    assert backend.length_of(0) == 4
    with pytest.raises(ValueError, match="path must be a chain"):
        backend.commit_path([0], 0)


def test_bad_parents_paths_and_overflow_raise() -> None:
    backend = LeanBackend(LeanModel(make_tiny_lm()), context_length=8)
    backend.append([3, 17, 42, 8, 99])
    for parents in ([-1, 1], [-2, 0], [-1, 5]):
        with pytest.raises(ValueError, match="parent must be in"):
            backend.append_tree([[5, 6]], [parents], [0])
    with pytest.raises(ValueError, match="same length"):
        backend.append_tree([[5, 6]], [[-1]], [0])
    backend.append_tree([[5, 6, 7]], [[-1, 0, -1]], [0])
    for path in ([1], [0, 2], [2, 1], [0, 1, 3], [-1]):
        with pytest.raises(ValueError, match="path must be a chain"):
            backend.commit_path(path, 0)
    with pytest.raises(ValueError, match="context overflow"):
        backend.append_tree([[8]], [[1]], [0])  # the ninth token of a cache of 8
    backend.commit_path([0, 1], 0)
    assert backend.length_of(0) == 7


def test_the_transformers_backend_says_trees_need_the_lean_backend() -> None:
    backend = TransformersBackend(make_tiny_lm())
    with pytest.raises(NotImplementedError, match="lean backend"):
        backend.append_tree([[5]], [[-1]], [0])
    with pytest.raises(NotImplementedError, match="lean backend"):
        backend.commit_path([0])
