"""Target-only rounds that decode several tokens per call (VerifyRequest.decode_ahead).

A target-only round is one Verify: the call's own time (the link's round trip, serialization, the
services' handling) plus one target step. Paid once per token, that time is what target-only decoding
through the orchestrator costs beyond the target's own steps: at GPU step times of a few ms and a call
of a few ms, most of it. A Verify that decodes n tokens pays it once per n, at the price of handing the
client its tokens n at a time.

So the orchestrator's round costs (orchestrator.decoding.costs, the measures that also price
target-only rounds for the draft-length policy) give the call's latency L (a Verify's wall time less the
forward time the target reported) and the target's step s, and a request asks for the fewest tokens per
call that keep the call's share of the decoding within AHEAD_SHARE of the steps:

    n = ceil(L / (AHEAD_SHARE * s)),  decode_ahead = n - 1

capped by the tokens the request may still make and the configured most. A call that costs little
(an orchestrator beside the target on a fast host) asks for no tokens ahead: tokens stream one by one as
before. The tokens are the same either way: the target decides each as a plain decode step would, its
sampling draws in the same order (target_service.engine).
"""

from __future__ import annotations

import math

from specmesh.roles import MAX_DECODE_AHEAD

# The call's time may add at most this share to the target's steps of a target-only round: target-only
# decoding then runs within a tenth of its steps' time, and tokens are bunched only as far as that needs.
AHEAD_SHARE = 0.1


def tokens_ahead(latency_s: float, step_s: float, most: int, limit: int) -> int:
    """decode_ahead for the next target-only round under the rule: at most `most` and `limit`."""
    return min(tokens_per_call(latency_s, step_s, most) - 1, max(0, limit))


def tokens_per_call(latency_s: float, step_s: float, most: int = MAX_DECODE_AHEAD) -> int:
    """Tokens a target-only Verify commits under the rule: 1 + decode_ahead."""
    if step_s <= 0.0:
        return 1
    return max(1, min(math.ceil(latency_s / (AHEAD_SHARE * step_s)), 1 + most))
