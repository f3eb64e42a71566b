"""ClusterConfig's `consolidation` section from YAML, the environment and `raylane serve`, with
clear errors that never echo the DSN; and how the serve app starts the consolidation actor."""

from __future__ import annotations

import pytest
from raylane.cli import build_parser
from raylane.config import ClusterConfig
from raylane.serve_cli import config_from_args

CONSOLIDATION_YAML = """\
consolidation:
  dsn: postgresql://raylane:pg-secret-3@db:5432/memories
  banks: [agent-7, agent-8, agent-7]
  interval_s: 30
  llm_batch_size: 4
  max_parallel_groups: 2
"""


def test_consolidation_section_from_yaml(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYLANE_CONSOLIDATION_DSN", raising=False)
    path = tmp_path / "cluster.yaml"
    path.write_text(CONSOLIDATION_YAML)
    config = ClusterConfig.from_yaml(str(path))
    service = config.consolidation_config()
    assert service.dsn == "postgresql://raylane:pg-secret-3@db:5432/memories"
    assert service.banks == ("agent-7", "agent-8")  # each once, in order
    assert (service.interval_s, service.model, service.max_tokens) == (30, None, 1024)
    limits = service.limits
    assert (limits.batch_size, limits.llm_batch_size, limits.max_parallel_groups) == (50, 4, 2)
    assert "secret" not in repr(config) and "secret" not in repr(service)
    assert ClusterConfig().consolidation_config() is None  # no section, no actor


def test_consolidation_banks_all_and_the_dsn_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLANE_CONSOLIDATION_DSN", "postgresql://env@db/m")
    service = ClusterConfig(consolidation={"banks": "all"}).consolidation_config()
    assert (service.dsn, service.banks) == ("postgresql://env@db/m", None)
    assert ClusterConfig(consolidation={}).consolidation_config().banks is None
    path = tmp_path / "cluster.yaml"
    path.write_text(CONSOLIDATION_YAML)
    monkeypatch.setenv("RAYLANE_CONFIG", str(path))
    argv = ["serve"]  # the environment wins over the YAML, as for every other option
    cli = config_from_args(build_parser(argv).parse_args(argv))
    assert cli.consolidation_config().dsn == "postgresql://env@db/m"
    assert cli.consolidation_config().banks == ("agent-7", "agent-8")


@pytest.mark.parametrize(
    "section, message",
    [
        ({"dsn": "pg://x", "interval": 5}, "interval"),
        ({"dsn": "pg://x", "bank": ["a"]}, "bank"),
        ({"interval_s": 5}, "RAYLANE_CONSOLIDATION_DSN"),
        ({"dsn": ""}, "dsn"),
        ({"dsn": "pg://x", "interval_s": 0}, "interval_s"),
        ({"dsn": "pg://x", "interval_s": "60"}, "interval_s"),
        ({"dsn": "pg://x", "banks": []}, "banks"),
        ({"dsn": "pg://x", "banks": "agent-7"}, "banks"),
        ({"dsn": "pg://x", "banks": ["a", ""]}, "banks"),
        ({"dsn": "pg://x", "batch_size": 0}, "batch_size"),
        ({"dsn": "pg://x", "max_parallel_groups": True}, "max_parallel_groups"),
        ({"dsn": "pg://x", "max_tokens": 0}, "max_tokens"),
        ({"dsn": "pg://x", "model": ""}, "model"),
        (["dsn"], "mapping"),
    ],
)
def test_bad_consolidation_section_names_the_key(section, message, monkeypatch):
    monkeypatch.delenv("RAYLANE_CONSOLIDATION_DSN", raising=False)
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict({"consolidation": section})


def test_a_bad_dsn_is_never_echoed(monkeypatch):
    monkeypatch.delenv("RAYLANE_CONSOLIDATION_DSN", raising=False)
    with pytest.raises(ValueError) as info:
        ClusterConfig(consolidation={"dsn": 12345})
    assert "12345" not in str(info.value)


def test_serve_help_shows_how_to_turn_consolidation_on(capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    assert "\n  consolidation:\n    dsn: postgresql://" in help_text  # the YAML keeps its lines
    assert "RAYLANE_CONSOLIDATION_DSN" in help_text and "raylane:consolidation_" in help_text


def test_consolidation_metrics_are_merged_only_when_configured():
    from raylane.consolidation import ActorMetrics, metrics_sources

    assert metrics_sources(ClusterConfig()) == []
    (source,) = metrics_sources(ClusterConfig(consolidation={"dsn": "pg://x"}))
    assert isinstance(source, ActorMetrics)


def test_the_app_logs_an_unusable_database_and_tries_again(monkeypatch, caplog):
    """The Ingress's start of the consolidation actor (an import_path deploy): after the app
    answers; a database it cannot use is logged (no DSN in it) and tried again, never raised."""
    import logging
    import threading

    from raylane import consolidation, listener

    calls: list[str] = []
    done = threading.Event()

    def start(config, url, model_name):
        calls.append(f"{url} {model_name}")
        if len(calls) == 2:  # the first try
            raise ValueError(
                "consolidation: cannot use the database at consolidation.dsn: "
                "ConnectionRefusedError: refused"
            )
        done.set()

    monkeypatch.setattr(consolidation, "serve_url", lambda: "http://10.0.0.7:8000")
    monkeypatch.setattr(listener, "wait_healthy", lambda url, timeout_s: calls.append("healthy"))
    monkeypatch.setattr(consolidation, "start_consolidation", start)
    monkeypatch.setattr(consolidation, "RETRY_S", 0.01)
    logging.getLogger("ray.serve").addHandler(caplog.handler)
    try:
        config = ClusterConfig(consolidation={"dsn": "postgresql://u:pw-secret@db/m"})
        thread = consolidation.start_with_app(config, "smollm2")
        assert done.wait(10) and (thread.join(10) or not thread.is_alive())
    finally:
        logging.getLogger("ray.serve").removeHandler(caplog.handler)
    assert calls == ["healthy", "http://10.0.0.7:8000 smollm2"] * 2
    # one record, which reaches caplog twice when ray.serve propagates to the root logger too
    # (it does until Serve configures it: the file alone, or run first)
    (error,) = {r for r in caplog.records if r.levelno == logging.ERROR}
    assert "cannot use the database" in error.getMessage()
    assert "serves on" in error.getMessage() and "pw-secret" not in error.getMessage()
    assert consolidation.start_with_app(ClusterConfig(), "m") is None  # no section: no thread


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://10.1.2.3:8123"),
        ("127.0.0.1", "http://127.0.0.1:8123"),
        ("::", "http://10.1.2.3:8123"),
        ("fd00::5", "http://[fd00::5]:8123"),
    ],
)
def test_the_actor_asks_the_serve_address_any_node_can_reach(host, url, monkeypatch):
    from types import SimpleNamespace

    import ray
    import ray.serve.context
    from raylane.consolidation import serve_url

    client = SimpleNamespace(http_config=SimpleNamespace(host=host, port=8123))
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda: client)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    assert serve_url() == url
