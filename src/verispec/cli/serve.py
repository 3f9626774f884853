"""``verispec serve``: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from verispec.cli.common import (
    add_drafter_arguments,
    add_max_batch_argument,
    add_suffix_arguments,
    model_fields,
    suffix_fields,
    warn,
)
from verispec.errors import UsageError

if TYPE_CHECKING:  # imported where a command runs (the CLI's import stays light)
    import socket

    from verispec.server.config import RayDeployment, ServerConfig

__all__ = ["SERVER_LIMITS", "add_serve_parser", "run_serve"]


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec serve``."""
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over the batched engine",
        description="Serve the OpenAI API (POST /v1/completions and /v1/chat/completions, streamed or not; "
        "GET /v1/models, /health, /metrics) with speculative decoding of up to --max-batch requests at once. "
        "Every response carries usage and a verispec object: drafter, K, target calls, acceptance by "
        "position. Requests may name their own drafter, k, top_k and min_p in the body.",
    )
    add_drafter_arguments(parser)
    add_suffix_arguments(parser)
    parser.add_argument(
        "--share-suffix-cache",
        action="store_true",
        help="one suffix cache for every --api-key tenant (default: one each, saved as FILE.<tenant>.npz)",
    )
    parser.add_argument(
        "--k", default="auto", help="K of requests naming none: N, additive or auto (default)"
    )
    parser.add_argument(
        "--allow-drafters",
        metavar="A,B",
        default="",
        help="drafters requests may choose besides --drafter, each loaded at start (default: none; e.g. "
        "ngram,suffix)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, only here)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: a free one)")
    add_max_batch_argument(parser, "requests")
    parser.add_argument(
        "--max-queue", type=int, default=64, metavar="N", help="requests waiting; more: 429 (64)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1 routes (repeatable: each key a tenant)",
    )
    parser.add_argument(
        "--model-name", metavar="NAME", help="the model id clients name (default: the target's)"
    )
    ray = parser.add_argument_group("more than one machine (docs/serve-ray.md)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve: --replicas servers behind its HTTP proxy, each request sent to the replica "
        "holding its conversation's or tenant's caches",
    )
    ray.add_argument("--replicas", type=int, metavar="N", help="servers on Ray Serve, a model each (1)")
    ray.add_argument(
        "--address",
        metavar="ADDRESS",
        help="the Ray cluster to join (auto, or the head's HOST:PORT; default: a local Ray started here)",
    )
    limits = parser.add_argument_group("limits (docs/server.md; unset: ServerConfig's defaults)")
    for flag, kind, meta, text in (
        ("--max-connections", int, "N", "open connections; at the cap a new one closes an idle one (512)"),
        ("--keep-alive", float, "S", "seconds an idle keep-alive connection stays open (5)"),
        ("--header-timeout", float, "S", "seconds for a request's headers to arrive (10)"),
        ("--body-timeout", float, "S", "seconds for a request's body to arrive; slower: 408 (30)"),
        ("--max-body", int, "BYTES", "a request body's size; larger: 413 (4194304)"),
    ):
        limits.add_argument(flag, type=kind, metavar=meta, help=text)
    parser.set_defaults(func=run_serve)


SERVER_LIMITS = ("max_connections", "keep_alive", "header_timeout", "body_timeout", "max_body")


def run_serve(args: argparse.Namespace) -> int:
    """Run ``verispec serve`` until interrupted: every flag checked (a ServerConfig) and the port bound before
    anything loads (a mistake, a port out of range or taken: one line at once)."""
    from verispec.server.config import ServerConfig, listen  # light: every flag checked before torch loads

    config = ServerConfig(
        **model_fields(args),
        **suffix_fields(args),
        share_suffix_cache=args.share_suffix_cache,
        k=args.k,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        api_key=tuple(args.api_key) if args.api_key else None,
        allow_drafters=tuple(name.strip() for name in args.allow_drafters.split(",") if name.strip()),
        model_name=args.model_name,
        **{name: value for name in SERVER_LIMITS if (value := getattr(args, name)) is not None},
    )
    deployment = _ray_deployment(args)
    config.check_models()
    with listen(args.host, args.port) as sock:  # closed whatever fails after it
        if deployment is None:
            return _serve(config, sock)
        host, port = sock.getsockname()[:2]  # a free port found: Ray Serve's proxy binds it
    if deployment.address is not None:
        from verispec.batch import check_reachable

        check_reachable(deployment.address)  # a cluster's head that does not answer: at once, no Ray loaded
    _warn_exposed(host, config)
    from verispec.server.ray_serve import serve_on_ray  # loads Ray

    return serve_on_ray(config, deployment, host, port)


RAY_REFUSED = (
    "max_connections",
    "header_timeout",
)  # limits of the server's own uvicorn: not Ray Serve's proxy


def _ray_deployment(args: argparse.Namespace) -> RayDeployment | None:
    """``--ray``'s deployment (None without it); UsageError for its flags without it, or with flags it
    cannot honour."""
    from verispec.server.config import RayDeployment

    if not args.ray:
        for flag in ("replicas", "address"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag} is a Ray Serve setting: give --ray too")
        return None
    for name in RAY_REFUSED:
        if getattr(args, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')} bounds the single server's connections, not Ray "
                             "Serve's proxy: not with --ray")  # fmt: skip
    if args.suffix_cache is not None:
        raise UsageError("--suffix-cache FILE: replicas keep their suffix caches in memory, not with --ray")
    return RayDeployment(
        replicas=1 if args.replicas is None else args.replicas, address=args.address, threads=args.threads
    )


def _warn_exposed(host: str, config: ServerConfig) -> None:
    """The warning for a server reachable from other machines without an API key."""
    from verispec.server.config import exposed

    if exposed(host) and config.api_key is None:
        warn(
            f"{host} is reachable from other machines and no --api-key is set: anyone who can reach it can "
            "generate (bind 127.0.0.1, or give --api-key)"
        )


def _serve(config: ServerConfig, sock: socket.socket) -> int:
    """``verispec serve`` of ``config`` on ``sock``: the server loaded, then run until interrupted."""
    from verispec.server.app import Server, run  # loads torch and transformers

    host, port = sock.getsockname()[:2]
    _warn_exposed(host, config)
    server = Server(config)
    print(
        f"verispec: serving {server.name} (drafter {server.default.drafter_name}) on http://{host}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    run(server, sock)
    print("verispec: stopped", file=sys.stderr)
    return 0
