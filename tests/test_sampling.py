"""Known-answer tests of each sampler on hand-built logits, the seeded generator, and stop strings."""
from __future__ import annotations

import numpy as np
import pytest

from ringllm import ConfigError
from ringllm.sampling import (Sampler, SamplingParams, StopMatcher, apply_logit_bias, apply_penalties, draw, greedy,
                              min_p, softmax, temperature, top_k, top_p)


def f64(*xs):
    return np.array(xs, dtype=np.float64)


def kept(x):
    return [i for i in range(len(x)) if np.isfinite(x[i])]


# ---------------------------------------------------------------------------------------------- filters

def test_greedy_argmax_and_ties_take_lowest_id():
    assert greedy(f64(0.1, 3.0, -1.0, 2.9)) == 1
    assert greedy(f64(1.0, 5.0, 5.0, 2.0)) == 1


def test_logit_bias_adds_bans_and_forces():
    x = apply_logit_bias(f64(1.0, 2.0, 3.0), {0: 0.5, 2: -1.0})
    assert x.tolist() == [1.5, 2.0, 2.0]
    x = apply_logit_bias(f64(1.0, 2.0, 3.0), {2: -100})
    assert kept(x) == [0, 1] and greedy(x) == 1
    x = apply_logit_bias(f64(1.0, 2.0, 3.0), {0: 100})
    assert kept(x) == [0]


def test_repeat_penalty_divides_positive_multiplies_negative():
    # llama.cpp's rule: a seen token's logit l -> l / r if l > 0 else l * r; unseen ones unchanged
    x = apply_penalties(f64(2.0, -2.0, 1.0, 4.0), [0, 1, 0], repeat_penalty=2.0)
    assert x.tolist() == [1.0, -4.0, 1.0, 4.0]


def test_frequency_and_presence_penalties():
    # OpenAI's rule: l -= f * count + p * (count > 0)
    x = apply_penalties(f64(5.0, 5.0, 5.0), [0, 0, 0, 1], frequency_penalty=0.5, presence_penalty=1.0)
    assert x.tolist() == [5.0 - 1.5 - 1.0, 5.0 - 0.5 - 1.0, 5.0]


def test_penalty_window_last_n():
    hist = [0, 1, 2]
    assert apply_penalties(f64(2.0, 2.0, 2.0), hist, repeat_penalty=2.0, last_n=1).tolist() == [2.0, 2.0, 1.0]
    assert apply_penalties(f64(2.0, 2.0, 2.0), hist, repeat_penalty=2.0, last_n=-1).tolist() == [1.0, 1.0, 1.0]
    assert apply_penalties(f64(2.0, 2.0, 2.0), hist, repeat_penalty=2.0, last_n=0).tolist() == [2.0, 2.0, 2.0]


def test_top_k_keeps_the_k_largest():
    x = top_k(f64(0.1, 0.5, 0.3, 0.9, 0.2), 2)
    assert kept(x) == [1, 3]
    assert kept(top_k(f64(1, 2, 3), 0)) == [0, 1, 2]     # 0 = off
    assert kept(top_k(f64(1, 2, 3), 10)) == [0, 1, 2]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(f64(0.5, 0.3, 0.15, 0.05))
    assert kept(top_p(logits.copy(), 0.8)) == [0, 1]        # 0.5 + 0.3 reaches 0.8
    assert kept(top_p(logits.copy(), 0.81)) == [0, 1, 2]
    assert kept(top_p(logits.copy(), 0.3)) == [0]            # the top token is always kept
    assert kept(top_p(logits.copy(), 1.0)) == [0, 1, 2, 3]


def test_top_p_nucleus_larger_than_the_fast_path():
    # 1000 equally likely tokens: p = 0.5 needs 500 of them (past the 256-candidate fast path)
    x = top_p(np.zeros(1000), 0.5)
    assert len(kept(x)) == 500
    # a big vocabulary with a peaked distribution takes the fast path and still gets it right
    rng = np.random.default_rng(1)
    logits = rng.normal(size=50000) * 3
    fast = kept(top_p(logits.copy(), 0.9))
    probs = softmax(logits.copy())
    order = np.argsort(-probs)
    n = int(np.searchsorted(np.cumsum(probs[order]), 0.9)) + 1
    assert sorted(fast) == sorted(order[:n].tolist())


def test_min_p_relative_to_the_top_token():
    logits = np.log(f64(0.5, 0.3, 0.1, 0.1))
    assert kept(min_p(logits.copy(), 0.25)) == [0, 1]        # threshold 0.125
    assert kept(min_p(logits.copy(), 0.2)) == [0, 1, 2, 3]   # threshold 0.1 (ties at the threshold kept)
    assert kept(min_p(logits.copy(), 0.0)) == [0, 1, 2, 3]


def test_temperature_scales_and_rejects_zero():
    assert temperature(f64(1.0, 2.0), 0.5).tolist() == [2.0, 4.0]
    with pytest.raises(ConfigError):
        temperature(f64(1.0), 0.0)


def test_draw_uses_one_uniform_number_known_answer():
    logits = np.log(f64(0.2, 0.5, 0.3))
    rng = np.random.Generator(np.random.PCG64(7))
    u = np.random.Generator(np.random.PCG64(7)).random()
    expect = int(np.searchsorted(np.cumsum([0.2, 0.5, 0.3]), u, side="right"))
    assert draw(logits, rng) == expect
    # the generator advanced by exactly one draw
    ref = np.random.Generator(np.random.PCG64(7))
    ref.random()
    assert rng.random() == ref.random()


