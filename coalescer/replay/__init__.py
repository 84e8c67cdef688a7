"""``coalescer replay``: what superseding would save and cost on a given task history.

* :mod:`~coalescer.replay.history` — a history's tasks and worker pool (pure).
* :mod:`~coalescer.replay.synthetic` — seeded synthetic histories (pushes through a day).
* :mod:`~coalescer.replay.sources` — recorded Pulse messages, or task groups read from a queue.
* :mod:`~coalescer.replay.pool` — the pool model: workers claim, ask, run, supersede.
* :mod:`~coalescer.replay.runner` — configurations, replayed through the real index.
* :mod:`~coalescer.replay.metrics` — what each configuration saved and cost (pure).
* :mod:`~coalescer.replay.sheriffs` — linear backfill and mozci's rule, the reference
  columns (pure).
* :mod:`~coalescer.replay.charts`, :mod:`~coalescer.replay.report` — table, JSON, HTML.
* :mod:`~coalescer.replay.cli` — the subcommand.
"""
