"""Replicas of the OpenAI-compatible server behind Ray Serve's HTTP proxy (optional: pip install -e ".[ray]").

Each replica is one engine and the very app `specdecode serve` runs (build_app): same routes, same limits, its
own /metrics. Ray Serve routes requests over the replicas, restarts one that dies or fails its health check
(check_health: the engine's own /health verdict), scales between bounds, and on shutdown lets each replica finish
its in-flight requests for up to graceful_shutdown_timeout_s before the engine stops. Every response names the
replica that served it (header x-specdecode-replica).

    specdecode serve --model M --replicas 2 --replica-cpus 1          # a local Ray cluster, or RAY_ADDRESS's
    serve run specdecode.server.ray_serve:app_builder model=M replicas=2   # Ray's own CLI (a config file too)
"""
from __future__ import annotations

import dataclasses
import os
import time

from specdecode.engine.async_engine import STALL_TIMEOUT
from specdecode.errors import ConfigError
from specdecode.server.limits import ServerLimits

REPLICA_HEADER = "x-specdecode-replica"
"""Response header naming the replica (its Ray replica id and process id) that served the request."""


@dataclasses.dataclass
class ReplicaSettings:
    """What every replica builds: its engine and its app."""

    llm_kwargs: dict
    """Keyword arguments of LLM (model, dtype, speculative_config, max_num_seqs, tensor_parallel_size, ...)."""
    model_name: str
    """The name clients ask for (/v1/models)."""
    max_waiting: int = 256
    """Requests queued per replica beyond its running sequences."""
    stall_timeout: float = STALL_TIMEOUT
    """Seconds one engine iteration may take before the replica reports itself unhealthy."""
    api_key: str | None = None
    """Bearer key clients must send (None = none)."""
    limits: ServerLimits | None = None
    """Request bounds (None = the defaults)."""
    allowed_hosts: list[str] | None = None
    """Host header values accepted (None = local names only; '*' = any, usual behind a cluster's proxy)."""
    strict_model_name: bool = False
    """A request naming another model gets 404 (else the served model answers it)."""
    cors_origins: str | None = None
    """The web pages that may call it (server/cors.py)."""


@dataclasses.dataclass
class DeploymentSettings:
    """How Ray Serve runs the replicas."""

    replicas: int = 1
    """Replicas when not autoscaling."""
    min_replicas: int | None = None
    """Autoscaling lower bound (with max_replicas; None = a fixed count)."""
    max_replicas: int | None = None
    """Autoscaling upper bound."""
    num_cpus: float = 1.0
    """CPUs Ray reserves per replica."""
    num_gpus: float = 0.0
    """GPUs per replica (its tensor-parallel size on GPUs)."""
    graceful_shutdown_timeout_s: float = 30.0
    """Seconds a stopping replica may spend finishing its requests before it is killed."""
    health_check_period_s: float = 5.0
    """Seconds between Ray's health checks of each replica."""

    def __post_init__(self):
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ConfigError("give both --min-replicas and --max-replicas to autoscale, or neither")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.min_replicas is None and self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")


class SpecdecodeReplica:
    """One Ray Serve replica: an engine and the OpenAI app (Ray calls __serve_build_asgi_app__ after __init__; the
    ingress wrapper owns the names `app` and the like, hence openai_app)."""

    def __init__(self, settings: ReplicaSettings):
        from ray import serve

        from specdecode.engine.async_engine import AsyncEngine
        from specdecode.engine.llm import LLM
        from specdecode.server.app import build_app

        self.llm = LLM(**settings.llm_kwargs)
        self.engine = AsyncEngine(self.llm, max_waiting=settings.max_waiting, stall_timeout=settings.stall_timeout)
        self.openai_app = build_app(self.engine, settings.model_name, api_key=settings.api_key, limits=settings.limits,
                             allowed_hosts=settings.allowed_hosts, strict_model_name=settings.strict_model_name,
                             cors_origins=settings.cors_origins)
        self.replica_name = f"{serve.get_replica_context().replica_id.unique_id}/{os.getpid()}"
        self.engine.start()

    def __serve_build_asgi_app__(self):
        return _NameReplica(self.openai_app, self.replica_name)

    def check_health(self) -> None:
        """Ray restarts a replica whose check raises: a dead or stalled engine."""
        problem = self.engine.health()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self):
        """Ray has drained the replica (up to graceful_shutdown_timeout_s): stop the engine and any TP workers."""
        self.engine.wait_idle(timeout=5)
        self.engine.shutdown()
        self.llm.close()


