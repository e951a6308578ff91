"""The whole service on one machine: ``cluster`` starts and supervises the processes
(gateway, decode pods, a chain) for ``baton up``, the end-to-end tests and the benchmarks;
``processes`` starts each child so that it dies with its parent, stops it within a bound,
and runs the private redis-server; ``child_exits`` is how the supervisor waits on them;
``autoscaler`` runs the planner over them (``baton up --autoscale``)."""
