"""Drafting or target-only under load, learned from what rounds delivered (orchestrator.decoding.regime).

Rounds are fed with constructed tokens and seconds (no timing): the regime must try both,
keep the better, look at the loser again less and less often, follow a change in which one
wins, and never count a round planned under the other regime. The policy must obey it.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from orchestrator.decoding.costs import RoundCosts
from orchestrator.decoding.loop import RoundTiming
from orchestrator.decoding.policy import AdaptiveSpeculation
from orchestrator.decoding.regime import LoadRegimes, RegimeConfig, load_bucket
from specmesh.step_costs import StepCosts

ACTIVE = 4  # requests decoding at once in these tests


def run_rounds(regimes: LoadRegimes, rounds: int, rate: dict[bool, float], active: int = ACTIVE,
               forecast: dict[int, float] | None = None) -> list[bool]:
    """`rounds` rounds of each of `active` requests; a round under regime r commits 2 tokens in
    2 / rate[r] seconds; `forecast`: the tables' drafting gain by requests decoding. Returns the
    regime of each batch round."""
    previous: list = [None] * active
    seen = []
    for _ in range(rounds):
        choices = [regimes.choice(active) for _ in range(active)]
        seen.append(choices[0].drafting)
        for request, choice in enumerate(choices):
            regimes.observe(choice, previous[request], 2, 2 / rate[choice.drafting], active,
                            None if forecast is None else forecast.get)
            previous[request] = choice
    return seen


def switches(seen: list[bool]) -> int:
    return sum(a != b for a, b in zip(seen, seen[1:]))


def trial_gaps(seen: list[bool], loser: bool) -> list[int]:
    """Batch rounds between the starts of the loser's trials, after the first."""
    starts = [i for i in range(1, len(seen)) if seen[i] == loser and seen[i - 1] != loser]
    return [b - a for a, b in zip(starts, starts[1:])]


def test_load_buckets():
    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_a_request_alone_always_drafts_as_its_policy_says():
    regimes = LoadRegimes()
    choice = regimes.choice(1)
    assert choice.drafting
    regimes.observe(choice, choice, 1, 100.0, 1)  # a dreadful round changes nothing alone
    assert regimes.choice(1).drafting and not regimes.buckets


def test_target_only_wins_where_it_delivers_more_and_drafting_is_retried_less_and_less():
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4, max_retry_every=64))
    seen = run_rounds(regimes, 600, {True: 8.0, False: 10.0})
    assert seen[0] is False  # a load met for the first time starts target-only ...
    assert any(seen[:8])  # ... and tries drafting after one window
    assert seen.count(False) > 0.85 * len(seen)
    gaps = trial_gaps(seen, loser=True)
    assert len(gaps) >= 3 and gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]  # every 4, 8, 16, ... windows
    regime = regimes.buckets[load_bucket(ACTIVE)]
    assert regime.rates[False] > regime.rates[True]


def test_drafting_keeps_the_load_where_it_pays():
    regimes = LoadRegimes()
    seen = run_rounds(regimes, 600, {True: 12.0, False: 10.0})
    assert seen.count(True) > 0.85 * len(seen) and seen[-100:].count(True) > 90


def test_a_change_in_which_regime_pays_is_followed():
    regimes = LoadRegimes()
    run_rounds(regimes, 300, {True: 12.0, False: 10.0})
    seen = run_rounds(regimes, 400, {True: 6.0, False: 10.0})
    assert seen[:30].count(False) > 15  # within a few windows, not after the long retry interval
    assert seen[-100:].count(False) > 85


def test_a_small_difference_does_not_flip_the_regime_back_and_forth():
    """Within the margin a trial never takes over: the first regime to win stays, tried against
    the other ever more rarely."""
    regimes = LoadRegimes()
    seen = run_rounds(regimes, 600, {True: 10.0, False: 10.1})
    regime = regimes.buckets[load_bucket(ACTIVE)]
    held = regime.drafting != regime.trying  # the established regime (not a trial in progress)
    assert seen[100:].count(held) > 0.9 * len(seen[100:])
    gaps = trial_gaps(seen, loser=not held)
    assert gaps == sorted(gaps)


