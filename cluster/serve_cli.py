"""`raylane serve`: serve a model over an OpenAI-compatible HTTP endpoint on Ray Serve."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF directory or .gguf file (default: the embedded "
                                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--config", help="a YAML file with ClusterConfig fields; flags win")
    parser.add_argument("--replicas", type=int, help="engine replicas (default 1)")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    parser.add_argument("--served-model-name", help="the model id clients send")
    parser.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (repeat for several keys)")
    parser.add_argument("--max-num-seqs", type=int, help="sequences per engine step")
    parser.add_argument("--max-model-len", type=int, help="context length limit")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="record MoE routing so requests can ask for routed experts")
    parser.add_argument("--ray-address", help="join an existing Ray cluster (default: start one)")


def config_from_args(args: argparse.Namespace):
    from cluster.config import ClusterConfig

    config = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
    config = ClusterConfig.from_env(config)
    updates = {name: getattr(args, name) for name in
               ("model", "replicas", "host", "port", "served_model_name", "ray_address")
               if getattr(args, name) is not None}
    if args.api_keys:
        updates["api_keys"] = tuple(args.api_keys)
    engine = dict(config.engine)
    for name in ("max_num_seqs", "max_model_len"):
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    if args.enable_return_routed_experts:
        engine["enable_return_routed_experts"] = True
    return dataclasses.replace(config, engine=engine, **updates)


def run(args: argparse.Namespace) -> int:
    from cluster import launch

    config = config_from_args(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    launch.start_ray(config.ray_address)
    try:
        url = launch.deploy(config)
        print(f"raylane is serving at {url}/v1 (OpenAI API), {url}/generate, {url}/metrics "
              f"- Ctrl-C to stop", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("shutting down Ray...", file=sys.stderr, flush=True)
        launch.shutdown()
    return 0
