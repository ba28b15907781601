import time

from kiln.recipes.probes.process_stats import Phases, peak_rss_bytes


def test_phases_record_the_time_since_the_previous_call_and_add_up_repeats():
    into: dict[str, float] = {}
    phase = Phases(into)
    time.sleep(0.02)
    phase("a")
    phase("b")
    time.sleep(0.01)
    phase("a")
    assert set(into) == {"a", "b"}
    assert into["a"] >= 0.03 and into["b"] < 0.01


def test_peak_rss_counts_memory_this_process_touched():
    before = peak_rss_bytes()
    block = bytearray(64 * 2**20)  # touched: zero-filled pages
    assert peak_rss_bytes() >= max(before, 64 * 2**20)
    del block
