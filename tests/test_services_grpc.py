"""The gRPC contract, against the real target and draft services with the real model."""

from __future__ import annotations

import dataclasses
import time
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.gateway.upstream import IncompatibleService, check_compatible
from tandem import PROTOCOL_VERSION
from tandem.ngram import LookupRule, NgramIndex
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.conftest import Service, start_model_service

GREEDY = pb.SamplingParams(temperature=0.0)


def _sid() -> str:
    return uuid.uuid4().hex


def _prompt(
    stub: pb_grpc.TargetStub, text: str = "The quick brown fox jumps over the lazy dog. The quick"
) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text, add_special=True)).token_ids)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def test_info_describes_model_and_vocab(target_channel: grpc.Channel) -> None:
    info = pb_grpc.TargetStub(target_channel).Info(pb.InfoRequest())
    assert info.vocab_size == 49152
    assert len(info.vocab_fingerprint) == 64
    assert info.context_size == 2048  # 16384 cells, a slice per session (8)
    assert info.backend == "CPU"
    assert info.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert "<|im_start|>" in info.chat_template
    assert 2 in info.eog_token_ids  # <|im_end|>
    assert "llama-cpp-python" in info.version


def test_draft_model_has_same_fingerprint(target_channel: grpc.Channel, draft_channel: grpc.Channel) -> None:
    t = pb_grpc.TargetStub(target_channel).Info(pb.InfoRequest())
    d = pb_grpc.DraftStub(draft_channel).Info(pb.InfoRequest())
    assert d.drafter == "model"
    assert d.vocab_fingerprint == t.vocab_fingerprint
    assert d.capabilities.proposes_after_repeat == 0  # a model proposes anywhere
    assert d.capabilities.constraints  # it masks its proposals with a request's grammar


def test_every_service_states_its_protocol_and_a_skewed_one_is_refused_by_name(
    target_channel: grpc.Channel, draft_channel: grpc.Channel, ngram_draft: Service
) -> None:
    t = pb_grpc.TargetStub(target_channel).Info(pb.InfoRequest())
    d = pb_grpc.DraftStub(draft_channel).Info(pb.InfoRequest())
    with grpc.insecure_channel(ngram_draft.address) as channel:
        n = pb_grpc.DraftStub(channel).Info(pb.InfoRequest())
    assert t.protocol_version == d.protocol_version == n.protocol_version == PROTOCOL_VERSION
    check_compatible(t, d)
    old = pb.InfoResponse()
    old.CopyFrom(d)
    old.protocol_version = PROTOCOL_VERSION - 1
    old.version = "tandem 0.0.9"
    with pytest.raises(IncompatibleService) as refused:
        check_compatible(t, old)
    message = str(refused.value)
    assert f"protocol {PROTOCOL_VERSION - 1}" in message and f"protocol {PROTOCOL_VERSION}" in message
    assert "draft" in message and "tandem 0.0.9" in message


def test_ngram_draft_declares_the_repeat_it_needs_and_proposes_only_behind_one(
    ngram_draft: Service, target_channel: grpc.Channel
) -> None:
    """`proposes_after_repeat` is a promise the gateway builds on (it stops asking until the sequence repeats): an
    n-gram service with the default 2-token minimum, whose m-token match drafts m - 1 tokens, declares 2, and at every
    position of a real sequence it proposes something exactly where the sequence ends with a repeated 2-gram."""
    tokens = _prompt(pb_grpc.TargetStub(target_channel), "one two three four one two five six two five one two three")
    with grpc.insecure_channel(ngram_draft.address) as channel:
        stub = pb_grpc.DraftStub(channel)
        info = stub.Info(pb.InfoRequest())
        assert info.capabilities.proposes_after_repeat == 2
        sid = _sid()
        stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=tokens[:1], sampling=GREEDY)]))
        proposing = []
        for end in range(2, len(tokens) + 1):
            new = tokens[end - 1 : end]
            item = pb.ProposeItem(session_id=sid, position=end - 1, append_token_ids=new, max_tokens=8)
            proposal = stub.Propose(pb.ProposeRequest(items=[item])).proposals[0]
            proposed = bool(proposal.token_ids)
            seen = {tuple(tokens[i : i + 2]) for i in range(end - 2)}  # 2-grams followed by a token
            assert proposed == (tuple(tokens[end - 2 : end]) in seen), end
            proposing.append(proposed)
            # Its confidence: the suffix of match_len tokens occurred before, followed by the first proposed token.
            m = proposal.match_len
            assert (m >= 2) if proposed else (m == 0)
            if proposed:
                suffix, first = tokens[end - m : end], proposal.token_ids[0]
                assert any(tokens[i : i + m] == suffix and tokens[i + m] == first for i in range(end - m)), end
        stub.Close(pb.CloseRequest(session_ids=[sid]))
    assert any(proposing) and not all(proposing)