class _NameReplica:
    """ASGI middleware: add the replica's name to every response."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named_send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named_send)


def deployment_settings(args) -> DeploymentSettings:
    """From `serve`'s replica flags (dist/flags.py)."""
    return DeploymentSettings(1 if args.replicas is None else args.replicas, args.min_replicas, args.max_replicas, args.replica_cpus,
                              args.replica_gpus, args.graceful_shutdown_timeout)


def build_deployment(settings: ReplicaSettings, deployment: DeploymentSettings):
    """The Ray Serve application: SpecdecodeReplica with its resources, count or autoscaling bounds, health
    checks and graceful shutdown."""
    from ray import serve

    options = {"ray_actor_options": {"num_cpus": deployment.num_cpus, "num_gpus": deployment.num_gpus},
               "max_ongoing_requests": settings.llm_kwargs.get("max_num_seqs", 32) + settings.max_waiting,
               "graceful_shutdown_timeout_s": deployment.graceful_shutdown_timeout_s,
               "graceful_shutdown_wait_loop_s": 1.0,
               "health_check_period_s": deployment.health_check_period_s}
    if deployment.min_replicas is not None:
        options["autoscaling_config"] = {"min_replicas": deployment.min_replicas,
                                         "max_replicas": deployment.max_replicas,
                                         "target_ongoing_requests": settings.llm_kwargs.get("max_num_seqs", 32)}
    else:
        options["num_replicas"] = deployment.replicas
    replica = serve.deployment(name="specdecode", **options)(serve.ingress()(SpecdecodeReplica))
    return replica.bind(settings)


def app_builder(args: dict):
    """For `serve run specdecode.server.ray_serve:app_builder model=M replicas=2 ...` (or a Serve config file):
    keys are model, served_model_name, dtype, device, max_num_seqs, max_model_len, tensor_parallel_size,
    replicas, min_replicas, max_replicas, num_cpus, num_gpus, allowed_hosts (comma-separated)."""
    from specdecode.catalog.registry import model_name

    model = args.get("model")  # a name is resolved (fetched) by each replica, on its own node
    llm_kwargs = {"model": model, "dtype": args.get("dtype", "auto"),
                  "device": args.get("device"), "max_num_seqs": int(args.get("max_num_seqs", 32)),
                  "tensor_parallel_size": int(args.get("tensor_parallel_size", 1))}
    if args.get("max_model_len"):
        llm_kwargs["max_model_len"] = int(args["max_model_len"])
    hosts = args.get("allowed_hosts")
    settings = ReplicaSettings(llm_kwargs, args.get("served_model_name") or model_name(model),
                               allowed_hosts=hosts.split(",") if hosts else None)
    fields = {f.name: f.type for f in dataclasses.fields(DeploymentSettings)}
    deployment = DeploymentSettings(**{k: (float if "float" in fields[k] else int)(v)
                                       for k, v in args.items() if k in fields})
    return build_deployment(settings, deployment)


def serve_replicas(settings: ReplicaSettings, deployment: DeploymentSettings, host: str, port: int,
                   address: str | None = None) -> int:
    """`specdecode serve --replicas N`: run the deployment on a Ray cluster (address, RAY_ADDRESS, or a local one
    started here) until interrupted, then shut it down gracefully."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ConfigError('--replicas needs Ray Serve: pip install -e ".[ray]"') from exc
    ray.init(address=address, include_dashboard=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_deployment(settings, deployment), name="specdecode", route_prefix="/")
        print(f"serving {settings.model_name} on http://{host}:{port} with Ray Serve; Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()  # replicas finish their requests (graceful_shutdown_timeout_s), then stop
        ray.shutdown()
