"""Every Redis key name coalescer uses, in one place.

A coalescing key's data lives under one Redis Cluster hash tag, ``{K}``, so that each script
touches a single slot:

* ``co:{K}:t`` hash    taskId → ``run|rank|order|deadline_ms|since_ms|state|reason``: what the
  index knows of the task (kept until its deadline plus the grace period);
* ``co:{K}:p`` zset    pending taskIds by order (ties by taskId: Redis sorts equal scores by member);
* ``co:{K}:w`` zset    pending taskIds by the time their current run became pending;
* ``co:{K}:d`` zset    pending taskIds by deadline, to stop offering them once it has passed;
* ``co:{K}:x`` zset    every known taskId by deadline, to forget it after deadline plus grace;
* ``co:{K}:log`` list  recent answers for the debug pages (capped);
* ``co:{K}:res`` list  recent resolutions seen (capped), apart from the answers so that a busy
  key's answers cannot push them out;
* ``co:{K}:a`` hash    taskId → the newest answer that listed the task (for the task page), and
  ``co:{K}:ax`` zset   the same taskIds by that answer's time, to keep only the newest ones.

Superseding policies (``coalescer.policy``), for keys whose rule decides on arrival:

* ``co:{K}:v`` hash    victim taskId → ``run|by|by_run|at_ms|rule|state|action|reason``: what
  superseded the task's run ``run`` (lineage; ``state`` is the enforcement's progress);
* ``co:{K}:vp`` zset   ``<by>|<victim>`` members (score 0) for lookups by primary (ZRANGEBYLEX);
* ``co:{K}:vx`` zset   victims by their deadline plus grace, to forget their lineage then;
* ``co:{K}:r`` zset    running taskIds by order, ``co:{K}:rs`` hash taskId → run start ms;
* ``co:{K}:o`` stream  the outbox: decisions for ``coalescer enforce`` (consumer group
  ``enforce``), each entry deleted once carried out;
* ``co:{K}:h`` zset    victims the enforcer holds (claimed), by when to renew the claim;
* ``co:{K}:m`` hash    ``<rule>|<state>`` counters and ``<rule>|saved_ms``;
* ``co:{K}:rd`` list   recent run durations (ms), to estimate the worker time saved;
* ``co:{K}:df`` hash   victim taskId → its task definition (JSON), for the primary's handoff;
* ``co:{K}:vn`` hash   victim taskId → ``run|how|why``: how the enforcer ended that run
  (``completed``, ``exception/superseded``, ``canceled``, ``released``) and why;
* ``co:{K}:lease``     string: the enforcer working on the key, with a TTL.
* ``co:{K}:bs`` hash   failed primary taskId → the bisection under way over the victims it held
  (JSON: its victims, the results so far, the victim running for it; see
  ``coalescer/policy/bisecting.py``): written by ``decide.lua`` when the primary fails, moved on
  by ``settle.lua``'s search steps (compare-and-set), deleted when the search is over.
* ``co:{K}:b`` hash    primary taskId → a bisection's finding (JSON), ``n:<primary>`` → the
  taskIds it names, and ``t:<taskId>`` → primary for each of them; ``co:{K}:bt`` zset primaries by when the finding
  was located, to keep the newest (see ``coalescer/store/bisections.py`` and ``bisect.lua``).
* ``co:{K}:hist`` hash  the key's history ring for its page's charts (pending tasks over time;
  see ``coalescer/history.py`` and ``history.lua``): fixed size, expires with the retention.

Outside any key's slot: ``co:keys`` (zset, key → last activity ms), ``co:stats`` (hash),
``co:outbox`` (zset, key → last time it may have had outbox work), ``co:index`` (hash: the
index's state marker, ``state`` ok|lost, ``since_ms``, ``rebuilt_ms``; see ``marker.lua``) and
``co:probe`` (string: a write that shows Redis takes writes). In the slot of ``co:keys`` (hash
tag ``{co:keys}``, so that one script can write both zsets):

* ``{co:keys}:expiry`` zset   key → when its data expires (its newest deadline plus the grace
  period): the sweeper forgets a key from both zsets once that has passed;
* ``{co:keys}:census`` hash   the index's totals (keys with pending tasks, pending tasks, the
  oldest wait), counted in the background for ``/metrics`` and ``/v1/stats``;
* ``{co:keys}:lease``  string the process doing that upkeep round, with a TTL;
* ``{co:keys}:history`` hash  the history ring over every key, for the overview's charts
  (pending, superseded, worker time saved, answers): fixed size, expires with the retention.
"""

from __future__ import annotations

import functools

KEYS_INDEX = "co:keys"
STATS = "co:stats"
OUTBOX = "co:outbox"
INDEX_STATE = "co:index"
PROBE = "co:probe"
#: Every finding kept, over every key (``<key> <primary>`` -> when it expires), for the limit.
FINDINGS = "co:findings"
KEYS_EXPIRY = "{co:keys}:expiry"
CENSUS = "{co:keys}:census"
UPKEEP_LEASE = "{co:keys}:lease"
HISTORY = "{co:keys}:history"
#: The consumer group of every outbox stream.
OUTBOX_GROUP = "enforce"


@functools.lru_cache(maxsize=4096)  # on every query: busy keys are few and asked often
def group(key: str) -> tuple[str, str, str, str, str]:
    """``(t, p, w, d, x)`` for coalescing key ``key``."""
    tag = f"co:{{{key}}}:"
    return (tag + "t", tag + "p", tag + "w", tag + "d", tag + "x")


def log(key: str) -> str:
    return f"co:{{{key}}}:log"


def resolutions(key: str) -> str:
    return f"co:{{{key}}}:res"


def answered(key: str) -> tuple[str, str]:
    """``(a, ax)`` for coalescing key ``key``: per-task answers, and their times."""
    tag = f"co:{{{key}}}:"
    return (tag + "a", tag + "ax")


def policy(key: str) -> tuple[str, str, str, str, str, str, str, str, str]:
    """``(v, vp, vx, r, rs, o, h, m, rd)`` for coalescing key ``key``."""
    tag = f"co:{{{key}}}:"
    v, vp, vx, r, rs, o, h, m, rd = (
        tag + n for n in ("v", "vp", "vx", "r", "rs", "o", "h", "m", "rd")
    )
    return (v, vp, vx, r, rs, o, h, m, rd)


def settled(key: str) -> tuple[str, ...]:
    """``(v, vp, vx, o, h, m, rd, df, vn, bs, t, p, w, d)``: what ``settle.lua`` touches."""
    tag = f"co:{{{key}}}:"
    v, vp, vx, _, _, o, h, m, rd = policy(key)
    return (v, vp, vx, o, h, m, rd, tag + "df", tag + "vn", searches(key), *group(key)[:4])


def searches(key: str) -> str:
    """``bs`` for coalescing key ``key``: the bisections under way, by failed primary."""
    return f"co:{{{key}}}:bs"


def history(key: str) -> str:
    return f"co:{{{key}}}:hist"


def lease(key: str) -> str:
    return f"co:{{{key}}}:lease"


def bisections(key: str) -> tuple[str, str]:
    """``(b, bt)`` for coalescing key ``key``: bisection findings and their times."""
    tag = f"co:{{{key}}}:"
    return (tag + "b", tag + "bt")