def test_rounds_planned_under_the_other_regime_are_not_counted():
    regimes = LoadRegimes(RegimeConfig(window_rounds=1))
    first = regimes.choice(2)
    regimes.observe(first, None, 1, 1.0, 2)  # a request's first round: nothing before it to compare
    regime = regimes.buckets[load_bucket(2)]
    assert regime.rounds == 0
    regimes.observe(first, first, 1, 1.0, 2)
    regimes.observe(first, first, 1, 1.0, 2)  # the window closes: drafting is tried next
    assert regime.drafting and regime.epoch == 1
    regimes.observe(first, first, 1, 1.0, 2)  # planned before the switch
    after = regimes.choice(2)
    regimes.observe(after, first, 1, 1.0, 2)  # the first round after it: the batch was still target-only
    assert regime.rounds == 0 and regime.rates[True] is None


def test_a_drafting_trial_is_judged_after_its_way_in():
    """The window drafting is entered in (drafts prefilling and catching up: slow rounds) is not
    counted; the next one is. A way in at a third of target-only's rate, then drafting at 1.25x:
    drafting takes over. The same way in followed by drafting at 0.9x: back to target-only."""
    for steady, wins in ((12.5, True), (9.0, False)):
        regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
        run_rounds(regimes, 4, {True: 10.0, False: 10.0})  # target-only's first window (a round to start)
        regime = regimes.buckets[load_bucket(ACTIVE)]
        assert regime.drafting and regime.trying and regime.settling and regime.rates[True] is None
        # Each stretch's first round is not counted (planned before it, as after a switch).
        run_rounds(regimes, 4, {True: 10.0 / 3, False: 10.0})  # the way in
        assert regime.drafting and not regime.settling and regime.rates[True] is None
        run_rounds(regimes, 4, {True: steady, False: 10.0})
        assert regime.rates[True] == pytest.approx(steady)
        assert regime.drafting is wins and not regime.trying and not regime.settling


def flat(seconds: float) -> StepCosts:
    return StepCosts({rows: seconds for rows in (1, 2, 4, 8, 16)})


def seasoned(target: StepCosts, draft: StepCosts) -> AdaptiveSpeculation:
    """Shared policy state priced by these step costs, with a deployment's history behind it: about 7
    in 10 draft tokens accepted."""
    shared = AdaptiveSpeculation(costs=RoundCosts(SimpleNamespace(target=target, draft=draft)))
    history = shared.for_request("code")
    for _ in range(20):
        history.acceptance.observe(4, 2)
        history.acceptance.observe(4, 3)
    return shared


def test_the_policy_obeys_the_target_only_regime():
    """Under target-only no round drafts, the others count as target-only, and no draft opens."""
    shared = AdaptiveSpeculation(costs=RoundCosts(SimpleNamespace(target=flat(0.1), draft=flat(0.001))))
    policies = [shared.for_request("code") for _ in range(2)]
    shared.regimes.choice(2)
    regime = shared.regimes.buckets[load_bucket(2)]
    regime.drafting = True
    drafting = [p.choose(8) for p in policies]
    assert all(k > 0 for k in drafting)  # a nearly free draft: long drafts, as priced
    regime.drafting = False
    shared.regimes.choice(3)
    shared.regimes.buckets[load_bucket(3)].drafting = False
    assert [p.choose(8) for p in policies] == [0, 0]
    assert all(p._batch.drafting == 0 for p in policies)  # each priced the other as target-only
    # a third request would start target-only too
    assert not shared.for_request("code").wants_draft(8, catch_up=1, tokens_left=400)
    for p in policies:
        p.observe(RoundTiming(draft_s=0.0, verify_s=0.1), 0, 0)
    regime.drafting = True
    assert [p.choose(8) for p in policies] == drafting  # back to each request's own k


def test_back_in_the_drafting_regime_the_others_are_priced_at_their_own_k():
    """A target whose step costs the same for any rows (a GPU's, or a CPU's at small batches): a
    draft beside requests that do not draft costs a target step of its own and does not pay, one
    beside requests that draft shares their step and does. Under target-only every request ran
    k = 0; when the load's regime turns to drafting again, each must price the others at the k
    they draft at, not at the k = 0 of their last round, or none of them ever drafts again."""
    shared = seasoned(target=flat(0.3), draft=flat(0.05))
    policies = [shared.for_request("code") for _ in range(2)]
    shared.regimes.choice(2)
    regime = shared.regimes.buckets[load_bucket(2)]
    regime.drafting = True
    drafting = [p.choose(8) for p in policies]
    assert all(k > 0 for k in drafting)
    regime.drafting = False
    for _ in range(3):  # a stretch of target-only rounds
        assert [p.choose(8) for p in policies] == [0, 0]
        for p in policies:
            p.observe(RoundTiming(draft_s=0.0, verify_s=0.3), 0, 0)
    regime.drafting = True
    assert [p.choose(8) for p in policies] == drafting
    assert [p._batch.drafting for p in policies] == [1, 1]  # each priced the other drafting beside it


