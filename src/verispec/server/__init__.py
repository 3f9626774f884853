"""The OpenAI-compatible HTTP server (``verispec serve``): request and response objects (``schema``), its
Prometheus metrics (``metrics``), and the app over the batched engine (``app``)."""
