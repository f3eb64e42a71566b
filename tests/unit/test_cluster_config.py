"""ClusterConfig from YAML, the environment and `raylane serve` flags, with clear errors."""

from __future__ import annotations

import pytest
from raylane.actors.engine.config import EngineConfig
from raylane.cli import build_parser
from raylane.config import ClusterConfig
from raylane.serve_cli import config_from_args


def test_yaml_then_env_then_flags(tmp_path, monkeypatch):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "model: /models/a\nreplicas: 2\nport: 9000\n"
        "engine:\n  max_num_seqs: 8\n  enable_prefix_caching: false\n"
    )
    config = ClusterConfig.from_yaml(str(path))
    assert (config.model, config.replicas, config.port) == ("/models/a", 2, 9000)
    assert config.engine == {"max_num_seqs": 8, "enable_prefix_caching": False}

    monkeypatch.setenv("RAYLANE_CONFIG", str(path))
    monkeypatch.setenv("RAYLANE_REPLICAS", "3")
    monkeypatch.setenv("RAYLANE_API_KEYS", "k1,k2")
    env = ClusterConfig.from_env()
    assert (env.replicas, env.api_keys, env.port) == (3, ("k1", "k2"), 9000)

    argv = [
        "serve",
        "--config",
        str(path),
        "--port",
        "9100",
        "--max-num-seqs",
        "4",
        "--api-key",
        "only",
        "--torch-threads",
        "1",
    ]
    flags = config_from_args(build_parser(argv).parse_args(argv))
    assert (flags.port, flags.replicas, flags.api_keys) == (9100, 3, ("only",))
    assert flags.engine["max_num_seqs"] == 4
    assert (flags.torch_threads, flags.replica_threads()) == (1, 1)


def test_raylane_config_reaches_the_cli_and_the_serve_app(tmp_path, monkeypatch):
    """The paths `raylane serve` and a RayService really take: no --config flag, and Serve
    args on top of the YAML."""
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "model: /models/a\nreplicas: 2\nmax_queue_per_replica: 7\n"
        "engine:\n  max_num_seqs: 8\n  dtype: float32\n"
    )
    monkeypatch.setenv("RAYLANE_CONFIG", str(path))
    monkeypatch.setenv("RAYLANE_PORT", "9300")
    argv = ["serve", "--max-model-len", "128", "--max-n", "8", "--request-timeout", "2.5"]
    cli = config_from_args(build_parser(argv).parse_args(argv))
    assert (cli.max_n, cli.request_timeout_s) == (8, 2.5)
    assert (cli.model, cli.replicas, cli.max_queue_per_replica, cli.port) == (
        "/models/a",
        2,
        7,
        9300,
    )
    assert cli.engine == {"max_num_seqs": 8, "dtype": "float32", "max_model_len": 128}
    app = ClusterConfig.for_serve_app({"replicas": 3, "engine": {"max_num_seqs": 16}})
    assert (app.model, app.replicas, app.max_queue_per_replica, app.port) == (
        "/models/a",
        3,
        7,
        9300,
    )
    assert app.engine == {"max_num_seqs": 16, "dtype": "float32"}
    monkeypatch.delenv("RAYLANE_CONFIG")
    assert ClusterConfig.for_serve_app({"replicas": 3}).model is None


@pytest.mark.parametrize(
    "data, field",
    [
        ({"replicas": 0}, "replicas"),
        ({"engine": {"max_num_seqz": 4}}, "max_num_seqz"),
        ({"prot": 80}, "prot"),
    ],
)
def test_bad_config_names_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        ClusterConfig.from_dict(data)


def test_admin_api_key_from_yaml_env_and_flag(tmp_path, monkeypatch):
    path = tmp_path / "cluster.yaml"
    path.write_text("admin_api_key: from-yaml\napi_keys: [user]\n")
    assert ClusterConfig.from_yaml(str(path)).admin_api_key == "from-yaml"
    monkeypatch.setenv("RAYLANE_CONFIG", str(path))
    monkeypatch.setenv("RAYLANE_ADMIN_API_KEY", "from-env")
    assert ClusterConfig.from_env().admin_api_key == "from-env"
    argv = ["serve", "--config", str(path), "--admin-api-key", "from-flag"]
    assert config_from_args(build_parser(argv).parse_args(argv)).admin_api_key == "from-flag"
    assert ClusterConfig().admin_api_key is None  # no admin routes unless asked
    for bad, message in (
        ({"admin_api_key": ""}, "empty"),
        ({"admin_api_key": "k", "api_keys": ("k",)}, "differ"),
    ):
        with pytest.raises(ValueError, match=message):
            ClusterConfig(**bad)


