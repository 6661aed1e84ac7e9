"""The runner hop (``backends.runner``): client, stream, errors, processes, the cluster secret."""
