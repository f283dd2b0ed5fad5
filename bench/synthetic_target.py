"""`python -m bench.synthetic_target --synth-len L [--synth-n-max K] [target flags]`: a target for benchmarks only.

Random-weight models of real shapes (bench/random_gguf.py) cost what real models cost per step, but their drafts
are noise, so real acceptance would be ~0. This target runs every forward pass for real and then imposes the
acceptance: each draft position is accepted with a fixed conditional probability p, chosen so that the mean
acceptance length (accepted drafts + the target's own token) is L with K draft tokens, the definition llama-server
uses for `--spec-synth-len`, so the two are comparable. The text it produces is not valid.

It is a separate entry point on purpose: the service's own settings (flags, TANDEM_TARGET_* variables, compose,
Helm) have no way to turn it on, and Info, every response's `timings` and the gateway's
`tandem_synthetic_acceptance` metric say when it is on.
"""

from __future__ import annotations

import argparse
import random
import sys

MAX_STREAMS = 4096  # sessions whose acceptance sequences are kept
GOLDEN = (5**0.5 - 1) / 2  # Weyl sequence step: the most evenly spread one


def conditional_rate(length: float, n_max: int) -> float:
    """p with 1 + p + p^2 + ... + p^n_max = length (bisection), i.e. mean acceptance length `length` at k=n_max."""
    if n_max <= 0:
        raise ValueError("synthetic acceptance needs at least one draft token")
    if not 1.0 <= length <= n_max + 1:
        raise ValueError(f"mean acceptance length must be within [1, {n_max + 1}] for {n_max} draft tokens")
    if length == n_max + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(1, n_max + 1)) < length - 1:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SyntheticAcceptance:
    """Draws how many of k drafts are accepted: each position with probability p given the previous ones were.

    p makes the mean acceptance length `length` at n_max draft tokens; without n_max, p is solved for each call's
    own k (a run at fixed k then matches llama-server's `--spec-synth-len L --spec-draft-n-max k`). A length that k
    tokens cannot reach (L > k + 1) accepts everything.
    """

    def __init__(self, length: float, n_max: int | None = None, seed: int = 0) -> None:
        if length < 1.0:
            raise ValueError("mean acceptance length must be at least 1")
        self.length = length
        self.n_max = n_max
        self._rates: dict[int, float] = {}
        if n_max is not None:
            self._rates[n_max] = conditional_rate(length, n_max)
        at = f"k={n_max} (conditional rate {self._rates[n_max]:.4f})" if n_max else "each call's k"
        self.label = f"mean length {length} at {at}"
        # Each round's outcome comes from one number u in [0, 1) through the inverse of the round's outcome
        # distribution. u follows a Weyl sequence (u_i = frac(offset + i * golden ratio)) per session, so:
        # - a session's realised mean length is within ~3% of L after 100 rounds; with pseudo-random draws a
        #   128-token request missed it by up to 20% (2x H200 run, mean length 1.63 at L=2), and all its rows alike;
        # - every session walks the same sequence (common random numbers), so two configurations compared at the
        #   same k see the same acceptance. With one shared pseudo-random stream, rows run in a fixed order took
        #   different stretches of it, and their difference repeated in every run.
        self._offset = random.Random(seed).random()
        self._rounds: dict[str | None, int] = {}

    def rate(self, k: int) -> float:
        key = self.n_max or k
        if key not in self._rates:
            self._rates[key] = conditional_rate(self.length, key) if self.length <= key + 1 else 1.0
        return self._rates[key]

    def _next_u(self, session_id: str | None) -> float:
        if session_id not in self._rounds and len(self._rounds) >= MAX_STREAMS:
            self._rounds.pop(next(iter(self._rounds)))  # the oldest session: long finished
        i = self._rounds.get(session_id, 0)
        self._rounds[session_id] = i + 1
        return (self._offset + i * GOLDEN) % 1.0

    def __call__(self, k: int, guess: bool = False, session_id: str | None = None) -> tuple[int, bool]:
        """(drafts accepted of k, whether the draft's guess of the next token is right): each position in turn
        passes with probability p, and the guess is one more position, reached only if all k passed. One u per
        round decides all of it, so asking for the guess or not leaves the session's sequence aligned."""
        if k <= 0:
            return 0, False
        p = self.rate(k)
        u = self._next_u(session_id)
        # P(at least i accepted) = p^i; the guess is right with P = p^(k+1). Count the thresholds u falls below.
        n, reach = 0, p
        while n < k and u < reach:
            n += 1
            reach *= p
        return n, bool(guess and n == k and u < reach)


def synthetic_verifier(synthetic: SyntheticAcceptance) -> type:
    """A Verifier whose outcomes are imposed by `synthetic` on the same logits rows (real compute, invalid text)."""
    from services.target.verifier import Verifier
    from tandem.acceptance import VerifyOutcome

    class SyntheticVerifier(Verifier):
        synthetic_label = synthetic.label

        def decide(self, session, spec, rows) -> VerifyOutcome:
            k = len(spec.draft_tokens)
            n, guess_right = synthetic(k, spec.bonus_guess is not None, session.session_id)
            n = min(n, k, len(rows) - 1)
            own = self._pick(session, rows[n])
            if n == k and guess_right:  # overlapped drafting: the draft's guess is right at the same rate
                own = spec.bonus_guess
            return VerifyOutcome(n, own)

    return SyntheticVerifier


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synth-len", type=float, required=True, help="mean acceptance length, bonus token included")
    parser.add_argument(
        "--synth-n-max", type=int, default=None, help="the draft length L is defined for (default: each call's k)"
    )
    parser.add_argument("--synth-seed", type=int, default=0)
    parser.add_argument(
        "--colocated-gateway",
        nargs="?",
        const="all",
        choices=("all", "target"),
        default=None,
        help="run a gateway around this target instead of a target service: `all` loads the draft too"
        " (services.gateway --colocate), `target` keeps the draft a gRPC service (--colocate-target, --draft"
        " ADDRESS); the other flags are the gateway's, the models' settings come from TANDEM_TARGET_* and"
        " TANDEM_DRAFT_*",
    )
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    synthetic = SyntheticAcceptance(args.synth_len, args.synth_n_max, args.synth_seed)

    print(f"tandem: SYNTHETIC ACCEPTANCE ({synthetic.label}); benchmark only, text is not valid", flush=True)

    if args.colocated_gateway:
        from services.gateway.__main__ import main as gateway_main

        flag = "--colocate" if args.colocated_gateway == "all" else "--colocate-target"
        gateway_main([flag, *rest], lambda: synthetic_verifier(synthetic))
        return

    from services.target.__main__ import serve_target
    from tandem.cli import service_main
    from tandem.config import TargetSettings

    async def run(settings: TargetSettings) -> None:
        await serve_target(settings, synthetic_verifier(synthetic))  # after llama_cpp: see services.gateway main

    service_main(TargetSettings, "tandem-target-synthetic", run, rest)


if __name__ == "__main__":
    main()
