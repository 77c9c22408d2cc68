"""The peer watchdog (CPU, fake health, abort and exit): it aborts once on a failed peer,
and ends the process only if the engine stays stuck past the grace period."""

import threading
import time

import pytest

from ostinato.distributed.failure import ParallelError, RankFailure
from ostinato.distributed.watchdog import EXIT_CODE, PeerWatchdog


class Fakes:
    def __init__(self, fail_after_s: float | None) -> None:
        self.start = time.monotonic()
        self.fail_after_s = fail_after_s
        self.aborts, self.exits = 0, []
        self.exited = threading.Event()

    def health(self) -> RankFailure | None:
        late = self.fail_after_s is not None
        if late and time.monotonic() - self.start > self.fail_after_s:
            return RankFailure(1, "its process exited with code 3")
        return None

    def abort(self) -> None:
        self.aborts += 1

    def exit(self, code: int) -> None:
        self.exits.append(code)
        self.exited.set()

    def watchdog(self, grace_s: float) -> PeerWatchdog:
        return PeerWatchdog(self.health, self.abort, 0, 0.01, grace_s, self.exit)


def test_healthy_peers_are_left_alone():
    fakes = Fakes(fail_after_s=None)
    with fakes.watchdog(grace_s=0.05).watching() as watchdog:
        time.sleep(0.2)
    assert watchdog.failure is None and fakes.aborts == 0 and not fakes.exits
    watchdog.check()  # nothing seen: no error


def test_a_failed_peer_is_aborted_once_and_named_for_the_engine():
    fakes = Fakes(fail_after_s=0.05)
    with fakes.watchdog(grace_s=5.0).watching() as watchdog:
        while watchdog.failure is None:  # the engine's step loop, after each step
            time.sleep(0.01)
        time.sleep(0.1)  # health keeps failing: still one abort
    assert fakes.aborts == 1 and not fakes.exits
    assert "rank 1 failed" in str(watchdog.failure.error(0))
    with pytest.raises(ParallelError, match="rank 1 failed: its process exited with code 3"):
        watchdog.check()
    time.sleep(0.1)
    assert not fakes.exits  # left in time: no exit later either


def test_an_engine_stuck_past_the_grace_period_ends_the_process(capsys):
    fakes = Fakes(fail_after_s=0.0)
    with fakes.watchdog(grace_s=0.1).watching():
        assert fakes.exited.wait(5.0)  # the engine's thread, stuck in a device call
    assert fakes.aborts == 1 and fakes.exits == [EXIT_CODE]
    err = capsys.readouterr().err
    assert "rank 1 failed: its process exited with code 3" in err
    assert f"exits with code {EXIT_CODE}" in err