def test_draw_never_returns_a_ruled_out_token():
    rng = np.random.Generator(np.random.PCG64(0))
    x = f64(-np.inf, 0.0, -np.inf, 1.0, -np.inf)
    seen = {draw(x.copy(), rng) for _ in range(2000)}
    assert seen == {1, 3}


def test_sampling_distribution_matches_softmax_over_temperature():
    logits = f64(1.0, 2.0, 0.0, 1.5)
    s = Sampler(SamplingParams(temperature=0.7), seed=3)
    counts = np.bincount([s.sample(logits) for _ in range(20000)], minlength=4) / 20000
    expect = softmax(logits / 0.7)
    assert np.abs(counts - expect).max() < 0.015


def test_chain_order_filters_before_temperature():
    # top_k=1 leaves only the argmax, whatever the temperature and the seed
    logits = f64(0.3, 2.0, 1.9, -1.0)
    for seed in range(20):
        assert Sampler(SamplingParams(temperature=5.0, top_k=1), seed).sample(logits) == 1
    # min_p computed on the logits before temperature: 0.9 leaves tokens 1 and 2 only
    s = Sampler(SamplingParams(temperature=100.0, min_p=0.9), 0)
    assert {s.sample(logits) for _ in range(300)} == {1, 2}


def test_greedy_sampler_ignores_the_generator_and_applies_penalties():
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=4.0), seed=1)
    state = s.state()
    assert s.sample(f64(1.0, 3.0, 2.0), history=[1]) == 2      # 3/4 < 2
    assert s.state() == state


def test_plain_greedy_reads_the_engine_logits_as_they_are():
    # no bias, penalty or grammar: the argmax of the float32 row itself, the token the chain's float64
    # copy gives (ties and all), the row untouched and the generator unused
    rng = np.random.default_rng(3)
    s = Sampler(SamplingParams(temperature=0.0), seed=1)
    state = s.state()
    for _ in range(20):
        x = rng.integers(-3, 4, size=257).astype(np.float32)          # many ties at the maximum
        before = x.copy()
        assert s.sample(x, history=[int(np.argmax(x))]) == greedy(x.astype(np.float64))
        np.testing.assert_array_equal(x, before)
    assert s.state() == state
    # a penalty with no window to read (penalty_last_n 0) changes nothing either
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=4.0, penalty_last_n=0))
    assert s.sample(f64(1.0, 3.0, 2.0), history=[1]) == 1


def test_same_seed_same_tokens_and_state_round_trip():
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=64) for _ in range(50)]
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, repeat_penalty=1.1, frequency_penalty=0.2)
    a, b = Sampler(p, 42), Sampler(p, 42)
    hist_a, hist_b = [], []
    for x in steps:
        hist_a.append(a.sample(x, hist_a))
        hist_b.append(b.sample(x, hist_b))
    assert hist_a == hist_b
    assert hist_a != [Sampler(p, 43).sample(x) for x in steps]
    # saving the generator's state mid-way and restoring it gives the same continuation
    c = Sampler(p, 5)
    first = [c.sample(x) for x in steps[:10]]
    saved = c.state()
    rest = [c.sample(x) for x in steps[10:]]
    d = Sampler(p, 999)
    d.set_state(saved)
    assert [d.sample(x) for x in steps[10:]] == rest and len(first) == 10


def test_sample_does_not_modify_the_callers_logits():
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    Sampler(SamplingParams(temperature=0.5, top_k=1, logit_bias={0: 5.0}), 0).sample(x, [2])
    assert x.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0),
                                    dict(top_k=-1), dict(repeat_penalty=0.0), dict(temperature=float("nan")),
                                    dict(logit_bias={"x": 1.0}), dict(logit_bias={1: "a"}), dict(top_k=1.5),
                                    dict(penalty_last_n=-2)])
def test_invalid_parameters_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_logit_bias_outside_vocabulary():
    p = SamplingParams(logit_bias={"7": 1.0})
    assert p.logit_bias == {7: 1.0}
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        p.validate(n_vocab=5)


# ---------------------------------------------------------------------------------------------- stop strings

def feed(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        text, stopped = m.push(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return out, stopped


def test_stop_string_split_across_deltas_is_never_emitted():
    out, stopped = feed(["</s>"], ["Hello <", "/", "s", "> more"])
    assert stopped and "".join(out) == "Hello "
    assert out == ["Hello ", "", "", ""]           # "<", "</", "</s" were held back, then dropped


def test_held_text_is_released_when_it_stops_matching():
    out, stopped = feed(["STOP"], ["a ST", "AR", "T b"])
    assert not stopped and "".join(out) == "a START b"
    assert out[0] == "a " and out[1] == "STAR"      # "ST" held, then released with "AR"


def test_earliest_of_several_stop_strings_wins():
    out, stopped = feed(["world", "lo w"], ["hello world"])
    assert stopped and out == ["hel"]
    m = StopMatcher(["\n\n", "User:"])
    assert m.push("abc User: x\n\ny") == ("abc ", True)
    assert m.matched == "User:"


def test_flush_returns_a_held_prefix_at_the_end():
    out, stopped = feed(["###"], ["text #", "#"])
    assert not stopped and out == ["text ", "", "##"]


def test_no_stops_passes_text_through_and_empty_stop_ignored():
    assert feed(None, ["a", "b"]) == (["a", "b", ""], False)
    assert feed([""], ["a"]) == (["a", ""], False)
    assert feed("x", ["abxcd"]) == (["ab"], True)    # a single string works too
