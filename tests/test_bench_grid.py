"""Grids from the command line and from files; bad methods, parameters and values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cactus_spec.bench.grid import (
    DEFAULT_ENTRIES,
    Config,
    expand,
    load_grid_file,
    make_config,
    parse_entry,
    parse_list,
)
from cactus_spec.core.methods import DEFAULT_NUM_DRAFT_TOKENS
from cactus_spec.core.rules import Cactus


def ids(configs: tuple[Config, ...]) -> list[str]:
    return [c.id for c in configs]


def test_cli_entries_expand_to_the_product() -> None:
    entries = [parse_entry("ar"), parse_entry("cactus:delta=0.5,1:exact=false,true")]
    grid = expand(entries, parse_list("4,6"), parse_list("model"))
    assert ids(grid) == ["ar"] + [
        f"cactus(delta={d},exact={e})/K{k}/model"
        for d in ("0.5", "1.0")
        for e in ("false", "true")
        for k in (4, 6)
    ]
    assert grid[-1].spec.rule == Cactus(1.0, exact=True)
    assert grid[0].num_draft_tokens == 0 and grid[0].drafter is None


def test_block_verification_expands_and_marks_ids() -> None:
    grid = expand([parse_entry("sps:verification=chain,block")], [6])
    assert ids(grid) == ["sps/K6/model", "sps/K6/model/block"]
    assert grid[1].spec.verification == "block" and grid[1].label == "sps K6 block"
    assert Config.from_dict(grid[1].as_dict()) == grid[1]
    assert expand([parse_entry("cactus:verification=block")], [6])[0].spec.verification == "block"
    with pytest.raises(ValueError, match="takes a method with a target per position"):
        expand([parse_entry("tas:verification=block")], [6])
    with pytest.raises(ValueError, match="peer: verification does not apply"):
        expand([parse_entry("hf_assisted:verification=block")], [6])
    with pytest.raises(ValueError, match="drafts nothing"):
        expand([parse_entry("ar:verification=block")], [6])


def test_draft_trees_expand_with_their_widths_and_mark_ids() -> None:
    grid = expand([parse_entry("sps:verification=chain,tree:branches=2,4")], [6])
    assert ids(grid) == ["sps/K6/model", "sps/K6/model/tree2", "sps/K6/model/tree4"]
    assert grid[2].spec.branches == 4 and grid[2].label == "sps K6 tree4"
    assert Config.from_dict(grid[2].as_dict()) == grid[2]
    assert "branches" not in grid[0].as_dict()  # chains record what they recorded before
    default = expand([parse_entry("cactus:verification=tree")], [6])[0]
    assert default.id.endswith("/tree2") and default.spec.branches == 2
    leaf_to_root = expand([parse_entry("sps:verification=traversal:branches=1,3")], [6])
    assert ids(leaf_to_root) == ["sps/K6/model/traversal1", "sps/K6/model/traversal3"]
    assert leaf_to_root[1].spec.trees and leaf_to_root[1].label == "sps K6 traversal3"
    with pytest.raises(ValueError, match="branches applies to verification tree or traversal"):
        expand([parse_entry("sps:verification=block:branches=2")], [6])
    with pytest.raises(ValueError, match="peer: branches does not apply"):
        make_config("hf_assisted", {}, branches=2)
    with pytest.raises(ValueError, match="branches must be an integer >= 1"):
        expand([parse_entry("sps:verification=tree:branches=0")], [6])


def test_another_draft_model_expands_and_marks_ids() -> None:
    grid = expand([parse_entry("sps:draft=smollm2-135m"), parse_entry("sps")], [6])
    assert ids(grid) == ["sps/K6/model=smollm2-135m", "sps/K6/model"]
    assert grid[0].draft == "smollm2-135m" and grid[1].draft is None
    assert grid[0].label == "sps K6 draft=smollm2-135m"
    assert Config.from_dict(grid[0].as_dict()) == grid[0]
    assert "draft" not in grid[1].as_dict()  # a run recorded before draft models keeps its id
    with pytest.raises(ValueError, match="peer: draft does not apply"):
        expand([parse_entry("hf_assisted:draft=smollm2-135m")], [6])
    with pytest.raises(ValueError, match="draft applies to the model drafter, not ngram"):
        expand([parse_entry("sps:drafter=ngram:draft=smollm2-135m")], [6])
    with pytest.raises(ValueError, match="drafts nothing"):
        expand([parse_entry("ar:draft=smollm2-135m")], [6])


def test_a_cut_draft_head_expands_and_marks_ids() -> None:
    entries = ["sps:draft_vocab=32768", "sps:draft=smollm2-135m:draft_vocab=1000", "sps"]
    grid = expand([parse_entry(e) for e in entries], [6])
    assert ids(grid) == [
        "sps/K6/model/vocab32768",
        "sps/K6/model=smollm2-135m/vocab1000",
        "sps/K6/model",
    ]
    assert [c.draft_key for c in grid] == ["--draft vocab=32768", "smollm2-135m vocab=1000", None]
    assert grid[0].label == "sps K6 vocab=32768" and grid[0].spec == grid[2].spec
    assert Config.from_dict(grid[1].as_dict()) == grid[1]
    assert "draft_vocab" not in grid[2].as_dict()  # a run recorded before cut heads keeps its id
    with pytest.raises(ValueError, match="peer: draft_vocab does not apply"):
        expand([parse_entry("hf_assisted:draft_vocab=5")], [6])
    with pytest.raises(ValueError, match="draft_vocab applies to the model drafter, not ngram"):
        expand([parse_entry("sps:drafter=ngram:draft_vocab=5")], [6])
    with pytest.raises(ValueError, match="draft_vocab must be an integer >= 1, got 0"):
        expand([parse_entry("sps:draft_vocab=0")], [6])
    with pytest.raises(ValueError, match="draft_vocab must be an integer, got 'x'"):
        expand([parse_entry("sps:draft_vocab=x")], [6])
    with pytest.raises(ValueError, match="drafts nothing"):
        expand([parse_entry("ar:draft_vocab=5")], [6])


def test_a_grids_draft_weights_expand_and_mark_ids() -> None:
    """``draft_quant`` names the draft's weights per entry (both formats in one run, items
    alternating); the run's own (None) keeps its id."""
    grid = expand([parse_entry("cactus:delta=1:draft_quant=int8,int4:draft_vocab=99")], [6])
    assert ids(grid) == [
        "cactus(delta=1.0,exact=false)/K6/model/vocab99/draft-int8",
        "cactus(delta=1.0,exact=false)/K6/model/vocab99/draft-int4",
    ]
    keys = ["--draft vocab=99 quant=int8", "--draft vocab=99 quant=int4"]
    assert [c.draft_key for c in grid] == keys
    assert grid[1].label == "cactus d=1.0 K6 vocab=99 draft-int4"
    assert Config.from_dict(grid[1].as_dict()) == grid[1]
    assert "draft_quant" not in expand([parse_entry("sps")], [6])[0].as_dict()
    with pytest.raises(ValueError, match="draft_quant must be one of none, int8, int4, got 'int3'"):
        expand([parse_entry("sps:draft_quant=int3")], [6])
    with pytest.raises(ValueError, match="peer: draft_quant does not apply"):
        expand([parse_entry("hf_assisted:draft_quant=int4")], [6])
    with pytest.raises(ValueError, match="draft_quant applies to the model drafter, not ngram"):
        expand([parse_entry("sps:drafter=ngram:draft_quant=int4")], [6])
    with pytest.raises(ValueError, match="drafts nothing"):
        expand([parse_entry("ar:draft_quant=int4")], [6])