def test_requests_that_chose_no_k_yet_are_priced_drafting_beside_this_one():
    """A target step flat up to 16 rows and compute-bound past them (this CPU's, a GPU's at a larger
    size). When the load's regime turns to drafting, no request has chosen a k yet: priced as if
    alone, each opened a draft and drafted, at 16 requests every verification doubled its rows. Each
    must count the undecided others as drafting at its own k: at 16 requests nobody drafts (nor opens
    a draft), at 2 both do."""
    target = StepCosts({rows: 0.3 if rows <= 16 else 0.3 * rows / 16 for rows in (1, 2, 4, 8, 16, 32, 64)})
    draft = StepCosts({rows: 0.04 + 0.005 * rows for rows in (1, 2, 4, 8, 16, 32, 64)})
    for active, drafts in ((16, False), (2, True)):
        shared = seasoned(target=target, draft=draft)
        policies = [shared.for_request("code") for _ in range(active)]
        for p in policies:
            p.arrive()
        shared.regimes.choice(active)
        shared.regimes.buckets[load_bucket(active)].drafting = True
        assert policies[0].wants_draft(8, catch_up=1, tokens_left=400) is drafts
        assert (policies[0].choose(8) > 0) is drafts
        assert policies[0]._batch.undecided == active - 1


def test_a_request_held_back_from_drafting_is_priced_target_only():
    """A request whose draft is lost, paused or not worth opening runs target-only rounds whatever its
    k: the others must price a draft beside it as a step of its own, not as rows that share its step.
    One whose draft is only opening drafts again in a round or so: it keeps its k in their pricing."""
    shared = seasoned(target=flat(0.3), draft=flat(0.05))
    policies = [shared.for_request("code") for _ in range(2)]
    shared.regimes.choice(2)
    shared.regimes.buckets[load_bucket(2)].drafting = True
    assert policies[1].choose(8) > 0
    policies[0].choose(8)
    assert policies[0]._batch.drafting == 1  # the other drafts beside it
    assert policies[1].choose(8) > 0
    policies[1].skip_drafting(draft_opening=True)  # its draft's session is on its way
    policies[0].choose(8)
    assert policies[0]._batch.drafting == 1
    assert policies[1].choose(8) > 0
    policies[1].skip_drafting()  # ... but its round will not draft after all
    policies[0].choose(8)
    assert policies[0]._batch.drafting == 0 and policies[0]._batch.undecided == 0
    assert policies[0]._batch.rows == 1


def test_a_draft_opened_beside_other_requests_must_win_back_its_prefill_for_each_of_them():
    """The draft's prefill delays every request decoding beside this one (the same cores as the
    target's, or the draft steps every drafting request waits on): alone, a 200-token prefill pays
    over 20 tokens; beside 7 others it must pay for itself 8 times, so only a long request opens one."""
    target = StepCosts({rows: 0.3 if rows <= 16 else 0.3 * rows / 16 for rows in (1, 2, 4, 8, 16, 32, 64)})
    draft = StepCosts({rows: 0.04 + 0.005 * rows for rows in (1, 2, 4, 8, 16, 32, 64)})
    opens = {}
    for active in (1, 8):
        shared = seasoned(target=target, draft=draft)
        policies = [shared.for_request("code") for _ in range(active)]
        for p in policies:
            p.arrive()
        shared.regimes.choice(active)
        if active > 1:
            shared.regimes.buckets[load_bucket(active)].drafting = True
        wanted = policies[0].wants_draft(8, catch_up=200, tokens_left=20)  # from the request's first token
        k = policies[0].choose(8)
        assert k > 0
        opens[active] = [wanted] + [policies[0].worth_opening(k, catch_up=200, tokens_left=left) for left in (20, 200)]
    assert opens == {1: [True, True, True], 8: [False, False, True]}


def settle(regimes: LoadRegimes, active: int, rate: dict[bool, float]) -> None:
    """Enough rounds at `active` for both regimes to be measured there."""
    run_rounds(regimes, 60, rate, active)
    assert regimes.buckets[load_bucket(active)].winner is not None