def test_health_and_reflection(target_channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(target_channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Target"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(target_channel)
    answers = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"tandem.v1.Target", "grpc.health.v1.Health"} <= names


def test_health_not_serving_while_loading(service_tmp) -> None:
    """A service listens before its model loads and says NOT_SERVING until then (here: a model that cannot load)."""
    bad = service_tmp / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    svc: Service = start_model_service("services.target", ["--model", str(bad)], service_tmp, wait_ready=False)
    try:
        with grpc.insecure_channel(svc.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            statuses = set()
            try:
                for _ in range(50):
                    statuses.add(health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Target")).status)
            except grpc.RpcError:
                pass  # the process gives up on the broken model and exits
        assert health_pb2.HealthCheckResponse.SERVING not in statuses
        svc.proc.wait(timeout=30)
        assert svc.proc.returncode != 0
        assert "model failed to load" in svc.log()
    finally:
        svc.stop()


def test_open_verify_greedy_matches_plain_decoding(target_channel: grpc.Channel) -> None:
    """Verify with no draft is one plain greedy step; drafting the target's own tokens must accept them all."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub)
    sid = _sid()
    opened = stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)]))
    result = opened.results[0]
    assert result.position == len(prompt) + 1
    plain = [result.first_token.id]
    pos = result.position
    for _ in range(6):
        r = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)])).results[0]
        assert r.num_accepted == 0 and len(r.tokens) == 1
        plain.append(r.tokens[0].id)
        pos = r.position
    assert stub.Close(pb.CloseRequest(session_ids=[sid])).closed == 1

    sid2 = _sid()
    opened = stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid2, prompt_token_ids=prompt, sampling=GREEDY)]))
    assert opened.results[0].first_token.id == plain[0]
    reply = stub.Verify(
        pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid2, position=len(prompt) + 1, draft_token_ids=plain[1:4])])
    )
    r = reply.results[0]
    assert r.num_accepted == 3
    assert [t.id for t in r.tokens][:3] == plain[1:4]
    assert r.position == len(prompt) + 1 + 4
    assert reply.timing.forward_ns > 0 and reply.timing.total_ns >= reply.timing.forward_ns
    stub.Close(pb.CloseRequest(session_ids=[sid2]))


def test_a_verify_call_reports_its_wait_behind_other_sessions_work(target_channel: grpc.Channel) -> None:
    """Timing.queue_ns: a Verify sent while another session's long prompt is being prefilled waits for a prefill
    chunk before its step begins, and says so; the gateway leaves that wait out of a round's overhead."""
    stub = pb_grpc.TargetStub(target_channel)
    sid, other = _sid(), _sid()
    prompt = _prompt(stub)
    pos = stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)]))
    pos = pos.results[0].position
    alone = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]))
    pos = alone.results[0].position
    long_prompt = _prompt(stub, "Tell me about the sea and the ships on it. " * 120)[:1500]
    prefill = stub.Open.future(
        pb.OpenRequest(items=[pb.OpenItem(session_id=other, prompt_token_ids=long_prompt, sampling=GREEDY)])
    )
    try:
        time.sleep(0.05)  # the first of three chunks of 512 tokens is under way (1.3-2 s each on the 2-core CPU)
        waited = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)]))
        assert not prefill.done(), "the prefill ended before the verify call: the call did not wait behind it"
        prefill.result()
    finally:
        stub.Close(pb.CloseRequest(session_ids=[sid, other]))
    for reply in (alone, waited):
        assert reply.timing.queue_ns + reply.timing.forward_ns <= reply.timing.total_ns
    assert waited.timing.queue_ns > 10_000_000 > alone.timing.queue_ns, (alone.timing, waited.timing)


