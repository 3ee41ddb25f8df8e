"""Transport security: TLS / mutual TLS material for every gRPC channel, and the API key.

One `TLSConfig` describes one side of a connection. As a server's: its certificate
and key, and optionally a client CA, which turns on mutual TLS (clients without a
certificate signed by that CA fail the handshake). As a client's: the root CA that
signed the server's certificate, and optionally a client certificate for mutual TLS.
PEM files are read once, at start-up, so a missing or unreadable file is an error
that names its flag before anything listens; the bytes then travel with the options
to the processes (or Ray actors) that serve.

The API key guards the client-facing API (Generation and Admin over gRPC, the OpenAI
routes over HTTP): callers send `authorization: Bearer <key>`. The internal draft and
target services are guarded the same way by the internal token, which the orchestrator
sends on every call (`token_interceptors`): `specmesh serve` generates one per
deployment and hands it to its children, Ray deployments use the API key, and
standalone services read it from `--internal-token-file` or SPECMESH_INTERNAL_TOKEN.
Under mutual TLS they also accept only certificates from the configured CA.
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
from dataclasses import dataclass
from typing import Iterable, Sequence

import grpc

AUTHORIZATION = "authorization"
UNAUTHENTICATED_MESSAGE = "missing or invalid API key (send 'authorization: Bearer <key>')"
INTERNAL_UNAUTHENTICATED_MESSAGE = ("missing or invalid internal token: only the deployment's orchestrator may "
                                    "call this service (it sends 'authorization: Bearer <token>')")
INTERNAL_TOKEN_ENV = "SPECMESH_INTERNAL_TOKEN"


class SecurityConfigError(ValueError):
    """A TLS or API-key setting cannot be used; the message names the flag."""


@dataclass(frozen=True)
class TLSConfig:
    """PEM material for one side of a TLS connection (bytes, read once; paths kept for HTTP servers)."""

    cert: bytes | None = None  # this side's certificate chain
    key: bytes | None = None  # its private key
    ca: bytes | None = None  # server: CA of the client certificates (= mTLS); client: root CA of the server
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None  # client: name to verify in the server's certificate instead of the host

    @classmethod
    def load(cls, cert_file: str | None, key_file: str | None, ca_file: str | None,
             flags: Sequence[str] = ("--tls-cert", "--tls-key", "--tls-ca"),
             server_name: str | None = None) -> "TLSConfig":
        """Read the given files; `flags` name them in errors (cert, key, ca order)."""
        if bool(cert_file) != bool(key_file):
            raise SecurityConfigError(f"{flags[0]} and {flags[1]} must be given together")
        return cls(cert=_read_pem(cert_file, flags[0]), key=_read_pem(key_file, flags[1]),
                   ca=_read_pem(ca_file, flags[2]), cert_file=cert_file or None, key_file=key_file or None,
                   ca_file=ca_file or None, server_name=server_name or None)

    @property
    def mutual(self) -> bool:
        """As a server's: client certificates are required."""
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise SecurityConfigError("a TLS server needs a certificate and a key (--tls-cert, --tls-key)")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.mutual)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Root CA None = the system's roots; a client certificate is presented when configured."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read_pem(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as pem:
            data = pem.read()
    except OSError as error:
        raise SecurityConfigError(f"{flag}: cannot read {path}: {error.strerror or error}") from error
    if b"-----BEGIN " not in data:
        raise SecurityConfigError(f"{flag}: {path} is not a PEM file")
    return data


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def add_server_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (serving)")
    group.add_argument("--tls-cert", default=_env("SPECMESH_TLS_CERT"), metavar="PEM",
                       help="serve TLS with this certificate chain (env SPECMESH_TLS_CERT)")
    group.add_argument("--tls-key", default=_env("SPECMESH_TLS_KEY"), metavar="PEM",
                       help="private key of --tls-cert (env SPECMESH_TLS_KEY)")
    group.add_argument("--tls-ca", default=_env("SPECMESH_TLS_CA"), metavar="PEM",
                       help="require client certificates signed by this CA: mutual TLS (env SPECMESH_TLS_CA)")


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS (connecting)")
    group.add_argument("--tls", action="store_true", default=bool(_env("SPECMESH_TLS")),
                       help="connect over TLS trusting the system's roots (implied by the flags below)")
    group.add_argument("--tls-root-ca", default=_env("SPECMESH_TLS_ROOT_CA"), metavar="PEM",
                       help="CA that signed the server's certificate (env SPECMESH_TLS_ROOT_CA)")
    group.add_argument("--tls-client-cert", default=_env("SPECMESH_TLS_CLIENT_CERT"), metavar="PEM",
                       help="client certificate for mutual TLS (env SPECMESH_TLS_CLIENT_CERT)")
    group.add_argument("--tls-client-key", default=_env("SPECMESH_TLS_CLIENT_KEY"), metavar="PEM",
                       help="private key of --tls-client-cert (env SPECMESH_TLS_CLIENT_KEY)")
    group.add_argument("--tls-server-name", default=_env("SPECMESH_TLS_SERVER_NAME"), metavar="NAME",
                       help="name to verify in server certificates instead of the endpoint's host, e.g. when "
                            "services are reached by pod IP (env SPECMESH_TLS_SERVER_NAME)")


