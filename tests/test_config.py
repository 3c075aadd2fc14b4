"""Config: YAML + dotted overrides, validation errors that name the dotted field, generated reference."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.advantages import SHAPING_METHODS, ShapingMethod
from klgrad.config import (
    AlgoConfig,
    Config,
    ConfigError,
    KLConfig,
    config_reference,
    load_config,
    parse_override_args,
    to_dict,
)
from klgrad.kl import Level, RatioLevel, RewardRatioLevel
from klgrad.objective import Aggregation, Form


def test_defaults_are_valid_and_round_trip_through_dict():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.kl.head == "k2_as_loss"
    again = load_config(overrides={})
    assert to_dict(again) == to_dict(cfg)


def test_yaml_plus_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("kl:\n  head: k3_as_loss\n  beta: 0.1\noptim:\n  betas: [0.9, 0.95]\n")
    cfg = load_config(p, parse_override_args(["--kl.beta", "0.5", "--rollout.group_size=4", "--kl.clip_eps", "null"]))
    assert cfg.kl.head == "k3_as_loss"
    assert cfg.kl.beta == 0.5
    assert cfg.rollout.group_size == 4
    assert cfg.kl.clip_eps is None
    assert cfg.optim.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kl.beta": -1.0}, "kl.beta"),
        ({"kl.head": "k4"}, "kl.head"),
        ({"kl.level": "tokn"}, "kl.level"),
        ({"kl.form": "combined", "kl.level": "token"}, "kl.level"),
        ({"kl.clip_eps": 0.0}, "kl.clip_eps"),
        ({"algo.clip_eps_low": 1.5}, "algo.clip_eps_low"),
        ({"algo.shaping": "grpo2"}, "algo.shaping"),
        ({"rollout.group_size": 1}, "rollout.group_size"),
        ({"rollout.temperature": 0}, "rollout.temperature"),
        ({"rollout.group_size": "eight"}, "rollout.group_size"),
        ({"algo.mini_batches": 3}, "algo.mini_batches"),
        ({"optim.lr": "fast"}, "optim.lr"),
        ({"optim.betas": [0.9]}, "optim.betas"),
        ({"train.steps": 0}, "train.steps"),
        ({"train.tensorboard": "yes"}, "train.tensorboard"),
        ({"kl.bta": 0.5}, "kl.bta"),
        ({"klx.beta": 0.5}, "klx"),
        ({"data.task": "file"}, "data.path"),
        ({"reward.functions": [{"name": "accuracy", "wieght": 1}]}, "reward.functions[0].wieght"),
    ],
)
def test_bad_values_name_the_dotted_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert str(e.value).startswith(field), str(e.value)


def test_choice_errors_list_the_allowed_values():
    with pytest.raises(ConfigError, match=r"\['sequence', 'token_to_go', 'token'\]"):
        load_config(overrides={"kl.level": "tokn"})


def test_choice_fields_are_typed_by_the_modules_that_define_the_choices():
    """One list of allowed values per choice: the config field's type is the implementing module's Literal, so
    validation, completion and docs/configuration.md follow the code."""
    kl, algo = typing.get_type_hints(KLConfig), typing.get_type_hints(AlgoConfig)
    typed = [
        (kl["level"], Level),
        (kl["form"], Form),
        (kl["ratio_level"], RatioLevel),
        (algo["shaping"], ShapingMethod),
        (algo["ratio_level"], RewardRatioLevel),
        (algo["aggregation"], Aggregation),
    ]
    assert all(field is alias for field, alias in typed)  # the very objects, not equal re-declarations
    for method in SHAPING_METHODS:
        group_size = 1 if method in ("none", "batch_baseline", "batch_norm", "reinforce", "reinforce_pp") else 2
        assert load_config(overrides={"algo.shaping": method, "rollout.group_size": group_size}).algo.shaping == method
    with pytest.raises(ConfigError, match=r"^algo\.shaping must be one of \['none', 'group_baseline', .*got 'grpo2'"):
        load_config(overrides={"algo.shaping": "grpo2"})


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kl: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)
    evil = tmp_path / "evil.yaml"  # safe_load refuses python object tags
    evil.write_text("kl: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(evil)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match=r"--section\.field"):
        parse_override_args(["kl.beta", "0.5"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_override_args(["--kl.beta"])


@settings(max_examples=60, deadline=None)
@given(
    key=st.sampled_from(["kl.beta", "rollout.group_size", "optim.lr", "kl.head", "train.steps"]),
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 5),
        st.floats(allow_nan=True),
        st.text(max_size=5),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_fuzzed_overrides_either_validate_or_fail_with_a_named_field(key, value):
    try:
        cfg = load_config(overrides={key: value})
    except ConfigError as e:
        message = str(e)
        assert message.startswith(key.split(".")[0]), message
    else:
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) is not None or value is None


def test_reference_lists_every_field_with_its_doc():
    ref = config_reference()
    for dotted in ("kl.head", "kl.beta", "rollout.group_size", "algo.shaping", "optim.lr", "train.out_dir"):
        assert f"`{dotted}`" in ref
    assert "KL weight β" in ref


def test_docs_configuration_reference_is_up_to_date():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert config_reference() in doc, "docs/configuration.md is stale: run `python -m klgrad.config`"


@pytest.mark.parametrize(("device", "message"), [("tpu", "must be auto, cpu, cuda or cuda:N"), ("cuda:x", "cuda:N")])
def test_model_device_is_validated(device, message):
    with pytest.raises(ConfigError, match=rf"model\.device .*{message}"):
        load_config(None, {"model.device": device})


def test_cuda_device_without_a_gpu_is_refused_naming_the_field():
    import torch

    if torch.cuda.is_available():  # on a GPU machine the setting is valid
        assert load_config(None, {"model.device": "cuda"}).model.device == "cuda"
    else:
        with pytest.raises(ConfigError, match=r"model\.device 'cuda': no CUDA GPU"):
            load_config(None, {"model.device": "cuda"})


@pytest.mark.parametrize(
    "overrides",
    [
        {"rollout.top_p": 0.9},  # default kl.head k2_as_loss
        {"rollout.top_p": 0.9, "kl.head": "none", "algo.ppo_epochs": 2},
        {"rollout.top_p": 0.9, "kl.head": "none", "algo.mini_batches": 2},
    ],
)
def test_top_p_is_refused_with_a_kl_head_or_off_policy(overrides):
    with pytest.raises(ConfigError, match=r"^rollout\.top_p must be 1\.0 .*full distribution"):
        load_config(None, overrides)


def test_top_p_is_allowed_without_a_kl_head_on_policy():
    assert load_config(None, {"rollout.top_p": 0.9, "kl.head": "none"}).rollout.top_p == 0.9


def test_gspo_ratio_is_a_reward_head_level_only():
    from klgrad.trainer import objective_spec

    cfg = load_config(None, {"algo.ratio_level": "gspo", "algo.clip_eps_low": 3e-4, "algo.clip_eps_high": 4e-4})
    assert objective_spec(cfg).ratio_level == "gspo"
    with pytest.raises(ConfigError, match=r"^kl\.ratio_level must be one of \['token', 'sequence'\]"):
        load_config(None, {"kl.ratio_level": "gspo"})