def test_rejected_draft_rolls_back_kv(target_channel: grpc.Channel) -> None:
    """A wrong draft is rejected at its first token and leaves no trace: the next steps equal plain decoding."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub, "def add(a, b):\n    return")
    plain_sid, spec_sid = _sid(), _sid()
    for sid in (plain_sid, spec_sid):
        stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)]))
    pos = len(prompt) + 1
    plain = []
    for _ in range(5):
        r = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=plain_sid, position=pos)])).results[0]
        plain.append(r.tokens[0].id)
        pos = r.position
    junk = [t for t in (100, 200, 300, 400) if t != plain[0]][:3]
    r = stub.Verify(
        pb.VerifyRequest(items=[pb.VerifyItem(session_id=spec_sid, position=len(prompt) + 1, draft_token_ids=junk)])
    ).results[0]
    assert r.num_accepted == 0
    assert [t.id for t in r.tokens] == [plain[0]]
    pos = r.position
    rest = []
    for _ in range(4):
        r = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=spec_sid, position=pos)])).results[0]
        rest.append(r.tokens[0].id)
        pos = r.position
    assert rest == plain[1:]
    stub.Close(pb.CloseRequest(session_ids=[plain_sid, spec_sid]))


def test_position_mismatch_and_retry(target_channel: grpc.Channel) -> None:
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub)
    sid = _sid()
    stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)]))
    pos = len(prompt) + 1
    request = pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos, draft_token_ids=[11, 12])])
    first = stub.Verify(request)
    again = stub.Verify(request)  # an exact retry is answered from memory, not applied twice
    assert again.results == first.results
    stale = pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos + 7)])
    assert _code(lambda: stub.Verify(stale)) == grpc.StatusCode.FAILED_PRECONDITION
    # The session still works at its real position.
    after = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=first.results[0].position)]))
    assert after.results[0].position == first.results[0].position + 1
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_bad_calls_get_status_codes(target_channel: grpc.Channel) -> None:
    stub = pb_grpc.TargetStub(target_channel)
    unknown = pb.VerifyRequest(items=[pb.VerifyItem(session_id="nope", position=1)])
    assert _code(lambda: stub.Verify(unknown)) == grpc.StatusCode.NOT_FOUND
    empty = pb.OpenRequest(items=[pb.OpenItem(session_id=_sid(), sampling=GREEDY)])
    assert _code(lambda: stub.Open(empty)) == grpc.StatusCode.INVALID_ARGUMENT
    out_of_vocab = pb.OpenRequest(items=[pb.OpenItem(session_id=_sid(), prompt_token_ids=[1, 10**6])])
    assert _code(lambda: stub.Open(out_of_vocab)) == grpc.StatusCode.INVALID_ARGUMENT
    too_long = pb.OpenRequest(items=[pb.OpenItem(session_id=_sid(), prompt_token_ids=[5] * 9000, sampling=GREEDY)])
    assert _code(lambda: stub.Open(too_long)) == grpc.StatusCode.INVALID_ARGUMENT
    sid = _sid()
    stub.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=[1, 2, 3], sampling=GREEDY)]))
    bad_token = pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=4, draft_token_ids=[-5])])
    assert _code(lambda: stub.Verify(bad_token)) == grpc.StatusCode.INVALID_ARGUMENT
    bad_dist = pb.VerifyRequest(
        items=[
            pb.VerifyItem(
                session_id=sid,
                position=4,
                draft_token_ids=[7],
                draft_distributions=[pb.SparseDistribution(token_ids=[7, 7], probs=[0.5, 0.5])],
            )
        ]
    )
    assert _code(lambda: stub.Verify(bad_dist)) == grpc.StatusCode.INVALID_ARGUMENT
    # None of the failed calls touched the session.
    ok = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=4)]))
    assert ok.results[0].position == 5
    assert stub.Close(pb.CloseRequest(session_ids=[sid, sid])).closed == 1


def test_draft_propose_appends_and_reuses_kv(draft_channel: grpc.Channel, target_channel: grpc.Channel) -> None:
    """The model drafter (same model) proposes exactly the target's greedy continuation."""
    target = pb_grpc.TargetStub(target_channel)
    draft = pb_grpc.DraftStub(draft_channel)
    prompt = _prompt(target)
    sid = _sid()
    first = target.Open(
        pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)])
    ).results[0]
    opened = draft.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)]))
    assert opened.results[0].position == len(prompt)
    prop = draft.Propose(
        pb.ProposeRequest(
            items=[
                pb.ProposeItem(
                    session_id=sid, position=len(prompt), append_token_ids=[first.first_token.id], max_tokens=4
                )
            ]
        )
    ).proposals[0]
    assert prop.position == len(prompt) + 1
    assert len(prop.token_ids) == 4 and not prop.distributions  # greedy drafts send no distributions
    verified = target.Verify(
        pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=first.position, draft_token_ids=prop.token_ids)])
    ).results[0]
    assert verified.num_accepted >= 3  # same model: batched numerics may flip at most a near-tie
    stale = pb.ProposeRequest(items=[pb.ProposeItem(session_id=sid, position=len(prompt), max_tokens=2)])
    assert _code(lambda: draft.Propose(stale)) == grpc.StatusCode.FAILED_PRECONDITION
    for stub in (target, draft):
        stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_sampled_draft_sends_exact_distributions(draft_channel: grpc.Channel, target_channel: grpc.Channel) -> None:
    target = pb_grpc.TargetStub(target_channel)
    draft = pb_grpc.DraftStub(draft_channel)
    prompt = _prompt(target)
    sid = _sid()
    params = pb.SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    draft.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=params)]))
    prop = draft.Propose(
        pb.ProposeRequest(
            items=[pb.ProposeItem(session_id=sid, position=len(prompt), append_token_ids=[], max_tokens=3)]
        )
    ).proposals[0]
    assert len(prop.distributions) == len(prop.token_ids) == 3
    for token, dist in zip(prop.token_ids, prop.distributions, strict=True):
        assert token in dist.token_ids
        assert 1 <= len(dist.token_ids) <= 40
        assert abs(float(np.sum(dist.probs)) - 1.0) < 1e-4
    draft.Close(pb.CloseRequest(session_ids=[sid]))


