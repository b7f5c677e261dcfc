"""`splitscope explain`: why one request was slow, from its trace and its neighbours' on the same worker.

For each chosen request: its time to first token in parts that add up to it (`ttft`), and its decode
stalls as time windows with the requests (and other causes) that filled them (`stalls`). The modules:

- `read`: trace files -> one `Trace` per trace id plus per-worker indexes and the step table;
- `select`: which requests to explain (given trace ids, or the N worst by TTFT or inter-token p99);
- `ttft`: the TTFT parts and who the request queued behind;
- `stalls`: stall windows and their causes;
- `build`: the JSON-shaped result (architecture.md section 8) and its summary;
- `render`: Markdown or JSON text;
- `cli`: the click command.

Pure computation over trace files, like the report: no reference server, no torch.
"""
