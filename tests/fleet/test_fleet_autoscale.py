"""The local fleet end to end: kmock as the API server, the real operator, real engines, a real router.

One scenario (e2e/local/step_load.py): a load step through the router makes the operator scale the
runtime up from the scheduler's queue depth, the router spreads load onto the new replicas, the queue
recovers, and once the load ends and the scale-down window passes the fleet returns to its minimum, with
no flapping. Timings are printed (pytest -s), never asserted.
"""

from __future__ import annotations

from pathlib import Path

from e2e.local import step_load
from e2e.local.fleet import LocalFleet


def test_step_load_scales_up_spreads_and_scales_back_down(tmp_path: Path) -> None:
    with LocalFleet(tmp_path) as fleet:
        report = step_load.run(fleet)
    print(step_load.format_report(report))
    maximum = step_load.SPEC["autoscaling"]["maxReplicas"]

    # Scaled up, and from the scheduler's queue depth.
    assert report.first_scale_up_s is not None, report.replicas_timeline
    assert any(
        e.startswith("ScaledUp: 1 -> ") and "queueDepthPerReplica asks" in e for e in report.scale_events
    )
    assert max(d for _, d, _ in report.replicas_timeline) == maximum

    # The router sent load to every replica once they were all ready.
    assert report.max_replicas_ready_s is not None
    assert report.first_request_on_new_replica_s is not None
    serving = {u for u, n in report.requests_by_replica_at_capacity.items() if u and n > 0}
    assert len(serving) == maximum, report.requests_by_replica_at_capacity

    # The queue recovered under the same load: per-replica depth at full capacity is below its peak.
    ready_at = report.max_replicas_ready_s
    before = [q for t, _, q in report.autoscaler_timeline if q is not None and t < ready_at]
    during = [
        q for t, _, q in report.autoscaler_timeline if q is not None and ready_at <= t < report.step_end_s
    ]
    assert before and during, report.autoscaler_timeline
    assert min(during) < max(before)

    # Back to the minimum after the load, and never reversing direction more than that once.
    assert report.back_to_min_s is not None, report.replicas_timeline
    assert any(e.startswith("ScaledDown:") for e in report.scale_events)
    assert report.direction_changes == 1, report.replicas_timeline
    assert set(report.statuses) == {200}, report.statuses
