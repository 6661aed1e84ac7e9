"""Batch jobs: OpenAI's Batch API and Anthropic's Message Batches over one store of lines claimed once.

    jobs.py     making, cancelling and finalizing a job; every change a compare-and-set on its epoch
    lines.py    reading and checking the lines, and running one through the dispatcher at the batch class
    views.py    jobs, files and results as each protocol shows them
    worker.py   the per-gateway task that claims lines and runs them with bounded concurrency

The records and the store (memory and Redis) are the control room's (``cluster.batch_store``,
``cluster.redis_batches``); the HTTP routes are ``http.routes.batches`` and ``http.routes.message_batches``.
Imports the serving and cluster rooms; only ``http`` and ``cli`` import it.
"""
