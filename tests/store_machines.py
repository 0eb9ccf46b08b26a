"""The rules every KV-store state machine shares (tests/test_kv_store_properties.py,
tests/test_paged_store_properties.py): feeding tokens through the engine, as a prompt chunk or as
decode steps, with the logits checked against the reference engine fed the same tokens."""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from test_engine import TOL

# CI's form runs 30 machines, the same ones every run (derandomized); RINGLLM_KV_PROPERTY_EXAMPLES=N
# runs N fresh random ones
EXAMPLES = int(os.environ.get("RINGLLM_KV_PROPERTY_EXAMPLES", "30"))
RANDOM = "RINGLLM_KV_PROPERTY_EXAMPLES" in os.environ


def run_machine(machine, engines, must_run) -> Counter:
    """Run `machine` (a FeedingMachine subclass) over EXAMPLES machines of up to 16 steps with the
    tiny model's engines; AssertionError unless every rule named in must_run ran. Returns the tally."""
    machine.engines = engines
    case = settings(max_examples=EXAMPLES, stateful_step_count=16, deadline=None, database=None,
                    derandomize=not RANDOM, suppress_health_check=list(HealthCheck))(machine)
    machine.ran.clear()
    case.TestCase().runTest()
    assert all(machine.ran[r] for r in must_run), machine.ran
    print(dict(machine.ran))
    return machine.ran


class FeedingMachine(RuleBasedStateMachine):
    """Subclasses set in their initialize rule: eng, ref (engine, reference engine), store, cache
    (the reference's cache), tokens (ids fed so far); they may extend _feed (bookkeeping around a
    feed). max_tokens bounds the tokens a machine feeds (the reference's rebuilds stay cheap)."""

    engines: tuple = None           # set by the test: the tiny model's engine and reference engine
    ran: Counter = Counter()        # rule -> times run, over all examples (the test checks each ran)
    max_tokens = 120

    def _feed(self, ids, run) -> None:
        """run(ids) feeds the store and returns (len(ids), n_vocab) logits; the reference gets the same."""
        got = run(ids)
        np.testing.assert_allclose(got, self.ref.forward(ids, self.cache), rtol=0, atol=TOL)
        self.tokens += ids

    @precondition(lambda self: len(self.tokens) < self.max_tokens)
    @rule(ids=st.lists(st.integers(0, 255), min_size=1, max_size=24))
    def prefill(self, ids):
        """A chunk through the engine's batched prefill."""
        self.ran["prefill"] += 1
        self._feed(ids, lambda x: self.eng.logits(x, self.store))

    @precondition(lambda self: len(self.tokens) < self.max_tokens)
    @rule(ids=st.lists(st.integers(0, 255), min_size=1, max_size=6))
    def decode(self, ids):
        """Tokens one decode step each."""
        self.ran["decode"] += 1
        self._feed(ids, lambda x: np.stack([self.eng.step(t, self.store).copy() for t in x]))
