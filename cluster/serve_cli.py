"""`raylane serve`: serve a model over an OpenAI-compatible HTTP endpoint on Ray Serve."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import signal
import sys
import textwrap
import threading

from raylane.serve_lora_args import add_lora_arguments, lora_options
from raylane.session_server.tool_calls import PARSERS

CONSOLIDATION_HELP = """\
Consolidation: a `consolidation:` section in the --config YAML (or RAYLANE_CONFIG) starts
one consolidation actor with the cluster, which folds agents' memories in PostgreSQL into
observations, using this endpoint as its LLM (with the first --api-key, if any). Its
counters appear on /metrics as raylane:consolidation_*. For example:

  consolidation:
    dsn: postgresql://raylane@db:5432/memories  # required, or RAYLANE_CONSOLIDATION_DSN
    banks: all                # or a list of bank ids (default: all)
    interval_s: 60            # the next pass starts this long after one ends
    batch_size: 50            # memories fetched per round
    llm_batch_size: 8         # memories per LLM call
    max_parallel_groups: 4    # LLM calls in flight (banks are run one at a time)
    max_tokens: 1024          # the longest answer of one call
    model: my-model           # default: the served model name
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Multi-turn sessions (/sessions) live in the Router actor's memory. "
        "Without --sessions-dsn (or RAYLANE_SESSIONS_DSN) a Router restart loses "
        "them (their ids answer 404); with it every session is written through to "
        "PostgreSQL and survives a restart. A session unused for an hour "
        "expires, and at most 10,000 are kept (the least recently used goes "
        "first); either way its id then answers 404 saying it expired."
    )
    # raw, so the YAML example keeps its lines; the paragraph above is wrapped here instead
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = textwrap.fill(parser.epilog, 90) + "\n\n" + CONSOLIDATION_HELP
    parser.add_argument(
        "--model", help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--config", help="a YAML file with ClusterConfig fields; flags win")
    parser.add_argument("--replicas", type=int, help="engine replicas (default 1)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch threads per engine replica (default: the cores split between replicas); "
        "1 where other work shares the cores (docs/serving.md)",
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    parser.add_argument("--served-model-name", help="the model id clients send")
    parser.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (repeat for several keys)",
    )
    parser.add_argument(
        "--admin-api-key",
        metavar="KEY",
        help="turn on the admin routes (/admin/...: pause, resume, weight "
        "updates, abort), which need 'Authorization: Bearer KEY'; user "
        "keys get 403 there (also RAYLANE_ADMIN_API_KEY)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        dest="request_timeout_s",
        metavar="SECONDS",
        help="default deadline of a generation (a body's 'timeout' wins): "
        "past it the request ends with its partial output, finish "
        "reason 'abort'",
    )
    parser.add_argument(
        "--max-n",
        type=int,
        metavar="N",
        help="the most samples one request may ask for (n; default 128)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        help="the format tool calls are read from the model's text in "
        "(tool_choice 'auto'; default: picked from the chat template)",
    )
    parser.add_argument("--max-num-seqs", type=int, help="sequences per engine step")
    parser.add_argument("--max-model-len", type=int, help="context length limit")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        metavar="N",
        help="split the model of each replica over N ranks (default 1: the model "
        "runs inside the replica process). N > 1 runs N ModelShard actors "
        "per replica (one GPU each on GPU nodes, 0.1 CPU each on CPU nodes; "
        "YAML engine.shard_resources changes that), always on one node: "
        "each replica gets its own placement group, and `raylane serve` "
        "fails at once if no node can hold one replica",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record MoE routing so requests can ask for routed experts",
    )
    parser.add_argument(
        "--enable-return-indexer-topk",
        action="store_true",
        help="record the sparse-attention indexer's top-k (DeepSeek-V3.2) so requests can "
        "ask for it (return_indexer_topk)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="plan each engine step while the one before runs (default on; "
        "--no-async-scheduling runs steps one after another)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights and activations (default auto: float32 on the CPU, exact "
        "against Hugging Face; bfloat16 is about 1.3x faster there, on "
        "CPUs with avx512_bf16; auto takes the checkpoint's dtype on a GPU)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant mode: a request's tokens and logprobs are bit-identical whether "
        "it runs alone or in any batch (and equal a trainer's transformers forward under "
        "raylane.batch_invariant(), docs/rl.md); greedy output is then reproducible. It "
        "costs throughput: matmuls run unpacked over rows padded to 16, RMSNorm/SiLU/RoPE "
        "as torch ops (`raylane bench throughput --batch-invariant` measures it). CPU only "
        "for now; /metrics shows raylane:batch_invariant 1",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never replay decode steps from CUDA graphs (by default a GPU "
        "replica captures one graph per batch size in "
        "engine.cudagraph_capture_sizes at start-up; the CPU runs eager)",
    )
    parser.add_argument(
        "--speculative-config",
        type=_json_object,
        help='speculative decoding as JSON, vLLM\'s names: \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' or "suffix" (drafts from the sample\'s siblings too); '
        "outputs are identical to decoding without it",
    )
    add_lora_arguments(parser)
    parser.add_argument("--ray-address", help="join an existing Ray cluster (default: start one)")
    parser.add_argument(
        "--direct-ingress",
        action=argparse.BooleanOptionalAction,
        help="the ingress replica answers HTTP on --port itself (the default "
        "on the local cluster raylane starts): one hop and two "
        "serializations less per streamed token than through Ray Serve's "
        "proxy, which then does not run. A crashed ingress replica is "
        "served again once Serve replaces it. --no-direct-ingress serves "
        "through Serve's proxy; with --ray-address the proxy is the only "
        "way (the ingress replica may land on any node)",
    )
    parser.add_argument(
        "--trainer-api",
        action="store_true",
        default=None,
        help="serve the trainer protocols beside raylane's own routes: vLLM's RL API "
        "(/pause, /inference/v1/generate, ...), SGLang's native API (/server_info, "
        "/pause_generation, ...; /generate answers SGLang's exact shape) and TRL's "
        "vllm-serve routes (/generate/, ...), so a trainer's unmodified client works "
        "(docs/trainers.md). With --admin-api-key their state-changing routes need that "
        "key; without one they are open, as vLLM's and SGLang's: a private network only",
    )
    parser.add_argument(
        "--sessions-dsn",
        metavar="DSN",
        help="PostgreSQL (postgresql://user@host/db) that multi-turn sessions "
        "are written through to, so they survive a Router restart "
        "(default: none, the Router's memory only). Prefer "
        "RAYLANE_SESSIONS_DSN: a command line is visible to other users",
    )


# the command-line options that set a ClusterConfig field of the same name when given
CLUSTER_OPTIONS = (
    "model",
    "replicas",
    "torch_threads",
    "host",
    "port",
    "served_model_name",
    "ray_address",
    "admin_api_key",
    "request_timeout_s",
    "max_n",
    "tool_call_parser",
    "sessions_dsn",
    "direct_ingress",
    "trainer_api",
)
# ... and those that set an engine field: values when given, flags when set
ENGINE_VALUES = (
    "max_num_seqs",
    "max_model_len",
    "tensor_parallel_size",
    "dtype",
    "async_scheduling",
    "speculative_config",
)
ENGINE_FLAGS = (
    "enable_return_routed_experts",
    "enable_return_indexer_topk",
    "enforce_eager",
    "batch_invariant",
)


def config_from_args(args: argparse.Namespace):
    from raylane.config import ClusterConfig

    # --config wins over RAYLANE_CONFIG; without it, from_env reads RAYLANE_CONFIG
    config = ClusterConfig.from_env(ClusterConfig.from_yaml(args.config) if args.config else None)
    updates = {
        name: getattr(args, name) for name in CLUSTER_OPTIONS if getattr(args, name) is not None
    }
    if args.api_keys:
        updates["api_keys"] = tuple(args.api_keys)
    engine = engine_from_args(args, dict(config.engine))
    updates.update(lora_options(args, engine))
    return dataclasses.replace(config, engine=engine, **updates)


def engine_from_args(args: argparse.Namespace, engine: dict) -> dict:
    """`engine` (the config's engine options) with the command line's engine options over it."""
    for name in ENGINE_VALUES:
        if getattr(args, name) is not None:
            engine[name] = getattr(args, name)
    for name in ENGINE_FLAGS:
        if getattr(args, name):
            engine[name] = True
    return engine


def run(args: argparse.Namespace) -> int:
    from raylane import launch

    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"raylane serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    launch.start_ray(config.ray_address)
    stop = threading.Event()

    def on_stop(*_) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts

    # after Ray's start: its core worker installs a failure handler for SIGTERM that dumped a
    # stack and ended the process with SIGABRT mid-shutdown; this one replaces it
    signal.signal(signal.SIGTERM, on_stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where is it stuck?
    code = 0
    try:
        url = launch.deploy(config)  # Ctrl-C meanwhile interrupts it (KeyboardInterrupt)
        signal.signal(signal.SIGINT, on_stop)
        print(
            f"raylane is serving at {url}/v1 (OpenAI API), {url}/generate, {url}/metrics "
            f"- Ctrl-C to stop",
            flush=True,
        )
        stop.wait()
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # the configuration does not fit the cluster (checked pre-deploy)
        print(f"raylane serve: error: {e}", file=sys.stderr, flush=True)
        code = 2
    finally:
        print("shutting down Ray...", file=sys.stderr, flush=True)
        launch.shutdown()
    return code


def _json_object(text: str) -> dict:
    """A JSON object option (argparse reports the ValueError as a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