def test_a_heavier_load_starts_target_only_where_a_lighter_one_found_drafting_loses():
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    settle(regimes, 4, {True: 8.0, False: 10.0})
    seen = run_rounds(regimes, 3 * 4 + 3, {True: 8.0, False: 10.0}, active=8)  # four windows and a bit
    assert not any(seen[:12])  # no opening window of drafting: it waits its turn ...
    assert any(seen[12:])  # ... and is measured after retry_every windows


def test_a_lighter_load_starts_drafting_where_a_heavier_one_found_it_pays():
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    settle(regimes, 8, {True: 12.0, False: 10.0})
    seen = run_rounds(regimes, 12, {True: 12.0, False: 10.0}, active=2)
    assert all(seen)  # target-only is not tried after the first window


def test_without_a_neighbour_that_says_so_a_bucket_measures_both_at_once():
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    settle(regimes, 8, {True: 8.0, False: 10.0})  # drafting lost under a heavier load: says nothing here
    seen = run_rounds(regimes, 6, {True: 8.0, False: 10.0}, active=2)
    assert seen[:3] == [False] * 3 and all(seen[4:])  # target-only first, drafting right after


def test_a_load_met_first_tries_drafting_only_where_the_tables_themselves_forecast_a_gain(caplog):
    """No lighter load measured to scale the forecast by: the tables' own forecast decides. A fresh
    server meeting 16 requests first, forecast at 0.95x, never tries drafting; forecast at 1.2x, it
    tries it after one window as before."""
    for gain, tried in ((0.95, False), (1.2, True)):
        regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
        with caplog.at_level(logging.INFO, logger="orchestrator.decoding.regime"):
            seen = run_rounds(regimes, 40, {True: 8.0, False: 10.0}, active=16, forecast={16: gain})
        assert any(seen) is tried
    verdicts = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert verdicts == ["16 requests: drafting not tried (forecast 0.95x, no lighter load measured)",
                        "16 requests: drafting tried (forecast 1.20x, no lighter load measured)"]


def test_no_drafting_trial_where_the_forecast_scaled_by_a_lighter_loads_measurement_says_it_loses(caplog):
    """At 2 requests the tables forecast drafting at 2x target-only and it delivered 1.2x: at 4, where
    they forecast 1.4x, it would deliver about 0.84x. A trial there would only pay its way in. The
    verdict, asked again every window, is logged once."""
    pays_at_two = {True: 12.0, False: 10.0}
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    run_rounds(regimes, 60, pays_at_two, active=2, forecast={2: 2.0, 4: 1.4})
    assert regimes.buckets[load_bucket(2)].winner is True
    last = regimes.choice(2)  # a request's last round, counted after its partner left: the load fell to 1
    regimes.observe(last, last, 2, 2 / pays_at_two[last.drafting], 1, {2: 2.0, 4: 1.4}.get)
    with caplog.at_level(logging.INFO, logger="orchestrator.decoding.regime"):
        seen = run_rounds(regimes, 200, {True: 8.0, False: 10.0}, active=4, forecast={2: 2.0, 4: 1.4})
    assert not any(seen)
    assert regimes.buckets[load_bucket(4)].rates[True] is None
    verdicts = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert verdicts == ["4 requests: drafting not tried (forecast 1.40x; 2.00x at 2 requests, where it delivered 1.20x)"]

    # Where the forecast holds up with load (1.9x at 4), drafting is tried at once, and kept where it pays.
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    run_rounds(regimes, 60, pays_at_two, active=2, forecast={2: 2.0, 4: 1.9})
    seen = run_rounds(regimes, 200, {True: 12.0, False: 10.0}, active=4, forecast={2: 2.0, 4: 1.9})
    assert seen[:3] == [False] * 3 and any(seen[3:8]) and seen[-100:].count(True) > 90


def test_where_drafting_was_forecast_to_lose_a_heavier_load_does_not_try_it_either():
    """4 requests were judged not worth a trial; at 8 the tables' own forecast (1.9x, scaled from 2
    requests: 1.14x) would try one, but more load only makes drafting pay less."""
    forecast = {2: 2.0, 4: 1.4, 8: 1.9}
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    run_rounds(regimes, 60, {True: 12.0, False: 10.0}, active=2, forecast=forecast)
    assert not any(run_rounds(regimes, 60, {True: 8.0, False: 10.0}, active=4, forecast=forecast))
    seen = run_rounds(regimes, 200, {True: 8.0, False: 10.0}, active=8, forecast=forecast)
    assert not any(seen) and regimes.buckets[load_bucket(8)].rates[True] is None

    # Without the verdict at 4 (that load never met), 8 is scaled from 2 and tried.
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    run_rounds(regimes, 60, {True: 12.0, False: 10.0}, active=2, forecast=forecast)
    assert any(run_rounds(regimes, 200, {True: 8.0, False: 10.0}, active=8, forecast=forecast))


