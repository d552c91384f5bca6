import pytest

from hsx.layers import LayerSpecError, dflash_layers, eagle3_layers, resolve_layers


@pytest.mark.parametrize("num_layers,expected", [
    (36, [1, 9, 17, 25, 33]), (32, [1, 8, 15, 22, 29]), (64, [1, 16, 31, 46, 61]),
    (28, [1, 7, 13, 19, 25]), (48, [1, 12, 23, 34, 45]),
])
def test_dflash_matches_contract(num_layers, expected):
    assert dflash_layers(num_layers) == expected
    assert resolve_layers("dflash", num_layers) == (expected, False)


def test_dflash_formula_for_other_counts():
    # n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1)) with Python's round
    assert dflash_layers(36, 1) == [18]
    assert dflash_layers(36, 3) == [1, 17, 33]
    assert dflash_layers(6, 3) == [1, 2, 3]
    assert resolve_layers("dflash:4", 40)[0] == [round(1 + i * 36 / 3) for i in range(4)]


@pytest.mark.parametrize("num_layers,expected", [
    (36, [1, 17, 32]), (32, [1, 15, 28]), (64, [1, 31, 60]), (7, [1, 2, 3]),   # the preset [1, L//2 - 1, L - 4]
    (6, [1, 3, 4]), (5, [1, 2, 3]), (4, [0, 1, 2]),                             # small models: distinct, below the last
])
def test_eagle3(num_layers, expected):
    assert eagle3_layers(num_layers) == expected
    assert resolve_layers("eagle3", num_layers) == (expected, True)


def test_eagle3_refuses_a_model_under_4_layers_saying_how_many_it_needs():
    with pytest.raises(LayerSpecError, match=r"^eagle3 needs a model of >= 4 decoder layers .* this one has 3$"):
        resolve_layers("eagle3", 3)


def test_plus_final_stores_the_final_state_for_any_spec():
    assert resolve_layers("dflash:5+final", 36) == ([1, 9, 17, 25, 33], True)
    assert resolve_layers("1,9,17+final", 36) == ([1, 9, 17], True)
    assert resolve_layers("dflash:3 +final", 6) == ([1, 2, 3], True)
    assert resolve_layers("eagle3+final", 36) == ([1, 17, 32], True)
    with pytest.raises(LayerSpecError, match=r"only layer-spec suffix is \+final"):
        resolve_layers("dflash+last", 36)
    with pytest.raises(LayerSpecError, match="dflash:4 picks 4 layers"):   # the base spec is still checked
        resolve_layers("dflash:4+final", 6)


def test_explicit_list_sorted_and_checked():
    assert resolve_layers("17, 3,9", 36) == ([3, 9, 17], False)
    with pytest.raises(LayerSpecError, match=r"\[36\] are out of range .* 36 decoder layers"):
        resolve_layers("1,36", 36)
    with pytest.raises(LayerSpecError, match="out of range"):
        resolve_layers("-1", 36)
    with pytest.raises(LayerSpecError, match="comma-separated list"):
        resolve_layers("first,last", 36)
    with pytest.raises(LayerSpecError, match="whole number"):
        resolve_layers("dflash:x", 36)


def test_too_many_layers_for_the_model_names_its_count_and_suggests_dflash_n():
    # The demo's tiny model has 6 decoder layers: the README's `--layers dflash` (5 layers) does not fit it.
    with pytest.raises(LayerSpecError, match=r"dflash picks 5 layers, but this model has only 6 decoder layers.*"
                                             r"use --layers dflash:3 \(at most 3 here\)"):
        resolve_layers("dflash", 6)
    with pytest.raises(LayerSpecError, match=r"dflash:4 picks 4 layers.*dflash:3"):
        resolve_layers("dflash:4", 6)
    assert resolve_layers("dflash:3", 6) == ([1, 2, 3], False)
    assert resolve_layers("eagle3", 6) == ([1, 3, 4], True)   # was refused: "layer ids repeat: [1, 2, 2]"
