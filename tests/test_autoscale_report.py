"""bench/autoscale.py's arithmetic: a stream's lost and repeated tokens against the
reference, and a report rendered from raw results alone (phases, pods, scale events)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "bench")]
import autoscale


def stream(tokens: list[int], start_s: float = 1.0, error: str = "") -> autoscale.Stream:
    return autoscale.Stream(0, start_s, [1, 2, 3], max_tokens=4, tokens=tokens,
                            times_s=[start_s + 0.1 * (i + 1) for i in range(len(tokens))],
                            end_s=start_s + 0.1 * len(tokens) + 0.05, error=error)


def test_a_stream_is_compared_with_the_reference_after_their_common_prefix():
    reference = [5, 6, 7, 8]
    assert autoscale.record(stream([5, 6, 7, 8]), reference)["identical"]
    skipped = autoscale.record(stream([5, 7, 8]), reference)  # one token lost, the rest shifted
    assert (skipped["lost"], skipped["repeated"], skipped["identical"]) == (3, 2, False)
    doubled = autoscale.record(stream([5, 6, 6, 7, 8]), reference)
    assert (doubled["lost"], doubled["repeated"]) == (2, 3)
    failed = autoscale.record(stream([5, 6], error="APIError: gone"), reference)
    assert (failed["lost"], failed["repeated"], failed["error"]) == (2, 0, "APIError: gone")
    assert autoscale.record(stream([5, 6, 7, 8]), reference)["gaps_ms"] == [100, 100, 100]


def test_the_report_counts_streams_in_flight_at_each_scale_event_and_tokens_lost():
    reference = [5, 6, 7, 8]
    streams = [autoscale.record(stream([5, 6, 7, 8], start_s=1.0), reference),
               autoscale.record(stream([5, 6, 7], start_s=2.0), reference)]
    results = {"provenance": {"commit": "0123456789abcdef", "dirty": False, "started": "now"},
               "machine": "a test", "setup": {**autoscale.SHORT.__dict__,
                                              "phases": [[1.0, 2.0], [0.0, 2.0]], "bin_s": 2.0},
               "command": "baton up --autoscale", "gateway_migrations": 1.0,
               "durations_s": {"start_s": 1.0, "load_s": 4.0, "reference_s": 1.0},
               "samples": [[0.5, 1, 1, 0], [1.5, 1, 2, 0], [2.5, 2, 2, 0], [3.5, 1, 1, 0]],
               "scale_events": [[1.2, "1", "2", "starting", "decode-1"],
                                [2.2, "2", "1", "draining", "decode-0"]],
               "streams": streams}
    text = autoscale.render(results)
    assert "| requests sent / completed | 2 / 2 |" in text
    assert "| scale-ups / scale-downs | 1 / 1 |" in text
    assert "| tokens lost (failed requests included) | 1 |" in text
    assert "| 2 | 2 -> 1 | draining decode-0 | 1 | 1 |" in text  # only the second was in flight
    assert "| 0-2 s | 1 | 1 | 1-1 | 100 | 100 |" in text and "| 2-4 s | 0 | 1 | 1-2 |" in text
    assert "1/s for 2 s, then 0/s for 2 s" in text