def test_a_forecast_never_overrules_drafting_measured_better_at_the_same_load():
    regimes = LoadRegimes(RegimeConfig(window_rounds=3, retry_every=4))
    run_rounds(regimes, 60, {True: 12.0, False: 10.0}, active=2, forecast={2: 2.0, 4: 1.9})
    settle(regimes, 4, {True: 12.0, False: 10.0})  # measured at 4: drafting wins there
    seen = run_rounds(regimes, 200, {True: 12.0, False: 10.0}, active=4, forecast={2: 2.0, 4: 0.5})
    assert seen[-100:].count(True) > 90


def test_the_forecast_of_drafting_falls_with_load_where_verification_rows_cost_more():
    rising = StepCosts({rows: 0.1 + 0.02 * rows for rows in (1, 2, 4, 8, 16, 32, 64)})
    policy = seasoned(target=rising, draft=flat(0.01)).for_request("code")
    assert policy.drafting_gain(2) is None  # no choice of k yet: no k_max to forecast at
    policy.choose(4)
    gains = [policy.drafting_gain(n) for n in (1, 2, 4, 8)]
    assert gains[0] > 1.0 and gains == sorted(gains, reverse=True) and gains[-1] < gains[0] * 0.8


def test_the_gate_forecasts_the_load_from_every_request_decoding_not_the_one_whose_round_closed_it():
    """Requests of one load forecast drafting by their own acceptance; the gate's forecast must not
    swing with whichever of them closed the window."""
    rising = StepCosts({rows: 0.1 + 0.02 * rows for rows in (1, 2, 4, 8, 16, 32, 64)})
    shared = seasoned(target=rising, draft=flat(0.01))
    good, poor = shared.for_request("code"), shared.for_request("code")
    for _ in range(10):
        good.acceptance.observe(4, 4)
        poor.acceptance.observe(4, 0)
    good.choose(4)
    poor.choose(4)
    mine, theirs = good.drafting_gain(4), poor.drafting_gain(4)
    assert mine > 1.1 * theirs
    assert shared.drafting_gain(4) == pytest.approx((mine + theirs) / 2)
    poor.close()
    assert shared.drafting_gain(4) == pytest.approx(good.drafting_gain(4))
    good.close()
    assert shared.drafting_gain(4) is None  # nobody decoding: nothing to forecast


def test_a_request_counts_towards_the_load_from_its_arrival():
    """A burst's first request to get its first token must not open a draft as if it were alone."""
    shared = AdaptiveSpeculation(costs=RoundCosts(SimpleNamespace(target=flat(0.1), draft=flat(0.001))))
    shared.regimes.choice(8)
    shared.regimes.buckets[load_bucket(8)].drafting = False
    burst = [shared.for_request("code") for _ in range(8)]
    assert burst[0].wants_draft(8, catch_up=1, tokens_left=400)  # before they arrive, it would be alone
    for policy in burst:
        policy.arrive()
    assert not burst[0].wants_draft(8, catch_up=1, tokens_left=400)
    for policy in burst[1:]:
        policy.close()
    assert burst[0].wants_draft(8, catch_up=1, tokens_left=400)  # alone again


def test_a_draft_opened_late_must_win_back_its_prefill():
    """Drafting that comes back near a request's end must not prefill its whole sequence for a few tokens."""
    shared = AdaptiveSpeculation(costs=RoundCosts(SimpleNamespace(target=flat(0.1), draft=flat(0.05))))
    policy = shared.for_request("code")
    assert policy.worth_opening(2, catch_up=160, tokens_left=400)
    assert not policy.worth_opening(2, catch_up=160, tokens_left=3)
    assert not policy.worth_opening(0, catch_up=1, tokens_left=400)  # a target-only round needs no draft
    unpriced = AdaptiveSpeculation(costs=RoundCosts()).for_request("code")
    assert unpriced.worth_opening(2, catch_up=160, tokens_left=3)  # no table: it cannot tell, so it drafts