def test_entry_overrides_and_duplicates() -> None:
    grid = expand([parse_entry("sps:drafter=ngram:num_draft_tokens=3"), parse_entry("ar")] * 2)
    assert ids(grid) == ["sps/K3/ngram", "ar"]


def test_default_grid_covers_the_issue() -> None:
    grid = ids(expand(DEFAULT_ENTRIES))
    k = DEFAULT_NUM_DRAFT_TOKENS
    assert {"ar", "hf", f"hf_assisted/K{k}/model", f"sps/K{k}/model"} <= set(grid)
    assert f"tas(alpha=0.3,epsilon=0.09)/K{k}/model" in grid
    assert sum(i.startswith("cactus(") for i in grid) == 10


def test_toml_and_json_files_give_the_same_grid(tmp_path) -> None:
    toml = tmp_path / "g.toml"
    toml.write_text(
        'num_draft_tokens = [4]\ndrafter = "ngram"\n'
        '[[methods]]\nmethod = "ar"\n'
        '[[methods]]\nmethod = "tas"\nalpha = [0.1, 0.3]\n'
        '[[methods]]\nmethod = "cactus"\ndelta = 0.5\nexact = true\nnum_draft_tokens = [2]\n'
    )
    data = {
        "num_draft_tokens": [4],
        "drafter": "ngram",
        "methods": [
            {"method": "ar"},
            {"method": "tas", "alpha": [0.1, 0.3]},
            {"method": "cactus", "delta": 0.5, "exact": True, "num_draft_tokens": [2]},
        ],
    }
    json_path = tmp_path / "g.json"
    json_path.write_text(json.dumps(data))
    expected = [
        "ar",
        "tas(alpha=0.1,epsilon=0.09)/K4/ngram",
        "tas(alpha=0.3,epsilon=0.09)/K4/ngram",
        "cactus(delta=0.5,exact=true)/K2/ngram",
    ]
    assert ids(load_grid_file(toml)) == expected
    assert ids(load_grid_file(json_path)) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("bogus", "method must be one of ar, sps, cactus, tas, interp, topk, hf, hf_assisted"),
        ("cactus:foo=1", "cactus does not take foo"),
        ("hf:alpha=0.1", "hf does not take alpha"),
        ("cactus:delta=-1", "cactus: delta must be a finite number >= 0"),
        ("cactus:delta=abc", "cactus: delta must be a number"),
        ("cactus:exact=maybe", "cactus: exact must be true or false"),
        ("topk:k=2.5", "topk: k must be an integer"),
        ("tas:epsilon=2", r"tas: epsilon must be a number in \[0, 1\]"),
        ("sps:num_draft_tokens=0", "num_draft_tokens must be an integer >= 1"),
        ("sps:drafter=oracle", "drafter must be one of model, ngram"),
        ("ar:num_draft_tokens=4", "ar drafts nothing"),
        ("cactus:delta", "expected KEY=V1,V2"),
    ],
)
def test_bad_entries_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand([parse_entry(spec)])


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        ('[[methods]]\nmethod = "sps"\n[extra]\n', ".toml", "unknown keys extra"),
        ("num_draft_tokens = [4]\n", ".toml", "non-empty list of"),
        ("[[methods]]\ndelta = 1.0\n", ".toml", 'needs method = "NAME"'),
        ("[[methods]\n", ".toml", "grid file"),
        ("{}", ".yaml", "expected a .toml or .json file"),
    ],
)
def test_bad_grid_files_are_refused(tmp_path, content: str, suffix: str, message: str) -> None:
    path = tmp_path / f"grid{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_grid_file(path)


