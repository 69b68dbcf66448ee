"""Runtimes: what a session runs its clusters, weight transports and reward deployments on.

:mod:`~rollart_nb.runtime.base` holds the :class:`Runtime` protocol; the Ray runtime and the
in-process (simulated) runtime sit beside it, each with its cluster class.
"""
