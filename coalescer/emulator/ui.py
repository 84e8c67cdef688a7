"""A minimal stand-in for the Taskcluster UI's task page, ``/tasks/<taskId>``, so that links
made for a real deployment (``<rootUrl>/tasks/<taskId>``) work against the emulator too: the
task's name, state, runs and their artifacts (linked through the queue API), and its
definition. No script, no external resource. The root, ``/``, lists the newest tasks, so
that the rootUrl itself answers in a browser."""

from __future__ import annotations

import jinja2
import orjson
from markupsafe import escape
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from coalescer.emulator.runtime import Emulator

_PAGE = jinja2.Environment(autoescape=True).from_string(
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ name }} · queue emulator</title>
<style>
body { font: 15px/1.45 system-ui, sans-serif; margin: 1.5rem auto; max-width: 60rem; padding: 0 1rem; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: .3rem .6rem;
border-bottom: 1px solid #d0d7de; vertical-align: top; } code, pre { font-size: 13px; }
pre { background: #f5f6f8; padding: .6rem; overflow: auto; } .muted { color: #6b7385; }
</style></head><body>
<p class="muted">Taskcluster queue emulator · task page</p>
<h1>{{ name }}</h1>
<p><code>{{ status.taskId }}</code> · <b>{{ status.state }}</b> · task queue <code>{{ status.taskQueueId }}</code></p>
<h2>Runs</h2>
{% if status.runs %}<table><thead><tr><th>run</th><th>state</th><th>reason</th><th>worker</th>
<th>scheduled</th><th>started</th><th>resolved</th><th>artifacts</th></tr></thead><tbody>
{% for run in status.runs %}<tr><td>{{ run.runId }}</td><td>{{ run.state }}</td>
<td>{{ run.reasonResolved or run.reasonCreated }}</td>
<td>{{ run.workerGroup ~ '/' ~ run.workerId if run.workerId else '' }}</td><td>{{ run.scheduled }}</td>
<td>{{ run.started or '' }}</td><td>{{ run.resolved or '' }}</td>
<td>{% for name in artifacts[run.runId] %}<div><a href="/api/queue/v1/task/{{ status.taskId }}/runs/{{ run.runId }}/artifacts/{{ name }}">{{ name }}</a></div>{% endfor %}</td></tr>
{% endfor %}</tbody></table>{% else %}<p class="muted">No runs yet.</p>{% endif %}
<h2>Definition</h2>
<pre>{{ definition }}</pre>
<p class="muted">As JSON: <a href="/api/queue/v1/task/{{ status.taskId }}">task</a> ·
<a href="/api/queue/v1/task/{{ status.taskId }}/status">status</a></p>
</body></html>
"""
)


#: Tasks the root page lists at most, newest first.
INDEX_TASKS = 200

_INDEX = jinja2.Environment(autoescape=True).from_string(
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>queue emulator</title>
<style>
body { font: 15px/1.45 system-ui, sans-serif; margin: 1.5rem auto; max-width: 60rem; padding: 0 1rem; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: .3rem .6rem;
border-bottom: 1px solid #d0d7de; } code { font-size: 13px; } .muted { color: #6b7385; }
</style></head><body>
<p class="muted">Taskcluster queue emulator</p>
<h1>{{ total }} task{{ '' if total == 1 else 's' }}</h1>
<p class="muted">This URL is the queue's rootUrl (its API under <code>/api/queue/v1/</code>).
{% if total > shown|length %}The newest {{ shown|length }}, newest first.{% else %}Newest first.{% endif %}
Everything lives in the emulator's memory: it is gone when the emulator stops.</p>
{% if shown %}<table><thead><tr><th>task</th><th>name</th><th>state</th><th>task queue</th></tr></thead><tbody>
{% for t in shown %}<tr><td><a href="/tasks/{{ t.task_id }}"><code>{{ t.task_id }}</code></a></td>
<td>{{ t.definition.get('metadata', {}).get('name', '') }}</td><td>{{ t.state }}</td>
<td><code>{{ t.task_queue_id }}</code></td></tr>
{% endfor %}</tbody></table>{% endif %}
</body></html>
"""
)


def routes(emulator: Emulator) -> list[Route]:
    async def index(request: Request) -> Response:
        tasks = emulator.state.tasks
        newest = sorted(tasks.values(), key=lambda t: t.seq, reverse=True)[:INDEX_TASKS]
        return HTMLResponse(_INDEX.render(total=len(tasks), shown=newest))

    async def task_page(request: Request) -> Response:
        task_id = request.path_params["taskId"]
        task = emulator.state.tasks.get(task_id)
        if task is None:
            return HTMLResponse(
                f"<!doctype html><title>not found</title><p>Task {escape(task_id)} "
                "does not exist (or has expired).</p>",
                status_code=404,
            )
        artifacts: dict[int, list[str]] = {run.run_id: [] for run in task.runs}
        for run_id, name in sorted(task.artifacts):
            artifacts.setdefault(run_id, []).append(name)
        return HTMLResponse(
            _PAGE.render(
                name=task.definition.get("metadata", {}).get("name") or task_id,
                status=task.status(),
                artifacts=artifacts,
                definition=orjson.dumps(task.definition, option=orjson.OPT_INDENT_2).decode(),
            )
        )

    return [
        Route("/", index, methods=["GET"]),
        Route("/tasks/{taskId}", task_page, methods=["GET"]),
    ]
