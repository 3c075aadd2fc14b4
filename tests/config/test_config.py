"""Config: YAML + dotted overrides, validation errors that name the dotted field, generated reference, choice
fields typed by their modules' Literals, and the config fuzzing that docs/reliability.md reports."""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import klgrad
from klgrad.choices import (
    SHAPING_METHODS,
    Aggregation,
    Form,
    HeadName,
    Level,
    RatioLevel,
    RewardRatioLevel,
    ShapingMethod,
)
from klgrad.config import (
    AlgoConfig,
    Config,
    ConfigError,
    ConfigLoader,
    KLConfig,
    dump_yaml,
    json_schema,
    load_config,
    load_yaml,
    parse_override_args,
    parse_value,
    resolve_config_path,
    to_dict,
)
from klgrad.docs import SCHEMA_FILE, config_reference, schema_text
from klgrad.kl import KL_HEADS
from tests.helpers.case_counts import CASES, report_counts


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
        ({"rollout.staleness": -1}, "rollout.staleness"),
        ({"rollout.staleness": 1.5}, "rollout.staleness"),
        ({"rollout.staleness": 1, "rollout.sampler_dtype": "bfloat16"}, "rollout.staleness"),
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
    with pytest.raises(ConfigError, match=r"'sequence', 'token_to_go' or 'token', got 'tokn'; did you mean 'token'"):
        load_config(overrides={"kl.level": "tokn"})


def test_choice_fields_are_typed_by_the_modules_that_define_the_choices():
    """One list of allowed values per choice: the config field's type is the implementing module's Literal, so
    validation, completion and docs/configuration.md follow the code."""
    kl, algo = typing.get_type_hints(KLConfig), typing.get_type_hints(AlgoConfig)
    head = typing.get_type_hints(KLConfig, include_extras=True)["head"]
    assert typing.get_args(head)[1].choices == typing.get_args(HeadName)  # str (TrlParser), checked as the choices
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
    with pytest.raises(ConfigError, match=r"^algo\.shaping must be 'none', 'group_baseline', .*got 'grpo2'"):
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
    with pytest.raises(ConfigError, match="a value is needed"):
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

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert config_reference() in doc, "docs/configuration.md is stale: run `python -m klgrad.docs`"


@pytest.mark.parametrize(("device", "message"), [("tpu", "should match pattern"), ("cuda:x", r"cuda:\[0-9\]\+")])
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
        {"rollout.top_p": 0.9, "kl.head": "none", "rollout.staleness": 1},
    ],
)
def test_top_p_is_refused_with_a_kl_head_or_off_policy(overrides):
    with pytest.raises(ConfigError, match=r"^rollout\.top_p must be 1\.0 .*full distribution"):
        load_config(None, overrides)


def test_top_p_is_allowed_without_a_kl_head_on_policy():
    assert load_config(None, {"rollout.top_p": 0.9, "kl.head": "none"}).rollout.top_p == 0.9


def test_sampler_dtype_and_masked_corrections():
    cfg = load_config(None, {"rollout.sampler_dtype": "bfloat16", "rollout.mismatch_correction": "sequence_mask"})
    assert (cfg.rollout.sampler_dtype, cfg.rollout.mismatch_correction) == ("bfloat16", "sequence_mask")
    assert load_config().rollout.sampler_dtype is None  # default: the policy itself, no mismatch


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout.sampler_dtype": "bf16"}, r"^rollout\.sampler_dtype must be .*'bfloat16'.*got 'bf16'"),
        (
            {"rollout.sampler_dtype": "bfloat16", "rollout.engine": "hf"},
            r"^rollout\.sampler_dtype needs rollout\.engine",
        ),
        (
            {"rollout.sampler_dtype": "bfloat16", "model.lora_rank": 4},
            r"^rollout\.sampler_dtype must be null with model\.lora",
        ),
        (
            {"rollout.mismatch_correction": "token_mask", "rollout.mismatch_cap": 1.0},
            r"^rollout\.mismatch_cap must be > 1",
        ),
        ({"rollout.mismatch_correction": "mask"}, r"^rollout\.mismatch_correction must be .*'token_mask'"),
    ],
)
def test_sampler_dtype_and_mismatch_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_gspo_ratio_is_a_reward_head_level_only():
    from klgrad.objective import ObjectiveSpec

    cfg = load_config(None, {"algo.ratio_level": "gspo", "algo.clip_eps_low": 3e-4, "algo.clip_eps_high": 4e-4})
    assert ObjectiveSpec.from_config(cfg).pg.ratio_level == "gspo"
    with pytest.raises(ConfigError, match=r"^kl\.ratio_level must be 'token', 'sequence' or 'per_decision'"):
        load_config(None, {"kl.ratio_level": "gspo"})


