"""The ``meshgate`` command (``commands``), its benchmark (``bench``, ``bench_report``) and placement progress."""
