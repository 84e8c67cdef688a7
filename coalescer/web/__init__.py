"""The HTTP edge: the superseding API, ingest, operations endpoints and browser pages."""
