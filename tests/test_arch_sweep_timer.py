"""The sweep's per-architecture time limit keeps a timer already running (pytest-timeout's signal timer)."""

import signal
import time

import pytest

from tests import arch_sweep

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM timers")


class Outer(Exception):
    pass


@pytest.fixture
def outer_timer():
    """An outer SIGALRM timer raising ``Outer`` (pytest-timeout's own timer is put back afterwards)."""
    saved_handler = signal.getsignal(signal.SIGALRM)
    saved_delay, saved_interval = signal.getitimer(signal.ITIMER_REAL)

    def raise_outer(signum, frame):
        raise Outer()

    signal.signal(signal.SIGALRM, raise_outer)
    try:
        yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, saved_handler)
        if saved_delay:
            signal.setitimer(signal.ITIMER_REAL, saved_delay, saved_interval)


def test_an_outer_timer_still_fires_after_the_block(outer_timer):
    outer_timer(1.0)
    with arch_sweep._time_limit(5):
        pass
    assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1.0
    with pytest.raises(Outer):
        time.sleep(3)


def test_an_outer_timer_that_comes_first_fires_inside_the_block(outer_timer):
    outer_timer(0.3)
    with pytest.raises(Outer):
        with arch_sweep._time_limit(5):
            time.sleep(3)
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0  # not re-armed after it fired


def test_the_block_limit_fires_and_the_outer_timer_keeps_its_deadline(outer_timer):
    outer_timer(5.0)
    with pytest.raises(arch_sweep._TimeLimit):
        with arch_sweep._time_limit(0.3):
            time.sleep(3)
    assert 4 < signal.getitimer(signal.ITIMER_REAL)[0] <= 4.8
