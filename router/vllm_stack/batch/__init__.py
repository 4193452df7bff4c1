"""The OpenAI Batch API (``/v1/files``, ``/v1/batches``): input files of request lines, run through the
router's director at sheddable priority, with their state in SQLite (one router) or PostgreSQL (router
replicas sharing the work through row leases). See docs/batch.md."""
