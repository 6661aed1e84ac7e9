"""The internal streaming protocol between the gateway and runner processes, shared by every runtime.

``POST /generate`` takes a msgspec-encoded ``protocols.model.Request`` and answers NDJSON, one encoded
``protocols.model.Event`` per line, ending in exactly one ``Finished`` or ``Failed``. ``GET /health`` answers 200
when the model is loaded. ``server`` serves an ``Engine`` this way; ``client`` reads it; ``process`` starts and
supervises the runner process; ``secret`` is the cluster secret every endpoint demands of callers. Imports
protocols only.
"""