def test_rollback_replays_the_same_tokens(target_channel: grpc.Channel) -> None:
    """Rolling a greedy session back and decoding again reproduces the same tokens (KV truncated, not corrupted)."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub)
    sid = _sid()
    first = stub.Open(
        pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)])
    ).results[0]
    pos, tokens = first.position, []
    for _ in range(5):
        r = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)])).results[0]
        tokens.append(r.tokens[0].id)
        pos = r.position
    back = first.position + 2  # keeps the first token and two more
    stub.Rollback(pb.RollbackRequest(items=[pb.RollbackItem(session_id=sid, position=back)]))
    replay = []
    pos = back
    for _ in range(3):
        r = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)])).results[0]
        replay.append(r.tokens[0].id)
        pos = r.position
    assert replay == tokens[2:5]
    into_prompt = pb.RollbackRequest(items=[pb.RollbackItem(session_id=sid, position=len(prompt) - 1)])
    assert _code(lambda: stub.Rollback(into_prompt)) == grpc.StatusCode.INVALID_ARGUMENT
    beyond = pb.RollbackRequest(items=[pb.RollbackItem(session_id=sid, position=pos + 1)])
    assert _code(lambda: stub.Rollback(beyond)) == grpc.StatusCode.INVALID_ARGUMENT
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_draft_rollback_forgets_tokens(draft_channel: grpc.Channel) -> None:
    draft = pb_grpc.DraftStub(draft_channel)
    sid = _sid()
    prompt = [1, 504, 2573, 1244, 504, 2573]
    draft.Open(pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)]))
    one = draft.Propose(
        pb.ProposeRequest(items=[pb.ProposeItem(session_id=sid, position=6, append_token_ids=[77, 78], max_tokens=3)])
    ).proposals[0]
    assert one.position == 8
    draft.Rollback(pb.RollbackRequest(items=[pb.RollbackItem(session_id=sid, position=6)]))
    again = draft.Propose(
        pb.ProposeRequest(items=[pb.ProposeItem(session_id=sid, position=6, append_token_ids=[77, 78], max_tokens=3)])
    ).proposals[0]
    assert again.position == 8
    assert list(again.token_ids) == list(one.token_ids)  # same committed sequence, same greedy proposal
    draft.Close(pb.CloseRequest(session_ids=[sid]))


def test_verify_stream_answers_by_request_id_with_in_band_errors(target_channel: grpc.Channel) -> None:
    """VerifyStream carries many calls, served concurrently (so they can share engine steps) and matched by
    request_id; a failed call is an `error` status and the stream keeps serving. Two pipelined calls for one
    session still apply in order: the second waits for the next step."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub)
    sid = _sid()
    first = stub.Open(
        pb.OpenRequest(items=[pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)])
    ).results[0]
    requests = [
        pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=first.position)], request_id=11),
        pb.VerifyRequest(items=[pb.VerifyItem(session_id="missing", position=1)], request_id=12),
        pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=first.position + 5)], request_id=13),
        pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=first.position + 1)], request_id=14),
    ]
    by_id = {r.request_id: r for r in stub.VerifyStream(iter(requests))}
    assert sorted(by_id) == [11, 12, 13, 14]
    replies = [by_id[i] for i in (11, 12, 13, 14)]
    assert not replies[0].HasField("error") and replies[0].results[0].position == first.position + 1
    assert replies[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert replies[2].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert not replies[3].HasField("error") and replies[3].results[0].position == first.position + 2
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def _open(stub: pb_grpc.TargetStub, prompt: list[int], sampling=GREEDY, logprobs: bool = False) -> tuple[str, int]:
    """A new session on `prompt`: its id and its position after the first token."""
    sid = _sid()
    item = pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=sampling, logprobs=logprobs)
    return sid, stub.Open(pb.OpenRequest(items=[item])).results[0].position


def _single_steps(stub: pb_grpc.TargetStub, prompt: list[int], n: int, sampling=GREEDY) -> list[pb.Token]:
    """n target-only tokens after the first, one Verify call each: the reference for multi-token calls."""
    sid, pos = _open(stub, prompt, sampling, logprobs=True)
    tokens = []
    for _ in range(n):
        r = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)])).results[0]
        tokens.extend(r.tokens)
        pos = r.position
    stub.Close(pb.CloseRequest(session_ids=[sid]))
    return tokens


