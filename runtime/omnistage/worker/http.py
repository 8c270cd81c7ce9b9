"""The worker's HTTP side port: health, readiness, metrics and state for probes and people."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from omnistage.metrics import CONTENT_TYPE, Family, render

if TYPE_CHECKING:
    from omnistage.worker.server import StageWorker


def worker_metrics(w: StageWorker) -> str:
    adm = w.admission.report()
    st = w.scheduler.stats
    c = w.counters
    replies = Family("omnistage_worker_replies_total", "counter", "Terminal replies, by type")
    for kind, n in sorted(w.outcomes.items()):
        replies.add(n, type=kind)
    fams = [
        Family("omnistage_worker_ready", "gauge", "1 when loaded, warmed up and not draining")
        .add(1 if w.ready else 0),
        Family("omnistage_worker_queue_depth", "gauge", "Requests waiting for the execution permit")
        .add(w.scheduler.queued),
        Family("omnistage_worker_inflight_requests", "gauge", "Admitted requests not yet answered")
        .add(len(w.requests)),
        Family("omnistage_worker_admission_units_in_use", "gauge", "Admission cost units held")
        .add(adm.units_in_use),
        Family("omnistage_worker_admitted_total", "counter", "Requests admitted")
        .add(c["admitted"]),
        Family("omnistage_worker_rejected_total", "counter", "Requests refused, by reason")
        .add(c["rejected_budget"], reason="budget")
        .add(c["rejected_queue"], reason="queue")
        .add(c["rejected_draining"], reason="draining"),
        Family("omnistage_worker_malformed_messages_total", "counter",
               "Frames that failed to parse")
        .add(c["malformed"]),
        replies,
        Family("omnistage_worker_execution_seconds", "summary", "Executor time per request")
        .add(st.exec_seconds_total, _suffix="_sum")
        .add(st.completed, _suffix="_count"),
    ]
    return render(fams, {"stage": w.cfg.stage.name, "replica": w.cfg.replica_id})


async def start_http(w: StageWorker, host: str, port: int) -> tuple[web.AppRunner, str]:
    async def livez(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        if w.ready:
            return web.Response(text="ready")
        reason = (
            "draining" if w.draining else f"load failed: {w.load_error}" if w.load_error
            else "loading"
        )
        return web.Response(status=503, text=reason)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=worker_metrics(w).encode(), headers={"Content-Type": CONTENT_TYPE})

    async def state(_: web.Request) -> web.Response:
        return web.json_response(w.state())

    app = web.Application()
    app.add_routes([web.get("/livez", livez), web.get("/readyz", readyz),
                    web.get("/metrics", metrics), web.get("/state", state)])
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, f"http://{host}:{bound}"