def server_tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return None
    if not args.tls_cert:
        raise SecurityConfigError("--tls-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    return TLSConfig.load(args.tls_cert, args.tls_key, args.tls_ca)


def client_tls_from_args(args: argparse.Namespace, fallback_ca: str | None = None) -> TLSConfig | None:
    """None = plaintext. `fallback_ca`: root CA when --tls-root-ca is not given (serve: --tls-ca)."""
    root_ca = args.tls_root_ca or fallback_ca
    if not (args.tls or root_ca or args.tls_client_cert or args.tls_client_key):
        return None
    return TLSConfig.load(args.tls_client_cert, args.tls_client_key, root_ca,
                          ("--tls-client-cert", "--tls-client-key", "--tls-root-ca"), args.tls_server_name)


def add_api_key_arguments(parser: argparse.ArgumentParser, serving: bool) -> None:
    what = "require this API key from clients" if serving else "send this API key"
    parser.add_argument("--api-key", default=_env("SPECMESH_API_KEY"),
                        help=f"{what} as 'authorization: Bearer <key>' (env SPECMESH_API_KEY)")
    parser.add_argument("--api-key-file", default=_env("SPECMESH_API_KEY_FILE"), metavar="PATH",
                        help="read the API key from this file (env SPECMESH_API_KEY_FILE)")


def api_key_from_args(args: argparse.Namespace) -> str | None:
    if args.api_key and args.api_key_file:
        raise SecurityConfigError("give --api-key or --api-key-file, not both")
    if not args.api_key_file:
        return args.api_key or None
    return _read_secret(args.api_key_file, "--api-key-file")


def _read_secret(path: str, flag: str) -> str:
    """A key or token from a file (surrounding whitespace dropped); errors name the flag."""
    try:
        with open(path, encoding="utf-8") as secret_file:
            secret = secret_file.read().strip()
    except OSError as error:
        raise SecurityConfigError(f"{flag}: cannot read {path}: {error.strerror or error}") from error
    if not secret:
        raise SecurityConfigError(f"{flag}: {path} is empty")
    return secret


def bearer_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the key (empty without one)."""
    return ((AUTHORIZATION, f"Bearer {api_key}"),) if api_key else ()


def authorized(header: str | None, api_key: str) -> bool:
    """Whether an `authorization` header value carries `api_key` (constant-time compare)."""
    scheme, _, presented = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), api_key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Aborts calls to the guarded services with UNAUTHENTICATED unless they carry the key.

    The key is the API key (client-facing services) or the internal token (draft and
    target). Health and reflection stay open, so probes and grpcurl's discovery work
    without it.
    """

    def __init__(self, api_key: str, guarded_services: Iterable[str], message: str = UNAUTHENTICATED_MESSAGE):
        self.api_key = api_key
        self.prefixes = tuple(f"/{name}/" for name in guarded_services)
        self.message = message

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefixes):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if authorized(metadata.get(AUTHORIZATION), self.api_key):
            return handler
        # The same kind of handler, refusing: one that returns for single responses, a generator for streams.
        message = self.message

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # makes this an async generator, the shape a streaming handler has
        denials = {"unary_unary": deny, "stream_unary": deny, "unary_stream": deny_stream,
                   "stream_stream": deny_stream}
        kind = next(kind for kind in denials if getattr(handler, kind) is not None)
        return handler._replace(**{kind: denials[kind]})