# ----------------------------------------------------------------------------------------------------------
# config fuzzing (docs/reliability.md, guarantee 4): unknown keys, wrong types, out-of-range values ->
# ConfigError naming the field


def _field_types() -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = tp

    walk(Config, "")
    return out


FIELDS = _field_types()
SECTIONS = sorted({k.split(".")[0] for k in FIELDS})
_IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        rest = [a for a in args if a is not type(None)]
        return rest[0], type(None) in args
    return tp, False


def _valid_float(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _type_ok(base: Any, v: Any) -> bool:
    """Whether ``v`` has the right type for ``base`` (the oracle: wrong-typed values must be refused)."""
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        return v in typing.get_args(base) and isinstance(v, str)
    if origin is tuple:
        return isinstance(v, list | tuple) and len(v) == 2 and all(_valid_float(x) for x in v)
    if origin is list:
        return True  # reward.functions: its own strategy below
    if base is bool:
        return isinstance(v, bool)
    if base is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if base is float:
        return _valid_float(v)
    if base is str:
        return isinstance(v, str)
    raise AssertionError(base)


_ANY_VALUE = st.one_of(
    st.text(max_size=6),
    st.integers(),
    st.sampled_from([10**400, -(10**400), 2.5, float("nan"), float("inf"), -float("inf")]),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def wrong_type(draw):
    key = draw(st.sampled_from(sorted(k for k in FIELDS if k != "reward.functions")))
    base, _ = _unwrap(FIELDS[key])
    value = draw(_ANY_VALUE.filter(lambda v: not _type_ok(base, v) and v is not None))
    return "wrong_type", {key: value}


@st.composite
def unknown_key(draw):
    if draw(st.booleans()):
        section = draw(st.sampled_from(SECTIONS))
        name = draw(_IDENT.filter(lambda n: f"{section}.{n}" not in FIELDS))
        return "unknown_key", {f"{section}.{name}": draw(_ANY_VALUE)}
    section = draw(_IDENT.filter(lambda n: n not in SECTIONS))
    return "unknown_key", {f"{section}.{draw(_IDENT)}": draw(_ANY_VALUE)}


def _neg(strict: bool = True):
    """Floats <= 0 (``strict``: the field must be > 0) or < 0 (the field must be >= 0)."""
    return st.floats(max_value=0.0 if strict else -1e-12, allow_nan=False, allow_infinity=False)


def _int_below(n: int):
    return st.integers(max_value=n - 1)


GROUP_METHODS = [
    m for m in SHAPING_METHODS if m not in ("none", "batch_baseline", "batch_norm", "reinforce", "reinforce_pp")
]
OUT_OF_RANGE = {
    "kl.beta": st.floats(max_value=-1e-12, allow_nan=False, allow_infinity=False),
    "algo.clip_eps_low": st.one_of(_neg(), st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)),
    "algo.clip_eps_high": _neg(),
    "kl.clip_eps": st.one_of(_neg(), st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)),
    "optim.lr": _neg(),
    "optim.weight_decay": _neg(strict=False),
    "optim.grad_clip": _neg(),
    "optim.warmup_steps": _int_below(0),
    "rollout.temperature": _neg(),
    "rollout.top_p": st.one_of(_neg(), st.floats(min_value=1.0 + 1e-9, allow_nan=False, allow_infinity=False)),
    "rollout.prompts_per_step": _int_below(1),
    "rollout.group_size": _int_below(1),
    "rollout.max_new_tokens": _int_below(1),
    "reward.timeout_s": _neg(),
    "reward.max_failure_fraction": st.one_of(
        _neg(strict=False), st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)
    ),
    "kl.target_kl": _neg(),
    "kl.reset_ref_every": _int_below(1),
    "kl.head": _IDENT.filter(lambda n: n not in KL_HEADS),
    "algo.shaping": _IDENT.filter(lambda n: n not in SHAPING_METHODS),
    "algo.dual_clip": st.floats(max_value=1.0, allow_nan=False, allow_infinity=False),
    "algo.entropy_coef": _neg(strict=False),
    "algo.std_min": _neg(),
    "algo.std_max": _neg(),
    "algo.ppo_epochs": _int_below(1),
    "algo.mini_batches": _int_below(1),
    "algo.micro_batch_size": _int_below(1),
    "train.steps": _int_below(1),
    "train.save_every": _int_below(1),
    "train.eval_every": _int_below(0),
    "train.max_skipped_steps": _int_below(1),
    "train.threads": _int_below(0),
    "data.digits": _int_below(1),
    "data.n_train": _int_below(1),
    "data.n_eval": _int_below(1),
}


