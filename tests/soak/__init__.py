"""The standing chaos soak: the product's real processes together, under random store, broker
and process faults over time, then a check of the invariants users care about.

    python -m tests.soak --duration 600 --store redis|cluster --report DIR

``make soak`` runs it (``SOAK_DURATION``, ``SOAK_STORE``) through ``scripts/with_services.py``;
``tests/integration/test_soak.py`` runs a 60 s version inside ``make test``.

* :mod:`tests.soak.cast`: the processes (emulator, serve, listen, enforce, workers), restarted
  when killed, their memory sampled.
* :mod:`tests.soak.load`: the stream of pushes, ingest bursts, the query prober.
* :mod:`tests.soak.faults`: the menu of faults, drawn with a seeded RNG.
* :mod:`tests.soak.checker`: the invariants, read from the queue and the service.
* :mod:`tests.soak.report`: ``report.json`` and ``report.html``.
"""
