import re

import pytest
import yaml
from support.configs import ROOT

import engine.config.load as load_module
from engine.config import load_config, to_yaml
from engine.errors import UsageError


def test_defaults_and_base_config_are_merged(make_config):
    cfg = make_config()
    assert cfg.model.name == "mlp" and cfg.model.hidden_sizes == [128] and cfg.model.dropout_rate == 0.2
    assert cfg.data.name == "digits"
    assert cfg.train.param_dtype == "float32"  # from base.yaml
    assert cfg.mesh.rules["embed"] == ["fsdp"]  # a schema default no file mentions
    assert cfg.checkpoint.keep == 3


def test_overrides_are_typed_and_nested(make_config):
    cfg = make_config(
        "mnist_mlp.yaml",
        "train.steps=7",
        "optimizer.learning_rate=3e-4",
        "model.hidden_sizes=[32,16]",
        "mesh.rules.embed=[tensor]",
        "mesh.rules.newaxis=[fsdp]",
    )
    assert cfg.train.steps == 7 and cfg.optimizer.learning_rate == pytest.approx(3e-4)
    assert cfg.model.hidden_sizes == [32, 16]
    assert cfg.mesh.rules["embed"] == ["tensor"] and cfg.mesh.rules["newaxis"] == ["fsdp"]


def test_model_name_override_switches_model_schema(make_config):
    cfg = make_config("mnist_mlp.yaml", "model.name=cnn", "model.channels=[4]")
    assert cfg.model.name == "cnn" and cfg.model.channels == [4]


def test_unknown_key_names_the_key_and_the_closest_valid_one(make_config):
    with pytest.raises(UsageError, match=r"unknown config key 'train.stepz'.*did you mean 'train.steps'"):
        make_config("mnist_mlp.yaml", "train.stepz=3")
    with pytest.raises(UsageError, match=r"'model.hiden_sizes'.*'model.hidden_sizes'"):
        make_config("mnist_mlp.yaml", "model.hiden_sizes=[3]")


def test_wrong_type_names_key_value_and_expected_type(make_config):
    with pytest.raises(UsageError, match=r"'train.steps' got 'abc' \(str\).*must be an int"):
        make_config("mnist_mlp.yaml", "train.steps=abc")
    with pytest.raises(UsageError, match=r"'optimizer.learning_rate' got 'fast'.*must be a float"):
        make_config("mnist_mlp.yaml", "optimizer.learning_rate=fast")


def test_bad_values_are_rejected_with_a_fix(make_config):
    with pytest.raises(UsageError, match=r"optimizer.name='adamm'.*did you mean optimizer.name=adam"):
        make_config("mnist_mlp.yaml", "optimizer.name=adamm")
    with pytest.raises(UsageError, match="not divisible by train.grad_accum_steps=3"):
        make_config("mnist_mlp.yaml", "train.global_batch_size=64", "train.grad_accum_steps=3")
    with pytest.raises(UsageError, match="model.name='mlpp'"):
        make_config("mnist_mlp.yaml", "model.name=mlpp")
    with pytest.raises(UsageError, match="train.steps=0 must be positive"):
        make_config("mnist_mlp.yaml", "train.steps=0")
    # calls end at every log line: at most 20 steps per call, and a divisor of 30, 500, 50, 1500
    assert make_config("mnist_mlp.yaml", "train.steps_per_call=20", "log.every_steps=30").train.steps_per_call == 10
    assert make_config("mnist_mlp.yaml", "train.steps_per_call=20", "log.every_steps=7").train.steps_per_call == 1


def test_unknown_key_in_a_file_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(f"extends: {ROOT / 'configs' / 'mnist_mlp.yaml'}\ntrain:\n  step: 5\n")
    with pytest.raises(UsageError, match=r"'train.step' \(from .*bad.yaml\).*did you mean 'train.steps'"):
        load_config(path)


def test_loads_of_one_file_with_different_overrides_stay_apart(tmp_path):
    """A sweep loads one file many times with each run's overrides (the file's layer is kept
    between loads): no run's override or workdir leaks into the next, and an edited file is
    read anew."""
    path = tmp_path / "base.yaml"
    path.write_text("train: {steps: 7}\noptimizer: {learning_rate: 0.5}\n")
    first = load_config(path, ["optimizer.learning_rate=0.1", "model.hidden_sizes=[16]"], str(tmp_path / "a"))
    second = load_config(path, ["train.steps=9"], str(tmp_path / "b"))
    assert (first.optimizer.learning_rate, first.model.hidden_sizes, first.train.steps) == (0.1, [16], 7)
    assert (second.optimizer.learning_rate, second.model.hidden_sizes, second.train.steps) == (0.5, [128], 9)
    assert (first.workdir, second.workdir) == (str(tmp_path / "a"), str(tmp_path / "b"))
    path.write_text("train: {steps: 8}\n")
    assert load_config(path, [], str(tmp_path / "c")).train.steps == 8
    path.write_text("train: {steps: 8, on: 1}\n")  # YAML reads `on` as True: a key of another type
    with pytest.raises(UsageError, match="unknown config key 'train.True'"):
        load_config(path, [], str(tmp_path / "d"))


