"""ClusterConfig: everything `raylane serve` needs, from flags, a YAML file or the environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raylane.actors.engine.config import EngineConfig
from raylane.actors.engine.strict import check_type, strict_fields
from raylane.engine_options import EngineOptions
from raylane.session_server.tool_calls import PARSERS

if TYPE_CHECKING:
    from raylane.actors.consolidation.config import ConsolidationServiceConfig

CONSOLIDATION_DSN_ENV = "RAYLANE_CONSOLIDATION_DSN"


@strict_fields
@dataclass(frozen=True)
class ClusterConfig:
    """One serving cluster: the model, how many engine replicas, and the HTTP front.

    `engine` holds `EngineConfig` options (vLLM names) applied to every replica, checked when
    the config loads (`EngineOptions`: a dict given is made one); with
    `tensor_parallel_size > 1` (or `distributed_executor_backend: ray`) each replica runs its
    model on that many `ModelShard` actors, placed with it on one node.
    """

    model: str | None = None  # HF directory or .gguf; None serves the embedded SmolLM2
    served_model_name: str | None = None
    replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    # keys stay out of repr, so a logged or printed config never shows them
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # turns on the admin routes (/admin/..., RL control)
    admin_api_key: str | None = field(default=None, repr=False)
    engine: Mapping[str, Any] = field(default_factory=EngineOptions)  # an EngineOptions
    max_queue_per_replica: int = 256  # requests in flight per replica before 429
    torch_threads: int | None = None  # per replica; default: the cores split between replicas
    max_body_bytes: int = 8 << 20
    request_timeout_s: float | None = None  # default deadline of a generation (body: timeout)
    max_n: int = 128  # samples one request may ask for (n)
    tool_call_parser: str | None = None  # "hermes" | "llama3"; None: from the chat template
    # the trainer protocols (vLLM's RL API, SGLang's native API, TRL's routes); off by default,
    # as vLLM keeps its RL routes behind its dev mode (docs/trainers.md)
    trainer_api: bool = False
    ray_address: str | None = None  # join this cluster instead of starting a local one
    # the ingress replica serves HTTP on `port` itself, without Serve's proxy (cluster/listener.py);
    # None: yes on the local cluster `raylane serve` starts, no when joining one (ray_address)
    direct_ingress: bool | None = None
    # PostgreSQL the Router writes multi-turn sessions through to, so they survive its restart
    # (None: its memory only, a restart loses them); out of repr: it may hold a password
    sessions_dsn: str | None = field(default=None, repr=False)
    # the consolidation actor's section (see consolidation_config); out of repr: its dsn may
    # hold a password
    consolidation: dict | None = field(default=None, repr=False)
    # LoRA adapters every replica loads at start ({"name", "path"}; needs engine.enable_lora)
    lora_modules: tuple[dict, ...] = ()

    def __post_init__(self) -> None:
        for name in ("replicas", "port", "max_queue_per_replica", "max_body_bytes", "max_n"):
            check_type("ClusterConfig", name, getattr(self, name), int)
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterConfig.{name} must be >= 1")
        # unknown keys and bad values fail here, not in a replica
        object.__setattr__(self, "engine", EngineOptions(self.engine))
        self.consolidation_config()  # and a bad consolidation section here, not in its actor
        self._check_lora_modules()
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        self._check_admin_key()
        if self.sessions_dsn is not None:
            check_type("ClusterConfig", "sessions_dsn", self.sessions_dsn, str)
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(
                f"ClusterConfig.tool_call_parser must be one of {list(PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        for flag in ("direct_ingress", "trainer_api"):
            if getattr(self, flag) is not None:
                check_type("ClusterConfig", flag, getattr(self, flag), bool)
        if self.direct_ingress and self.ray_address:
            raise ValueError(
                "ClusterConfig.direct_ingress works on the local cluster raylane "
                "starts, not with ray_address: the ingress replica may land on "
                "any node of that cluster, Serve's proxy answers on every node"
            )
        if self.request_timeout_s is not None:
            check_type("ClusterConfig", "request_timeout_s", self.request_timeout_s, (int, float))
            if not self.request_timeout_s > 0:
                raise ValueError("ClusterConfig.request_timeout_s must be > 0 seconds")

    def _check_lora_modules(self) -> None:
        from raylane.serve_lora_args import check_module

        if not isinstance(self.lora_modules, (list, tuple)):
            raise ValueError("ClusterConfig.lora_modules must be a list of {name, path}")
        object.__setattr__(self, "lora_modules", tuple(map(check_module, self.lora_modules)))
        if self.lora_modules and not self.engine.get("enable_lora"):
            raise ValueError("ClusterConfig.lora_modules needs engine.enable_lora: true")

    def _check_admin_key(self) -> None:
        if self.admin_api_key is None:
            return
        check_type("ClusterConfig", "admin_api_key", self.admin_api_key, str)
        if not self.admin_api_key:
            raise ValueError("ClusterConfig.admin_api_key must not be empty")
        if self.admin_api_key in self.api_keys:
            raise ValueError("ClusterConfig.admin_api_key must differ from every api_key")

    @classmethod
    def from_dict(cls, data: dict) -> ClusterConfig:
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str) -> ClusterConfig:
        return cls.from_dict(_read_yaml(path))

    @classmethod
    def for_serve_app(cls, args: dict) -> ClusterConfig:
        """What a RayService / `serve run` app gets: the YAML at `RAYLANE_CONFIG` (if set), the
        app's `args` on top (engine options merged key by key), the environment on top."""
        data = _read_yaml(os.environ["RAYLANE_CONFIG"]) if os.environ.get("RAYLANE_CONFIG") else {}
        engine = {**(data.get("engine") or {}), **(args.get("engine") or {})}
        return cls.from_env(cls.from_dict({**data, **args, "engine": engine}))

    @classmethod
    def from_env(cls, base: ClusterConfig | None = None) -> ClusterConfig:
        """`base`, or else the YAML file at `RAYLANE_CONFIG` (or the defaults), with
        `RAYLANE_MODEL`, `RAYLANE_REPLICAS`, `RAYLANE_PORT`, `RAYLANE_API_KEYS` (comma
        separated), `RAYLANE_ADMIN_API_KEY`, `RAYLANE_SESSIONS_DSN` and (into a
        `consolidation` section, when there is one) `RAYLANE_CONSOLIDATION_DSN` on top."""
        config = base or (
            cls.from_yaml(os.environ["RAYLANE_CONFIG"])
            if os.environ.get("RAYLANE_CONFIG")
            else cls()
        )
        updates: dict = {}
        if os.environ.get("RAYLANE_MODEL"):
            updates["model"] = os.environ["RAYLANE_MODEL"]
        for name, key in (("replicas", "RAYLANE_REPLICAS"), ("port", "RAYLANE_PORT")):
            if os.environ.get(key):
                updates[name] = int(os.environ[key])
        if os.environ.get("RAYLANE_API_KEYS"):
            updates["api_keys"] = tuple(k for k in os.environ["RAYLANE_API_KEYS"].split(",") if k)
        if os.environ.get("RAYLANE_ADMIN_API_KEY"):
            updates["admin_api_key"] = os.environ["RAYLANE_ADMIN_API_KEY"]
        if os.environ.get("RAYLANE_SESSIONS_DSN"):
            updates["sessions_dsn"] = os.environ["RAYLANE_SESSIONS_DSN"]
        if os.environ.get(CONSOLIDATION_DSN_ENV) and config.consolidation is not None:
            updates["consolidation"] = {
                **config.consolidation,
                "dsn": os.environ[CONSOLIDATION_DSN_ENV],
            }
        return dataclasses.replace(config, **updates)

    def engine_config(self, model_dir: str) -> EngineConfig:
        assert isinstance(self.engine, EngineOptions)  # __post_init__ made it one
        return self.engine.config(model_dir)

    def consolidation_config(self) -> ConsolidationServiceConfig | None:
        """The `consolidation:` section validated, or None when there is none (no actor).
        Without a `dsn` key the DSN comes from `RAYLANE_CONSOLIDATION_DSN`."""
        if self.consolidation is None:
            return None
        # imported only when asked for: it brings asyncpg and prometheus_client
        from raylane.actors.consolidation.config import ConsolidationServiceConfig

        return ConsolidationServiceConfig.from_dict(
            self.consolidation, default_dsn=os.environ.get(CONSOLIDATION_DSN_ENV) or None
        )

    def resolved(self) -> ClusterConfig:
        """This config with `direct_ingress` decided: unset, it is on for the local cluster
        (no `ray_address`)."""
        if self.direct_ingress is not None:
            return self
        return dataclasses.replace(self, direct_ingress=self.ray_address is None)

    def replica_threads(self) -> int:
        return self.torch_threads or max(1, (os.cpu_count() or 1) // self.replicas)


def _read_yaml(path: str) -> dict:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must hold a mapping of options")
    return data
