"""aiohttp (what the orchestrator's HTTP API uses) against FastAPI and Starlette on uvicorn.

Why: issue 8 made the request bodies pydantic models, which is what FastAPI is built around, so
the framework was measured before keeping aiohttp. Each server exposes the same two routes:

  GET  /hello  returns {"ok": true}
  POST /chat   validates the body with omnistage's real ChatCompletionRequest model and returns
               a small JSON answer (aiohttp and Starlette: the HTTP API's own parse_json_body +
               model_validate; FastAPI: the model as a typed body parameter)

Each server runs in its own process (uvicorn with uvloop and httptools, as `uvicorn[standard]`
installs; aiohttp on its default loop and, when uvloop is importable, on uvloop too). One
closed-loop load generator (aiohttp client, CONCURRENCY connections kept alive) drives them in
turn, alternating rounds, and the best round per server and route is reported (the least
disturbed by other load on the machine). Loopback only.

Goal (the decision this bench backs): aiohttp on its default loop, as the orchestrator runs it,
serves /chat at >= 1x the req/s of each other framework measured (FastAPI, Starlette). Its
summary line says PASS or MISS per framework; `--check` exits 1 on a MISS.

Needs `pip install fastapi "uvicorn[standard]"`; without them those lines say so.
Run from the repository root: `python bench/bench_http_framework.py [--seconds 4] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goals import Goal, add_check_flag, exit_status, verdicts

ROOT = Path(__file__).resolve().parents[1]
BODY = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hello there"}],
        "max_tokens": 16, "temperature": 0.5, "n": 1, "stream": False}

SERVER = r'''
import json, sys
kind, port = sys.argv[1], int(sys.argv[2])
from omnistage.orchestrator.request_parsing import parse_json_body, validate
from omnistage.orchestrator.schemas import ChatCompletionRequest

def answer(req):
    return {"n": req.n or 1, "messages": len(req.messages)}

if kind.startswith("aiohttp"):
    from aiohttp import web
    if kind == "aiohttp-uvloop":
        import uvloop
        uvloop.install()
    async def hello(_r):
        return web.json_response({"ok": True})
    async def chat(r):
        req = validate(ChatCompletionRequest, parse_json_body(await r.read()))
        return web.json_response(answer(req))
    app = web.Application()
    app.add_routes([web.get("/hello", hello), web.post("/chat", chat)])
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
elif kind == "fastapi":
    import uvicorn
    from fastapi import FastAPI
    app = FastAPI()
    @app.get("/hello")
    async def hello():
        return {"ok": True}
    @app.post("/chat")
    async def chat(req: ChatCompletionRequest):
        return answer(req)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False,
                loop="uvloop", http="httptools")
elif kind == "starlette":
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    async def hello(_r):
        return JSONResponse({"ok": True})
    async def chat(r):
        req = validate(ChatCompletionRequest, parse_json_body(await r.body()))
        return JSONResponse(answer(req))
    app = Starlette(routes=[Route("/hello", hello), Route("/chat", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False,
                loop="uvloop", http="httptools")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(kind: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "runtime"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, kind, str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/hello", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{kind} did not start")


async def _load(url: str, method: str, seconds: float, concurrency: int) -> tuple[float, float,
                                                                                 float]:
    """Closed loop: (requests per second, p50 ms, p99 ms)."""
    data = json.dumps(BODY).encode()
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                if method == "GET":
                    async with s.get(url) as r:
                        await r.read()
                else:
                    async with s.post(url, data=data,
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        assert r.status == 200, await r.text()
                lat.append(time.perf_counter() - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    lat.sort()
    return (len(lat) / elapsed, statistics.median(lat) * 1000,
            lat[int(0.99 * (len(lat) - 1))] * 1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    add_check_flag(ap)
    args = ap.parse_args()
    kinds = ["aiohttp"]
    if importlib.util.find_spec("uvloop"):
        kinds.append("aiohttp-uvloop")
    missing = [m for m in ("fastapi", "uvicorn", "uvloop", "httptools")
               if importlib.util.find_spec(m) is None]
    if missing:
        print(f"fastapi/starlette skipped: missing {', '.join(missing)}")
    else:
        kinds += ["fastapi", "starlette"]
    best: dict[tuple[str, str], tuple[float, float, float]] = {}
    servers = {k: _start(k) for k in kinds}
    try:
        for _ in range(args.rounds):
            for kind in kinds:
                for route, method in (("/hello", "GET"), ("/chat", "POST")):
                    got = asyncio.run(_load(servers[kind][1] + route, method, args.seconds,
                                            args.concurrency))
                    if got[0] > best.get((kind, route), (0.0, 0.0, 0.0))[0]:
                        best[(kind, route)] = got
    finally:
        for proc, _url in servers.values():
            proc.terminate()
            proc.wait(10)
    print(f"{'server':16} {'route':7} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7}")
    for (kind, route), (rps, p50, p99) in best.items():
        print(f"{kind:16} {route:7} {rps:8.0f} {p50:7.2f} {p99:7.2f}")
    ours = best.get(("aiohttp", "/chat"), (0.0, 0.0, 0.0))[0]
    # aiohttp on uvloop is the same framework on another event loop (measured end to end in
    # docs/benchmarks.md): shown above, not an alternative framework with a goal.
    goals = [Goal(f"aiohttp/{kind} /chat", ours / best[(kind, "/chat")][0] if ours else None, 1.0)
             for kind in kinds
             if not kind.startswith("aiohttp") and best.get((kind, "/chat"), (0.0,))[0]]
    print("summary: " + (verdicts(goals) or "no alternative measured"), flush=True)
    return exit_status(goals, args.check)


if __name__ == "__main__":
    sys.exit(main())