def test_yaml_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        ClusterConfig.from_yaml(str(path))


def test_tensor_parallel_size_from_yaml_and_flag(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  tensor_parallel_size: 3\n  shard_resources: {CPU: 0.5}\n")
    assert ClusterConfig.from_yaml(str(path)).engine["tensor_parallel_size"] == 3
    argv = ["serve", "--config", str(path), "--tensor-parallel-size", "2"]
    flags = config_from_args(build_parser(argv).parse_args(argv))
    assert flags.engine == {"tensor_parallel_size": 2, "shard_resources": {"CPU": 0.5}}
    argv = ["serve"]  # no flag: TP=1 in the replica process, as before
    plain = config_from_args(build_parser(argv).parse_args(argv))
    assert "tensor_parallel_size" not in plain.engine


def test_serve_help_explains_tensor_parallel_size(capsys):
    with pytest.raises(SystemExit):
        build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--tensor-parallel-size N" in help_text and "placement group" in help_text


@pytest.mark.parametrize(
    "engine, field",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": "2"}, "tensor_parallel_size"),
        ({"distributed_executor_backend": "mpi"}, "distributed_executor_backend"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "'ray'"),
        ({"shard_resources": {"CPU": -1}}, "shard_resources"),
    ],
)
def test_bad_engine_values_fail_when_the_config_loads(engine, field):
    with pytest.raises(ValueError, match=field):
        ClusterConfig(engine=engine)


def test_serve_with_a_bad_tp_size_exits_2_before_starting_ray(capsys):
    from raylane.serve_cli import run

    argv = ["serve", "--tensor-parallel-size", "0"]
    assert run(build_parser(argv).parse_args(argv)) == 2
    assert "tensor_parallel_size must be >= 1" in capsys.readouterr().err


def test_replica_bundles_and_the_fit_check():
    from raylane.actors.executor.placement import check_fits_one_node, replica_bundles

    bundles = replica_bundles({"CPU": 1.5}, 2)
    assert bundles == [{"CPU": 0.01}, {"CPU": 1.5}, {"CPU": 1.5}]
    nodes = [
        {"Alive": True, "Resources": {"CPU": 2.0}},
        {"Alive": False, "Resources": {"CPU": 8.0}},
    ]
    with pytest.raises(ValueError, match=r"CPU: needs 3\.01, the largest node has 2"):
        check_fits_one_node(bundles, nodes, "one engine replica")
    check_fits_one_node(replica_bundles({"CPU": 0.5}, 2), nodes, "one engine replica")


def test_a_replica_group_too_small_for_its_shards_is_named():
    from raylane.actors.executor.placement import _check_replica_group, replica_bundles

    _check_replica_group(replica_bundles({"GPU": 1.0}, 2), {"GPU": 1.0}, 2)
    with pytest.raises(ValueError, match="needs 3"):
        _check_replica_group(replica_bundles({"GPU": 1.0}, 1), {"GPU": 1.0}, 2)
    with pytest.raises(ValueError, match="cannot hold a shard"):  # a CPU group, GPU shards
        _check_replica_group(replica_bundles({"CPU": 0.1}, 2), {"GPU": 1.0}, 2)


def test_tp1_deploys_without_a_placement_group():
    from raylane.serve import replica_spec

    config = ClusterConfig(replicas=2, engine={"max_num_seqs": 4})
    spec = replica_spec(config, "m")
    assert (spec.count, spec.bundles) == (2, None)
    assert spec.engine_options == {"model": "m", "max_num_seqs": 4}


def test_a_replica_spec_key_changes_with_the_engine_only():
    from raylane.router.replica_set import ReplicaSpec

    base = ReplicaSpec({"model": "m"}, 2, 1, None, stamp=1.0)
    assert ReplicaSpec({"model": "m"}, 3, 1, None, stamp=2.0).key == base.key  # scale, rebuild
    assert ReplicaSpec({"model": "m", "seed": 1}, 2, 1, None).key != base.key
    assert ReplicaSpec({"model": "m"}, 2, 2, None).key != base.key  # threads
    assert ReplicaSpec({"model": "m"}, 2, 1, [{"CPU": 1.0}]).key != base.key  # placement


