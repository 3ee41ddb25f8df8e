"""The batch-wide sums the draft-length rule reads, kept as the requests in flight change, and the rule
over one state of them.

The rule (orchestrator.decoding.policy) weighs, at each draft length k, the batch's expected committed
tokens sum_i E_i(min(k, k_max_i)) over every request decoding on this orchestrator, and prices the round
by their number and cached context. Summed afresh for every request's plan that is O(n k) per request and
O(n^2 k) per round of the batch. Here each request's share (its E_i at every k, its context, its k_max)
is added when it arrives, replaced when it changes (a round's outcome changes its acceptance, a new round
its context and k_max) and taken out when it leaves: O(k) per change, O(1) per read of a sum. The rates
the rule reads over a state (tokens per second at each k, the best k) are worked out once per plan call
(BatchRule), however many requests it plans.
"""

from __future__ import annotations

from orchestrator.decoding.costs import BatchLoad, RoundCosts
from specmesh.roles import MAX_DRAFT_TOKENS

LENGTHS = MAX_DRAFT_TOKENS + 1  # draft lengths 0..MAX_DRAFT_TOKENS


class BatchSums:
    """Keyed by request; a share is its [E(min(k, k_max)) for k in range(LENGTHS)]."""

    def __init__(self):
        self._members: dict[object, list] = {}  # request -> [share, context, k_max]
        self._tokens = [0.0] * LENGTHS
        self._k_maxes = [0] * LENGTHS  # how many members have each k_max
        self.context = 0  # the members' cached context in all

    def __contains__(self, key: object) -> bool:
        return key in self._members

    def __len__(self) -> int:
        return len(self._members)

    def place(self, key: object, share: list[float], context: int, k_max: int) -> None:
        """Add a member, or replace all of one."""
        old = self._members.get(key)
        if old is not None:
            self._take_out(old)
        tokens = self._tokens
        for k, tokens_at_k in enumerate(share):
            tokens[k] += tokens_at_k
        k_max = min(k_max, LENGTHS - 1)
        self.context += context
        self._k_maxes[k_max] += 1
        self._members[key] = [share, context, k_max]

    def move(self, key: object, context: int) -> bool:
        """A member's new context (the one change of most rounds: O(1)); False for one that is not a member."""
        entry = self._members.get(key)
        if entry is None:
            return False
        self.context += context - entry[1]
        entry[1] = context
        return True

    def discard(self, key: object) -> None:
        old = self._members.pop(key, None)
        if old is None:
            return
        if not self._members:  # start clean: no rounding left over from the adds and removes
            self._tokens, self._k_maxes, self.context = [0.0] * LENGTHS, [0] * LENGTHS, 0
            return
        self._take_out(old)

    def _take_out(self, entry: list) -> None:
        share, context, k_max = entry
        tokens = self._tokens
        for k, tokens_at_k in enumerate(share):
            tokens[k] -= tokens_at_k
        self.context -= context
        self._k_maxes[k_max] -= 1

    def tokens(self, k: int) -> float:
        """The batch's expected committed tokens of a round at k (1.0 for an empty batch)."""
        return self._tokens[min(k, LENGTHS - 1)] if self._members else 1.0

    def k_max(self) -> int:
        """The largest k_max among the members (0 for none)."""
        return next((k for k in range(LENGTHS - 1, 0, -1) if self._k_maxes[k]), 0)


class BatchRule:
    """The rule over one state of the batch: its load, its tokens per second at each k and the best k, each
    worked out once (on first use) and read by every request planned over that state."""

    def __init__(self, costs: RoundCosts, sums: BatchSums):
        self.costs, self.sums = costs, sums
        self.batch = BatchLoad(requests=max(1, len(sums)), context=sums.context)
        self.known = costs.known  # whether rounds can be priced yet
        self._goodput: dict[int, float] = {}
        self._round_s: dict[tuple[int, int], float] = {}
        self._per_token_s: dict[int, float] = {}
        self._best: int | None = None
        self.plans: dict[tuple, tuple] = {}  # a situation's plan and k after it (DraftLength.plan_round)

    def tokens(self, k: int) -> float:
        """Expected committed tokens of a round of the batch, each request drafting k (capped by its k_max)."""
        return self.sums.tokens(k)

    def goodput(self, k: int) -> float:
        """The batch's tokens per second drafting k; at k = 0 as target-only rounds run, decoding ahead. (A
        free proposal is weighed against a target-only round of one token (DraftLength's proposal choice):
        decoding ahead would also put off the proposals that teach the policy their acceptance.)"""
        rate = self._goodput.get(k)
        if rate is None:
            round_s = self.costs.target_only_s(self.batch) if k == 0 else self.round_s(k)
            rate = self._goodput[k] = self.tokens(k) / max(round_s, 1e-9)
        return rate

    def round_s(self, k: int, lookup: int = 0) -> float:
        """RoundCosts.round_s over this state of the batch, worked out once per (k, lookup): a free proposal's
        every length is priced by each session that weighs one."""
        seconds = self._round_s.get((k, lookup))
        if seconds is None:
            seconds = self._round_s[k, lookup] = self.costs.round_s(k, self.batch, lookup)
        return seconds

    def best_k(self) -> int:
        if self._best is None:
            self._best = max(range(0, self.sums.k_max() + 1), key=self.goodput)
        return self._best

    def per_token_s(self, k_max: int) -> float:
        """What one more draft token a request costs the batch's round, averaged over the span 1..k_max the
        draft may run (step-cost tables jump at row counts)."""
        cost = self._per_token_s.get(k_max)
        if cost is None:
            cost = self._per_token_s[k_max] = (
                self.round_s(k_max) - self.round_s(1)) / (k_max - 1)
        return cost
