"""`--trainer-api` travels from the CLI and YAML into ClusterConfig, off by default; the app
mounts the trainer protocols' routes only when asked, and guards those that change state."""

from __future__ import annotations

import argparse

import pytest
from raylane.config import ClusterConfig
from raylane.serve_cli import add_arguments, config_from_args
from raylane.session_server.trainer_api import MODULES, mount


def test_the_setting_travels_from_the_cli_and_yaml(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYLANE_CONFIG", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--trainer-api"])).trainer_api is True
    assert config_from_args(parser.parse_args([])).trainer_api is False
    path = tmp_path / "cluster.yaml"
    path.write_text("trainer_api: true\n")
    assert ClusterConfig.from_yaml(str(path)).trainer_api is True
    with pytest.raises(ValueError, match="trainer_api"):
        ClusterConfig(trainer_api="yes")  # type: ignore[arg-type]


def test_every_state_changing_route_is_guarded():
    from fastapi import FastAPI

    guarded = mount(FastAPI())
    assert {"/pause", "/resume", "/pause_generation", "/flush_cache", "/abort_request"} <= guarded
    for module in MODULES:  # the reads and generation stay user routes
        assert not guarded & {r.path for r in module.router.routes}, module.__name__
