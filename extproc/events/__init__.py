"""vLLM's KV-cache event stream: what each engine says its prefix cache holds.

* ``wire``: the msgpack batch, byte for byte as vLLM 0.32 writes it.
* ``publisher``: vLLM's PUB + replay protocol, for the simulator and the tests.
* ``subscriber``: one trusted stream per engine (gaps, restarts, warm-up, silence) feeding
  an ``EventSink``, and the set of them for the current fleet.
* ``sources``: where an engine publishes, from its ``GET /kv_event_sources``.

Nothing is re-exported here, so importing ``wire`` alone does not load zmq.
"""