@pytest.mark.parametrize(
    "sampling", [GREEDY, pb.SamplingParams(temperature=0.9, top_k=40, seed=7)], ids=["greedy", "sampled"]
)
def test_plain_steps_answer_several_tokens_exactly_as_single_calls(target_channel: grpc.Channel, sampling) -> None:
    """`Continuation.plain_steps` decodes N tokens in one call, one engine step each: the same tokens,
    log-probabilities and random stream as N single calls; an exact retry is answered from memory."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub)
    reference = _single_steps(stub, prompt, 9, sampling)
    sid, pos = _open(stub, prompt, sampling, logprobs=True)
    request = pb.VerifyRequest(
        items=[pb.VerifyItem(session_id=sid, position=pos, continuation=pb.Continuation(plain_steps=5))]
    )
    reply = stub.Verify(request)
    (result,) = reply.results
    assert result.num_accepted == 0 and result.position == pos + 5
    assert list(result.tokens) == reference[:5]  # ids, pieces and log-probabilities
    assert reply.timing.steps == 5 and reply.timing.forward_ns > 0
    assert stub.Verify(request).results == reply.results  # an exact retry: nothing applied twice
    rest = stub.Verify(
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=pos + 5, continuation=pb.Continuation(plain_steps=4))]
        )
    )
    assert list(rest.results[0].tokens) == reference[5:9]
    stub.Close(pb.CloseRequest(session_ids=[sid]))


@pytest.mark.parametrize(
    "sampling", [GREEDY, pb.SamplingParams(temperature=0.9, top_k=40, seed=7)], ids=["greedy", "sampled"]
)
def test_a_round_that_goes_on_answers_as_a_round_then_a_plain_call(target_channel: grpc.Channel, sampling) -> None:
    """Drafts with `Continuation.plain_steps` (Capabilities.continues_rounds): the first step verifies them, then the
    call decodes on its own until the sequence is plain_steps tokens past its position. Tokens, log-probabilities and
    random stream must be those of the round as a call of its own followed by a target-only call; the round is
    reported at offset 0 with match_len 0; an exact retry is answered from memory, and a retry with other drafts is
    not mistaken for it."""
    stub = pb_grpc.TargetStub(target_channel)
    assert stub.Info(pb.InfoRequest()).capabilities.continues_rounds
    prompt = _prompt(stub)
    greedy = _single_steps(stub, prompt, 4)
    drafts = [greedy[0].id, greedy[1].id, (greedy[2].id + 1) % 1000]  # greedy: two accepted, the third rejected
    sid, pos = _open(stub, prompt, sampling, logprobs=True)
    first = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos, draft_token_ids=drafts)]))
    after = first.results[0].position
    plain = stub.Verify(
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=after, continuation=pb.Continuation(plain_steps=12))]
        )
    )
    reference = [*first.results[0].tokens, *plain.results[0].tokens][:12]
    stub.Close(pb.CloseRequest(session_ids=[sid]))

    sid, pos = _open(stub, prompt, sampling, logprobs=True)
    call = pb.VerifyRequest(
        items=[
            pb.VerifyItem(
                session_id=sid, position=pos, draft_token_ids=drafts, continuation=pb.Continuation(plain_steps=12)
            )
        ]
    )
    reply = stub.Verify(call)
    (result,) = reply.results
    assert list(result.tokens) == reference and result.position == pos + 12
    (own,) = result.lookup_rounds
    assert (own.offset, own.match_len, own.drafted) == (0, 0, 3)
    assert own.accepted == first.results[0].num_accepted and own.forward_ns > 0
    if sampling is GREEDY:
        assert own.accepted == 2
    assert reply.timing.steps == 1 + 12 - (own.accepted + 1)
    assert stub.Verify(call).results == reply.results  # an exact retry: nothing applied twice
    other = pb.VerifyRequest(
        items=[
            pb.VerifyItem(
                session_id=sid, position=pos, draft_token_ids=drafts[:2], continuation=pb.Continuation(plain_steps=12)
            )
        ]
    )
    assert _code(lambda: stub.Verify(other)) == grpc.StatusCode.FAILED_PRECONDITION  # not its answer: refused
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_pipelined_multi_token_calls_apply_in_order(target_channel: grpc.Channel) -> None:
    """The gateway sends the next call before the previous one is answered. A multi-token call runs a step at a
    time, so the call queued behind it must wait for its last step (else its first step would find the session
    short of the position it names); calls of other sessions keep batching meanwhile."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub)
    reference = _single_steps(stub, prompt, 10)
    sid, other = _sid(), _sid()
    opened = stub.Open(
        pb.OpenRequest(
            items=[
                pb.OpenItem(session_id=s, prompt_token_ids=prompt, sampling=GREEDY, logprobs=True) for s in (sid, other)
            ]
        )
    ).results
    pos = opened[0].position
    requests = [
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=pos, continuation=pb.Continuation(plain_steps=4))],
            request_id=1,
        ),
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=other, position=pos, continuation=pb.Continuation(plain_steps=6))],
            request_id=2,
        ),
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=pos + 4, continuation=pb.Continuation(plain_steps=5))],
            request_id=3,
        ),
        pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos + 9)], request_id=4),
    ]
    by_id = {r.request_id: r for r in stub.VerifyStream(iter(requests))}
    assert not any(r.HasField("error") for r in by_id.values()), [r.error for r in by_id.values()]
    ours = [t for i in (1, 3, 4) for t in by_id[i].results[0].tokens]
    assert ours == reference
    assert list(by_id[2].results[0].tokens) == reference[:6]
    stub.Close(pb.CloseRequest(session_ids=[sid, other]))


