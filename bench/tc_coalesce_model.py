"""A model of the original tc-coalesce web app, for comparison in bench/query.py.

Same stack and the same Redis layout and calls per request as tc-coalesce's
``/v1/list/<age>/<size>/<key>``: Flask on one gunicorn sync worker, a Redis list per key
(newest first) read with LRANGE, then a GET of the oldest task's timestamp.
"""

from __future__ import annotations

import os
import time

import flask
import redis

app = flask.Flask(__name__)
rds = redis.Redis.from_url(os.environ["REDIS_URL"], decode_responses=True)
PREFIX = "tc."


@app.route("/v1/list/<int:age>/<int:size>/<key>")
def coalesce_list(age: int, size: int, key: str) -> flask.Response:
    empty = flask.jsonify({"supersedes": []})
    tasks = rds.lrange(PREFIX + "lists." + key, 0, -1)
    if len(tasks) == 0 or len(tasks) <= size:
        return empty
    oldest = rds.get(PREFIX + tasks[-1] + ".timestamp")
    if oldest is None or time.time() - float(oldest) <= age:
        return empty
    return flask.jsonify({"supersedes": tasks})
