"""cuflash._compile's build-once cache on the CPU: one build per key however many threads ask,
builds of other keys beside it, and a failed build raised where it was asked and tried again by
the next call."""

from __future__ import annotations

import threading
import time

from cuflash import _compile


def test_one_build_per_key_however_many_threads_ask():
    cache, builds, started = {}, [], threading.Event()
    release = threading.Event()

    def build():
        builds.append(threading.get_ident())
        started.set()
        release.wait(10)
        return "kernel"

    results = []
    threads = [threading.Thread(target=lambda: results.append(_compile._once(cache, "k", build))) for _ in range(8)]
    threads[0].start()
    assert started.wait(10)
    for t in threads[1:]:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert results == ["kernel"] * 8 and len(builds) == 1 and cache == {"k": "kernel"}
    assert not _compile._building


def test_builds_of_other_keys_go_on_beside_each_other():
    cache, a_running = {}, threading.Event()

    def build_a():   # waits for b's build to run: serialized builds would time out here
        a_running.set()
        assert b_done.wait(10), "b's build waited for a's"
        return "a"

    b_done = threading.Event()

    def build_b():
        b_done.set()
        return "b"

    results = {}
    t = threading.Thread(target=lambda: results.setdefault("a", _compile._once(cache, "a", build_a)))
    t.start()
    assert a_running.wait(10)
    results["b"] = _compile._once(cache, "b", build_b)
    t.join(10)
    assert results == {"a": "a", "b": "b"} == cache


def test_a_failed_build_is_raised_to_its_waiters_and_tried_again():
    cache, started, release, calls = {}, threading.Event(), threading.Event(), []

    def failing():
        calls.append(1)
        started.set()
        release.wait(10)
        raise RuntimeError("nvrtc: error")

    errors = []

    def ask():
        try:
            _compile._once(cache, "k", failing)
        except RuntimeError as error:
            errors.append(str(error))

    first = threading.Thread(target=ask)
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=ask)
    second.start()
    time.sleep(0.5)   # (the second thread waiting on the first's build by now)
    release.set()
    first.join(10)
    second.join(10)
    assert errors == ["nvrtc: error"] * 2 and len(calls) == 1 and not cache
    assert _compile._once(cache, "k", lambda: "kernel") == "kernel"   # not kept failed