def test_plain_steps_end_early_at_end_of_text_and_at_a_full_context(target_channel: grpc.Channel) -> None:
    """A multi-token call stops after an end-of-generation token, and where the session's context fills it answers
    the tokens that fit; the next call then gets the context error. Nothing computed is lost."""
    stub = pb_grpc.TargetStub(target_channel)
    chat = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2? Answer with one number.<|im_end|>\n<|im_start|>assistant\n"
    )  # the model answers "The answer is 4." and ends
    prompt = list(stub.Tokenize(pb.TokenizeRequest(text=chat, parse_special=True)).token_ids)
    sid, pos = _open(stub, prompt)
    tokens = stub.Verify(
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=pos, continuation=pb.Continuation(plain_steps=200))]
        )
    )
    tokens = tokens.results[0].tokens
    assert tokens[-1].is_eog and len(tokens) < 200
    assert not any(t.is_eog for t in tokens[:-1])
    stub.Close(pb.CloseRequest(session_ids=[sid]))

    n_ctx = stub.Info(pb.InfoRequest()).context_size
    long_prompt = (_prompt(stub, "one two three four five six seven eight " * 300))[: n_ctx - 8]
    sid, pos = _open(stub, long_prompt)
    reply = stub.Verify(
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=pos, continuation=pb.Continuation(plain_steps=16))]
        )
    )
    (result,) = reply.results
    assert result.position == n_ctx and len(result.tokens) == n_ctx - pos
    assert reply.timing.steps == n_ctx - pos
    full = pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=result.position)])
    assert _code(lambda: stub.Verify(full)) == grpc.StatusCode.INVALID_ARGUMENT
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_a_cancelled_call_behind_a_multi_token_call_leaves_it_alone(target_channel: grpc.Channel) -> None:
    """The gateway cancels pipelined calls it no longer needs (end of text, a client gone). A call waiting behind a
    multi-token call of its session that is cancelled must not cancel or break the call it waits for."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub)
    reference = _single_steps(stub, prompt, 12)
    sid, pos = _open(stub, prompt, logprobs=True)
    ahead = stub.Verify.future(
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=pos, continuation=pb.Continuation(plain_steps=12))]
        )
    )
    behind = stub.Verify.future(
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=pos + 12, continuation=pb.Continuation(plain_steps=4))]
        )
    )
    behind.cancel()
    assert list(ahead.result(timeout=60).results[0].tokens) == reference
    after = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos + 12)]))
    assert after.results[0].position == pos + 13
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_calls_wait_in_order_behind_a_multi_token_call_and_a_cancelled_waiter_changes_nothing() -> None:
    """The target's ordering of calls behind a multi-token call, in-process (deterministic): a waiter runs after the
    call ahead of it, and cancelling a waiter neither cancels nor breaks the call it waits for."""
    import asyncio

    from services.target.servicer import TargetServicer
    from services.target.verifier import VerifySpec

    spec = VerifySpec("s", 0, (), None)

    async def main() -> list[str]:
        servicer = TargetServicer(worker=None)  # type: ignore[arg-type]  # _in_order needs no engine
        gate, order = asyncio.Event(), []

        async def job(name: str) -> str:
            if name == "ahead":
                await gate.wait()
            order.append(name)
            return name

        ahead = asyncio.create_task(servicer._in_order(set(), [spec], lambda: job("ahead")))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(servicer._in_order({servicer._chains["s"]}, [spec], lambda: job("cancelled")))
        behind = asyncio.create_task(servicer._in_order({servicer._chains["s"]}, [spec], lambda: job("behind")))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        assert not ahead.done() and not behind.done()
        gate.set()
        assert await ahead == "ahead" and await behind == "behind"
        assert waiter.cancelled() and not servicer._chains
        return order

    assert asyncio.run(main()) == ["ahead", "behind"]


# Its greedy continuation copies the list: the sequence ends with a repeat of up to 5 tokens at once, of 6 to 11
# tokens after 1 to 6 more tokens (SmolLM2-135M).
COPYING_PROMPT = "Colors: red, green, blue, yellow, purple. Again: red, green"


def _ends_with_repeat(sequence: list[int], n: int) -> bool:
    """The definition `stop_at_repeat` implements, written out: the last n tokens occurred together earlier."""
    suffix = sequence[len(sequence) - n :]
    return len(sequence) > n and any(sequence[i : i + n] == suffix for i in range(len(sequence) - n))


def test_stop_at_repeat_ends_target_only_calls_where_prompt_lookup_could_draft(target_channel: grpc.Channel) -> None:
    """`stop_at_repeat=n`: a call at a sequence that already ends with a repeated n-gram is refused
    (FAILED_PRECONDITION, nothing changed), and a multi-token call ends after the first token that makes one. Checked
    against one-token calls and the definition written out, for n from 1 to 12 on a prompt whose continuation copies
    its start."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub, COPYING_PROMPT)
    reference = [t.id for t in _single_steps(stub, prompt, 16)]
    seen = {"refused": 0, "stopped inside": 0}
    for n in range(1, 13):
        sid = _sid()
        item = pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)
        opened = stub.Open(pb.OpenRequest(items=[item])).results[0]
        sequence, pos = [*prompt, opened.first_token.id], opened.position
        call = pb.VerifyRequest(
            items=[
                pb.VerifyItem(
                    session_id=sid, position=pos, continuation=pb.Continuation(plain_steps=16, stop_at_repeat=n)
                )
            ]
        )
        if _ends_with_repeat(sequence, n):
            assert _code(lambda call=call: stub.Verify(call)) == grpc.StatusCode.FAILED_PRECONDITION
            plain = stub.Verify(pb.VerifyRequest(items=[pb.VerifyItem(session_id=sid, position=pos)])).results[0]
            assert [t.id for t in plain.tokens] == reference[:1]  # the refused call changed nothing
            seen["refused"] += 1
        else:
            got = [t.id for t in stub.Verify(call).results[0].tokens]
            want = next(
                (reference[: j + 1] for j in range(16) if _ends_with_repeat([*sequence, *reference[: j + 1]], n)),
                reference,
            )
            assert got == want, n
            seen["stopped inside"] += len(want) < 16
        stub.Close(pb.CloseRequest(session_ids=[sid]))
    assert seen["refused"] and seen["stopped inside"], seen  # the prompt exercises both (greedy, deterministic)

    sid, pos = _open(stub, prompt)
    with_drafts = pb.VerifyRequest(
        items=[
            pb.VerifyItem(
                session_id=sid, position=pos, draft_token_ids=[5], continuation=pb.Continuation(stop_at_repeat=4)
            )
        ]
    )
    assert _code(lambda: stub.Verify(with_drafts)) == grpc.StatusCode.INVALID_ARGUMENT  # one step: nothing to stop
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_a_round_that_goes_on_stops_at_a_repeat_and_is_never_skipped_for_one(target_channel: grpc.Channel) -> None:
    """A round with `plain_steps` and `stop_at_repeat=n` always verifies its drafts, even where the sequence already
    ends with a repeated n-gram, and the decoding after it ends after the first token (the round's own included)
    that leaves the sequence so. Checked against one-token calls and the definition written out, n from 1 to 12."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub, COPYING_PROMPT)
    reference = [t.id for t in _single_steps(stub, prompt, 16)]
    drafts = reference[:2]  # greedy: both accepted, the round emits reference[:3]
    seen = {"repeat before": 0, "stopped by the round": 0, "stopped after it": 0}
    for n in range(1, 13):
        sid = _sid()
        item = pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)
        opened = stub.Open(pb.OpenRequest(items=[item])).results[0]
        sequence, pos = [*prompt, opened.first_token.id], opened.position
        call = pb.VerifyItem(
            session_id=sid,
            position=pos,
            draft_token_ids=drafts,
            continuation=pb.Continuation(plain_steps=16, stop_at_repeat=n),
        )
        result = stub.Verify(pb.VerifyRequest(items=[call])).results[0]
        want = next(
            (reference[: j + 1] for j in range(2, 16) if _ends_with_repeat([*sequence, *reference[: j + 1]], n)),
            reference,
        )
        assert [t.id for t in result.tokens] == want, n
        assert result.lookup_rounds[0].accepted == 2
        seen["repeat before"] += _ends_with_repeat(sequence, n)
        seen["stopped by the round"] += len(want) == 3
        seen["stopped after it"] += 3 < len(want) < 16
        stub.Close(pb.CloseRequest(session_ids=[sid]))
    assert all(seen.values()), seen  # the prompt exercises every case (greedy, deterministic)


def test_a_call_pipelined_behind_one_stopped_at_a_repeat_is_skipped(target_channel: grpc.Channel) -> None:
    """The gateway sends the next call from where the one in flight would end if it ran all its steps. When that one
    stops at a repeat, the next is refused at its position and changes nothing; decoding goes on from the real end."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub, COPYING_PROMPT)
    reference = [t.id for t in _single_steps(stub, prompt, 20)]
    sid = _sid()
    item = pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=GREEDY)
    opened = stub.Open(pb.OpenRequest(items=[item])).results[0]
    sequence, pos = [*prompt, opened.first_token.id], opened.position

    # An n whose first repeat comes a few tokens into the first call (the prompt has one: greedy, deterministic).
    def first_repeat(n: int) -> int | None:
        return next((j for j in range(20) if _ends_with_repeat([*sequence, *reference[: j + 1]], n)), None)

    n = next(n for n in range(1, 13) if not _ends_with_repeat(sequence, n) and 2 <= (first_repeat(n) or 0) < 15)
    first = stub.Verify.future(
        pb.VerifyRequest(
            items=[
                pb.VerifyItem(
                    session_id=sid, position=pos, continuation=pb.Continuation(plain_steps=16, stop_at_repeat=n)
                )
            ]
        )
    )
    behind = stub.Verify.future(
        pb.VerifyRequest(
            items=[
                pb.VerifyItem(
                    session_id=sid, position=pos + 16, continuation=pb.Continuation(plain_steps=4, stop_at_repeat=n)
                )
            ]
        )
    )
    result = first.result().results[0]
    assert 0 < len(result.tokens) < 16  # it stopped at the repeat
    with pytest.raises(grpc.RpcError) as info:
        behind.result()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    rest = stub.Verify(
        pb.VerifyRequest(
            items=[pb.VerifyItem(session_id=sid, position=result.position, continuation=pb.Continuation(plain_steps=3))]
        )
    )
    assert [t.id for t in [*result.tokens, *rest.results[0].tokens]] == reference[: len(result.tokens) + 3]
    stub.Close(pb.CloseRequest(session_ids=[sid]))


