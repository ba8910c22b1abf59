"""The default policy with the engines' prefix caches (``RouterCore.cache_view``):
a request goes to the engine holding its deepest match while that engine takes it
about as soon as the least-loaded one, and by load otherwise (pure logic, no Redis;
the view is filled directly, as a reader from Redis fills it)."""

from __future__ import annotations

from support.helpers import cache_core, make_snapshot

from redisbal.routing.cache_view import anchors, chain_hashes
from redisbal.routing.policies import RedisbalPolicy
from redisbal.routing.router_core import RouterCore

ENGINES = [f"e{i}" for i in range(8)]
SLACK = int(RedisbalPolicy.cache_slack)  # what a whole cached prompt is worth, in requests
PROMPT = chain_hashes(list(range(16 * 32)))  # a 512-token prompt: 32 blocks, 8 anchors


def hold(core: RouterCore, engine: str, blocks: list[int]) -> None:
    """``engine`` caches the prefix made of ``blocks`` (its anchors, as the view keeps)."""
    core.cache_view.apply(engine, added=anchors(blocks))


def even(running: int = 10) -> dict[str, tuple[int, int]]:
    return {e: (0, running) for e in ENGINES}


def test_the_holder_takes_a_request_within_the_slack_its_match_earns() -> None:
    # the holder runs SLACK - 1 more than every other engine: a whole prompt saved is
    # worth SLACK requests, so it takes the request
    core = cache_core({**even(10), "e5": (0, 10 + SLACK - 1)})
    hold(core, "e5", PROMPT)
    d = core.route(blocks=PROMPT, prompt_tokens=512)
    assert d.engine_id == "e5" and d.cached == len(PROMPT)
    assert core.counters["cache_routes"] == 1


def test_a_small_share_saved_earns_a_small_slack() -> None:
    # the same load difference, but the match covers a quarter of the prompt: worth a
    # quarter of the slack, so the request goes by load
    core = cache_core({**even(10), "e5": (0, 10 + SLACK - 1)})
    hold(core, "e5", PROMPT[:8])
    d = core.route(blocks=PROMPT, prompt_tokens=512)
    assert d.engine_id != "e5" and d.cached == 0
    assert core.counters["cache_routes"] == 0


def test_the_holder_with_room_now_takes_it_whatever_its_load() -> None:
    kv = {e: 0.2 for e in ENGINES}
    core = cache_core({**even(2), "e5": (0, 2 + SLACK + 2)}, kv=kv)
    hold(core, "e5", PROMPT)
    assert core.route(blocks=PROMPT, prompt_tokens=512).engine_id == "e5"
    # no room (its KV cache nearly full) and beyond the slack: the least loaded takes it
    full = cache_core({**even(2), "e5": (0, 2 + SLACK + 2)}, kv={**kv, "e5": 0.95})
    hold(full, "e5", PROMPT)
    assert full.route(blocks=PROMPT, prompt_tokens=512).engine_id != "e5"


def test_a_popular_prefix_spreads_when_its_holder_is_loaded() -> None:
    core = cache_core({**even(10), "e5": (SLACK + 2, 10)})  # the holder queues, beyond the slack
    hold(core, "e5", PROMPT)
    first = core.route(blocks=PROMPT, prompt_tokens=512)
    assert first.engine_id != "e5" and first.cached == 0
    # that engine computed the prompt and caches it too: now two engines hold it, and
    # the next request goes to the one with room
    hold(core, first.engine_id, PROMPT)
    core.unroute(first)
    d = core.route(blocks=PROMPT, prompt_tokens=512)
    assert d.engine_id == first.engine_id and d.cached == len(PROMPT)


def test_among_holders_of_one_depth_the_least_loaded() -> None:
    core = cache_core({**even(10), "e2": (0, 12), "e5": (0, 11), "e6": (0, 11)})
    for e in ("e2", "e5"):
        hold(core, e, PROMPT)
    assert core.route(blocks=PROMPT, prompt_tokens=512).engine_id == "e5"


def test_the_deepest_match_wins() -> None:
    core = cache_core(even(10))
    hold(core, "e1", PROMPT[:8])
    hold(core, "e2", PROMPT[:24])
    hold(core, "e3", PROMPT[:16])
    d = core.route(blocks=PROMPT, prompt_tokens=512)
    assert d.engine_id == "e2" and d.cached == 24


def test_a_shallower_holder_takes_it_when_the_deepest_one_is_loaded() -> None:
    core = cache_core({**even(10), "e2": (SLACK + 2, 10), "e1": (0, 10)})
    hold(core, "e2", PROMPT)
    hold(core, "e1", PROMPT[:28])
    d = core.route(blocks=PROMPT, prompt_tokens=512)
    assert d.engine_id == "e1" and d.cached == 28


def test_a_prompt_no_engine_holds_the_root_of_goes_by_load() -> None:
    core = cache_core({**even(10), "e5": (0, 11)})
    other = chain_hashes([7] * 512)
    hold(core, "e5", other)
    assert core.route(blocks=PROMPT, prompt_tokens=512).cached == 0


def test_an_excluded_holder_is_not_chosen() -> None:
    core = cache_core(even(10))
    hold(core, "e5", PROMPT)
    core.apply_snapshot(
        make_snapshot(even(10), version=2, admitted={e: (0,) for e in ENGINES}, suspect={"e5": 900})
    )
    assert "e5" not in [e.engine_id for e in core.engines]
    assert core.route(blocks=PROMPT, prompt_tokens=512).engine_id != "e5"


