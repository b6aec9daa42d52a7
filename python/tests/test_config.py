import pytest

import moerail


def test_make_config_sets_fields_and_validates():
    cfg = moerail.make_config(hidden=256, ffn_hidden=128, num_experts=16, topk=4, align=16, activation="geglu",
                              score_function="sigmoid", num_groups=4, group_topk=2, capacity_factor=1.5)
    assert (cfg.hidden, cfg.topk, cfg.activation, cfg.score_function) == (256, 4, "geglu", "sigmoid")
    assert cfg.capacity_factor == 1.5 and cfg.local_experts == 16 and cfg.fc1_out == 256
    cfg.capacity_factor = None
    assert cfg.capacity_factor is None
    assert "H=256" in repr(cfg)


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="unknown field 'hiden'"):
        moerail.make_config(hiden=3)
    with pytest.raises(moerail.Error, match="activation = 'relu3'"):
        moerail.make_config(activation="relu3")
    with pytest.raises(moerail.Error, match="topk"):
        moerail.make_config(num_experts=4, topk=5)


def test_presets():
    cfg = moerail.preset("deepseek-v3")
    assert (cfg.hidden, cfg.num_experts, cfg.topk, cfg.score_function) == (7168, 256, 8, "sigmoid")
    assert "deepseek-v3" in moerail.preset_names()
    with pytest.raises(moerail.Error):
        moerail.preset("gpt-5")
