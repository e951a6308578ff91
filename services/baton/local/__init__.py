"""The whole service on one machine: ``cluster`` starts and supervises the processes
(gateway, decode pods, a chain, redis-server) for ``baton up``, the end-to-end tests and
the benchmarks; ``child_exits`` is how the supervisor waits on them; ``autoscaler`` runs
the planner over them (``baton up --autoscale``); ``ports`` picks free ports."""
