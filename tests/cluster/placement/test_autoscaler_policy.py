"""The autoscaler's policy (``control.autoscaler``): a model's target from its replicas' loads, with Serve's
hysteresis, within its bounds; and the ``[[model]]`` keys that set it."""

from __future__ import annotations

import pytest
from pie_cluster.config import ModelConfigEntry
from pie_cluster.control.autoscaler import ModelScale, ReplicaLoad, ScalePolicy


def policy(target: int = 1, **keys) -> ScalePolicy:
    entry = ModelConfigEntry(
        **{
            "min_replicas": 1,
            "max_replicas": 4,
            "target_load": 8,
            "upscale_delay_s": 10,
            "downscale_delay_s": 60,
            "load_window_s": 0,
        }
        | keys
    )
    return ScalePolicy(entry, ModelScale(entry.name, entry.fewest, entry.most, target))


def loads(*contexts: int, suspended: int = 0) -> list[ReplicaLoad]:
    return [ReplicaLoad(c, suspended) for c in contexts]


def test_more_load_raises_the_target_once_it_held_for_the_upscale_delay():
    p = policy()
    assert p.decide(loads(20), now=0).target == 1  # wanted: ceil(20 / 8) = 3, from now on
    assert p.decide(loads(20), now=9.9).target == 1
    scale = p.decide(loads(20), now=10)
    assert scale.target == 3 and "load 20" in scale.reason and "for 10 s" in scale.reason


def test_a_burst_shorter_than_the_delay_moves_nothing():
    p = policy()
    p.decide(loads(20), now=0)
    p.decide(loads(3), now=5)  # back under the target: the wait starts over
    assert p.decide(loads(20), now=12).target == 1
    assert p.decide(loads(20), now=22).target == 3


def test_less_load_lowers_it_after_the_downscale_delay_and_never_under_the_minimum():
    p = policy(target=3, min_replicas=2)
    assert p.decide(loads(0, 0, 0), now=0).target == 3
    scale = p.decide(loads(0, 0, 0), now=60)
    assert scale.target == 2 and "min_replicas 2" in scale.reason


def test_the_load_is_the_mean_over_its_window_so_noise_does_not_scale():
    """Requests that come and go between readings: single readings jump over and under the target, their mean
    does not; a load that stays up moves the mean past it."""
    p = policy(load_window_s=10, upscale_delay_s=5)
    for second in range(30):  # readings of 0 and 12 in turn: a mean of 6, under 8 per replica
        assert p.decide(loads(12 if second % 2 else 0), now=second).target == 1
    for second in range(30, 50):
        scale = p.decide(loads(12), now=second)
    assert scale.target == 2 and "(live contexts, mean over 10 s)" in scale.reason


def test_the_maximum_bounds_the_target():
    p = policy(upscale_delay_s=0)
    scale = p.decide(loads(30, 30, 20), now=0)  # 80 at 8 per replica: 10 wanted
    assert scale.target == 4 and "max_replicas 4" in scale.reason


def test_suspended_contexts_want_one_replica_more_whatever_the_load():
    """KV memory, not load: the market suspended contexts, so the replicas are short of pages."""
    p = policy(target=2, upscale_delay_s=0)
    scale = p.decide(loads(1, 1, suspended=2), now=0)
    assert scale.target == 3 and "4 contexts suspended" in scale.reason


def test_a_model_s_bounds_must_hold_its_starting_count():
    assert ModelConfigEntry(min_replicas=2, max_replicas=5).replicas == 2  # starts at its minimum
    assert ModelConfigEntry(replicas=3).fewest == ModelConfigEntry(replicas=3).most == 3  # fixed
    with pytest.raises(ValueError, match=r"min_replicas \(1\) <= replicas \(3\) <= max_replicas \(2\)"):
        ModelConfigEntry(replicas=3, min_replicas=1, max_replicas=2)