def test_a_given_key_keeps_its_engine_and_a_guessed_one_gives_way_to_a_match() -> None:
    ref = cache_core(even(10))
    home = ref.route(key="s").engine_id  # where the ring puts the key
    holder = next(e for e in ENGINES if e != home)
    core = cache_core(even(10))
    hold(core, holder, PROMPT)
    given = core.route(key="s", blocks=PROMPT, prompt_tokens=512)
    assert given.engine_id == home and given.cached == 0
    core.unroute(given)
    # no guessed key has come back yet: the key is no session, the match decides
    guessed = core.route(key="s", key_guessed=True, blocks=PROMPT, prompt_tokens=512)
    assert guessed.engine_id == holder and guessed.cached == len(PROMPT)


def test_a_guessed_key_that_comes_back_is_followed_not_weighed_against_a_match() -> None:
    """Once guessed keys come back (sessions), a guessed key goes where the ring puts
    it, as a given one does, though another engine holds its prompt: its match there
    is mostly its own history, on the engines its key chose."""
    ref = cache_core(even(10))
    home = ref.route(key="t").engine_id
    holder = next(e for e in ENGINES if e != home)
    core = cache_core(even(10))
    hold(core, holder, PROMPT)
    for _ in range(3):  # a guessed key comes back
        core.finished(core.route(key="u", key_guessed=True))
    followed = core.route(key="t", key_guessed=True, blocks=PROMPT, prompt_tokens=512)
    assert followed.engine_id == home and followed.cached == 0


def test_an_unfollowed_keys_holder_earns_a_keys_slack_not_a_shared_prefixs() -> None:
    # no guessed key came back: the key is not followed, the views place the request;
    # the holder runs SLACK - 1 more than every other engine: within what a whole
    # prompt saved earns, beyond the key's own slack
    keyed_slack = RedisbalPolicy.keyed_cache_slack
    assert keyed_slack is not None and keyed_slack < SLACK - 1
    core = cache_core({**even(10), "e5": (0, 10 + SLACK - 1)})
    hold(core, "e5", PROMPT)
    keyed = core.route(key="s", key_guessed=True, blocks=PROMPT, prompt_tokens=512)
    assert keyed.engine_id != "e5" and keyed.cached == 0
    assert core.route(blocks=PROMPT, prompt_tokens=512).engine_id == "e5"


def decisions(core: RouterCore, **kw: object) -> list[str]:
    out = []
    for k in range(200):
        d = core.route(**kw)  # type: ignore[arg-type]
        out.append(d.engine_id)
        if k % 3:
            core.finished(d)
    return out


def test_without_blocks_or_a_view_the_choice_is_todays_exactly() -> None:
    loads = {e: (i % 3, 8 + i % 4) for i, e in enumerate(ENGINES)}
    today = decisions(cache_core(loads, seed=4))
    empty = decisions(cache_core(loads, seed=4), blocks=PROMPT, prompt_tokens=512)
    filled = cache_core(loads, seed=4)
    for e in ENGINES:
        hold(filled, e, chain_hashes([hash(e) % 1000] * 512))
    no_blocks = decisions(filled, prompt_tokens=512)
    unmatched = cache_core(loads, seed=4)
    for e in ENGINES:
        hold(unmatched, e, chain_hashes([hash(e) % 1000] * 512))
    no_match = decisions(unmatched, blocks=PROMPT, prompt_tokens=512)
    assert today == empty == no_blocks == no_match
    assert isinstance(filled.policy, RedisbalPolicy) and filled.counters["cache_routes"] == 0


def test_a_prefix_spreads_as_its_traffic_grows_and_load_stays_even() -> None:
    """Requests of one prefix that stay in flight: its holder takes them until it is the
    slack above the rest, then the least loaded does and caches it too; the load
    never parts by more than the slack, and the prefix ends up on every engine."""
    core = cache_core(even(10))
    hold(core, "e0", PROMPT)
    holders_over_time = []
    for _ in range(len(ENGINES) * (SLACK + 1)):
        d = core.route(blocks=PROMPT, prompt_tokens=512)
        hold(core, d.engine_id, PROMPT)  # it computed the prompt: it holds it now
        holders_over_time.append(len(core.cache_view.holders[anchors(PROMPT)[0]]))
        pending = [e.pending for e in core.known]
        assert max(pending) - min(pending) <= SLACK + 1, pending
    assert holders_over_time[0] <= 2 and holders_over_time[-1] == len(ENGINES)
    assert holders_over_time == sorted(holders_over_time)


def test_a_router_without_kv_events_follows_the_prefixes_it_sent() -> None:
    """Learning its routes, a router sends a prompt sharing an earlier one's prefix to
    the engine it sent that one to, though another is now less loaded; not learning,
    by load. Once every holder is beyond the slack, the prefix spreads by load."""
    follow_up = [*PROMPT[:24], *chain_hashes(list(range(7, 7 + 128)), parent=PROMPT[23])]
    for learn in (64, 0):
        core = cache_core(even(10), learn_routes=learn)
        first = core.route(blocks=PROMPT, prompt_tokens=512)
        d = core.route(blocks=follow_up, prompt_tokens=512)
        if learn:
            assert d.engine_id == first.engine_id and d.cached == 24
        else:
            assert d.engine_id != first.engine_id and d.cached == 0
    core = cache_core(even(10), learn_routes=64)
    sent = [core.route(blocks=PROMPT, prompt_tokens=512).engine_id for _ in range(3 * SLACK)]
    assert len(set(sent)) > 1 and sent[: SLACK - 1] == [sent[0]] * (SLACK - 1)