def test_resolved_config_reproduces_the_run(make_config, tmp_path):
    cfg = make_config("mnist_mlp.yaml", "train.steps=11", "model.hidden_sizes=[20]")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert "extends" not in yaml.safe_load(path.read_text())
    again = load_config(path)
    assert again == cfg


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("seed: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize(
    "text, expected",
    [("", "is empty"), ("train:\n  steps: [1\n", ".yaml:3:1 is not valid YAML")],
    ids=["empty", "syntax-error"],
)
def test_bad_config_files_are_named_with_the_place(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=re.escape(expected)):
        load_config(path)


def test_a_shipped_config_by_bare_name(tmp_path):
    assert load_config("gpt_small", [], str(tmp_path)).model.name == "transformer"


def test_a_warm_up_longer_than_the_run_is_clamped_with_a_warning(make_config, capsys):
    cfg = make_config("gpt_small.yaml", "train.steps=4")
    assert cfg.optimizer.warmup_steps == 4
    assert "warning: optimizer.warmup_steps=50 exceeds train.steps=4" in capsys.readouterr().err


def test_config_files_that_expand_or_point_nowhere_are_refused_by_name(tmp_path, monkeypatch):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcde", "bcdef")
    )
    cases = {
        "bomb.yaml": (bomb, "expands to more than 100,000 values"),
        "five.yaml": ("extends: 5\n", r"extends: 5 must be the path of one config file"),
        "interp.yaml": ("extends: base.yaml\ndata:\n  path: ${foo}\n", r"Interpolation key 'foo' not found"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        (tmp_path / "base.yaml").write_text((ROOT / "configs" / "base.yaml").read_text())
        with monkeypatch.context() as patched:
            if name == "bomb.yaml":  # refused while counting, before anything expands the aliases
                patched.setattr(load_module.OmegaConf, "create", _never)
            with pytest.raises(UsageError, match=message):
                load_config(tmp_path / name, [], str(tmp_path / "run"))
    with pytest.raises(UsageError, match=r"seed=-1 must be 0 or more"):
        load_config("mnist_mlp", ["seed=-1"], str(tmp_path / "run"))


def test_extends_names_a_shipped_config_by_bare_name_from_anywhere(tmp_path):
    """A user's own file extends a shipped config by bare name, as --config takes it; a name
    that is neither a file nor shipped lists the shipped ones, base.yaml included."""
    (tmp_path / "mine").mkdir()
    for base in ("base", "base.yaml", "mnist_mlp"):
        (tmp_path / "mine" / "run.yaml").write_text(f"extends: {base}\nmodel: {{name: mlp}}\ntrain: {{steps: 7}}\n")
        cfg = load_config(tmp_path / "mine" / "run.yaml", [], str(tmp_path / "run"))
        assert cfg.train.steps == 7, base
    (tmp_path / "mine" / "base.yaml").write_text("model: {name: mlp}\ntrain: {steps: 3}\n")  # the user's own base
    (tmp_path / "mine" / "run.yaml").write_text("extends: base\n")
    assert load_config(tmp_path / "mine" / "run.yaml", [], str(tmp_path / "run")).train.steps == 3
    (tmp_path / "mine" / "run.yaml").write_text("extends: nowhere\n")
    with pytest.raises(UsageError, match=r"does not exist; shipped configs \(also by bare name\): base.yaml, "):
        load_config(tmp_path / "mine" / "run.yaml", [], str(tmp_path / "run"))


def _never(*args, **kwargs):
    raise AssertionError("the YAML alias bomb reached OmegaConf")


def test_sweeps_of_absurd_size_are_refused(tmp_path):
    from engine.sweep.spec import load_sweep

    (tmp_path / "huge.yaml").write_text(
        f"base: {ROOT / 'configs' / 'mnist_mlp.yaml'}\n"
        "random: {samples: 100000000, params: {seed: {int_uniform: [0, 9]}}}\n"
    )
    with pytest.raises(UsageError, match="random.samples=100,000,000 is more than 10,000 runs"):
        load_sweep(tmp_path / "huge.yaml")
    (tmp_path / "grid.yaml").write_text(
        f"base: {ROOT / 'configs' / 'mnist_mlp.yaml'}\ngrid:\n"
        + "".join(
            f"  {k}: [{', '.join(map(str, range(20)))}]\n"
            for k in ("seed", "train.steps", "log.every_steps", "eval.every_steps")
        )
    )
    with pytest.raises(UsageError, match="makes 160,000 runs"):
        load_sweep(tmp_path / "grid.yaml")
