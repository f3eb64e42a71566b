"""ClusterConfig from YAML, the environment and `raylane serve` flags, with clear errors."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser
from cluster.config import ClusterConfig
from cluster.serve_cli import config_from_args


def test_yaml_then_env_then_flags(tmp_path, monkeypatch):
    path = tmp_path / "cluster.yaml"
    path.write_text("model: /models/a\nreplicas: 2\nport: 9000\n"
                    "engine:\n  max_num_seqs: 8\n  enable_prefix_caching: false\n")
    config = ClusterConfig.from_yaml(str(path))
    assert (config.model, config.replicas, config.port) == ("/models/a", 2, 9000)
    assert config.engine == {"max_num_seqs": 8, "enable_prefix_caching": False}

    monkeypatch.setenv("RAYLANE_CONFIG", str(path))
    monkeypatch.setenv("RAYLANE_REPLICAS", "3")
    monkeypatch.setenv("RAYLANE_API_KEYS", "k1,k2")
    env = ClusterConfig.from_env()
    assert (env.replicas, env.api_keys, env.port) == (3, ("k1", "k2"), 9000)

    argv = ["serve", "--config", str(path), "--port", "9100", "--max-num-seqs", "4",
            "--api-key", "only"]
    flags = config_from_args(build_parser(argv).parse_args(argv))
    assert (flags.port, flags.replicas, flags.api_keys) == (9100, 3, ("only",))
    assert flags.engine["max_num_seqs"] == 4


@pytest.mark.parametrize("data, field", [
    ({"replicas": 0}, "replicas"),
    ({"engine": {"max_num_seqz": 4}}, "max_num_seqz"),
    ({"prot": 80}, "prot"),
])
def test_bad_config_names_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        ClusterConfig.from_dict(data)


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        ClusterConfig.from_yaml(str(path))
