"""The flood bounds of docs/security.md ("Under a flood") where they did not hold (issue 42, classes 5
and 6): real gateway processes with the site defaults, real CURVE, the floods of nebula_lab.bench.flood
(`nebula bench flood --only refused --only stalled-small` runs them for 20 s).

5. Refusals coming back: a stage of a floods a stage of b that cannot take it; b's gateway refuses
   each message (`unreachable`) and every refusal crosses back into site a. Gateway a recorded each as a
   `transfer.in`, on top of the `transfer.out` of the message: about twice the stated bound. Refusals a
   peer gateway sends as itself are now recorded as its own refusals are: a few in full per
   (gateway, stage) and interval, the rest counted in a `transfer.in.summary`.
6. What a queued message costs: 1 KiB messages toward a stage that never reads cost the gateway several
   times their bytes (frames, trackers), which `queue_bytes` did not count.

Issue 55, point 5: a legitimate stage at its rate limit made the audit log grow one record per forwarded
message (0.34 MB/s); a link's transfer records are now summarised past `audit_transfer_rate`. And the
memory of a queue dropped with its stage stayed with the gateway (177 MiB after 256 KiB messages, 48 MiB
after 1 KiB); it now goes back to the system (nebula/gateway/memory.py).
"""
from __future__ import annotations

from nebula_lab.bench.flood import flood
from tests.integration.test_attack_flood import BURST, RATE, counted, records, stopped_stats

SECONDS = 3.0


def test_refusals_coming_back_from_a_peer_gateway_cost_a_few_records_and_each_is_counted(tmp_path):
    row = flood("refused", tmp_path, SECONDS)  # b/stall/0 is not connected: b's gateway refuses each message
    assert row["exits"] == {"a": 0, "b": 0}
    log_a = records(tmp_path, "a")
    came_back = stopped_stats(log_a)["links"]["from:b"]["messages"]  # every one a refusal from b's gateway
    assert row["replies"].get("unreachable", 0) > 500 and came_back > 500, row
    forwarded = [r for r in log_a if r["event"] == "transfer.out"]
    assert len(forwarded) <= BURST + RATE * (SECONDS + 2)
    in_full = [r for r in log_a if r["event"] == "transfer.in"]
    assert all(r["src"] == "b/gateway/0" and r["kind"] == "ERROR" for r in in_full)
    assert len(in_full) <= 10, f"{len(in_full)} refusals from b recorded one by one"  # 5 per interval
    assert counted(log_a, "transfer.in", src="b/gateway/0") == came_back  # ... and each is in the log


def test_a_stage_that_never_reads_small_messages_costs_its_gateway_what_queue_bytes_says(tmp_path):
    """1 KiB messages: what the gateway holds per queued message beyond its bytes counts against `queue_bytes`."""
    queue = 16 << 20
    slack = 24 << 20  # the interpreter's own growth in a flood, messages being handled, allocator slack
    row = flood("stalled-small", tmp_path, 6.0, gateway={"queue_bytes": queue},
                stop_when=lambda growth: growth > 4 * (queue + slack))
    assert row["exits"] == {"a": 0, "b": 0}
    growth = row["rss_peak"] - row["rss_start"]
    assert growth <= queue + slack, f"gateway RSS grew by {growth >> 20} MiB"
    status = row["status"]
    assert status["dropped"].get("internal", 0) > 0  # it did refuse: the budget was reached
    assert max(status["queued_bytes"].values(), default=0) <= queue


AUDIT_RATE, AUDIT_BURST = 20, 200  # the defaults of [gateway] audit_transfer_rate and audit_transfer_burst


def test_a_stage_at_its_rate_limit_costs_a_few_records_a_second_and_every_message_is_counted(tmp_path):
    row = flood("messages", tmp_path, SECONDS)  # b/sink/0 reads everything: all of it is legitimate traffic
    assert row["exits"] == {"a": 0, "b": 0}
    assert row["received"] > 2 * AUDIT_BURST, row  # far more messages than records in full
    for site, direction, link in (("a", "transfer.out", "to:b"), ("b", "transfer.in", "from:a")):
        log = records(tmp_path, site)
        forwarded = stopped_stats(log)["links"][link]["messages"]  # the gateway's own count of the link
        in_full = [r for r in log if r["event"] == direction and r["kind"] == "TENSORS"]
        assert len(in_full) <= AUDIT_BURST + AUDIT_RATE * (SECONDS + 2), f"{site}: {len(in_full)} records"
        summaries = [r for r in log if r["event"] == "transfer.summary" and r["kind"] == "TENSORS"
                     and r["direction"] == direction.split(".")[1]]
        counted_messages = len(in_full) + sum(r["messages"] for r in summaries)
        # nothing unaccounted: every message that crossed the link is on the record, in full or counted
        assert counted_messages == forwarded >= row["received"] - 1, (site, counted_messages, forwarded, row)
        assert sum(r["bytes"] for r in in_full) + sum(r["bytes"] for r in summaries) \
            == forwarded * in_full[0]["bytes"]
    assert row["audit"]["a"]["bytes"] < 200_000, row["audit"]  # was ~1 MB for these 3 s


def test_the_memory_of_a_dropped_queue_goes_back_to_the_system(tmp_path):
    """256 KiB messages toward a stage that never reads, which then hangs up: its queue is dropped, and the
    gateway's memory returns to within 20 MB of what it was before the flood (it stayed ~177 MiB above)."""
    row = flood("stalled", tmp_path, SECONDS)
    assert row["exits"] == {"a": 0, "b": 0}
    assert row["rss_peak"] - row["rss_start"] > 100 << 20, row  # the queue did fill: there was memory to return
    assert row["rss_end"] - row["rss_start"] <= 20 << 20, \
        f"gateway a kept {(row['rss_end'] - row['rss_start']) >> 20} MiB after the queue was dropped"
