"""How long an orchestrator takes to stop, from the pipeline spec alone.

Why a module of its own: the operator sizes the orchestrator pod's termination grace from it,
and the operator image has none of the runtime's heavy dependencies (numpy, zmq, torch) that
orchestrator.main pulls in.
"""

from __future__ import annotations

from omnistage.spec import OmniPipeline

__all__ = ["CLOSE_MARGIN_SECONDS", "drain_timeout", "shutdown_seconds"]


def drain_timeout(pipeline: OmniPipeline) -> float:
    """How long a stopping orchestrator waits for its in-flight requests: the longest stage
    drain timeout (a request cannot outlive the replicas' own drains)."""
    return float(max((s.drain_timeout_seconds for s in pipeline.spec.stages), default=30))


CLOSE_MARGIN_SECONDS = 5.0
"""Time after the drain for the last responses to be written and the listener to close."""


def shutdown_seconds(pipeline: OmniPipeline, shutdown_delay: float | None = None) -> float:
    """The longest an orchestrator takes from SIGTERM to exit: shutdown delay, drain, close.

    A pod's terminationGracePeriodSeconds must cover it, or the kubelet's SIGKILL cuts the
    drain short.
    """
    delay = (pipeline.spec.orchestrator.shutdown_delay_seconds if shutdown_delay is None
             else shutdown_delay)
    return delay + drain_timeout(pipeline) + CLOSE_MARGIN_SECONDS
