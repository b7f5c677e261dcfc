"""The sidecar: a process beside each serving engine that takes its telemetry and emits ours.

    wire.py          the Unix-socket ingest protocol (handshake, length-prefixed compact JSON frames)
    client.py        SidecarSink: the worker side of that socket (non-blocking, bounded, reconnecting)
    auth.py          the shared-secret token for non-loopback binds
    ingest_queue.py  the bounded queue between network threads and the export thread
    otlp_decode.py   OTLP protobuf / JSON requests -> SpanData batches
    unix_ingest.py   the Unix-socket server
    otlp_http.py     OTLP/HTTP receiver (aiohttp) and /metrics
    otlp_grpc.py     OTLP/gRPC receiver
    scrape.py        a prometheus_client Collector that scrapes an engine and re-yields our names
                     (through the mapping tables of tracer.engines.metrics)
    fast_json.py     SpanData -> OTLP/JSON line, byte-identical to tracer.export.otel.encode_line
    export.py        the export thread: engine adapters (tracer.engines), metrics, file and OTLP export
    server.py        wires all of the above into one running sidecar
    main.py          `splitscope sidecar`

Nothing here is imported by engine code except `client.SidecarSink` (through tracer.session).
"""
