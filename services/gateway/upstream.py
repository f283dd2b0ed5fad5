"""The gateway's view of the two model services: channels, start-up checks, and calls with deadlines."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.streams import FrameMux, StreamMux
from tandem import PROTOCOL_VERSION, __version__
from tandem.frames import PROPOSE, VERIFY, client_ssl_context
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A restarted service is found again within seconds (gRPC's default backoff grows to 120 s between tries).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


class TokenMetadata(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the shared service token to every unary call (streams get it when they open: see Upstreams)."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), self._entry)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


@dataclass(frozen=True)
class ChannelSecurity:
    """How the gateway reaches the services: plaintext by default, TLS with a CA, mutual TLS with a client cert."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    token: str | None = None

    def stream_metadata(self) -> tuple[tuple[str, str], ...]:
        """The shared token for streams, which the unary interceptor does not reach."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def ssl_context(self):
        """The same trust (and client certificate) for the frame transport; None for plaintext."""
        return client_ssl_context(self.ca, self.cert, self.key)

    def open(self, address: str) -> grpc.aio.Channel:
        interceptors = [TokenMetadata(self.token)] if self.token else None
        if self.ca is None:
            if self.cert or self.key:
                raise ValueError("--upstream-tls-cert/--upstream-tls-key need --upstream-tls-ca")
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )
        return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS, interceptors=interceptors)


def frame_host(address: str) -> str | None:
    """The host of a `host:port` gRPC address (`[v6]:port` too); None for other targets (unix:, dns:///, ...)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host or host.startswith("unix"):
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def with_frames(
    mux: StreamMux, address: str, info: pb.InfoResponse, info_call, kind: int, response_type: type, security
) -> StreamMux | FrameMux:
    """Calls over the service's frame port where it offers one (tandem/frames.py), else over the stream `mux`."""
    host = frame_host(address)
    if host is None or not info.frame_port:
        return mux
    known = [info.frame_port]

    async def locate() -> int:
        """The service's frame port: the one Info told at start-up, then asked again (after a lost connection)."""
        if known:
            return known.pop()
        return (await info_call(pb.InfoRequest(), timeout=5)).frame_port

    return FrameMux(host, kind, response_type, locate, mux, security.ssl_context(), security.token)


class IncompatibleDraft(RuntimeError):
    """The draft's vocabulary differs from the target's and one of the two cannot translate between them."""


class IncompatibleService(RuntimeError):
    """A service speaks another revision of the wire contract than this gateway."""


def check_protocol(info: pb.InfoResponse, role: str) -> None:
    """Refuse a service built from another revision of the contract (e.g. a draft on another node left at an older
    release), naming both revisions, rather than misread its answers."""
    if info.protocol_version != PROTOCOL_VERSION:
        raise IncompatibleService(
            f"the {role} service speaks tandem protocol {info.protocol_version} ({info.version or 'unknown version'}),"
            f" this gateway protocol {PROTOCOL_VERSION} (tandem {__version__}): run the same tandem release on every"
            " node"
        )


def cross_vocabulary(target: pb.InfoResponse, draft: pb.InfoResponse) -> bool:
    """Whether the draft is a model of another vocabulary than the target's (model-free drafters use the target's)."""
    return draft.drafter != "ngram" and draft.vocab_fingerprint != target.vocab_fingerprint


def check_compatible(target: pb.InfoResponse, draft: pb.InfoResponse) -> None:
    """Refuse a pair that cannot work: another protocol revision, or vocabularies that differ where a service cannot
    translate between them. A draft of another vocabulary is otherwise served by cross-vocabulary drafting (the
    fingerprints decide the path, not whether to serve: docs/decisions/0015)."""
    check_protocol(target, "target")
    check_protocol(draft, "draft")
    if not cross_vocabulary(target, draft):
        return
    missing = [
        what
        for what, able in (
            (f"the target {target.model_name!r} does not translate draft text", target.capabilities.translates_text),
            (f"the draft {draft.model_name!r} does not draft in text", draft.capabilities.drafts_text),
        )
        if not able
    ]
    if missing:
        raise IncompatibleDraft(
            f"draft model {draft.model_name!r} (vocab {draft.vocab_size}, fingerprint {draft.vocab_fingerprint[:12]}) "
            f"does not share the target {target.model_name!r}'s vocabulary (vocab {target.vocab_size}, fingerprint "
            f"{target.vocab_fingerprint[:12]}), and {' and '.join(missing)}: pick a draft from the same model family,"
            " or use --drafter ngram"
        )


async def wait_serving(channel: grpc.aio.Channel, service: str, timeout_s: float) -> None:
    """Poll grpc.health.v1 until the service reports SERVING (a large model may take minutes to load)."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            last = exc.code().name
        await asyncio.sleep(0.25)
    raise TimeoutError(f"{service} not SERVING after {timeout_s:.0f} s (last status: {last})")


@dataclass
class Upstreams:
    """Connected, checked services. `draft` is None when speculation is off or no draft is configured."""

    target: pb_grpc.TargetStub
    target_info: pb.InfoResponse
    draft: pb_grpc.DraftStub | None
    draft_info: pb.InfoResponse | None
    channels: list[grpc.aio.Channel]
    verify: StreamMux | None = None  # Target.VerifyStream, shared by all requests (or a LocalMux)
    propose: StreamMux | None = None  # Draft.ProposeStream (or a LocalMux)
    target_health: health_pb2_grpc.HealthStub | None = None
    draft_health: health_pb2_grpc.HealthStub | None = None
    stream_metadata: tuple[tuple[str, str], ...] = ()  # the shared token, for streams (interceptors miss them)
    #: The target's vocabulary as text, for a draft of another vocabulary (fetched once: see speculation.cross_vocab).
    vocabularies: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        md = self.stream_metadata or None
        self.verify = StreamMux(lambda: self.target.VerifyStream(metadata=md), "target")
        self.target_health = health_pb2_grpc.HealthStub(self.channels[0])
        if self.draft is not None:
            self.propose = StreamMux(lambda: self.draft.ProposeStream(metadata=md), "draft")
            self.draft_health = health_pb2_grpc.HealthStub(self.channels[1])

    @property
    def draft_cross_vocabulary(self) -> bool:
        """The draft is a model of another vocabulary: rounds go through text (speculation.cross_vocab)."""
        return self.draft_info is not None and cross_vocabulary(self.target_info, self.draft_info)

    @property
    def draft_is_ngram(self) -> bool:
        """The draft service drafts by prompt lookup (model-free: no vocabulary to check, no cost per token)."""
        return self.draft_info is not None and self.draft_info.drafter == "ngram"

    async def close(self) -> None:
        for mux in (self.verify, self.propose):
            if mux is not None:
                await mux.close()
        for channel in self.channels:
            await channel.close()


async def connect(
    target_addr: str,
    draft_addr: str | None,
    timeout_s: float,
    security: ChannelSecurity | None = None,
    frames: bool = True,
) -> Upstreams:
    """Connect to the services, wait until they serve, check them; Verify and Propose over frames where offered."""
    security = security or ChannelSecurity()
    channels = []
    target_channel = security.open(target_addr)
    channels.append(target_channel)
    draft_channel = None
    if draft_addr:
        draft_channel = security.open(draft_addr)
        channels.append(draft_channel)
    try:
        waits = [wait_serving(target_channel, "tandem.v1.Target", timeout_s)]
        if draft_channel is not None:
            waits.append(wait_serving(draft_channel, "tandem.v1.Draft", timeout_s))
        await asyncio.gather(*waits)
        target = pb_grpc.TargetStub(target_channel)
        target_info = await target.Info(pb.InfoRequest(), timeout=10)
        check_protocol(target_info, "target")
        draft = draft_info = None
        if draft_channel is not None:
            draft = pb_grpc.DraftStub(draft_channel)
            draft_info = await draft.Info(pb.InfoRequest(), timeout=10)
            check_compatible(target_info, draft_info)
        log.info(
            "target %s on %s; draft %s",
            target_info.model_name,
            target_info.device,
            f"{draft_info.drafter}:{draft_info.model_name} on {draft_info.device}" if draft_info else "none",
        )
        up = Upstreams(target, target_info, draft, draft_info, channels, stream_metadata=security.stream_metadata())
        if frames:
            args = (target_addr, target_info, target.Info, VERIFY, pb.VerifyResponse, security)
            up.verify = with_frames(up.verify, *args)
            if draft is not None:
                args = (draft_addr, draft_info, draft.Info, PROPOSE, pb.ProposeResponse, security)
                up.propose = with_frames(up.propose, *args)
        return up
    except BaseException:
        for channel in channels:
            await channel.close()
        raise