def test_keys_never_show_in_a_printed_config():
    config = ClusterConfig(api_keys=("sk-user-secret-1",), admin_api_key="sk-admin-secret-2")
    for text in (repr(config), str(config), f"{config}"):
        assert "secret" not in text


def test_dtype_and_graph_options_from_flags_and_yaml(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  dtype: float32\n  cudagraph_capture_sizes: [8, 1, 4]\n")
    argv = ["serve", "--config", str(path), "--dtype", "bfloat16", "--enforce-eager"]
    flags = config_from_args(build_parser(argv).parse_args(argv))
    assert flags.engine["dtype"] == "bfloat16"  # the flag wins over the YAML
    engine = flags.engine_config("/models/a")
    assert engine.enforce_eager is True
    assert engine.cudagraph_capture_sizes == (1, 4, 8)  # sorted, as a tuple
    argv = ["serve", "--config", str(path)]
    assert (
        config_from_args(build_parser(argv).parse_args(argv)).engine_config("/m").enforce_eager
        is None
    )  # graphs where they capture
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        ClusterConfig.from_dict({"engine": {"cudagraph_capture_sizes": [0, 8]}})
    with pytest.raises(SystemExit):
        argv = ["serve", "--dtype", "float64"]
        build_parser(argv).parse_args(argv)


def test_batch_invariant_from_the_flag_yaml_and_serve_args(tmp_path, monkeypatch):
    argv = ["serve", "--batch-invariant"]
    assert config_from_args(build_parser(argv).parse_args(argv)).engine_config("/m").batch_invariant
    argv = ["serve"]
    assert (
        not config_from_args(build_parser(argv).parse_args(argv))
        .engine_config("/m")
        .batch_invariant
    )
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  batch_invariant: true\n")
    assert ClusterConfig.from_yaml(str(path)).engine_config("/m").batch_invariant
    monkeypatch.setenv("RAYLANE_CONFIG", str(path))  # a RayService's args merge key by key
    app = ClusterConfig.for_serve_app({"engine": {"max_num_seqs": 4}})
    assert app.engine_config("/m").batch_invariant
    with pytest.raises(ValueError, match="batch_invariant"):
        ClusterConfig.from_dict({"engine": {"batch_invariant": "yes"}})


def test_the_ingress_reads_the_engines_tokenizer(tiny_llama_dir, tmp_path):
    """`engine.tokenizer` names another tokenizer: the ingress (chat templates, token counts)
    must use the one the engine uses, not the model directory's."""
    from raylane.serve import _model_facts
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tiny_llama_dir)
    other.chat_template = "OTHER {{ messages[0]['content'] }}"
    other.save_pretrained(tmp_path)
    config = ClusterConfig(model=tiny_llama_dir, engine={"tokenizer": str(tmp_path)})
    tokenizer = _model_facts(tiny_llama_dir, config)[0]
    assert tokenizer.chat_template == other.chat_template
    own = _model_facts(tiny_llama_dir, ClusterConfig(model=tiny_llama_dir))[0]
    assert own.chat_template != other.chat_template


def test_an_engine_typo_in_yaml_fails_at_load_naming_the_key_and_its_match(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  max_num_seqs: 8\n  enable_prefix_cacheing: false\n")
    with pytest.raises(ValueError, match="'enable_prefix_cacheing' .did you mean 'enable_pre"):
        ClusterConfig.from_yaml(str(path))
    path.write_text("engine: [max_num_seqs]\n")
    with pytest.raises(ValueError, match="ClusterConfig.engine must be a mapping"):
        ClusterConfig.from_yaml(str(path))
    path.write_text("replicas: 2\nengine:\n")  # an empty section is no options
    assert ClusterConfig.from_yaml(str(path)).engine == {}


def test_the_engine_section_is_typed_read_only_and_survives_pickling():
    import pickle

    from raylane.engine_options import EngineOptions

    config = ClusterConfig(engine={"max_num_seqs": 8, "dtype": "float32"})
    assert isinstance(config.engine, EngineOptions)
    with pytest.raises(TypeError):
        config.engine["max_num_seqs"] = 9  # type: ignore[index]
    engine = config.engine_config("/m")  # given keys, the engine's defaults for the rest
    assert (engine.max_num_seqs, engine.dtype) == (8, "float32")
    assert engine.block_size == EngineConfig(model="/m").block_size
    shipped = pickle.loads(pickle.dumps(config))  # as Serve ships it to the replicas
    assert shipped == config and shipped.engine == {"max_num_seqs": 8, "dtype": "float32"}