class _MetadataAdder:
    """Appends fixed metadata to every call's; one subclass per call shape (grpc.aio files each by type)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _with_metadata(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *self.metadata))


class _UnaryUnaryAdder(_MetadataAdder, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_metadata(client_call_details), request)


class _UnaryStreamAdder(_MetadataAdder, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_metadata(client_call_details), request)


class StreamCallMetadata(_MetadataAdder):
    """Not an interceptor: metadata that a channel's bidirectional calls (round streams, round batches) send
    as the call's own, given by whoever opens them (orchestrator.serving.clients.open_channel keeps it for
    the channel). grpc.aio hands every message of an intercepted stream call to a queue and a task of its
    own before writing it, a hop each round message would pay (about 0.1 ms of the client's CPU)."""


def token_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor | StreamCallMetadata]:
    """What sends `token` as `authorization: Bearer` on every call (nothing without one): interceptors for
    the unary and server-streaming calls (PreDraft), StreamCallMetadata for the bidirectional ones.

    For the orchestrator's channels to the draft and target, pooled or not (open_channel takes them all).
    """
    metadata = bearer_metadata(token)
    return [_UnaryUnaryAdder(metadata), _UnaryStreamAdder(metadata), StreamCallMetadata(metadata)] if metadata else []


def new_internal_token() -> str:
    """A fresh per-deployment internal token (256 random bits)."""
    return secrets.token_urlsafe(32)


def add_internal_token_arguments(parser: argparse.ArgumentParser, serving: bool, what: str | None = None) -> None:
    """--internal-token-file; the token itself only through the environment, never on a command line.
    `what`: the help's account of what the token is for, where the command's own differs."""
    what = what or ("require this token from the orchestrator" if serving
                    else "send this token to the draft and target services (default: the API key)")
    parser.add_argument("--internal-token-file", default=_env("SPECMESH_INTERNAL_TOKEN_FILE"), metavar="PATH",
                        help=f"{what}; read from this file (env SPECMESH_INTERNAL_TOKEN_FILE, or the token "
                             f"itself in {INTERNAL_TOKEN_ENV})")


def internal_token_from_args(args: argparse.Namespace) -> str | None:
    """The token from --internal-token-file, else from SPECMESH_INTERNAL_TOKEN; None when neither is set."""
    if not args.internal_token_file:
        return _env(INTERNAL_TOKEN_ENV)
    return _read_secret(args.internal_token_file, "--internal-token-file")


def caller_of(context: grpc.aio.ServicerContext) -> str:
    """Whom a call comes from, for per-caller session limits: its connection's peer address.

    Each orchestrator holds one connection per service (gRPC shares it among the
    channels of a process), so this is one orchestrator process.
    """
    return context.peer() or "unknown"


@dataclass(frozen=True)
class Security:
    """Everything a deployment's flags say about transport security, checked together."""

    server_tls: TLSConfig | None = None  # every service's listening side
    channel_tls: TLSConfig | None = None  # the orchestrator's channels to the draft and target
    api_key: str | None = None  # the client-facing API


def security_from_args(args: argparse.Namespace) -> Security:
    """For commands that serve all three services: the internal channels must match the servers' TLS.

    The orchestrator verifies the draft and target with --tls-root-ca (default: --tls-ca, the usual
    single-CA set-up) and, under mutual TLS, presents --tls-client-cert.
    """
    server_tls = server_tls_from_args(args)
    channel_tls = client_tls_from_args(args, fallback_ca=args.tls_ca if server_tls else None)
    if server_tls and (channel_tls is None or channel_tls.ca is None):
        raise SecurityConfigError("--tls-cert needs --tls-root-ca (or --tls-ca): the CA the orchestrator "
                                  "verifies the draft and target services with")
    if server_tls and server_tls.mutual and channel_tls.cert is None:
        raise SecurityConfigError("--tls-ca (mutual TLS) needs --tls-client-cert and --tls-client-key: the "
                                  "orchestrator's certificate for its channels to the draft and target")
    return Security(server_tls, channel_tls if server_tls else None, api_key_from_args(args))