LOOKUP_PROMPT = (
    "def area(width, height):\n    return width * height\n\n"
    "def volume(width, height, depth):\n    return width * height * depth\n\n"
    "Rewrite both unchanged:\ndef area(width, height):\n    return"
)


def _opened(stub: pb_grpc.TargetStub, prompt: list[int], sampling=GREEDY) -> tuple[str, int, list[int]]:
    """A new session: its id, its position after the first token, and its sequence (prompt and that token)."""
    sid = _sid()
    item = pb.OpenItem(session_id=sid, prompt_token_ids=prompt, sampling=sampling)
    opened = stub.Open(pb.OpenRequest(items=[item])).results[0]
    return sid, opened.position, [*prompt, opened.first_token.id]


def _rounds_one_call_each(
    stub: pb_grpc.TargetStub, prompt: list[int], rule: LookupRule, n: int, sampling=GREEDY
) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """What a caller with this lookup rule gets sending every round itself, one Verify each (tandem.ngram's drafter
    and rule, as the gateway runs them): the tokens after the first, and (offset, match length, drafted, accepted)
    of each round that drafted."""
    sid, pos, sequence = _opened(stub, prompt, sampling)
    rule = dataclasses.replace(rule, end_position=pos + n)
    index = NgramIndex(rule.ngram_min, rule.ngram_max)
    tokens: list[int] = []
    rounds = []
    while len(tokens) < n:
        index.extend(sequence)
        drafts, match = rule.draft(index, sequence, 10_000)
        item = pb.VerifyItem(session_id=sid, position=pos, draft_token_ids=drafts)
        r = stub.Verify(pb.VerifyRequest(items=[item])).results[0]
        if drafts:
            rounds.append((len(tokens), match, len(drafts), r.num_accepted))
        emitted = [t.id for t in r.tokens]
        tokens += emitted
        sequence += emitted
        pos = r.position
    stub.Close(pb.CloseRequest(session_ids=[sid]))
    return tokens[:n], rounds


