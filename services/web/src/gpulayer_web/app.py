"""The pages: Starlette routes rendering Jinja2 templates (autoescape on) from the cache. A
request with ``X-Live: 1`` gets only the page's live part, which the page's script swaps in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gpulayer_cli.render import ago
from gpulayer_web import views
from gpulayer_web.cache import FleetCache

HERE = Path(__file__).parent
# Nothing but this service's own files: no inline script runs, even if escaping ever failed.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _env() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env


def _int(value: str | None, default: int = 1) -> int:
    try:
        return int(value or default)
    except ValueError:
        return default


class Pages:
    def __init__(self, cache: FleetCache, refresh_ms: int = 2000) -> None:
        self.cache = cache
        self.refresh_ms = refresh_ms
        self.templates = _env()

    def render(
        self, request: Request, template: str, status: int = 200, **context: Any
    ) -> Response:
        snap = self.cache.snapshot
        live = request.headers.get("x-live") == "1"
        context |= {
            "live_only": live,
            "refresh_ms": self.refresh_ms,
            "updated": ago(snap.at.isoformat()) if snap.at else "never",
            "error": snap.error,
            "path": request.url.path,
        }
        html = self.templates.get_template(template).render(**context)
        return HTMLResponse(html, status_code=status, headers=_HEADERS)

    async def fleet(self, request: Request) -> Response:
        q = request.query_params
        nodes = self.cache.snapshot.nodes
        every = [views.fleet_row(n) for n in nodes]
        rows = views.filter_fleet(
            every, q.get("platform", ""), q.get("api", ""), q.get("state", "")
        )
        shown, page, pages = views.page_of(rows, _int(q.get("page")))
        return self.render(
            request,
            "fleet.html",
            rows=shown,
            total=len(rows),
            all_nodes=len(nodes),
            page=page,
            pages=pages,
            query={k: q.get(k, "") for k in ("platform", "api", "state")},
            pager_query=_pager(q, ("platform", "api", "state")),
            filters=views.fleet_filters(every),
            matrix=views.matrix(nodes),
        )

    async def node(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        node = next((n for n in self.cache.snapshot.nodes if n["node_id"] == node_id), None)
        if node is None:
            return self.render(request, "missing.html", 404, what="node", name=node_id)
        jobs = [
            views.job_row(j)
            for j in self.cache.snapshot.jobs
            if j.get("node_id") == node_id and j.get("state") in ("placed", "running")
        ]
        return self.render(
            request,
            "node.html",
            node=views.fleet_row(node),
            devices=views.device_rows(node),
            apis=views.api_rows(node),
            container=views.container_detail(node),
            charts=views.sparklines(self.cache.observations(node_id), _memory(node)),
            jobs=jobs,
            notes=(node.get("capabilities") or {}).get("notes") or [],
        )

    async def jobs(self, request: Request) -> Response:
        q = request.query_params
        query = {k: q.get(k, "") for k in ("state", "owner", "node")}
        rows = views.select_jobs(self.cache.snapshot.jobs, **query)
        picked, page, pages = views.page_of(rows, _int(q.get("page")))
        shown = [views.job_row(j) for j in picked]
        states = sorted({str(j.get("state")) for j in self.cache.snapshot.jobs})
        return self.render(
            request,
            "jobs.html",
            rows=shown,
            total=len(rows),
            page=page,
            pages=pages,
            query=query,
            pager_query=_pager(q, ("state", "owner", "node")),
            states=states,
        )

    async def job(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        detail = await self.cache.job(job_id)
        if detail.record is None:
            return self.render(
                request, "missing.html", 404, what="job", name=job_id, why=detail.error
            )
        request_body = detail.record.get("request") or {}
        return self.render(
            request,
            "job.html",
            job=views.job_row(detail.record),
            record=detail.record,
            request_body=request_body if isinstance(request_body, dict) else {},
            explain=detail.explain,
            events=views.timeline(detail.events),
            ranks=detail.record.get("ranks") or [],
            detail_error=detail.error,
        )

    async def owners(self, request: Request) -> Response:
        snap = self.cache.snapshot
        return self.render(
            request,
            "owners.html",
            owners=views.owners(snap.jobs, snap.quotas),
            quotas_shown=snap.quotas is not None,
        )


def _memory(node: dict[str, Any]) -> dict[int, int]:
    devices = (node.get("capabilities") or {}).get("accelerators") or []
    return {int(d["index"]): int(d["memory_mib"]) for d in devices if d.get("memory_mib")}


def _pager(q: Any, keys: tuple[str, ...]) -> str:
    """The filters of this page as a query string prefix for the pager's links."""
    kept = urlencode({k: q[k] for k in keys if q.get(k)})
    return f"{kept}&" if kept else ""


def _route(fn: Callable[[Request], Awaitable[Response]], path: str) -> Route:
    return Route(path, fn, methods=["GET", "HEAD"])


def build_app(cache: FleetCache, *, allowed_hosts: list[str], refresh_ms: int = 2000) -> Starlette:
    """The web app over ``cache``; ``allowed_hosts``: the Host headers answered (a page bound
    to loopback answers only loopback names, so another site can't rebind a name to it)."""
    pages = Pages(cache, refresh_ms)
    return Starlette(
        routes=[
            _route(pages.fleet, "/"),
            _route(pages.node, "/nodes/{node_id}"),
            _route(pages.jobs, "/jobs"),
            _route(pages.job, "/jobs/{job_id}"),
            _route(pages.owners, "/owners"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)],
    )