def test_values_are_typed_so_ids_are_stable() -> None:
    a = make_config("cactus", {"delta": "1"}, 6, "model")
    b = make_config("cactus", {"delta": 1.0, "exact": False}, 6, "model")
    assert a == b and a.id == "cactus(delta=1.0,exact=false)/K6/model"
    assert a.label == "cactus d=1.0 K6"


def test_shipped_grid_files_parse() -> None:
    grids = sorted((Path(__file__).parents[1] / "benchmarks" / "grids").glob("*.toml"))
    assert grids
    for path in grids:
        assert load_grid_file(path)


def test_verifier_formats_expand_and_mark_ids() -> None:
    grid = expand([parse_entry("cactus:delta=1:verifier=none,int8"), parse_entry("ar")], [4])
    assert ids(grid) == [
        "cactus(delta=1.0,exact=false)/K4/model",
        "cactus(delta=1.0,exact=false)/K4/model@int8",
        "ar",
    ]
    assert grid[1].verifier == "int8" and "int8-verifier" in grid[1].label
    by_default = expand([parse_entry("ar")], verifiers=["int8"])
    assert ids(by_default) == ["ar@int8"]


def test_bad_verifier_formats_are_refused() -> None:
    with pytest.raises(ValueError, match="verifier must be one of none, int8, int4, got 'int2'"):
        expand([parse_entry("sps:verifier=int2")])
    with pytest.raises(ValueError, match="llamacpp runs the verifier's GGUF itself"):
        expand([parse_entry("llamacpp:verifier=int8")])