def _rule_pb(rule: LookupRule, end_position: int) -> pb.LookupRule:
    return pb.LookupRule(
        ngram_min=rule.ngram_min,
        ngram_max=rule.ngram_max,
        max_draft=rule.max_draft,
        min_draft=rule.min_draft,
        end_position=end_position,
        bucket_rates=rule.bucket_rates,
        round_costs=rule.round_costs,
        plain_cost=rule.plain_cost,
    )


@pytest.mark.parametrize("sampling", [GREEDY, pb.SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_target_drafts_with_the_callers_lookup_rule(target_channel: grpc.Channel, sampling: pb.SamplingParams) -> None:
    """Continuation.lookup: one target-only call in which the target drafts as the caller's prompt lookup would, round
    by round. Each round verifies the same tokens in the same batch as a caller's own Verify would, so the tokens,
    the rounds and their acceptance are those of one call per round, greedy and seeded sampling alike."""
    stub = pb_grpc.TargetStub(target_channel)
    assert stub.Info(pb.InfoRequest()).capabilities.prompt_lookup
    prompt = _prompt(stub, LOOKUP_PROMPT)
    rule = LookupRule(ngram_min=2, ngram_max=16, max_draft=8, min_draft=1)
    n = 40
    reference, reference_rounds = _rounds_one_call_each(stub, prompt, rule, n, sampling)
    assert reference_rounds and any(accepted > 0 for *_, accepted in reference_rounds)  # the prompt repeats

    sid, pos, _ = _opened(stub, prompt, sampling)
    tokens: list[int] = []
    rounds = []
    steps = 0
    while len(tokens) < n:
        item = pb.VerifyItem(
            session_id=sid,
            position=pos,
            continuation=pb.Continuation(plain_steps=n - len(tokens), lookup=_rule_pb(rule, pos - len(tokens) + n)),
        )
        reply = stub.Verify(pb.VerifyRequest(items=[item]))
        r = reply.results[0]
        rounds += [(len(tokens) + lr.offset, lr.match_len, lr.drafted, lr.accepted) for lr in r.lookup_rounds]
        assert all(lr.forward_ns > 0 and lr.step_tokens == lr.drafted + 1 for lr in r.lookup_rounds)
        steps += reply.timing.steps
        tokens += [t.id for t in r.tokens]
        pos = r.position
    assert tokens[:n] == reference
    assert rounds == reference_rounds
    assert steps < n  # rounds that accepted drafts emitted several tokens a step
    stub.Close(pb.CloseRequest(session_ids=[sid]))


def test_lookup_drafts_refuse_the_call_behind_and_bad_rules(target_channel: grpc.Channel) -> None:
    """A call whose drafts were accepted past the tokens it asked for leaves the session further on: the call
    pipelined behind it is refused (FAILED_PRECONDITION) and changes nothing. A rule that does not hold together, or
    one on a call with drafts or stop_at_repeat, is INVALID_ARGUMENT."""
    stub = pb_grpc.TargetStub(target_channel)
    prompt = _prompt(stub, LOOKUP_PROMPT)
    rule = LookupRule(ngram_min=2, ngram_max=16, max_draft=8, min_draft=1)
    sid, pos, _ = _opened(stub, prompt)
    end = pos + 60
    first = stub.Verify.future(
        pb.VerifyRequest(
            items=[
                pb.VerifyItem(
                    session_id=sid,
                    position=pos,
                    continuation=pb.Continuation(plain_steps=2, lookup=_rule_pb(rule, end)),
                )
            ]
        )
    )
    behind = stub.Verify.future(
        pb.VerifyRequest(
            items=[
                pb.VerifyItem(
                    session_id=sid,
                    position=pos + 2,
                    continuation=pb.Continuation(plain_steps=2, lookup=_rule_pb(rule, end)),
                )
            ]
        )
    )
    result = first.result().results[0]
    assert result.lookup_rounds[0].accepted > 0 and result.position > pos + 2  # the prompt's code is copied
    with pytest.raises(grpc.RpcError) as info:
        behind.result()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    rest = stub.Verify(
        pb.VerifyRequest(
            items=[
                pb.VerifyItem(
                    session_id=sid,
                    position=result.position,
                    continuation=pb.Continuation(plain_steps=2, lookup=_rule_pb(rule, end)),
                )
            ]
        )
    )
    assert rest.results[0].position > result.position  # the refused call changed nothing: decoding goes on
    bad = [
        pb.VerifyItem(
            session_id=sid,
            position=pos,
            continuation=pb.Continuation(lookup=pb.LookupRule(ngram_min=0, ngram_max=16, max_draft=8)),
        ),
        pb.VerifyItem(
            session_id=sid,
            position=pos,
            continuation=pb.Continuation(
                lookup=pb.LookupRule(
                    ngram_min=2, ngram_max=16, max_draft=2, bucket_rates=[0.5] * 7, round_costs=[1.0], plain_cost=1.0
                )
            ),
        ),
        pb.VerifyItem(
            session_id=sid, position=pos, draft_token_ids=[5], continuation=pb.Continuation(lookup=_rule_pb(rule, end))
        ),
        pb.VerifyItem(
            session_id=sid, position=pos, continuation=pb.Continuation(stop_at_repeat=3, lookup=_rule_pb(rule, end))
        ),
    ]
    for item in bad:
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(pb.VerifyRequest(items=[item]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Close(pb.CloseRequest(session_ids=[sid]))
