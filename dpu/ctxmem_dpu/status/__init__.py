"""``ctxmem status``: one screen for an operator, read from the metrics endpoint.

The screen's source is the service's own loopback HTTP endpoint (``metrics.listen``:
``/metrics``, ``/readyz``), the operator's surface that already carries per-tenant data
(docs/security.md, "Metrics endpoint"): no new listener, no new credential.
``scrape`` fetches and reduces it to the documented ``--json`` document, ``render``
draws it with rich, ``command`` is the CLI (``--watch``, ``--count``, ``--interval``).
"""
