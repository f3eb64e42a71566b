"""LoRA's serving configuration: `raylane serve`'s flags in vLLM's shapes, the YAML fields, and
the Helm chart's `serving.lora` (rendered offline, its Serve args loaded into ClusterConfig and
an EngineConfig, bad values refused)."""

from __future__ import annotations

import argparse

import pytest
import yaml
from raylane.config import ClusterConfig
from raylane.serve_cli import add_arguments, config_from_args


def parse(*argv: str) -> ClusterConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_flags_in_vllms_shapes():
    config = parse(
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        "a=/adapters/a",
        '{"name": "b", "path": "/adapters/b", "base_model_name": "base"}',
    )
    engine = config.engine_config("/m")
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 2, 8)
    assert config.lora_modules == (
        {"name": "a", "path": "/adapters/a"},
        {"name": "b", "path": "/adapters/b", "base_model_name": "base"},
    )


def test_lora_modules_alone_turn_lora_on():
    config = parse("--lora-modules", "a=/x")
    assert config.engine["enable_lora"] is True


@pytest.mark.parametrize("bad", ["no-equals-sign", "=path", "name=", '{"name": "a"}', "{oops"])
def test_bad_lora_module_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit):
        parse("--lora-modules", bad)
    assert "--lora-modules" in capsys.readouterr().err


def test_yaml_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "engine": {"enable_lora": True, "max_loras": 3},
                "lora_modules": [{"name": "a", "path": "/x"}],
            }
        )
    )
    config = ClusterConfig.from_yaml(str(path))
    assert config.engine_config("/m").max_loras == 3
    assert config.lora_modules == ({"name": "a", "path": "/x"},)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lora_modules": [{"name": "a", "path": "/x"}]}, "needs engine.enable_lora"),
        ({"engine": {"enable_lora": True}, "lora_modules": [{"name": "a"}]}, "'path'"),
        (
            {
                "engine": {"enable_lora": True},
                "lora_modules": [{"name": "a", "path": "/x", "r": 1}],
            },
            "unknown key",
        ),
    ],
)
def test_bad_yaml_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(fields)


helm_chart = pytest.importorskip("tests.unit.test_helm_chart")


def serve_args(values: dict) -> dict:
    service = helm_chart.only(helm_chart.render(values), "RayService")
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    return app["args"]


def test_helm_serving_lora_renders_into_the_config():
    modules = [{"name": "a", "path": "/models/a"}]
    lora = {"enabled": True, "maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 6}
    config = ClusterConfig.from_dict(
        serve_args({"serving": {"lora": {**lora, "modules": modules}}})
    )
    engine = config.engine_config("/m")
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 2, 32)
    assert engine.max_cpu_loras == 6
    assert config.lora_modules == tuple(modules)
    report = helm_chart.helm.lint(str(helm_chart.CHART), {"serving": {"lora": lora}}, strict=True)
    assert not report["errors"]


def test_helm_lora_off_by_default():
    args = serve_args({})
    assert "enable_lora" not in args["engine"] and "lora_modules" not in args


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"enabled": "yes"}, "enabled"),
        ({"enabled": True, "maxLoras": 0}, "maxLoras"),
        ({"modules": [{"name": "a", "path": "/x"}]}, "needs serving.lora.enabled"),
        ({"enabled": True, "modules": [{"name": "a"}]}, "path"),
    ],
)
def test_helm_bad_lora_values_refused(lora, message):
    with pytest.raises(Exception, match=message):
        helm_chart.render({"serving": {"lora": lora}})
