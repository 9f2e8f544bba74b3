"""`tokenmill router`: an OpenAI-compatible proxy over several engine replicas (docs/scaling.md).

radix_tree.py holds the approximate prompt trees, policies.py the routing rules, workers.py the
replicas and their health, proxy.py the forwarding with retries and streaming, app.py the HTTP
routes, metrics.py the router's own Prometheus metrics and replicas.py `tokenmill serve
--data-parallel-size N`."""