def test_llamacpp_methods_take_their_own_parameters_only() -> None:
    grid = expand(
        [parse_entry("llamacpp"), parse_entry("llamacpp_lookup:num_pred_tokens=6")],
        verifiers=["int8"],
    )
    assert ids(grid) == ["llamacpp", "llamacpp_lookup(num_pred_tokens=6)"]
    assert not any(c.engine or c.drafts for c in grid)
    assert all(c.verifier == "none" for c in grid)  # the GGUF's own weights, whatever the default
    with pytest.raises(ValueError, match="drafts nothing"):
        expand([parse_entry("llamacpp_lookup:num_draft_tokens=4")])


def test_prompt_lookup_is_hf_assisted_with_the_drafter_that_needs_no_model() -> None:
    entries = ["hf_assisted:drafter=ngram,model", "sps:drafter=ngram", "hf"]
    grid = expand([parse_entry(e) for e in entries], [4])
    assert [c.id for c in grid if c.prompt_lookup] == ["hf_assisted/K4/ngram"]


def test_k_auto_leaves_the_draft_length_to_the_policy() -> None:
    (config,) = expand([parse_entry("sps:num_draft_tokens=auto")], [6])
    assert config.id == "sps/Kauto/model" and config.label == "sps Kauto"
    assert config.spec.num_draft_tokens is None and config.spec.drafts
    assert Config.from_dict(config.as_dict()) == config
    with pytest.raises(ValueError, match="peer: num_draft_tokens auto does not apply"):
        expand([parse_entry("hf_assisted:num_draft_tokens=auto")], [6])
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer"):
        expand([parse_entry("sps:num_draft_tokens=often")], [6])


def test_a_grid_file_that_names_no_verifier_takes_the_runs_format(tmp_path) -> None:
    path = tmp_path / "g.toml"
    path.write_text('[[methods]]\nmethod = "ar"\n[[methods]]\nmethod = "sps"\n')
    assert {c.verifier for c in load_grid_file(path, "int8")} == {"int8"}
    assert {c.verifier for c in load_grid_file(path)} == {"none"}  # control: the default
    path.write_text('verifier = ["int4"]\n[[methods]]\nmethod = "sps"\n')
    assert {c.verifier for c in load_grid_file(path, "int8")} == {"int4"}  # the file's own


def test_cactus_entries_take_an_answers_budget() -> None:
    grid = expand([parse_entry("cactus:kl_budget=0.1,2:allocation=greedy,paced")], [6])
    assert ids(grid)[:2] == [
        "cactus(allocation=greedy,delta=1.0,exact=false,kl_budget=0.1)/K6/model",
        "cactus(allocation=paced,delta=1.0,exact=false,kl_budget=0.1)/K6/model",
    ]
    assert (grid[3].spec.kl_budget, grid[3].spec.allocation) == (2.0, "paced")
    assert Config.from_dict(grid[3].as_dict()) == grid[3]
    assert "kl_budget" not in expand([parse_entry("cactus")], [6])[0].as_dict()["params"]
    with pytest.raises(ValueError, match="sps does not take kl_budget"):
        expand([parse_entry("sps:kl_budget=0.1")], [6])
    with pytest.raises(ValueError, match="allocation applies with kl_budget only"):
        expand([parse_entry("cactus:allocation=paced")], [6])
    with pytest.raises(ValueError, match="kl_budget must be a finite number >= 0"):
        expand([parse_entry("cactus:kl_budget=-1")], [6])
