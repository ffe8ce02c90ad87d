"""core.at_once: the agent's per-GPU work (benchmark, challenge, memory proof) runs on every device at once, and one
device's failure is the command's error naming that device."""
import threading

import pytest

from provisioning.agent.gpumarket_agent.core import AgentError, at_once


def test_every_item_runs_at_the_same_time_and_its_result_is_kept_by_index():
    barrier = threading.Barrier(3, timeout=10)  # broken, and so raised, unless all three wait on it together

    def work(i, x):
        barrier.wait()
        return x * 10
    assert at_once([(0, 1), (4, 2), (7, 3)].__iter__(), work, "challenge_failed") == {0: 10, 4: 20, 7: 30}


def test_a_failing_device_is_the_commands_error_and_names_it():
    finished = []

    def work(i, x):
        if i == 3:
            raise RuntimeError("CUDA error: an illegal memory access " + "x" * 2000)
        finished.append(i)
        return x
    with pytest.raises(AgentError) as caught:
        at_once({0: "a", 3: "b", 5: "c"}.items(), work, "memproof_failed")
    assert caught.value.code == "memproof_failed"
    assert caught.value.message.startswith("GPU 3: RuntimeError: CUDA error: an illegal memory access")
    assert len(caught.value.message) < 600  # the node's exception is cut, not sent whole
    assert sorted(finished) == [0, 5]  # the others ran to their end: no thread left behind


def test_what_names_the_kind_of_device():
    with pytest.raises(AgentError) as caught:
        at_once([(1, None)], lambda i, x: 1 / 0, "benchmark_failed", what="device")
    assert caught.value.message.startswith("device 1: ZeroDivisionError")
