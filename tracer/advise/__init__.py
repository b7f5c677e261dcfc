"""`splitscope advise`: the split decision per time window, held against flapping (architecture.md §8).

windows.py cuts loaded traces into consecutive windows by request start; build.py decides each with the
report's model (tracer.report.build.report_from_data); hold.py keeps the advice until a different one wins
N windows in a row; render.py writes Markdown or the JSON contract. Pure computation over trace files.
"""