@st.composite
def out_of_range(draw):
    kind = draw(st.sampled_from(["single", "group_size_1", "not_divisible", "combined_token", "betas", "file"]))
    if kind == "single":
        key = draw(st.sampled_from(sorted(OUT_OF_RANGE)))
        return "out_of_range", {key: draw(OUT_OF_RANGE[key])}
    if kind == "group_size_1":
        return "out_of_range", {"rollout.group_size": 1, "algo.shaping": draw(st.sampled_from(GROUP_METHODS))}
    if kind == "not_divisible":
        p, g = draw(st.integers(1, 12)), draw(st.integers(2, 8))
        m = draw(st.integers(2, 64).filter(lambda m: (p * g) % m != 0 or ((p * g) // m) % g != 0))
        return "out_of_range", {"rollout.prompts_per_step": p, "rollout.group_size": g, "algo.mini_batches": m}
    if kind == "combined_token":
        return "out_of_range", {"kl.form": "combined", "kl.level": "token"}
    if kind == "betas":
        bad = draw(st.one_of(st.floats(max_value=-1e-12, allow_nan=False), st.floats(min_value=1.0, allow_nan=False)))
        return "out_of_range", {"optim.betas": draw(st.permutations([0.9, bad]))}
    return "out_of_range", {"data.task": "file", "data.path": draw(st.sampled_from([None, ""]))}


@st.composite
def bad_reward_functions(draw):
    value = draw(
        st.one_of(
            st.just([]),
            st.text(max_size=5),
            st.integers(),
            st.lists(st.integers(), min_size=1, max_size=2),
            st.lists(
                st.fixed_dictionaries({"name": st.integers() | st.none() | st.lists(st.text(max_size=2))}),
                min_size=1,
                max_size=2,
            ),
            st.lists(
                st.fixed_dictionaries(
                    {"name": st.just("accuracy"), "weight": st.sampled_from(["1", float("nan"), 10**400, None])}
                ),
                min_size=1,
                max_size=2,
            ),
            st.lists(
                st.fixed_dictionaries({"name": st.just("accuracy"), "wieght": st.floats()}), min_size=1, max_size=1
            ),
        )
    )
    return "wrong_type", {"reward.functions": value}


@st.composite
def section_not_mapping(draw):
    return "wrong_type", {draw(st.sampled_from(SECTIONS)): draw(_ANY_VALUE.filter(lambda v: not isinstance(v, dict)))}


_PATH_RE = re.compile(r"[A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*")


def _names_a_field(message: str, overrides: dict[str, Any]) -> bool:
    m = _PATH_RE.match(message)
    if not m:
        return False
    name = re.sub(r"\[\d+\]", "", m.group(0))
    known = set(FIELDS) | set(SECTIONS) | {f"reward.functions.{f}" for f in ("name", "weight")}
    prefixes = {".".join(k.split(".")[: i + 1]) for k in overrides for i in range(k.count(".") + 1)}
    allowed = known | prefixes
    return name in allowed or name.rpartition(".")[0] in allowed  # the field, or an unknown key under one


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=st.one_of(wrong_type(), unknown_key(), out_of_range(), bad_reward_functions(), section_not_mapping()))
@example(case=("wrong_type", {"kl.beta": 10**400}))  # a 401-digit YAML integer for a float field
@example(case=("wrong_type", {"optim.betas": [0.9, 10**400]}))
@example(case=("out_of_range", {"train.threads": -1}))
@example(case=("out_of_range", {"rollout.group_size": 1, "algo.shaping": "grpo"}))
@example(case=("out_of_range", {"rollout.prompts_per_step": 3, "rollout.group_size": 2, "algo.mini_batches": 4}))
@example(case=("out_of_range", {"algo.clip_eps_low": 0.0}))
def test_config_fuzz_always_raises_config_error_naming_the_field(case):
    kind, overrides = case
    CASES["config_fuzz"] += 1
    CASES[f"config_fuzz_{kind}"] += 1
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert _names_a_field(message, overrides), (overrides, message)


@pytest.fixture(scope="module", autouse=True)
def _report_case_counts():
    """The fuzz case counts docs/reliability.md reports (``KLGRAD_RELIABILITY_COUNTS``;
    tests/helpers/case_counts.py)."""
    yield
    report_counts()


def test_shipped_configs_load_from_any_working_directory(tmp_path, monkeypatch):
    """``klgrad compare``'s default ``configs/tiny_add.yaml`` is relative: outside the repository it is found in
    the installed package (``klgrad/configs/``); a path that exists nowhere still fails naming it."""
    here = load_config("configs/tiny_scratchpad.yaml")
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/tiny_scratchpad.yaml") == here
    assert load_config("tiny_scratchpad.yaml") == here
    assert here.rollout.max_new_tokens == 32  # the scratchpad config, not the defaults
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny_scratchpad.yaml").write_text("rollout:\n  max_new_tokens: 5\n")
    assert load_config("configs/tiny_scratchpad.yaml").rollout.max_new_tokens == 5  # the working directory wins
    with pytest.raises(ConfigError, match=r"configs/nope\.yaml"):
        load_config("configs/nope.yaml")


@pytest.mark.parametrize(
    "name",
    ["configs/tiny_add.yaml", "tiny_add.yaml", "configs/accelerate/ddp_cpu.yaml", "accelerate/fsdp_gpu.yaml"],
)
def test_relative_config_paths_resolve_into_the_package(name, tmp_path, monkeypatch):
    """From a directory without them, ``configs/<name>`` and plain ``<name>`` are the package's own files
    (``importlib.resources``: the same in a checkout, an editable install and a wheel)."""
    package = Path(str(importlib.resources.files("klgrad"))).resolve()
    monkeypatch.chdir(tmp_path)
    p = resolve_config_path(name)
    assert p.is_file()
    assert p.resolve().is_relative_to(package / "configs"), p
    assert p.name == Path(name).name


@pytest.mark.parametrize("name", ["configs/nope.yaml", "nope.yaml", "configs", "__init__.py", "../config.py"])
def test_unknown_relative_config_paths_are_returned_unchanged(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path(name) == Path(name)


YAML12_FLOATS = ["1e-6", "5e-7", "1E-4", "+1e-3", "1e+3", ".5", "-2.5E-3", "-.5", "1.0e6", "2.", "0.25"]


@pytest.mark.parametrize("text", YAML12_FLOATS)
def test_numbers_as_users_write_them_are_floats_in_files_and_overrides(text, tmp_path):
    """YAML 1.1 (PyYAML) reads ``1e-6`` as a string; config YAML reads it, and every YAML 1.2 float, as the
    exact float Python reads."""
    assert parse_value(text) == float(text)
    assert type(parse_value(text)) is float
    p = tmp_path / "c.yaml"
    p.write_text(f"reward:\n  failure_value: {text}\n")
    cfg = load_config(p, parse_override_args(["--reward.timeout_s", text.lstrip("+-")]))
    assert cfg.reward.failure_value == float(text)
    assert cfg.reward.timeout_s == float(text.lstrip("+-"))


def test_learning_rates_as_users_write_them(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 5e-7\n")
    assert load_config(p).optim.lr == 5e-7
    assert load_config(p, parse_override_args(["--optim.lr", "1e-6"])).optim.lr == 1e-6
    assert load_config(p, parse_override_args(["--optim.lr=1E-4"])).optim.lr == 1e-4
    assert load_config(p, parse_override_args(["--optim.betas", "[9e-1, 9.99E-1]"])).optim.betas == (0.9, 0.999)


@pytest.mark.parametrize(("text", "value"), [("12", 12), ("-3", -3), ("0", 0), ("1_000", 1000)])
def test_integers_stay_integers(text, value, tmp_path):
    assert parse_value(text) == value
    assert type(parse_value(text)) is int
    p = tmp_path / "c.yaml"
    p.write_text(f"train:\n  seed: {text}\n")
    assert load_config(p).train.seed == value


@pytest.mark.parametrize("text", ["1e-6", "1e3", "2.5"])
def test_a_float_for_an_integer_field_fails_naming_it(text, tmp_path):
    with pytest.raises(ConfigError, match=r"^train\.steps must be a valid integer"):
        load_config(overrides=parse_override_args(["--train.steps", text]))
    p = tmp_path / "c.yaml"
    p.write_text(f"train:\n  steps: {text}\n")
    with pytest.raises(ConfigError, match=r"^train\.steps must be a valid integer"):
        load_config(p)


@pytest.mark.parametrize("text", ["1e-6", "1.10", "5e-7", ".5"])
def test_quoted_numbers_stay_text_in_string_fields(text, tmp_path):
    """A string field keeps a quoted number's spelling through the file, the override round trip and a run's
    saved config.yaml (:func:`dump_yaml` quotes what :func:`load_yaml` would read as a number)."""
    p = tmp_path / "c.yaml"
    p.write_text(f"model:\n  path: '{text}'\ndata:\n  prompt_column: \"{text}\"\n")
    cfg = load_config(p, parse_override_args(["--train.out_dir", f"'{text}'"]))
    assert (cfg.model.path, cfg.data.prompt_column, cfg.train.out_dir) == (text, text, text)
    saved = tmp_path / "saved.yaml"
    saved.write_text(dump_yaml(to_dict(cfg)))
    assert load_config(saved) == cfg
    assert load_yaml(dump_yaml({"x": text})) == {"x": text}


def test_an_unquoted_number_for_a_string_field_fails_naming_it():
    """Not converted back: ``1e-6`` is a number in config YAML, as ``0.5`` always was; the message says to quote."""
    with pytest.raises(ConfigError, match=r"^model\.path must be a valid string, got 1e-06 .*quote it"):
        load_config(overrides=parse_override_args(["--model.path", "1e-6"]))


@pytest.mark.parametrize("text", ["nan", ".nan", "NaN", "inf", ".inf", "-.inf", "+.inf", "1e999", "-1e999"])
def test_non_finite_numbers_are_still_refused(text, tmp_path):
    with pytest.raises(ConfigError, match=r"^optim\.lr must be"):
        load_config(overrides=parse_override_args(["--optim.lr", text]))
    p = tmp_path / "c.yaml"
    p.write_text(f"optim:\n  lr: {text}\n")
    with pytest.raises(ConfigError, match=r"^optim\.lr must be"):
        load_config(p)


def test_config_yaml_is_read_with_one_safe_loader_everywhere():
    """No module of klgrad reads YAML with anything but :func:`klgrad.config.load_yaml` (its own loader)."""
    src = Path(klgrad.__file__).parent
    readers = [
        f"{path.relative_to(src)}: {line.strip()}"
        for path in sorted(src.rglob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.search(r"\byaml\.(safe_load|load|full_load|unsafe_load|load_all|safe_load_all)\(", line)
    ]
    assert readers == [
        "config/__init__.py: return yaml.load(text, Loader=ConfigLoader)  # safe: ConfigLoader is a SafeLoader"
    ]
    assert issubclass(ConfigLoader, yaml.SafeLoader)


@pytest.mark.parametrize("method", SHAPING_METHODS)
def test_group_size_one_is_refused_exactly_for_group_shaping(method):
    """A group statistic over one response is 0 or undefined: the config refuses group_size 1 for the methods
    whose operator chain has a group operator (hand list: the group ones), and accepts it for the others."""
    group_methods = {"group_baseline", "group_norm", "rloo", "grpo", "dr_grpo", "reinforce_pp_baseline"}
    over = {"algo.shaping": method, "rollout.group_size": 1, "rollout.prompts_per_step": 8}
    if method in group_methods:
        with pytest.raises(ConfigError, match="group_size"):
            load_config(None, over)
    else:
        assert load_config(None, over).rollout.group_size == 1


def test_config_and_cli_import_no_model_library():
    """``klgrad.config`` (a YAML check) and ``klgrad.cli`` (``klgrad --help``, shell completion) load neither torch
    nor transformers: the choices live in the leaf module ``klgrad.choices`` and the package's public names load
    on first use. A fresh interpreter, so that no other test's imports count."""
    import subprocess
    import sys

    code = (
        "import sys, klgrad.config, klgrad.cli; "
        "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert "kl_loss" in dir(klgrad)
    assert klgrad.KL_HEADS["k2_as_loss"].name == "k2_as_loss"  # still there on first use
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = klgrad.nope


# ----------------------------------------------------------------------------------------------------------
# every problem at once, suggestions, the shipped JSON schema


def test_a_yaml_with_three_mistakes_reports_all_three(tmp_path):
    """A typo'd key, a wrong choice and an out-of-range value in different sections: one read names all three,
    one line each, starting with the dotted field."""
    p = tmp_path / "c.yaml"
    p.write_text("kl:\n  bta: 0.1\nalgo:\n  shaping: grpo2\noptim:\n  lr: -1.0e-6\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.problems == [
        "kl.bta is not a config field; allowed here: ['head', 'level', 'form', 'clip_eps', 'ratio_level', "
        "'is_correction', 'beta', 'target_kl', 'adapt_rate', 'reset_ref_every', 'aggregation']; did you mean 'beta'?",
        f"algo.shaping must be {', '.join(map(repr, SHAPING_METHODS[:-1]))} or 'reinforce_pp_baseline', got 'grpo2'; "
        "did you mean 'grpo'?",
        "optim.lr must be greater than 0, got -1e-06",
    ]
    assert str(e.value) == "\n".join(e.value.problems)


def test_value_rules_of_every_section_then_across_sections_are_all_reported():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"kl.beta": -1, "train.steps": 0, "rollout.group_size": 1})
    assert e.value.problems == [  # sections first ...
        "kl.beta must be greater than or equal to 0, got -1",
        "train.steps must be greater than or equal to 1, got 0",
    ]
    with pytest.raises(ConfigError) as e:
        load_config(None, {"rollout.group_size": 1, "rollout.top_p": 0.9})
    assert [p.split(" ")[0] for p in e.value.problems] == ["rollout.group_size", "rollout.top_p"]  # ... then across


@pytest.mark.parametrize(
    ("over", "problem"),
    [
        (
            {"trian.steps": 3},
            "trian is not a config field; allowed here: ['model', 'data', 'rollout', 'reward', "
            "'kl', 'algo', 'optim', 'train']; did you mean 'train'?",
        ),
        ({"kl.head": "k3_as_los"}, "did you mean 'k3_as_loss'?"),
        (
            {"reward.functions": [{"name": "accuracy", "wieght": 2}]},
            "reward.functions[0].wieght is not a config "
            "field; allowed here: ['name', 'weight']; did you mean 'weight'?",
        ),
        ({"optim.betas": [0.9]}, "optim.betas[1] field required"),
        ({"optim.betas": [0.9, 0.9, 0.9]}, "optim.betas tuple should have at most 2 items"),
        ({"optim.lr": 10**400}, "optim.lr must be a finite number, got 100000000000000000...0000000000000000000"),
        ({"model.lora_targets": ["q_proj", 3]}, "model.lora_targets[1] must be 'q_proj', 'k_proj', "),
    ],
)
def test_messages_name_the_field_and_suggest_a_near_miss(over, problem):
    with pytest.raises(ConfigError) as e:
        load_config(None, over)
    assert len(e.value.problems) == 1
    assert problem in e.value.problems[0]
    assert e.value.problems[0].startswith(next(iter(over)).split(".")[0])


def test_no_suggestion_for_a_far_miss():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"kl.zzzzzz": 1})
    assert "did you mean" not in str(e.value)


def test_an_empty_section_is_its_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("kl:\noptim:\n")
    assert load_config(p) == Config()


def test_shipped_schema_is_the_generated_one_and_every_shipped_config_names_it():
    configs = importlib.resources.files("klgrad") / "configs"
    assert (configs / SCHEMA_FILE).read_text(encoding="utf-8") == schema_text(), (
        "klgrad.schema.json is stale: run `python -m klgrad.docs`"
    )
    shipped = sorted(p for p in configs.iterdir() if p.name.endswith(".yaml"))
    assert len(shipped) >= 6
    for p in shipped:
        assert p.read_text(encoding="utf-8").splitlines()[0] == f"# yaml-language-server: $schema={SCHEMA_FILE}"


def test_schema_accepts_every_shipped_config_and_refuses_what_the_config_refuses():
    """The editor's check (JSON schema, jsonschema's validator) and klgrad's agree on the shipped configs and on
    wrong keys, types and choices (value rules such as lr > 0 are klgrad's own: the schema has no ranges)."""
    import jsonschema

    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    configs = importlib.resources.files("klgrad") / "configs"
    for p in sorted(p for p in configs.iterdir() if p.name.endswith(".yaml")):
        data = load_yaml(p.read_text(encoding="utf-8"))
        assert list(validator.iter_errors(data)) == [], p.name
    for bad in (
        {"kl": {"bta": 0.1}},
        {"kl": {"head": "k9"}},
        {"kl": {"head": 3}},
        {"train": {"steps": 2.5}},
        {"train": {"tensorboard": 1}},
        {"optim": {"betas": [0.9]}},
        {"model": {"path": 5}},
        {"trian": {}},
    ):
        assert list(validator.iter_errors(bad)), bad
        with pytest.raises(ConfigError):
            load_config(None, {f"{s}.{k}": v for s, section in bad.items() for k, v in section.items()} or bad)
    assert not list(validator.iter_errors({"kl": {"head": "my_pkg.heads:half_square"}}))


def test_klgrad_train_prints_every_problem_and_exits_2(capsys):
    from klgrad.cli import main

    assert main(["train", "--kl.bta", "1", "--kl.head", "k9", "--optim.lr", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "klgrad train: 3 problems in the config:"
    assert [line.split(" ")[2] for line in err[1:]] == ["kl.head", "kl.bta", "optim.lr"]


def test_a_yaml_with_four_mistakes_prints_four_problems_exits_2_and_creates_no_run(tmp_path, capsys):
    """A misspelt key, an unknown head, a text β and a negative length: one line each, value rules beside type
    errors, each naming its dotted field; exit code 2 and no run directory."""
    from klgrad.cli import main

    out = tmp_path / "run"
    p = tmp_path / "c.yaml"
    text = "kl:\n  head: k9_as_loss\n  beta: lots\n  levl: token\nrollout:\n  max_new_tokens: -3\n"
    p.write_text(f"{text}train:\n  out_dir: {out}\n")
    assert main(["train", "--config", str(p)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "klgrad train: 4 problems in the config:"
    assert sorted(line.split(" ")[2] for line in err[1:]) == [
        "kl.beta",
        "kl.head",
        "kl.levl",
        "rollout.max_new_tokens",
    ]
    assert "kl.levl is not a config field" in err[4]
    assert err[4].endswith("did you mean 'level'?")
    assert "got 'k9_as_loss'; did you mean 'k3_as_loss'?" in "\n".join(err)
    assert "  rollout.max_new_tokens must be greater than or equal to 1, got -3" in err
    assert not out.exists()


def test_train_help_lists_every_dotted_flag_with_its_doc_from_the_schema(capsys):
    """The flags, their help and their choices come from the records (pydantic's JSON schema), like the docs."""
    from klgrad.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for dotted in FIELDS:
        assert f"  --{dotted} " in out, dotted
    assert "  --kl.beta  KL weight β" in out
    assert "  --kl.level {sequence,token_to_go,token}  Where the head acts" in out
